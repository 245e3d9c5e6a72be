"""Sequences, scheduling and the prefill/decode loop, over any pipeline of stages.

One engine thread owns all sequence state. Requests, step results and cancellations reach it
through one inbox, so nothing here needs a lock. Every sequence keeps its whole token history
(prompt and generated), which is all a replay needs to rebuild its KV cache.

Recovery: when a pipeline that can recover (a cluster) breaks, its sequences are not failed.
Once every step in flight has come back, the pipeline is rebuilt on the capacity that is left
(or that returns) and each sequence replays its tokens in the steps that first carried them:
its prompt in the same chunks, its generated tokens in the same decode steps. Where the new
stages compute as the old ones did, the cache is rebuilt bit for bit, and sampling depends
only on (seed, position), so the next token is the one an uninterrupted run would have drawn.

One module of this length: scheduling, prefill and decode, and recovery all change the same sequence
state on one thread; apart, that state's rules would be spread over files (what a sequence's tokens
show is apart, in output.py).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

from ..averages import moved
from ..backends import IDLE_S
from ..constrain import Grammar, ProposalCheck, RowConstraint, vocabulary_of
from ..enums import PAGE, pages_for
from ..pipeline import Pipeline, PipelineError, Recoverable, Row, Step, StepResult
from ..sampling import Sampled, SamplingParams
from .draft_model import DraftModel
from .drafting import MAX_PROPOSALS, Acceptance, ByModel, Drafter, Lookup, Speculation, StepCosts
from .output import Output
from .pages import PagePool, prefix_hashes

log = logging.getLogger("shardwire.engine")

MAX_FRUITLESS_REPLAYS = 3
# The fewest rows a prompt is split into for its stages to overlap: each piece reads every weight
# once more, and on a CPU a product of fewer rows spends more on that than the overlap gains
# (a 64-token prompt of the 1B F16 file on 2 workers: 2 pieces of 32 5-10% sooner, 4 of 16 slower).
MIN_PIECE = 32


def _shared(a: list[int], b: list[int]) -> int:
    """How many tokens a and b begin with alike."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # what the output must follow (see constrain.py)
    cache_prompt: bool = True  # reuse the KV pages of a cached prefix of the prompt
    report_progress: bool = False  # events tell how far the prompt is, before its first token
    kept_tokens: frozenset[int] = frozenset()  # special tokens whose text the output shows (output.py)
    speculation: Speculation | None = None  # decode steps propose tokens to check (drafting.py)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")


@dataclass(frozen=True)
class PromptProgress:
    """How far a prompt is (llama-server's prompt_progress): `processed` of its `total` positions,
    the first `cached` of them found in the KV cache; `ms` since the request came in."""

    total: int
    cached: int
    processed: int
    ms: float


@dataclass
class Event:
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    progress: PromptProgress | None = None  # only this: the prompt got this far (report_progress)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the KV cache (not computed again)
    completion_tokens: int = 0
    draft_n: int = 0  # tokens its decode steps proposed (speculative decoding)
    draft_n_accepted: int = 0  # of them, those kept
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_token: float = 0.0
    t_end: float = 0.0

    @property
    def prompt_tps(self) -> float:
        elapsed = self.t_first_token - self.t_submit
        return self.prompt_tokens / elapsed if elapsed > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        elapsed = self.t_end - self.t_first_token
        return (self.completion_tokens - 1) / elapsed if elapsed > 0 and self.completion_tokens > 1 else 0.0


@dataclass(frozen=True)
class SlotView:
    """A slot's request as any thread may read it (Engine.slots_in_use); its stats are the
    request's own, which the engine thread updates as tokens come."""

    slot: int
    request: Request
    stats: Stats


@dataclass
class Counters:
    """What the engine has done since it started (for /metrics; read from any thread)."""

    steps: int = 0  # sent through the pipeline: prefill chunks, decode steps, replays
    decode_steps: int = 0
    decode_rows: int = 0  # sequences those decode steps carried
    drafts: int = 0  # decode rows that carried proposed tokens (speculative decoding)
    draft_tokens: int = 0  # the tokens they proposed
    draft_accepted: int = 0  # of them, those kept
    most_positions: int = 0  # the longest any sequence has grown
    generated: int = 0  # tokens every sequence has generated
    prompt_positions: int = 0  # prompt positions whose prefill steps came back
    step_ms: float | None = None  # a decode step, sent to result: a moving average
    ahead_steps: int = 0  # decode steps sent ahead, on what the steps before them were expected to give
    void_steps: int = 0  # of them, those whose expectation failed: their results were dropped


class Handle:
    """The caller's side of one request: a stream of events, cancellable from any thread."""

    def __init__(self, engine: "Engine", request: Request, events=None):
        self.request, self._engine = request, engine
        self.events: queue.Queue[Event] = queue.Queue() if events is None else events
        self.stats = Stats(prompt_tokens=len(request.prompt))
        self.tokens: list[int] = []
        self.prefix_hashes: list[bytes] = []  # of the prompt's full pages, kept while it waits
        self.finish_reason: str | None = None
        self.error: str | None = None

    def cancel(self) -> None:
        self._engine.cancel(self)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> str:
        """Wait for the end; the whole generated text."""
        return "".join(e.text for e in self)


