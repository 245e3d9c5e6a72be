"""Engine scheduling over a fake pipeline: chunked prefill, shared decode steps, waiting for a
slot, cancellation, step errors and recovery by replay. No processes and no model files.

The fake "model" keeps a KV cache per slot (the tokens written at each position) and answers a
sampled row with rule(cache of that slot), so a row that skips positions, or a replay that does
not carry the whole history, shows up as an error and as a wrong token.
"""

from __future__ import annotations

import threading
import time

import pytest

from shardwire.backends import IDLE_S
from shardwire.engine import Engine, Request
from shardwire.engine.drafting import Speculation
from shardwire.kvcache import pool_pages
from shardwire.pipeline import PipelineError, Step, StepResult
from shardwire.sampling import GREEDY, Sampled, SamplingParams

from speculating import FreeWidth

TIMEOUT = 5.0


def plus_one(tokens: list[int]) -> int:
    return (tokens[-1] + 1) % 1000


def mixing(tokens: list[int]) -> int:
    """A rule that depends on every position, so a wrong replay changes what follows."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % 997


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def finished(handle, timeout: float = TIMEOUT) -> list:
    """Every event of a handle, up to and including the one with a finish_reason."""
    events = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no finish event; got {events}"
        event = handle.events.get(timeout=remaining)
        events.append(event)
        if event.finish_reason is not None:
            return events


class FakePipeline:
    """The pipeline interface the engine drives. hold=False answers each step inside submit();
    hold=True keeps steps pending until the test answers them."""

    def __init__(self, n_slots=2, ctx=64, vocab_size=1000, n_stages=1, hold=False, rule=plus_one):
        self.n_slots, self.ctx, self.vocab_size, self.n_stages = n_slots, ctx, vocab_size, n_stages
        self.stages_overlap = True  # as workers' stages do
        self.recurrent, self.ring_step, self.kv_pages = False, 0, pool_pages(n_slots, ctx)
        self.hold, self.rule = hold, rule
        self.on_result = None
        self.on_wake = None
        self.cond = threading.Condition()
        self.steps: list[Step] = []  # every step submitted, in order
        self.pending: list[Step] = []  # held steps, not answered yet
        self.freed: list[int] = []
        self.idled: list[tuple[float, int]] = []  # (when, on which thread) idle() was called
        self.cache: dict[int, list[int]] = {s: [] for s in range(n_slots)}
        self.problems: list[str] = []  # rows the fake model could not run
        self.submit_error: PipelineError | None = None

    # -- the interface -----------------------------------------------------------------
    def idle(self) -> None:
        self.idled.append((time.monotonic(), threading.get_ident()))

    def submit(self, step: Step) -> None:
        if self.submit_error is not None:
            raise self.submit_error
        with self.cond:
            self.steps.append(step)
            if self.hold:
                self.pending.append(step)
                self.cond.notify_all()
                return
        self.on_result(self.run(step))

    def free(self, slot: int) -> None:
        with self.cond:
            self.freed.append(slot)
            self.cond.notify_all()

    def status(self) -> dict:
        return {"plan": "fake", "ready": True, "broken": getattr(self, "broken", None)}

    def close(self) -> None:
        pass

    # -- the fake model ------------------------------------------------------------------
    def run(self, step: Step) -> StepResult:
        sampled = []
        for row in step.rows:
            cache = self.cache[row.slot]
            if row.start > len(cache):
                self.problems.append(f"slot {row.slot}: row starts at {row.start} past its cache of {len(cache)}")
                return StepResult(step.id, error=PipelineError(self.problems[-1]))
            del cache[row.start :]
            cache.extend(row.tokens)
            drawn = []
            first = len(cache) - 1 - row.n_draft  # the position of the first token sampled after
            for j in range(row.n_draft + 1 if row.sampling is not None else 0):
                drawn.append(Sampled(self.rule(cache[: first + j + 1])))
                if j == row.n_draft or drawn[-1].token != cache[first + j + 1]:
                    break
            sampled.append(drawn)
        return StepResult(step.id, sampled)

    # -- test controls -------------------------------------------------------------------
    def wait_pending(self, n: int, timeout: float = TIMEOUT) -> list[Step]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.pending) >= n, timeout), (
                f"expected {n} pending step(s), have {len(self.pending)}"
            )
            return list(self.pending)

    def wait_steps(self, n: int, timeout: float = TIMEOUT) -> list[Step]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.steps) >= n, timeout), (
                f"expected {n} step(s), have {len(self.steps)}"
            )
            return list(self.steps)

    def answer(self, step: Step, error: PipelineError | None = None) -> None:
        with self.cond:
            self.pending.remove(step)
        self.on_result(StepResult(step.id, error=error) if error is not None else self.run(step))

    def answer_all(self) -> int:
        with self.cond:
            steps = list(self.pending)
        for step in steps:
            self.answer(step)
        return len(steps)

    def drive(self, handles, timeout: float = TIMEOUT) -> None:
        """Answer steps as they come until every handle has finished."""
        deadline = time.monotonic() + timeout
        while not all(h.finish_reason is not None for h in handles):
            assert time.monotonic() < deadline, "requests did not finish"
            if not self.answer_all():
                time.sleep(0.001)


class RecoverablePipeline(FakePipeline):
    """A cluster's extra surface: broken, rebalance_due and recover() (with every member of the
    Pipeline interface present, so the engine takes it as recoverable)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.broken: str | None = None
        self.rebalance_due = False
        self.recoveries: list[dict] = []
        self.recover_error: Exception | None = None

    def recover(self) -> dict:
        if self.recover_error is not None:
            raise self.recover_error
        with self.cond:
            event = {"reason": self.broken or "rebalance"}
            self.recoveries.append(event)
            self.broken, self.rebalance_due = None, False
            self.cache = {s: [] for s in range(self.n_slots)}  # a rebuilt pipeline holds no KV cache
            self.cond.notify_all()
            return event

    def break_(self, reason: str = "worker w1 is gone") -> None:
        self.broken = reason
        self.on_wake()


