"""A request in flight survives the loss of a worker: detect, re-plan, replay, continue."""

import threading
import time

import pytest

from shardwire.engine import Engine, Request
from shardwire.engine.drafting import Acceptance, Speculation
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import SamplingParams
from shardwire_kit.drafting import Scripted
from shardwire_kit.synthetic import SIX_BLOCKS, write_random_llama

from models import model_path
from recovery import (
    CHUNK,
    GREEDY,
    PROMPT,
    BreakingPipeline,
    Setup,
    budget_for_a_third,
    collect,
    wait_for_tokens,
)
from runs import single_process
from speculating import FreeWidth

pytestmark = pytest.mark.slow  # worker processes

SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory):
    """The same, with output rows in near-identical pairs: every greedy step is a near-tie that
    float32 rounding decides."""
    return write_random_llama(tmp_path_factory.mktemp("recovery") / "six-near-ties.gguf", near_ties=1e-6, **SIX_BLOCKS)


@pytest.fixture
def setup(tmp_path, model_file):
    made = []

    def make(path=None, **kw):
        made.append(Setup(tmp_path, path or model_file, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_kill_during_decode_all_requests_complete_unchanged(setup, reference):
    s = setup()
    handles = [
        s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)),
        s.engine.submit(Request(PROMPT[:9], SEEDED, max_tokens=40)),
        s.engine.submit(Request(PROMPT[3:], GREEDY, max_tokens=30)),
    ]
    wait_for_tokens(handles[0], 8)
    s.workers[1].kill()
    assert collect(handles[0])[0] == reference()
    assert collect(handles[1])[0] == reference(PROMPT[:9], 40, SEEDED)
    assert collect(handles[2])[0] == reference(PROMPT[3:], 30)
    event = s.cluster.events[-1]
    assert event["recovered"] and s.workers[1].address in event["lost"] and event["replayed_tokens"] > 0
    assert len(s.cluster.plan.stages) == 2


def test_a_replay_through_near_ties_gives_exactly_the_uninterrupted_tokens(setup, near_ties):
    """Every step of this model is a near-tie, so a cache rebuilt with other arithmetic than the
    first run's (the generated tokens prefilled as a batch, say) changes the text within a few
    tokens; the replay must recompute each position as it was first computed."""
    s = setup(path=near_ties)
    n = 200  # the prompt and 200 tokens fill 216 of the 256 positions
    uninterrupted = collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=n, ignore_eos=True)))[0]
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=n, ignore_eos=True))
    wait_for_tokens(handle, 60)
    s.workers[1].kill()
    assert collect(handle)[0] == uninterrupted
    event = s.cluster.events[-1]
    assert event["recovered"] and event["replayed_tokens"] > len(PROMPT) + 50


def test_a_replay_of_speculative_steps_gives_exactly_the_uninterrupted_tokens(setup, near_ties):
    """The same through near-ties with prompt lookup on: the replay sends each step with the tokens
    it fed, proposals refused included, so the cache is the one the steps first wrote."""
    s = setup(path=near_ties)
    s.engine.step_costs = FreeWidth()  # proposals as long as the rate says, whatever steps cost here

    def asked():
        s.engine.acceptance = {}  # each run starts from the same rate, so proposes the same
        return Request(PROMPT * 3, GREEDY, max_tokens=150, ignore_eos=True, speculation=Speculation(n_max=7))

    first = s.engine.submit(asked())
    uninterrupted = collect(first)[0]
    assert first.stats.draft_n_accepted > 0
    handle = s.engine.submit(asked())
    wait_for_tokens(handle, 50)
    s.workers[1].kill()
    assert collect(handle)[0] == uninterrupted
    event = s.cluster.events[-1]
    assert event["recovered"] and event["replayed_tokens"] > len(PROMPT) * 3 + 40


def test_steps_sent_ahead_are_left_out_of_a_replay(setup):
    """Proposals kept but for one step in four: a sequence's steps go ahead of the one in flight
    (some void where that one refused a proposal). A worker killed mid-generation: those in
    flight give nothing, the replay sends only the steps that counted, and the tokens are
    the uninterrupted run's."""
    s = setup()
    uninterrupted = collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=120, ignore_eos=True)))[0]
    s.engine.step_costs = FreeWidth()
    s.engine.acceptance["ngram-simple"] = Acceptance()
    vocab = s.pipeline.vocab_size
    s.engine._drafter = lambda speculation, slot: Scripted(uninterrupted, len(PROMPT), vocab, every=4)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=120, ignore_eos=True, speculation=Speculation()))
    wait_for_tokens(handle, 40)
    ahead = s.engine.counters.ahead_steps
    s.workers[1].kill()
    assert collect(handle)[0] == uninterrupted
    assert ahead > 0 and s.engine.counters.void_steps > 0, s.engine.counters
    event = s.cluster.events[-1]
    assert event["recovered"] and event["replayed_tokens"] > len(PROMPT) + 30


def test_a_hybrid_replays_its_speculative_steps_and_the_state_it_took_back(setup):
    """Qwen3.5 over three workers, its proposals set to be refused in part every step (each
    stage takes its delta-net state back to before them): a worker killed mid-generation, the
    replay sends the steps again as they went, copies and takings-back included, and the
    tokens are those of the uninterrupted run."""
    s = setup(path=model_path("qwen35", "F32"))
    uninterrupted = collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=120, ignore_eos=True)))[0]
    s.engine.step_costs = FreeWidth()
    s.engine.acceptance["ngram-simple"] = Acceptance()
    vocab = s.pipeline.vocab_size
    s.engine._drafter = lambda speculation, slot: Scripted(uninterrupted, len(PROMPT), vocab)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=120, ignore_eos=True, speculation=Speculation()))
    wait_for_tokens(handle, 30)
    s.workers[1].kill()
    assert collect(handle)[0] == uninterrupted
    assert 0 < handle.stats.draft_n_accepted < handle.stats.draft_n
    event = s.cluster.events[-1]
    assert event["recovered"] and event["replayed_tokens"] > len(PROMPT) + 20