class _Sequence:
    def __init__(self, handle: Handle, slot: int, output: Output):
        self.handle, self.request, self.slot = handle, handle.request, slot
        self.tokens = list(handle.request.prompt)
        self.n_prompt = len(self.tokens)
        self.in_flight = 0  # steps sent and not yet answered
        self.interrupted = False  # its pipeline broke; it waits to be replayed
        self.fruitless_replays = 0  # replays since its last new token
        # per decode step that fed it: (step id, row, position of the first token fed, tokens fed)
        self.fed: list[tuple[int, int, int, list[int]]] = []
        self.output = output
        self.finished = False
        self.cancelled = False
        self.pages: list[int] = []  # its page table: page i holds positions [i * PAGE, (i + 1) * PAGE)
        self.hashes: list[bytes] = []  # prefix hashes of its full pages, as far as computed
        self.n_cached = 0  # positions its pages held already when it (re)started
        self.filling: tuple[int, list[bytes]] | None = None  # (last prefill step, prefixes it computes)
        self.preempted = False  # its pages went to others; it restarts from its tokens when some are free
        self.failed = False  # a step of it failed: its pages may hold anything
        self.progress_at: dict[int, int] = {}  # prompt chunk's step id -> positions done once it is back
        self.prefill_rows: int | None = None  # rows a step of its first prefill took; a replay takes as many
        self.drafter: Drafter | None = None  # how its decode steps propose tokens (speculative decoding)
        self.proposal: list[int] = []  # what its next decode step proposes
        self.check: ProposalCheck | None = None  # its grammar, where it speculates under one
        self.decoding: list[int] = []  # its decode steps in flight whose results count, in order
        self.void = 0  # its steps in flight whose results no longer count (sent ahead on a wrong guess)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        tokenizer=None,
        *,
        prefill_chunk: int = 512,
        draft: DraftModel | None = None,
        ahead: bool = True,
    ):
        """`draft`: the model that requests' speculative type draft-simple proposes with (its
        cache sized for the pipeline's slots); `ahead`: a speculating sequence's decode steps
        may be sent while the one before is in flight (_send_ahead), where the stages overlap."""
        self.pipeline, self.tokenizer, self.draft, self.ahead = pipeline, tokenizer, draft, ahead
        self.prefill_chunk = prefill_chunk
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[Handle] = []
        self._running: dict[int, _Sequence] = {}  # slot -> sequence
        # slot -> SlotView of the sequence in it: replaced whole by the engine thread on each change
        self.slots_in_use: Mapping[int, SlotView] = MappingProxyType({})
        self._steps: dict[int, list[_Sequence]] = {}  # in-flight step id -> its sequences
        self._decoding: set[int] = set()  # the decode steps among them
        self._free_slots = list(range(pipeline.n_slots))
        self._sent_at: dict[int, tuple[float, int]] = {}  # decode step id -> (when sent, width)
        self._prefilling: dict[int, int] = {}  # in-flight prefill step id -> its positions
        self._checking: set[int] = set()  # the steps whose sampled rows check proposals: decode steps, replayed or not
        self._void: set[int] = set()  # steps in flight sent ahead on an expectation that failed
        self.step_costs = StepCosts()
        # of every sequence's proposals, by kind: where a new sequence's rate starts
        self.acceptance: dict[str, Acceptance] = {}
        self.pages = PagePool(pipeline.kv_pages)
        self.counters = Counters()
        # a recurrent state cannot start past position 0, so such a model reuses no prefix; nor
        # may a model whose sliding windows keep a ring per slot, but in the slot whose last
        # sequence began with it (_ring_prefix)
        self._ring_step = getattr(pipeline, "ring_step", 0)
        self._reuse = not (getattr(pipeline, "recurrent", False) or self._ring_step)
        self._ring_held: dict[int, list[int]] = {}  # slot -> its last sequence's tokens, which its rings hold
        pipeline.on_result = lambda result: self._inbox.put((self._on_result, result))
        pipeline.on_wake = lambda: self._inbox.put((self._on_wake, None))
        self._recoverable = isinstance(pipeline, Recoverable)
        self._vocabulary = None  # constrain.Vocabulary of the tokenizer, made for the first grammar
        self._thread = threading.Thread(target=self._loop, name="shardwire-engine", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------

    def submit(self, request: Request, events=None) -> Handle:
        """Queue a request. `events` replaces the handle's queue: anything with put(event), called
        on the engine thread (the HTTP server passes one that hands events to its event loop)."""
        if request.sampling.seed is None:
            request.sampling = SamplingParams(**{**request.sampling.to_dict(), "seed": random.getrandbits(31)})
        handle = Handle(self, request, events)
        self._inbox.put((self._on_request, handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop a request from any thread: it ends with finish_reason "cancelled"."""
        self._inbox.put((self._on_cancel, handle))

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def slots(self) -> dict:
        """Sequence slots in use, requests waiting for one, and the KV pages: a snapshot, readable
        from any thread."""
        return {
            "total": self.pipeline.n_slots,
            "busy": len(self._running),
            "waiting": len(self._waiting),
            "kv": self.pages.stats(),
        }

    def close(self) -> None:
        self._inbox.put((None, None))
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        busy = False
        while True:
            try:
                handler, item = self._inbox.get(timeout=IDLE_S) if busy else self._inbox.get()
            except queue.Empty:  # no step for IDLE_S
                busy = False
                self._guarded(self.pipeline.idle)
                continue
            busy = True
            while True:
                if handler is None:  # close()
                    self._fail_all("the engine is shutting down", "cancelled")
                    return
                self._guarded(handler, item)
                try:
                    handler, item = self._inbox.get_nowait()
                except queue.Empty:
                    break
            self._guarded(self._schedule)

    def _guarded(self, fn, *args) -> None:
        """A bug in handling one message must not take every request down with the thread."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            log.exception("engine error")
            self._fail_all(f"internal error: {type(e).__name__}: {e}", "error")

    def _on_request(self, handle: Handle) -> None:
        ctx, vocab = self.pipeline.ctx, self.pipeline.vocab_size
        prompt = handle.request.prompt
        if len(prompt) >= ctx:
            self._finish_handle(handle, "error", f"the prompt has {len(prompt)} tokens; the context holds {ctx}")
            return
        if min(prompt) < 0 or max(prompt) >= vocab:
            self._finish_handle(handle, "error", f"token ids must be in [0, {vocab}), the vocabulary of this model")
            return
        speculation = handle.request.speculation
        if speculation is not None and speculation.kind == "draft-simple" and self.draft is None:
            self._finish_handle(handle, "error", "speculative type draft-simple needs a draft model (-md)")
            return
        if handle.request.grammar is not None and self._vocabulary is None:
            if self.tokenizer is None or not hasattr(self.pipeline, "use_vocabulary"):
                self._finish_handle(handle, "error", "this engine cannot constrain output")
                return
            self._vocabulary = vocabulary_of(self.tokenizer)
            self.pipeline.use_vocabulary(self._vocabulary)
        self._waiting.append(handle)

    def _on_cancel(self, handle: Handle) -> None:
        if handle in self._waiting:
            self._waiting.remove(handle)
            self._finish_handle(handle, "cancelled")
            return
        for seq in self._running.values():
            if seq.handle is handle:
                seq.cancelled = True
                self._finish(seq, "cancelled")  # may release the slot: stop iterating over them
                return

    def _on_wake(self, _) -> None:
        pass  # the pipeline broke or wants rebalancing; _schedule() looks

    def _measured_step(self, sent_at: float, width: int) -> None:
        seconds = time.perf_counter() - sent_at
        self.step_costs.add(width, seconds)
        self.counters.step_ms = moved(self.counters.step_ms, seconds * 1000)

    def _on_result(self, result: StepResult) -> None:
        seqs = self._steps.pop(result.step_id, [])
        self._decoding.discard(result.step_id)
        checking = result.step_id in self._checking
        self._checking.discard(result.step_id)
        void = result.step_id in self._void
        self._void.discard(result.step_id)
        sent = self._sent_at.pop(result.step_id, None)
        prefilled = self._prefilling.pop(result.step_id, 0)
        if result.error is None:
            self.counters.prompt_positions += prefilled
            if sent is not None:
                self._measured_step(*sent)
        broken = self._recoverable and self.pipeline.broken
        for i, seq in enumerate(seqs):
            seq.in_flight -= 1
            seq.void -= void
            if result.step_id in seq.decoding:
                seq.decoding.remove(result.step_id)
            seq.failed |= result.error is not None
            if seq.filling is not None and seq.filling[0] == result.step_id:
                self.pages.computed(seq.filling[1], ok=not seq.failed)
                seq.filling = None
            reached = seq.progress_at.pop(result.step_id, None)
            if reached is not None and result.error is None and not seq.finished:
                self._progress(seq, reached)
            if result.error is not None:
                if broken and not seq.finished:
                    seq.interrupted = True  # replayed once the pipeline is back
                elif not seq.finished:
                    self._finish(seq, "error", str(result.error))
            elif result.sampled and result.sampled[i] and not (seq.finished or void):
                sampled, fed = result.sampled[i], self._fed_by(seq, result.step_id)
                guess = self._fed_by(seq, seq.decoding[0])[0] if seq.decoding else None  # of the step ahead
                self._accept(seq, fed, sampled, checking, guess)
                if seq.decoding and (seq.finished or [s.token for s in sampled] != fed[1:] + [guess]):
                    self._void_ahead(seq)  # it went ahead on tokens this step did not give
            if seq.finished and seq.in_flight == 0:
                self._release(seq)

    def _schedule(self) -> None:
        if self._recoverable and (self.pipeline.broken or self.pipeline.rebalance_due):
            if self._steps:
                return  # let the steps in flight come back (or fail) first
            if not self._recover():
                return
        live = sum(not (s.finished or s.preempted) for s in self._running.values())
        for seq in [s for s in self._running.values() if s.preempted]:
            # back only with a page to spare for each sequence still on, or it takes theirs again
            if self.pages.available < pages_for(len(seq.tokens)) + live or not self._restart(seq, seq.tokens[:-1]):
                break
            live += 1
            seq.preempted = False
            self._prefill(seq, len(seq.tokens) - 1)
        i = 0
        while i < len(self._waiting) and self._free_slots:
            handle = self._waiting[i]
            request = handle.request
            output = Output(self.tokenizer, request.prompt, request.stop, request.ignore_eos, request.kept_tokens)
            seq = _Sequence(handle, self._slot_for(request.prompt), output)
            seq.drafter = self._drafter(request.speculation, seq.slot)
            if seq.drafter is not None and request.grammar is not None:
                seq.check = ProposalCheck(self._vocabulary, request.grammar)
            seq.hashes = handle.prefix_hashes
            if handle.request.max_tokens > 0 and not self._restart(seq, handle.request.prompt):
                handle.prefix_hashes = seq.hashes  # not hashed again on the next pass
                i += 1  # it waits for pages, or for a prefix another request is computing
                continue
            del self._waiting[i]
            self._free_slots.remove(seq.slot)
            self._running[seq.slot] = seq
            self._publish_slots()
            handle.stats.cached_tokens = seq.n_cached
            self.pages.hits += seq.n_cached
            self.pages.misses += seq.n_prompt - seq.n_cached
            if handle.request.max_tokens == 0:
                self._finish(seq, "length")
                self._release(seq)
                continue
            self._prefill(seq)
        # One decode step per stage keeps every stage busy; sequences that become ready while
        # that many are in flight wait and join the next step, so a step carries many rows and
        # each stage reads its weights once for all of them. A step takes at most its share of
        # the decoding sequences: rows cost time (on a CPU, ggml's kernels are bound by
        # arithmetic past a few rows), and steps of 7 rows and 1 would keep the stages waiting
        # on the large one where two of 4 keep both at work.
        stages = max(1, self.pipeline.n_stages)
        free = stages - len(self._decoding)
        decoding = [s for s in self._running.values() if not (s.finished or s.interrupted or s.preempted)]
        # a sequence whose steps in flight were all sent ahead on a wrong guess goes on at once:
        # its next step follows them through every stage and writes over what they wrote
        ready = [s for s in decoding if s.in_flight == s.void][: max(0, free) * -(-len(decoding) // stages)]
        if ready and free > 0:
            self._send_decode(ready, free)
        self._send_ahead(decoding, stages)

    def _send_decode(self, ready: list[_Sequence], free: int) -> None:
        """Decode steps for the sequences `ready` (in at most `free` steps)."""
        for seq in ready:
            seq.proposal = self._propose(seq)
        ready = self._with_pages(ready)
        if not ready:
            return
        groups = min(len(ready), free)
        size = -(-len(ready) // groups)
        for i in range(0, len(ready), size):
            group = ready[i : i + size]
            fed = self._feeds(group)
            step = Step([self._decode_row(s, len(s.tokens) - 1, tokens) for s, tokens in zip(group, fed)])
            for row, (s, tokens) in enumerate(zip(group, fed)):
                s.fed.append((step.id, row, len(s.tokens) - 1, tokens))
            if all(s.in_flight == 0 for s in group):  # not queued behind steps that no longer count
                self._sent_at[step.id] = (time.perf_counter(), step.width)
            self._send_decoding(step, group)

    def _send_decoding(self, step: Step, group: list[_Sequence]) -> None:
        self._decoding.add(step.id)
        self._checking.add(step.id)
        for seq in group:
            seq.decoding.append(step.id)
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(group)
        if step.width > 1:
            self.counters.drafts += len(group)
            self.counters.draft_tokens += len(group) * (step.width - 1)
        self._send(step, group)

    # -- steps sent ahead ------------------------------------------------------------------
    #
    # Where the stages overlap (workers), a decode step of one sequence leaves all stages but one
    # idle, and over a network most of its time is the trip. A speculating sequence may then send
    # its next step before the one in flight is back, on what that one is expected to give: its
    # proposals all kept and, after them, the token its drafter guesses it will sample. The step
    # sent ahead starts with that guess and carries proposals after it, as any step does. When the
    # step before comes back as expected, the one ahead is simply the sequence's next step; when
    # not, it and any sent after it are void: their results are dropped, and the sequence's next
    # step, sent at once, follows them through every stage and writes over the positions they
    # wrote (a step writes each position it reads past the kept ones before reading it). Void
    # steps are left out of a replay. Not where a stage keeps a recurrent state (it would have
    # to go back past the void steps), nor under a grammar (its matcher would follow the guesses).

    def _send_ahead(self, decoding: list[_Sequence], stages: int) -> None:
        if not (self.ahead and self.pipeline.stages_overlap) or getattr(self.pipeline, "recurrent", False):
            return
        # the void steps a sequence's next step goes back over must fit in the sliding windows'
        # rings, with the positions it brings
        if self._ring_step and self._ring_stray() > self._ring_step:
            return
        for seq in decoding:
            while len(self._decoding) < stages and self._worth_ahead(seq, stages) and self._step_ahead(seq):
                pass

    def _worth_ahead(self, seq: _Sequence, stages: int) -> bool:
        """Whether a step sent ahead now is likely enough to count: every token the sequence's
        steps in flight are expected to give comes true with about the acceptance rate's chance;
        a void step costs the stages its rows, one that counts saves a trip around the ring of
        `stages` (at least stages - 1 of their shares)."""
        if seq.drafter is None or seq.request.grammar is not None:
            return False
        if not seq.decoding or seq.in_flight != len(seq.decoding) + seq.void or len(seq.decoding) >= stages:
            return False  # nothing to go ahead of, or a prefill or replay in flight
        expected = sum(len(self._fed_by(seq, step_id)) for step_id in seq.decoding)
        return seq.drafter.acceptance.rate**expected >= 1 / stages

    @staticmethod
    def _fed_by(seq: _Sequence, step_id: int) -> list[int]:
        """The tokens a decode step fed the sequence ([] for any other step)."""
        return next((tokens for fed_by, _, _, tokens in reversed(seq.fed) if fed_by == step_id), [])

    def _step_ahead(self, seq: _Sequence) -> bool:
        """Send the sequence a step after what its steps in flight are expected to give; False
        where its drafter guesses nothing or no page is free for it."""
        fed = [self._fed_by(seq, step_id) for step_id in seq.decoding]
        expected = seq.tokens + fed[0][1:] + [token for tokens in fed[1:] for token in tokens]
        will_have = seq.n_generated + len(expected) - len(seq.tokens) + 1  # and the last step's token after them
        room = min(self.pipeline.ctx - len(expected), seq.request.max_tokens - will_have)  # tokens it may give
        if room < 1:
            return False
        tokens = seq.drafter.propose(expected, self.step_costs, room - 1, known=len(seq.tokens), guess=1)
        if not tokens:
            return False
        at = len(expected)
        if not self._hold(seq, at + len(tokens)):
            return False
        pages = seq.pages[: pages_for(at + len(tokens))]
        row = Row(seq.slot, at, tokens, seq.request.sampling, self._recent(seq, expected), pages=pages)
        row.n_draft = len(tokens) - 1
        step = Step([row])
        seq.fed.append((step.id, 0, at, tokens))
        self.counters.ahead_steps += 1
        self._send_decoding(step, [seq])
        return True

    def _void_ahead(self, seq: _Sequence) -> None:
        void = set(seq.decoding)
        self._void |= void
        self._checking -= void
        seq.void += len(void)
        seq.decoding = []
        seq.fed = [fed for fed in seq.fed if fed[0] not in void]
        self.counters.void_steps += len(void)

    def _recover(self) -> bool:
        """Rebuild the pipeline and replay every unfinished sequence; False if that failed and
        everything was ended with the error."""
        try:
            event = self.pipeline.recover()
        except Exception as e:  # noqa: BLE001 -- a failed recovery ends the requests, never this thread
            self._fail_all(str(e), "error")
            return False
        self.pages.reset()  # the new stages' pools hold nothing
        self._ring_held.clear()
        replaying = []
        for seq in list(self._running.values()):
            seq.pages, seq.hashes, seq.filling, seq.failed = [], [], None, False
            if seq.finished or seq.preempted:
                continue
            seq.interrupted = False
            seq.fruitless_replays += 1
            if seq.fruitless_replays > MAX_FRUITLESS_REPLAYS:  # the failure follows this sequence
                self._finish(
                    seq,
                    "error",
                    f"interrupted {seq.fruitless_replays} times without progress; last failure: {event.get('reason')}",
                )
                continue
            # steps sent ahead that never came back gave nothing: the replay leaves them out
            seq.fed = [fed for fed in seq.fed if fed[2] < len(seq.tokens)]
            seq.decoding = []
            # the replayed steps write every position they first wrote, refused proposals included
            reach = max([len(seq.tokens)] + [at + len(tokens) for _, _, at, tokens in seq.fed])
            pages = self.pages.allocate(pages_for(reach))
            if pages is None:
                self._finish(seq, "error", "the KV cache of the rebuilt pipeline cannot hold this sequence")
                continue
            seq.pages, seq.n_cached = pages, 0
            replaying.append(seq)
            self._prefill(seq)
        self._replay_decode(replaying)
        event["replayed_tokens"] = sum(s.n_prompt + sum(len(f[3]) for f in s.fed) for s in replaying)
        log.warning("replayed %d token(s) of %d sequence(s)", event["replayed_tokens"], len(replaying))
        return True

    def _replay_decode(self, seqs: list[_Sequence]) -> None:
        """Send again, in their first order, the decode steps that fed these sequences' generated
        tokens, each with the rows it first had (less those of sequences finished since) and the
        tokens they fed, proposals refused included.

        Not as a prefill, and not regrouped: a matrix product over several rows rounds differently
        from a one-row one, and a batch's attention spans its longest row, so a token recomputed
        in other company than it first had gets a slightly different cache, enough to flip a
        near-tie later. Only a step some of whose sequences have finished since is replayed in
        smaller company (those rows may round differently; the finished ones cannot come back).

        The steps go out at once and follow each other around the ring as prefill chunks do: n
        tokens cost n one-token passes through each stage (slower than one prefill of them, but
        exact), not n round trips."""
        steps: dict[int, list[tuple[int, _Sequence, int, list[int]]]] = {}
        for seq in seqs:
            for step_id, row, at, tokens in seq.fed:
                steps.setdefault(step_id, []).append((row, seq, at, tokens))
            seq.fed = []  # each entry again, under the step that replays it
        sending = []
        for step_id in sorted(steps):
            rows = sorted(steps[step_id], key=lambda r: r[0])
            step = Step([self._decode_row(seq, at, tokens) for _, seq, at, tokens in rows])
            for row, (_, seq, at, tokens) in enumerate(rows):
                seq.fed.append((step.id, row, at, tokens))
            sending.append((step, [seq for _, seq, _, _ in rows]))
        for step, group in sending:
            self._checking.add(step.id)  # the step in flight at the break samples again: its check counts
            self._send(step, group)

    def _restart(self, seq: _Sequence, tokens: list[int]) -> bool:
        """Give a sequence the pages for `tokens`, reusing those of a cached prefix; False, taking
        nothing, if it must wait (too few free pages, or its next prefix page is being computed)."""
        n_full = (len(tokens) - 1) // PAGE  # full pages before the one the last token goes to
        reused, wait = [], False
        if self._reuse and seq.request.cache_prompt:
            seq.hashes = prefix_hashes(tokens, n_full, seq.hashes)
            reused, wait = self.pages.match(seq.hashes)
        elif self._ring_step and seq.request.cache_prompt and not seq.preempted:
            reused = self._ring_prefix(seq, tokens, n_full)
        if wait:
            return False
        self.pages.take(reused)
        new = self.pages.allocate(pages_for(len(tokens)) - len(reused))
        if new is None:
            self.pages.release(reused)
            return False
        seq.pages, seq.n_cached, seq.failed = reused + new, len(reused) * PAGE, False
        return True

    def _slot_for(self, prompt: list[int]) -> int:
        """A free slot for a new sequence: where the sliding windows keep a ring per slot, the one
        whose last sequence shares the longest start with the prompt (a chat's next turn goes
        where its last one ran), else one that held none, else the first."""
        if not self._ring_step:
            return self._free_slots[0]

        def fit(slot: int) -> tuple:
            held = self._ring_held.get(slot, [])
            return _shared(held[:-1], prompt), not held, -slot

        return max(self._free_slots, key=fit)

    def _ring_prefix(self, seq: _Sequence, tokens: list[int], n_full: int) -> list[int]:
        """The cached pages of the prompt's start that the slot's last sequence also began with,
        where its sliding windows' rings still hold the positions before the first one computed:
        the rings take a step over [start, start + T) where the positions written past `start`
        are at most ring_step, and besides the last sequence's tokens a slot's rings may have
        had positions written by refused proposals and steps sent ahead."""
        held = self._ring_held.get(seq.slot, [])
        n = min(n_full, _shared(held[:-1], tokens) // PAGE)  # its last token went through no stage
        seq.hashes = prefix_hashes(tokens, n_full, seq.hashes)
        reused, _ = self.pages.match(seq.hashes[:n])
        return reused if reused and len(held) + self._ring_stray() - len(reused) * PAGE <= self._ring_step else []

    def _ring_stray(self) -> int:
        """The most positions a sequence's steps may write past its tokens: a step's proposals and
        guess refused on each stage's step in flight (those sent ahead, void)."""
        return max(1, self.pipeline.n_stages) * (2 + MAX_PROPOSALS)

    def _hold(self, seq: _Sequence, positions: int) -> bool:
        """Give the sequence pages for its first `positions` positions; False, taking none, where
        too few are free."""
        short = pages_for(positions) - len(seq.pages)
        new = self.pages.allocate(short) if short > 0 else []
        if new is None:
            return False
        seq.pages += new
        return True

    def _with_pages(self, ready: list[_Sequence]) -> list[_Sequence]:
        """Those of `ready` that have (or now get) a page for their next position. When none does
        and nothing is in flight, the newest sequence gives its pages up and restarts later."""
        out = []
        for seq in ready:
            if self._hold(seq, len(seq.tokens) + len(seq.proposal)):
                out.append(seq)
            elif seq.proposal:  # pages for its next position alone, then
                seq.proposal = []
                if self._hold(seq, len(seq.tokens)):
                    out.append(seq)
        if not out and not self._steps:
            live = [s for s in self._running.values() if not (s.finished or s.preempted)]
            newest = max(live, key=lambda s: s.handle.stats.t_submit)
            log.info("the KV pool is full: slot %d gives up %d pages, restarts later", newest.slot, len(newest.pages))
            self._release_pages(newest)
            newest.preempted = True
            self._inbox.put((self._on_wake, None))  # schedule again: its pages may let the others on
        return out

    def _prefill(self, seq: _Sequence, end: int | None = None) -> None:
        """Positions [seq.n_cached, end) (default: the prompt's end) in chunks; a chunk that ends
        at the last token samples the next, unless a replay knows it already. The prompt's last
        chunk also (re)builds the sequence's grammar matcher from every token generated so far,
        so a replay leaves it where it was. The full pages it fills become a known prefix once
        the last chunk is back."""
        tokens, n = seq.tokens, seq.n_prompt
        end = n if end is None else end
        step = None
        report = seq.request.report_progress and seq.n_generated == 0
        if report:
            self._progress(seq, seq.n_cached)
        seq.prefill_rows = rows = seq.prefill_rows or self._prefill_rows(end - seq.n_cached)
        for start in range(seq.n_cached, end, rows):
            chunk = tokens[start : min(start + rows, end)]
            last = start + len(chunk) == len(tokens)
            row = Row(
                seq.slot,
                start,
                chunk,
                seq.request.sampling if last else None,
                self._recent(seq) if last else [],
                pages=seq.pages[: pages_for(start + len(chunk))],
            )
            grammar = seq.request.grammar
            if grammar is not None and start + len(chunk) == n:
                generated = tokens[n:]
                row.constraint = RowConstraint(grammar.key, len(generated), grammar.text, generated)
            step = Step([row])
            self._prefilling[step.id] = len(chunk)
            if report:
                seq.progress_at[step.id] = start + len(chunk)
            self._send(step, [seq])
        if step is not None and (self._reuse or self._ring_step) and seq.request.cache_prompt:
            seq.filling = (step.id, self._filling(seq, end))

    def _prefill_rows(self, n: int) -> int:
        """The rows of each step that prefills n positions: prefill_chunk, or where the pipeline's
        stages overlap, fewer, so that a prompt goes through its S stages in about 2S pieces (the
        first stage takes the second piece while the next one runs the first; the time to the
        first token is about (2S + S - 1) / 2S of one stage's share of the prompt, times S), but
        not fewer than MIN_PIECE."""
        stages = self.pipeline.n_stages if self.pipeline.stages_overlap else 1
        if stages <= 1:
            return self.prefill_chunk
        return min(self.prefill_chunk, max(MIN_PIECE, -(-n // (2 * stages))))

    def _filling(self, seq: _Sequence, end: int) -> list[bytes]:
        """Tell the page book that the sequence's full pages up to position `end` are being
        computed; their prefix hashes (those it did not reuse)."""
        first = seq.n_cached // PAGE
        seq.hashes = prefix_hashes(seq.tokens, end // PAGE, seq.hashes)
        hashes = seq.hashes[first : end // PAGE]
        self.pages.computing(hashes, seq.pages[first : end // PAGE])
        return hashes

    def _propose(self, seq: _Sequence) -> list[int]:
        """The tokens the sequence's next decode step proposes after its last: none for a
        sequence without speculation."""
        drafter = seq.drafter
        if drafter is None:
            return []
        room = min(
            self.pipeline.ctx - len(seq.tokens),  # positions left
            seq.request.max_tokens - seq.n_generated - 1,  # tokens wanted after the next
        )
        proposal = drafter.propose(seq.tokens, self.step_costs, max(room, 0))
        return proposal if seq.check is None else seq.check.allowed(proposal)

    def _drafter(self, speculation: Speculation | None, slot: int) -> Drafter | None:
        if speculation is None:
            return None
        seen = self.acceptance.setdefault(speculation.kind, Acceptance())
        if speculation.kind == "draft-simple":
            return ByModel(speculation, seen, self.draft, slot)
        return Lookup(speculation, seen)

    def _feeds(self, group: list[_Sequence]) -> list[list[int]]:
        """What each row of a decode step feeds: its last token and its proposals, all rows as
        wide as the widest. A row with fewer proposals takes more of what its lookup found, else
        its last token again: anything may be proposed, and a proposal the model would have
        drawn is kept like any other."""
        width = max(1 + len(s.proposal) for s in group)
        room = self.pipeline.ctx - max(len(s.tokens) for s in group) + 1
        width = min([width, room] + [len(s.pages) * PAGE - len(s.tokens) + 1 for s in group])
        fed = []
        for seq in group:
            tokens = [seq.tokens[-1], *seq.proposal[: width - 1]]
            if len(tokens) < width and seq.drafter is not None:
                tokens += seq.drafter.filler(seq.tokens, len(tokens) - 1, width - len(tokens))
                if seq.check is not None:
                    tokens = tokens[:1] + seq.check.allowed(tokens[1:])
            fed.append(tokens + [seq.tokens[-1]] * (width - len(tokens)))
        return fed

    def _decode_row(self, seq: _Sequence, at: int, tokens: list[int]) -> Row:
        """`tokens` from position `at`; they sample only if they follow the sequence's last token
        (a replay knows what follows), checking all but the first as proposals."""
        last = at == len(seq.tokens) - 1
        row = Row(
            seq.slot,
            at,
            tokens,
            seq.request.sampling if last else None,
            self._recent(seq) if last else [],
            pages=seq.pages[: pages_for(at + len(tokens))],
            n_draft=len(tokens) - 1,  # a replay's too: its step goes the way the first one went
        )
        if last and seq.request.grammar is not None:
            row.constraint = RowConstraint(seq.request.grammar.key, seq.n_generated)
        return row

    @staticmethod
    def _recent(seq: _Sequence, tokens: list[int] | None = None) -> list[int]:
        params, tokens = seq.request.sampling, seq.tokens if tokens is None else tokens
        return tokens[-params.repeat_last_n :] if params.penalized and params.repeat_last_n else []

    def _send(self, step: Step, seqs: list[_Sequence]) -> None:
        self.counters.steps += 1
        self._steps[step.id] = seqs
        for seq in seqs:
            seq.in_flight += 1
        try:
            self.pipeline.submit(step)
        except PipelineError as e:
            self._on_result(StepResult(step.id, error=e))

    def _accept(
        self, seq: _Sequence, fed: list[int], sampled: list[Sampled], decoded: bool, guess: int | None = None
    ) -> None:
        """What a step that fed the sequence `fed` sampled for it; `decoded`: a decode step, whose
        proposals (all but the first token fed) it kept up to the first it would not have drawn.
        `guess`: the token a step sent ahead of it guessed it samples after them, which counts
        with the proposals in the sequence's acceptance rate where they were all kept."""
        if decoded:
            proposed, kept = len(fed) - 1, len(sampled) - 1
            seq.handle.stats.draft_n += proposed
            seq.handle.stats.draft_n_accepted += kept
            self.counters.draft_accepted += kept
            if guess is not None and kept == proposed:
                proposed, kept = proposed + 1, kept + (sampled[-1].token == guess)
            if seq.drafter is not None and proposed:
                seq.drafter.checked(proposed, kept)
                self.acceptance[seq.request.speculation.kind].checked(proposed, kept)
        for one in sampled:
            if seq.finished:
                return
            self._accept_one(seq, one)

    def _accept_one(self, seq: _Sequence, sampled: Sampled) -> None:
        handle, token = seq.handle, sampled.token
        stats = handle.stats
        if seq.n_generated == 0:
            stats.t_first_token = time.perf_counter()
        seq.tokens.append(token)
        self.counters.generated += 1
        if seq.check is not None:
            seq.check.kept(token)
        self.counters.most_positions = max(self.counters.most_positions, len(seq.tokens))
        seq.fruitless_replays = 0
        handle.tokens.append(token)
        stats.completion_tokens = seq.n_generated
        text, stopped = seq.output.token(token)
        self._emit(seq, text, sampled)
        if stopped:
            self._finish(seq, "stop")
        elif seq.n_generated >= seq.request.max_tokens or len(seq.tokens) >= self.pipeline.ctx:
            self._finish(seq, "length")

    @staticmethod
    def _progress(seq: _Sequence, processed: int) -> None:
        ms = (time.perf_counter() - seq.handle.stats.t_submit) * 1000
        seq.handle.events.put(Event(progress=PromptProgress(seq.n_prompt, seq.n_cached, processed, ms)))

    def _emit(self, seq: _Sequence, text: str, sampled: Sampled) -> None:
        seq.handle.events.put(Event(text, sampled.token, sampled.logprob, sampled.top))

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        tail = ""
        if reason in ("stop", "length"):
            tail = seq.output.tail()
        self._finish_handle(seq.handle, reason, error, tail)
        if seq.in_flight == 0:
            self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if self._running.get(seq.slot) is seq:
            caching = (self._reuse or self._ring_step) and seq.request.cache_prompt
            if caching and not (seq.failed or seq.interrupted or seq.preempted):
                # every position but the last token's went through the stages: its full pages
                # are a prefix the next turn of a chat may start with
                self.pages.computed(self._filling(seq, len(seq.tokens) - 1), ok=True)
            if self._ring_step:
                lost = seq.failed or seq.interrupted or seq.preempted  # its rings hold what, nobody knows
                self._ring_held[seq.slot] = [] if lost else list(seq.tokens)
            self._release_pages(seq)
            del self._running[seq.slot]
            self._publish_slots()
            self.pipeline.free(seq.slot)
            self._free_slots.append(seq.slot)
            self._free_slots.sort()

    def _publish_slots(self) -> None:
        views = {slot: SlotView(slot, seq.request, seq.handle.stats) for slot, seq in self._running.items()}
        self.slots_in_use = MappingProxyType(views)

    def _release_pages(self, seq: _Sequence) -> None:
        self.pages.release(seq.pages)
        seq.pages, seq.n_cached, seq.filling = [], 0, None

    @staticmethod
    def _finish_handle(handle: Handle, reason: str, error: str | None = None, text: str = "") -> None:
        handle.stats.t_end = time.perf_counter()
        handle.finish_reason, handle.error = reason, error
        handle.events.put(Event(text=text, finish_reason=reason, error=error))

    def _fail_all(self, message: str, reason: str) -> None:
        for handle in self._waiting:
            self._finish_handle(handle, reason, message)
        self._waiting.clear()
        for seq in list(self._running.values()):
            self._finish(seq, reason, message)