@pytest.fixture
def make_engine():
    engines = []

    def make(pipeline, **kw) -> Engine:
        engine = Engine(pipeline, None, **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
        assert not engine.running


def req(prompt, max_tokens=4, **kw) -> Request:
    return Request(list(prompt), GREEDY, max_tokens=max_tokens, **kw)


def expected(prompt, n, rule=plus_one) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(rule(tokens))
    return tokens[len(prompt) :]


# -- a whole request -----------------------------------------------------------------------


def test_a_request_generates_max_tokens_and_ends_with_length(make_engine):
    pipe = FakePipeline()
    engine = make_engine(pipe)
    handle = engine.submit(req([5, 6, 7], max_tokens=4))
    events = finished(handle)
    assert [e.token for e in events[:-1]] == [8, 9, 10, 11]
    assert all(e.text == "" for e in events)
    last = events[-1]
    assert (last.finish_reason, last.token, last.error) == ("length", None, None)
    assert handle.tokens == [8, 9, 10, 11]
    assert handle.finish_reason == "length"
    assert handle.stats.prompt_tokens == 3 and handle.stats.completion_tokens == 4
    wait_until(lambda: pipe.freed == [0], what="slot 0 freed")
    # one prefill step, then one decode step per new token but the last
    assert len(pipe.steps) == 4
    assert [r.tokens for s in pipe.steps for r in s.rows] == [[5, 6, 7], [8], [9], [10]]
    assert [r.start for s in pipe.steps for r in s.rows] == [0, 3, 4, 5]
    assert pipe.problems == []


def test_the_engine_tells_its_pipeline_once_when_no_step_has_run_for_a_while(make_engine):
    """IDLE_S after the last step the engine calls the pipeline's idle() (a local pipeline gives
    back its stages' scratch there), on the thread that submitted the steps, and once: an idle
    engine then sleeps until the next request."""
    pipe = FakePipeline()
    engine = make_engine(pipe)
    submitted = []
    submit = pipe.submit
    pipe.submit = lambda step: submitted.append((time.monotonic(), threading.get_ident())) or submit(step)
    finished(engine.submit(req([5, 6, 7], max_tokens=4)))
    wait_until(lambda: pipe.idled, timeout=IDLE_S + TIMEOUT, what="idle()")
    (at, thread), (last_step, stepper) = pipe.idled[0], submitted[-1]
    assert at - last_step >= IDLE_S - 0.01 and thread == stepper
    time.sleep(2 * IDLE_S)
    assert len(pipe.idled) == 1
    finished(engine.submit(req([1], max_tokens=2)))
    wait_until(lambda: len(pipe.idled) == 2, timeout=IDLE_S + TIMEOUT, what="idle() again")


def result_within(handle, timeout: float = TIMEOUT) -> str:
    """handle.result() on a helper thread, so a missing finish event fails instead of hanging."""
    out = []
    thread = threading.Thread(target=lambda: out.append(handle.result()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, "handle.result() did not return"
    return out[0]


def test_result_waits_for_the_end(make_engine):
    engine = make_engine(FakePipeline())
    handle = engine.submit(req([1, 2], max_tokens=3))
    assert result_within(handle) == ""  # no tokenizer: token ids only, no text
    assert handle.finish_reason == "length" and handle.tokens == [3, 4, 5]


def test_iterating_a_handle_yields_every_event_then_stops(make_engine):
    engine = make_engine(FakePipeline())
    handle = engine.submit(req([1], max_tokens=3))
    got = []
    done = threading.Event()

    def consume():
        got.extend(handle)
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert done.wait(TIMEOUT)
    assert [e.token for e in got] == [2, 3, 4, None]
    assert got[-1].finish_reason == "length"


def test_max_tokens_zero_finishes_without_a_step_and_frees_its_slot(make_engine):
    pipe = FakePipeline()
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2, 3], max_tokens=0))
    events = finished(handle)
    assert [e.finish_reason for e in events] == ["length"]
    assert handle.tokens == []
    wait_until(lambda: pipe.freed == [0], what="slot freed")
    assert pipe.steps == []
    # the slot is usable again
    other = engine.submit(req([1], max_tokens=1))
    finished(other)
    assert other.tokens == [2] and pipe.steps[0].rows[0].slot == 0


def test_the_context_ends_generation_with_length(make_engine):
    pipe = FakePipeline(ctx=8)
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2, 3, 4, 5], max_tokens=100))
    assert finished(handle)[-1].finish_reason == "length"
    assert handle.tokens == [6, 7, 8]  # 5 + 3 = ctx
    assert max(r.start + len(r.tokens) for s in pipe.steps for r in s.rows) <= 8


def test_request_rejects_an_empty_prompt_and_negative_max_tokens():
    with pytest.raises(ValueError, match="empty"):
        Request([])
    with pytest.raises(ValueError, match="max_tokens"):
        Request([1], max_tokens=-1)