def test_a_replay_of_shared_decode_steps_is_exact(near_ties):
    """Three sequences decode in shared steps, which the replay sends again as they were: through
    this model's near-ties, every sequence gives its uninterrupted tokens."""
    model = open_model(near_ties)
    stages = [load_stage(model, 0, model.config.n_layers)]

    def run(break_at=0):
        pipe = BreakingPipeline(stages, break_at)
        engine = Engine(pipe, prefill_chunk=CHUNK)
        try:
            handles = [engine.submit(Request(PROMPT, GREEDY, max_tokens=100, ignore_eos=True))]
            assert pipe.entered.wait(10)
            handles += [
                engine.submit(Request(p, GREEDY, max_tokens=100, ignore_eos=True)) for p in (PROMPT[:9], PROMPT[3:])
            ]
            pipe.go.set()
            return [collect(h)[0] for h in handles], pipe.n_steps
        finally:
            engine.close()

    uninterrupted, n_steps = run()
    assert n_steps < 150  # 300 tokens: most steps carry all three
    for break_at in (30, 70):
        assert run(break_at)[0] == uninterrupted


def test_kill_during_prefill(setup, reference):
    s = setup()
    prompt = (PROMPT * 12)[:180]  # 12 chunks of 16
    handle = s.engine.submit(Request(prompt, GREEDY, max_tokens=20))
    time.sleep(0.05)
    s.workers[2].kill()
    assert collect(handle)[0] == reference(tuple(prompt), 20)


def test_kill_between_requests(setup, reference):
    s = setup()
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)))[0] == reference()
    s.workers[0].kill()
    time.sleep(2.5)  # the heartbeat notices; recovery runs before the next request
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)))[0] == reference()


def test_too_little_capacity_waits_for_the_worker_to_come_back(setup, reference, model_file):
    s = setup(mem=budget_for_a_third(model_file))
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    wait_for_tokens(handle, 5)
    killed = s.workers[1].address
    s.workers[1].kill()
    threading.Timer(3.0, s.restart, args=(1,)).start()
    # what GET /v1/cluster and the web page show meanwhile: the lost worker, the others recovering
    deadline = time.monotonic() + 3.0
    while (states := _states(s.cluster)) != {**{w.address: "recovering" for w in s.workers}, killed: "lost"}:
        assert time.monotonic() < deadline, states
        time.sleep(0.02)
    assert collect(handle)[0] == reference()
    assert len(s.cluster.plan.stages) == 3
    assert _states(s.cluster) == {**{w.address: "healthy" for w in s.workers}, killed: "rejoined"}


def _states(cluster) -> dict[str, str]:
    return {w["name"]: w["state"] for w in cluster.status()["workers"]}


def test_too_little_capacity_fails_clearly_within_the_deadline_and_serves_again(setup, reference, model_file):
    s = setup(mem=budget_for_a_third(model_file), recovery_timeout=4.0)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=200, ignore_eos=True))
    wait_for_tokens(handle, 5)
    lost = s.workers[2].address
    killed = time.monotonic()
    s.workers[2].kill()
    events = list(handle)
    assert time.monotonic() - killed < 4.0 + 6.0
    assert events[-1].finish_reason == "error"
    assert lost in events[-1].error and "does not fit" in events[-1].error
    s.restart(2)
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)))[0] == reference()


def test_a_link_that_silently_stops_is_detected_and_recovered(setup, reference):
    s = setup(relay_index=2)
    handle = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40))
    wait_for_tokens(handle, 8)
    frozen = time.monotonic()
    s.relay.frozen.set()
    assert collect(handle)[0] == reference()
    event = s.cluster.events[-1]
    assert event["recovered"] and s.relay.address in event["lost"]
    assert event["at"] - (time.time() - (time.monotonic() - frozen)) < 5.0


def test_a_restarted_worker_is_admitted_back_into_the_plan(setup, reference):
    s = setup()
    s.workers[1].kill()
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=20)))[0] == reference(n=20)
    assert len(s.cluster.plan.stages) == 2
    s.restart(1)
    deadline = time.monotonic() + 20
    while len(s.cluster.plan.stages) < 3:
        assert time.monotonic() < deadline, "the returning worker was not admitted"
        s.engine.submit(Request(PROMPT, GREEDY, max_tokens=2)).result()
        time.sleep(0.3)
    assert collect(s.engine.submit(Request(PROMPT, GREEDY, max_tokens=40)))[0] == reference()


def test_a_mixture_of_experts_recovers_like_a_dense_model(tmp_path):
    """Replay rebuilds the lost blocks' cache through the new plan's experts: both sequences
    continue with the tokens an uninterrupted run gives."""
    path = model_path("qwen3moe", "Q8_0")
    s = Setup(tmp_path, path)
    try:
        greedy = s.engine.submit(Request(PROMPT, GREEDY, max_tokens=30))
        seeded = s.engine.submit(Request(PROMPT[:9], SEEDED, max_tokens=30))
        wait_for_tokens(greedy, 6)
        s.workers[1].kill()
        assert collect(greedy)[0] == single_process(path, n=30, prompt=PROMPT)[0]
        assert collect(seeded)[0] == single_process(path, n=30, sampling=SEEDED, prompt=PROMPT[:9])[0]
        assert s.cluster.events[-1]["recovered"]
    finally:
        s.close()