@pytest.mark.parametrize(
    "prompt, message",
    [
        (list(range(1, 17)), "the prompt has 16 tokens; the context holds 16"),
        (list(range(1, 30)), "the prompt has 29 tokens"),
        ([1, 2, 100], "token ids must be in [0, 100)"),
        ([-1, 2], "token ids must be in [0, 100)"),
    ],
)
def test_a_prompt_too_long_or_out_of_the_vocabulary_is_an_error(make_engine, prompt, message):
    pipe = FakePipeline(ctx=16, vocab_size=100)
    engine = make_engine(pipe)
    handle = engine.submit(req(prompt))
    events = finished(handle)
    assert len(events) == 1
    assert events[0].finish_reason == "error" and message in events[0].error
    assert handle.finish_reason == "error" and message in handle.error
    assert handle.tokens == []
    # nothing reached the pipeline and the engine still serves
    assert pipe.steps == []
    ok = engine.submit(req([1, 2, 3], max_tokens=1))
    assert finished(ok)[-1].finish_reason == "length" and ok.tokens == [4]


def test_a_prompt_of_ctx_minus_one_is_accepted(make_engine):
    pipe = FakePipeline(ctx=16)
    engine = make_engine(pipe)
    handle = engine.submit(req(list(range(15)), max_tokens=5))
    assert finished(handle)[-1].finish_reason == "length"
    assert handle.tokens == [15]


# -- prefill ---------------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples(make_engine):
    pipe = FakePipeline(ctx=64)
    engine = make_engine(pipe, prefill_chunk=4)
    prompt = list(range(10, 20))  # 10 tokens: chunks of 4, 4, 2
    handle = engine.submit(req(prompt, max_tokens=2))
    finished(handle)
    prefill = [s.rows for s in pipe.steps[:3]]
    assert all(len(rows) == 1 for rows in prefill)
    rows = [rows[0] for rows in prefill]
    assert [r.start for r in rows] == [0, 4, 8]
    assert [r.tokens for r in rows] == [prompt[0:4], prompt[4:8], prompt[8:10]]
    assert [r.sampling for r in rows] == [None, None, GREEDY]
    assert all(r.slot == 0 for r in rows)
    decode = pipe.steps[3].rows
    assert len(decode) == 1 and decode[0].start == 10 and decode[0].tokens == [20]
    assert len(pipe.steps) == 4
    assert handle.tokens == [20, 21]
    assert pipe.cache[0] == prompt + [20]


def test_a_prompt_of_exactly_one_chunk_goes_in_one_step(make_engine):
    pipe = FakePipeline()
    engine = make_engine(pipe, prefill_chunk=4)
    handle = engine.submit(req([1, 2, 3, 4], max_tokens=1))
    finished(handle)
    assert len(pipe.steps) == 1
    assert pipe.steps[0].rows[0].tokens == [1, 2, 3, 4] and pipe.steps[0].rows[0].sampling == GREEDY


def test_penalized_sampling_sends_recent_tokens_only_with_sampled_rows(make_engine):
    params = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=3, seed=1)
    pipe = FakePipeline()
    engine = make_engine(pipe, prefill_chunk=2)
    handle = engine.submit(Request([1, 2, 3, 4, 5], params, max_tokens=2))
    finished(handle)
    rows = [r for s in pipe.steps for r in s.rows]
    assert [r.recent for r in rows] == [[], [], [3, 4, 5], [4, 5, 6]]
    assert handle.tokens == [6, 7]


# -- several sequences -------------------------------------------------------------------------


def sequences(engine) -> tuple[int, int, int]:
    slots = engine.slots()
    return slots["total"], slots["busy"], slots["waiting"]


def test_requests_beyond_the_slots_wait_for_a_freed_slot(make_engine):
    pipe = FakePipeline(n_slots=1, hold=True)
    engine = make_engine(pipe)
    first = engine.submit(req([1, 2], max_tokens=2))
    pipe.wait_pending(1)
    second = engine.submit(req([50, 51, 52], max_tokens=2))
    wait_until(lambda: engine.slots()["waiting"] == 1, what="the second request to wait")
    assert sequences(engine) == (1, 1, 1) and engine.slots()["kv"]["in_use"] == 1
    time.sleep(0.05)
    assert len(pipe.steps) == 1  # the second has no slot yet, so no step
    assert pipe.freed == []
    pipe.drive([first])
    assert first.tokens == [3, 4] and first.finish_reason == "length"
    # the first's slot goes to the second: its prefill starts at position 0 of slot 0
    steps = pipe.wait_pending(1)
    assert steps[0].rows[0].slot == 0 and steps[0].rows[0].start == 0 and steps[0].rows[0].tokens == [50, 51, 52]
    assert pipe.freed == [0]
    assert sequences(engine) == (1, 1, 0)
    pipe.drive([second])
    assert second.tokens == [53, 54]
    wait_until(lambda: pipe.freed == [0, 0], what="slot freed twice")
    wait_until(lambda: sequences(engine) == (1, 0, 0), what="empty slots")


def test_many_requests_on_few_slots_all_finish_with_their_own_tokens(make_engine):
    pipe = FakePipeline(n_slots=3, n_stages=2, rule=mixing)
    engine = make_engine(pipe, prefill_chunk=3)
    prompts = [[i, i + 1, i + 2, i + 3][: 1 + i % 4] for i in range(1, 11)]
    handles = [engine.submit(req(p, max_tokens=1 + i % 5)) for i, p in enumerate(prompts)]
    for handle in handles:
        assert finished(handle)[-1].finish_reason == "length"
    for i, (p, handle) in enumerate(zip(prompts, handles)):
        assert handle.tokens == expected(p, 1 + i % 5, mixing)
    assert len(pipe.freed) == 10
    assert {r.slot for s in pipe.steps for r in s.rows} <= {0, 1, 2}
    assert pipe.problems == []
    wait_until(lambda: engine.slots()["busy"] == 0, what="all slots free")


def test_ready_sequences_share_one_decode_step_with_one_stage(make_engine):
    pipe = FakePipeline(n_slots=2, n_stages=1, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1, 2], max_tokens=3))
    (prefill_a,) = pipe.wait_pending(1)
    b = engine.submit(req([100, 101, 102], max_tokens=3))
    prefill_b = pipe.wait_pending(2)[1]
    assert prefill_b.rows[0].slot == 1
    pipe.answer(prefill_a)
    (decode_a,) = [s for s in pipe.wait_pending(2) if s is not prefill_b]
    assert [r.slot for r in decode_a.rows] == [0]
    pipe.answer(prefill_b)  # b is ready, but the one stage already has a decode step in flight
    time.sleep(0.05)
    assert pipe.pending == [decode_a]
    pipe.answer(decode_a)  # now both are ready: one step, two rows
    (shared,) = pipe.wait_pending(1)
    assert [(r.slot, r.start, r.tokens) for r in shared.rows] == [(0, 3, [4]), (1, 3, [103])]
    pipe.drive([a, b])
    assert a.tokens == [3, 4, 5] and b.tokens == [103, 104, 105]
    assert pipe.problems == []


def test_two_stages_keep_two_decode_steps_in_flight(make_engine):
    pipe = FakePipeline(n_slots=2, n_stages=2, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1], max_tokens=3))
    b = engine.submit(req([10], max_tokens=3))
    pipe.wait_pending(2)
    pipe.answer_all()
    decodes = pipe.wait_pending(2)
    assert sorted(len(s.rows) for s in decodes) == [1, 1]
    assert sorted(s.rows[0].slot for s in decodes) == [0, 1]
    pipe.drive([a, b])
    assert a.tokens == [2, 3, 4] and b.tokens == [11, 12, 13]


def test_with_one_stage_one_decode_step_is_in_flight_and_carries_all_ready_sequences(make_engine):
    pipe = FakePipeline(n_slots=4, n_stages=1, hold=True)
    engine = make_engine(pipe)
    handles = [engine.submit(req([10 * i + 1], max_tokens=6)) for i in range(4)]
    pipe.wait_pending(4)
    pipe.answer_all()  # the four prefills
    most_in_flight = 0
    deadline = time.monotonic() + TIMEOUT
    while not all(h.finish_reason is not None for h in handles):
        assert time.monotonic() < deadline, "requests did not finish"
        with pipe.cond:
            most_in_flight = max(most_in_flight, len(pipe.pending))
        if not pipe.answer_all():
            time.sleep(0.001)
    assert most_in_flight == 1
    assert [h.tokens for h in handles] == [expected([10 * i + 1], 6) for i in range(4)]
    decode = pipe.steps[4:]
    assert sum(len(s.rows) for s in decode) == 4 * 5
    # the first decode step may leave before the other prefills are back; every later one
    # carries all four sequences
    assert len(decode) <= 6 and max(len(s.rows) for s in decode) == 4


def test_stages_share_the_sequences_between_their_decode_steps(make_engine):
    """Eight sequences on two stages: the first two back decode alone, and then no step takes
    more than its share (4), where steps of 7 rows and 1 would leave one stage idle while the
    other works through 7."""
    pipe = FakePipeline(n_slots=8, n_stages=2, hold=True)
    engine = make_engine(pipe)
    handles = [engine.submit(req([10 * i + 1], max_tokens=6)) for i in range(8)]
    prefills = pipe.wait_pending(8)
    for n, step in enumerate(prefills[:2]):
        pipe.answer(step)
        pipe.wait_steps(9 + n)  # its decode step, one row
    for step in prefills[2:]:
        pipe.answer(step)
    first, second = pipe.wait_pending(2)
    pipe.answer(first)
    assert len(pipe.wait_steps(11)[-1].rows) == 4  # 1 back + 6 waiting: 4 go, 3 wait for the next
    pipe.answer(second)
    assert len(pipe.wait_steps(12)[-1].rows) == 4
    pipe.drive(handles)
    assert [h.tokens for h in handles] == [expected([10 * i + 1], 6) for i in range(8)]
    assert max(len(s.rows) for s in pipe.steps[8:]) == 4


# -- cancellation ------------------------------------------------------------------------------


def test_cancel_a_running_request_frees_its_slot_once_its_step_is_back(make_engine):
    pipe = FakePipeline(n_slots=1, hold=True)
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2, 3], max_tokens=50))
    pipe.wait_pending(1)
    pipe.answer_all()
    (step,) = pipe.wait_pending(1)  # a decode step is in flight
    handle.cancel()
    events = finished(handle)
    assert events[-1].finish_reason == "cancelled" and handle.finish_reason == "cancelled"
    assert handle.tokens == [4]
    time.sleep(0.05)
    assert pipe.freed == []  # the slot is still written by the step in flight
    assert engine.slots()["busy"] == 1
    pipe.answer(step)
    wait_until(lambda: pipe.freed == [0], what="slot freed after the step came back")
    assert handle.tokens == [4]  # what the step sampled after the cancel is dropped
    assert handle.events.empty()
    assert len(pipe.steps) == 2
    assert sequences(engine) == (1, 0, 0) and engine.slots()["kv"]["in_use"] == 0


def test_a_slots_request_is_published_while_it_runs_and_withdrawn_when_its_slot_is_free(make_engine):
    """Engine.slots_in_use, read from another thread as /slots reads it: the request in each busy
    slot and its live token count, replaced whole by the engine thread."""
    pipe = FakePipeline(n_slots=2, hold=True)
    engine = make_engine(pipe)
    request = req([1, 2, 3], max_tokens=50)
    handle = engine.submit(request)
    pipe.wait_pending(1)
    (view,) = engine.slots_in_use.values()
    assert view.slot == 0 and view.request is request and view.stats.completion_tokens == 0
    pipe.answer_all()
    pipe.wait_pending(1)
    assert engine.slots_in_use[0].stats.completion_tokens == 1
    with pytest.raises(TypeError):
        engine.slots_in_use[1] = view  # a snapshot: only the engine thread replaces it
    handle.cancel()
    pipe.answer_all()
    wait_until(lambda: not engine.slots_in_use, what="the slot withdrawn")


def test_cancel_a_waiting_request(make_engine):
    pipe = FakePipeline(n_slots=1, hold=True)
    engine = make_engine(pipe)
    running = engine.submit(req([1], max_tokens=2))
    pipe.wait_pending(1)
    waiting = engine.submit(req([7], max_tokens=2))
    wait_until(lambda: engine.slots()["waiting"] == 1, what="a waiting request")
    waiting.cancel()
    events = finished(waiting)
    assert [e.finish_reason for e in events] == ["cancelled"] and waiting.tokens == []
    assert engine.slots()["waiting"] == 0
    pipe.drive([running])
    assert running.tokens == [2, 3]
    time.sleep(0.05)
    assert all(r.tokens != [7] for s in pipe.steps for r in s.rows)  # never scheduled


def test_cancel_after_finish_changes_nothing(make_engine):
    engine = make_engine(FakePipeline())
    handle = engine.submit(req([1], max_tokens=2))
    finished(handle)
    handle.cancel()
    later = engine.submit(req([5], max_tokens=1))
    finished(later)
    assert handle.finish_reason == "length" and handle.events.empty()


def test_cancel_a_sequence_waiting_to_join_a_decode_step_leaves_the_others_running(make_engine):
    pipe = FakePipeline(n_slots=2, n_stages=1, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1, 2], max_tokens=3))
    (prefill_a,) = pipe.wait_pending(1)
    b = engine.submit(req([100], max_tokens=3))
    prefill_b = pipe.wait_pending(2)[1]
    pipe.answer(prefill_a)
    pipe.wait_pending(2)  # a's decode step is in flight
    pipe.answer(prefill_b)  # b is ready, with no step in flight, waiting for the stage
    time.sleep(0.05)
    b.cancel()
    assert finished(b)[-1].finish_reason == "cancelled"
    pipe.drive([a])
    assert a.finish_reason == "length" and a.error is None
    assert a.tokens == [3, 4, 5]


def test_cancel_while_broken_leaves_the_other_sequences_to_be_replayed(make_engine):
    pipe = RecoverablePipeline(n_slots=2, n_stages=1, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1], max_tokens=3))
    (pa,) = pipe.wait_pending(1)
    b = engine.submit(req([5], max_tokens=3))
    pb = pipe.wait_pending(2)[1]
    pipe.break_()
    pipe.answer(pa, error=PipelineError("gone"))  # a is interrupted; b's step is still in flight
    time.sleep(0.05)
    a.cancel()
    assert finished(a)[-1].finish_reason == "cancelled"
    pipe.answer(pb, error=PipelineError("gone"))
    wait_until(lambda: len(pipe.recoveries) == 1, what="recover()")
    pipe.drive([b])
    assert b.finish_reason == "length" and b.tokens == [6, 7, 8]


# -- errors ------------------------------------------------------------------------------------


def test_a_failed_step_ends_its_sequences_with_error(make_engine):
    pipe = FakePipeline(n_slots=2, hold=True)
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2], max_tokens=10))
    pipe.wait_pending(1)
    pipe.answer_all()
    (step,) = pipe.wait_pending(1)
    pipe.answer(step, error=PipelineError("stage 1 failed: out of memory", worker="w1"))
    events = finished(handle)
    assert events[-1].finish_reason == "error"
    assert "stage 1 failed: out of memory" in events[-1].error
    assert handle.finish_reason == "error" and handle.tokens == [3]
    wait_until(lambda: pipe.freed == [0], what="slot freed")
    # the engine keeps serving
    other = engine.submit(req([9], max_tokens=1))
    pipe.drive([other])
    assert other.tokens == [10] and other.finish_reason == "length"


def test_a_failed_shared_step_ends_every_sequence_in_it(make_engine):
    pipe = FakePipeline(n_slots=2, n_stages=1, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1], max_tokens=5))
    (pa,) = pipe.wait_pending(1)
    b = engine.submit(req([2], max_tokens=5))
    pb = pipe.wait_pending(2)[1]
    pipe.answer(pa)
    da = [s for s in pipe.wait_pending(2) if s is not pb][0]
    pipe.answer(pb)
    time.sleep(0.02)
    pipe.answer(da)
    (shared,) = pipe.wait_pending(1)
    assert len(shared.rows) == 2
    pipe.answer(shared, error=PipelineError("link reset"))
    assert finished(a)[-1].error == "link reset"
    assert finished(b)[-1].error == "link reset"
    wait_until(lambda: sorted(pipe.freed) == [0, 1], what="both slots freed")


def test_submit_raising_a_pipeline_error_is_a_failed_step(make_engine):
    pipe = FakePipeline()
    pipe.submit_error = PipelineError("no route to worker")
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2], max_tokens=3))
    events = finished(handle)
    assert events[-1].finish_reason == "error" and "no route to worker" in events[-1].error
    wait_until(lambda: pipe.freed == [0], what="slot freed")
    pipe.submit_error = None
    ok = engine.submit(req([1, 2], max_tokens=1))
    assert finished(ok)[-1].finish_reason == "length" and ok.tokens == [3]


def test_close_cancels_running_and_waiting_requests():
    pipe = FakePipeline(n_slots=1, hold=True)
    engine = Engine(pipe, None)
    running = engine.submit(req([1], max_tokens=10))
    pipe.wait_pending(1)
    waiting = engine.submit(req([2], max_tokens=10))
    wait_until(lambda: engine.slots()["waiting"] == 1, what="a waiting request")
    engine.close()
    assert not engine.running
    for handle in (running, waiting):
        last = finished(handle, timeout=1)[-1]
        assert last.finish_reason == "cancelled" and "shutting down" in last.error


# -- recovery ----------------------------------------------------------------------------------


def run_uninterrupted(prompts, max_tokens, rule, prefill_chunk):
    pipe = FakePipeline(n_slots=len(prompts), n_stages=2, rule=rule)
    engine = Engine(pipe, None, prefill_chunk=prefill_chunk)
    try:
        handles = [engine.submit(req(p, max_tokens)) for p in prompts]
        for h in handles:
            assert finished(h)[-1].finish_reason == "length"
        return [h.tokens for h in handles]
    finally:
        engine.close()


def shape(step: Step) -> list[tuple[int, int, list[int]]]:
    return [(r.slot, r.start, r.tokens) for r in step.rows]


def test_a_broken_pipeline_is_recovered_and_sequences_replay_their_history(make_engine):
    prompts, max_tokens, chunk = [[1, 2, 3], [10, 11]], 6, 4
    pipe = RecoverablePipeline(n_slots=2, n_stages=2, hold=True, rule=mixing)
    engine = make_engine(pipe, prefill_chunk=chunk)
    a, b = (engine.submit(req(p, max_tokens)) for p in prompts)
    for _ in range(3):  # prefill and two decode rounds: three tokens each
        pipe.wait_pending(2)
        pipe.answer_all()
    in_flight = pipe.wait_pending(2)
    assert len(in_flight) == 2
    wait_until(lambda: len(a.tokens) == 3 and len(b.tokens) == 3, what="three tokens each")
    history = [p + h.tokens for p, h in zip(prompts, (a, b))]

    pipe.break_("worker w1 is gone")
    pipe.answer(in_flight[0], error=PipelineError("worker w1 is gone", worker="w1"))
    time.sleep(0.1)
    assert pipe.recoveries == []  # the other step is still in flight
    assert a.finish_reason is None and b.finish_reason is None
    n_before = len(pipe.steps)
    pipe.answer(in_flight[1], error=PipelineError("worker w1 is gone", worker="w1"))
    wait_until(lambda: len(pipe.recoveries) == 1, what="recover()")
    assert pipe.recoveries[0]["reason"] == "worker w1 is gone"

    # the steps that filled the cache are sent again as they were: the prompts in the same
    # chunks, then the same decode steps; only the steps that were in flight sample
    replay = pipe.wait_steps(2 * n_before)[n_before:]
    assert [shape(s) for s in replay] == [shape(s) for s in pipe.steps[:n_before]]
    assert [r.sampling is not None for s in replay for r in s.rows] == [False] * 6 + [True] * 2
    assert pipe.recoveries[0]["replayed_tokens"] == sum(map(len, history))

    pipe.drive([a, b])
    assert (a.finish_reason, b.finish_reason) == ("length", "length")
    assert [a.tokens, b.tokens] == run_uninterrupted(prompts, max_tokens, mixing, chunk)
    assert [a.tokens, b.tokens] == [expected(p, max_tokens, mixing) for p in prompts]
    assert pipe.problems == []


def test_a_prompt_goes_in_pieces_where_stages_overlap_and_a_replay_on_fewer_stages_keeps_them(make_engine):
    """With 512-token chunks, a 70-token prompt goes through 2 overlapping stages in pieces of 32
    rows (MIN_PIECE; 70 / 4 is fewer); rebuilt on one stage, the replay sends it in the same
    pieces, so that its keys and values are computed as they first were."""
    prompt = [(5 * i + 1) % 1000 for i in range(70)]
    pipe = RecoverablePipeline(n_slots=1, ctx=128, n_stages=2, hold=True, rule=mixing)
    engine = make_engine(pipe, prefill_chunk=512)
    handle = engine.submit(req(prompt, 3))
    first = pipe.wait_pending(3)
    assert [(s.rows[0].start, len(s.rows[0].tokens)) for s in first] == [(0, 32), (32, 32), (64, 6)]
    pipe.answer_all()
    in_flight = pipe.wait_pending(1)  # the first decode step
    n_before = len(pipe.steps)
    pipe.n_stages = 1
    pipe.break_("worker w1 is gone")
    pipe.answer(in_flight[0], error=PipelineError("worker w1 is gone", worker="w1"))
    replay = pipe.wait_steps(n_before + 4)[n_before:]
    assert [shape(s) for s in replay[:3]] == [shape(s) for s in first]
    pipe.drive([handle])
    assert handle.tokens == expected(prompt, 3, mixing)


def test_a_replay_keeps_the_decode_steps_as_they_were_grouped_less_finished_sequences(make_engine):
    """One stage: one decode step in flight, carrying every ready sequence. The replay sends the
    same groups, without the sequence that has finished since, and every row at its position."""
    prompts, lengths = [[1, 2, 3], [10, 11], [20, 21, 22, 23, 24]], (8, 2, 8)
    pipe = RecoverablePipeline(n_slots=3, n_stages=1, hold=True, rule=mixing)
    engine = make_engine(pipe, prefill_chunk=2)
    a, b, c = (engine.submit(req(p, n)) for p, n in zip(prompts, lengths))
    while len(a.tokens) < 5:
        if not pipe.answer_all():
            time.sleep(0.001)
    (in_flight,) = pipe.wait_pending(1)
    assert b.finish_reason == "length"
    assert any(len(s.rows) > 1 and any(r.slot == 1 for r in s.rows) for s in pipe.steps)  # b ran in slot 1
    n_before = len(pipe.steps)
    pipe.break_()
    pipe.answer(in_flight, error=PipelineError("gone"))
    wait_until(lambda: len(pipe.recoveries) == 1, what="recover()")

    first = [[row for row in shape(s) if row[0] != 1] for s in pipe.steps[:n_before]]
    first = [rows for rows in first if rows]
    assert [shape(s) for s in pipe.wait_steps(n_before + len(first))[n_before:]] == first
    pipe.drive([a, c])
    assert [a.tokens, b.tokens, c.tokens] == [expected(p, n, mixing) for p, n in zip(prompts, lengths)]
    assert pipe.problems == []


def test_requests_arriving_while_broken_wait_for_the_recovery(make_engine):
    pipe = RecoverablePipeline(n_slots=2, hold=True)
    engine = make_engine(pipe)
    a = engine.submit(req([1], max_tokens=3))
    (step,) = pipe.wait_pending(1)
    pipe.break_()
    late = engine.submit(req([20], max_tokens=2))
    wait_until(lambda: engine.slots()["waiting"] == 1, what="the late request to wait")
    time.sleep(0.05)
    assert len(pipe.steps) == 1  # nothing is sent to a broken pipeline with a step in flight
    pipe.answer(step, error=PipelineError("gone"))
    wait_until(lambda: len(pipe.recoveries) == 1, what="recover()")
    pipe.drive([a, late])
    assert a.tokens == [2, 3, 4] and late.tokens == [21, 22]


def test_a_due_rebalance_waits_for_steps_in_flight_then_replays(make_engine):
    pipe = RecoverablePipeline(n_slots=1, hold=True)
    engine = make_engine(pipe)
    handle = engine.submit(req([5, 6], max_tokens=4))
    pipe.wait_pending(1)
    pipe.answer_all()
    (step,) = pipe.wait_pending(1)  # decode of the second token
    pipe.rebalance_due = True
    pipe.on_wake()
    time.sleep(0.05)
    assert pipe.recoveries == []
    pipe.answer(step)  # a successful step: its token counts, then the rebalance
    wait_until(lambda: len(pipe.recoveries) == 1, what="rebalance")
    replay = pipe.wait_pending(2)  # 8 was never fed: the next decode step feeds it
    assert [(r.start, r.tokens, r.sampling) for s in replay for r in s.rows] == [(0, [5, 6], None), (2, [7], None)]
    pipe.drive([handle])
    assert handle.tokens == [7, 8, 9, 10] and handle.finish_reason == "length"


def test_a_failed_recovery_ends_the_requests_with_its_error(make_engine):
    pipe = RecoverablePipeline(n_slots=1, hold=True)
    pipe.recover_error = RuntimeError("no worker can hold stage 2")
    engine = make_engine(pipe)
    handle = engine.submit(req([1], max_tokens=3))
    (step,) = pipe.wait_pending(1)
    pipe.break_()
    pipe.answer(step, error=PipelineError("gone"))
    last = finished(handle)[-1]
    assert last.finish_reason == "error" and last.error == "no worker can hold stage 2"
    assert engine.running


def test_a_sequence_that_keeps_breaking_without_progress_ends_with_error(make_engine):
    pipe = RecoverablePipeline(n_slots=1, hold=True)
    engine = make_engine(pipe)
    handle = engine.submit(req([1, 2], max_tokens=3))
    for i in range(4):
        (step,) = pipe.wait_pending(1)
        pipe.break_(f"failure {i}")
        pipe.answer(step, error=PipelineError(f"failure {i}"))
        wait_until(lambda: len(pipe.recoveries) == i + 1, what=f"recovery {i + 1}")
    last = finished(handle)[-1]
    assert last.finish_reason == "error"
    assert "interrupted 4 times without progress" in last.error and "failure 3" in last.error
    assert len(pipe.steps) == 4  # the first prefill and three replays
    wait_until(lambda: pipe.freed == [0], what="slot freed")


def test_a_non_recoverable_pipeline_ignores_broken(make_engine):
    pipe = FakePipeline(hold=True)
    pipe.broken = "something"  # no recover(): the engine must not wait for a recovery
    engine = make_engine(pipe)
    handle = engine.submit(req([1], max_tokens=2))
    (step,) = pipe.wait_pending(1)
    pipe.answer(step, error=PipelineError("gone"))
    assert finished(handle)[-1].finish_reason == "error"


# -- text, stop strings and end-of-generation tokens (a tiny fake tokenizer) -----------------------


class CharTokenizer:
    """Token i is chr(i); 0 is the end-of-generation token."""

    stop_ids = frozenset({0})

    class _Decoder:
        def feed(self, token):
            return chr(token)

        def flush(self):
            return ""

    def stream_decoder(self, after=None, kept=frozenset()):
        return self._Decoder()


def scripted(text: str):
    """A rule that writes `text` (then the stop token 0 forever), whatever the prompt."""
    it = iter(text)

    def rule(tokens):
        return ord(next(it, "\0"))

    return rule


def test_the_eos_token_ends_with_stop_unless_ignore_eos():
    pipe = FakePipeline(vocab_size=256, rule=scripted("hi"))
    engine = Engine(pipe, CharTokenizer())
    try:
        handle = engine.submit(req([65], max_tokens=10))
        events = finished(handle)
        assert handle.finish_reason == "stop" and handle.tokens == [ord("h"), ord("i"), 0]
        assert "".join(e.text for e in events) == "hi"
        pipe.rule = scripted("ab")
        ignoring = engine.submit(req([65], max_tokens=4, ignore_eos=True))
        events = finished(ignoring)
        assert ignoring.finish_reason == "length" and ignoring.tokens == [97, 98, 0, 0]
    finally:
        engine.close()


def test_a_stop_string_across_tokens_is_held_back_and_cut():
    pipe = FakePipeline(vocab_size=256, rule=scripted("abc<EN>xyz"))
    engine = Engine(pipe, CharTokenizer())
    try:
        handle = engine.submit(req([65], max_tokens=20, stop=("<END>", "<EN>")))
        events = finished(handle)
        assert handle.finish_reason == "stop"
        assert "".join(e.text for e in events) == "abc"
        assert [e.text for e in events[:-1]] == ["a", "b", "c", "", "", "", ""]
        # a held-back prefix that never completes comes out when generation ends
        pipe.rule = scripted("ok<E")
        other = engine.submit(req([65], max_tokens=4, stop=("<END>",)))
        assert "".join(e.text for e in finished(other)) == "ok<E"
        assert other.finish_reason == "length"
    finally:
        engine.close()


# -- speculative decoding --------------------------------------------------------------------------

# ends as it starts: with the 3 plus_one adds, lookup proposes 4 ... 8, 1, 2, 3
COUNTING = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]


def test_proposals_from_the_context_are_checked_in_one_step_and_give_the_tokens_of_plain_decoding(make_engine):
    """plus_one continues 1, 2 with 3 ... 8, 9: the first decode step proposes what followed 1, 2, 3
    at the start, keeps 4 ... 8 and draws 9 where the context had 1."""
    pipe = FakePipeline(ctx=128)
    engine = make_engine(pipe)
    engine.step_costs = FreeWidth()
    handle = engine.submit(req(COUNTING, 12, speculation=Speculation(n_max=8)))
    assert finished(handle)[-1].finish_reason == "length"
    assert handle.tokens == expected(COUNTING, 12)
    first = pipe.steps[1].rows[0]
    assert (first.start, first.tokens, first.n_draft) == (10, [3, 4, 5, 6, 7, 8, 1, 2], 7)  # steps 8 wide
    assert handle.stats.draft_n_accepted >= 5 and engine.counters.draft_accepted == handle.stats.draft_n_accepted
    assert engine.counters.decode_steps < 12 - 1
    assert pipe.problems == []


def test_proposals_stop_at_max_tokens_and_at_the_context(make_engine):
    pipe = FakePipeline(ctx=16)
    engine = make_engine(pipe)
    engine.step_costs = FreeWidth()
    short = engine.submit(req(COUNTING, 3, speculation=Speculation(n_max=8)))
    assert finished(short)[-1].finish_reason == "length"
    assert short.tokens == expected(COUNTING, 3)
    assert all(len(r.tokens) <= 2 for s in pipe.steps[1:] for r in s.rows)  # two more wanted after the first
    long = engine.submit(req(COUNTING, 20, speculation=Speculation(n_max=8)))
    assert finished(long)[-1].finish_reason == "length"
    assert long.tokens == expected(COUNTING, 6)  # the context holds 16 positions
    assert all(r.start + len(r.tokens) <= 16 for s in pipe.steps for r in s.rows)
    assert pipe.problems == []


def test_a_step_carries_speculating_and_plain_sequences_as_wide_as_its_widest_row(make_engine):
    pipe = FakePipeline(n_slots=2, ctx=128, hold=True)
    engine = make_engine(pipe)
    engine.step_costs = FreeWidth()
    spec = engine.submit(req(COUNTING, 10, speculation=Speculation(n_max=4)))
    plain = engine.submit(req([40, 41], 10))
    pipe.wait_pending(2)
    pipe.answer_all()  # the prompts
    step = pipe.wait_pending(1)[0]
    assert [len(r.tokens) for r in step.rows] == [4, 4]
    assert [r.n_draft for r in step.rows] == [3, 3]
    assert step.rows[1].tokens[0] == 42  # its next token, then filler: its last token again
    pipe.drive([spec, plain])
    assert spec.tokens == expected(COUNTING, 10) and plain.tokens == expected([40, 41], 10)
    assert pipe.problems == []


def test_a_replay_sends_the_speculative_steps_again_with_the_tokens_they_fed(make_engine):
    """The cache a replay rebuilds is the one the steps wrote: the same rows, proposals refused
    included, and the step in flight samples (and checks its proposals) again."""
    pipe = RecoverablePipeline(n_slots=1, ctx=128, n_stages=1, hold=True)
    engine = make_engine(pipe, prefill_chunk=16)
    engine.step_costs = FreeWidth()
    handle = engine.submit(req(COUNTING, 14, speculation=Speculation(n_max=8)))
    for _ in range(3):  # the prompt and two decode steps
        pipe.wait_pending(1)
        pipe.answer_all()
    in_flight = pipe.wait_pending(1)
    n_before = len(pipe.steps)
    pipe.break_()
    pipe.answer(in_flight[0], error=PipelineError("worker w1 is gone", worker="w1"))
    replay = pipe.wait_steps(2 * n_before)[n_before:]
    assert [shape(s) for s in replay] == [shape(s) for s in pipe.steps[:n_before]]
    assert [[r.n_draft for r in s.rows] for s in replay] == [[r.n_draft for r in s.rows] for s in pipe.steps[:n_before]]
    assert [r.sampling is not None for s in replay for r in s.rows] == [False] * (n_before - 1) + [True]
    pipe.drive([handle])
    assert handle.tokens == expected(COUNTING, 14)
    assert pipe.problems == []
