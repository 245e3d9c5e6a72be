"""What the engine hands a pipeline of stages, and the pipeline that runs them in this process.

A Step is one forward pass over the whole pipeline for a batch of rows; a row is T new tokens
of one sequence (its slot, the position of its first new token, the KV pages its positions
live in: pages.py). Rows that carry sampling parameters come back with what they sampled; the
others (all but the last chunk of a long prompt, replays) only fill the cache.

A row may end with proposed tokens (speculative decoding: engine/drafting.py): the sampling
stage samples each of the row's last positions in turn and stops at the first token that is not
the proposal after it, so a row comes back with the proposals it kept and one token more. Each
draw depends only on its logits and (seed, position), so the tokens are the ones decoding one
at a time would have drawn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import psutil
import torch

from ..backends import release_scratch
from ..constrain import Matchers, RowConstraint, Vocabulary
from ..devices import free_memory, objects_held_for_good, objects_let_go
from ..kvcache import pool_pages
from ..model import Stage
from ..sampling import Sampled, SamplingParams, sample
from ..weights.in_use import compute_line


@dataclass
class Row:
    slot: int
    start: int
    tokens: list[int]
    sampling: SamplingParams | None = None
    recent: list[int] = field(default_factory=list)  # for repetition penalties
    constraint: RowConstraint | None = None  # a grammar's matcher to follow (see constrain.py)
    pages: list[int] = field(default_factory=list)  # its KV page table, up to its last new position
    n_draft: int = 0  # the last n_draft tokens are proposals for the sampler to check

    @property
    def draft(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.n_draft :]


@dataclass
class Step:
    rows: list[Row]
    id: int = field(default_factory=itertools.count().__next__)

    @property
    def width(self) -> int:
        return len(self.rows[0].tokens)


@dataclass
class StepResult:
    step_id: int
    sampled: list[list[Sampled]] = field(default_factory=list)  # per row, in order; [] for a cache-only row
    error: "PipelineError | None" = None


class PipelineError(RuntimeError):
    """A step could not complete: a stage failed or its worker is gone."""

    def __init__(self, message: str, worker: str | None = None):
        super().__init__(message)
        self.worker = worker


class Pipeline(Protocol):
    """What the engine drives: stages in this process (LocalPipeline) or on workers
    (coordinator.remote.RemotePipeline). Results arrive through on_result, from any thread.
    One that can constrain output also has use_vocabulary(vocabulary), which the engine calls
    before its first constrained row."""

    n_slots: int
    ctx: int
    kv_pages: int  # pages in each stage's KV pool (kvcache.pool_pages)
    vocab_size: int
    n_stages: int
    stages_overlap: bool  # its stages work on different steps at once (on workers), not one after another
    recurrent: bool  # some block keeps a recurrent state: a sequence cannot start past position 0
    ring_step: int  # sliding windows keep a ring per slot: the most positions a step brings (0: no ring)
    on_result: Callable[[StepResult], None]
    on_wake: Callable[[], None]  # the pipeline broke, or wants rebalancing

    def submit(self, step: Step) -> None: ...

    def free(self, slot: int) -> None: ...

    def status(self) -> dict: ...

    def idle(self) -> None:
        """No step has run for model.IDLE_S: give back what only a running step needs. Called on
        the thread that submits steps."""

    def close(self) -> None: ...


@runtime_checkable
class Recoverable(Pipeline, Protocol):
    """A pipeline that can be rebuilt on the capacity that is left after a failure."""

    broken: str | None  # why it broke; None while it works
    rebalance_due: bool  # a lost worker answers again

    def recover(self) -> dict: ...


def sample_rows(logits: torch.Tensor, rows: list[Row], matchers: Matchers | None = None) -> list[list[Sampled]]:
    """What each row that asks for it samples from its logits [B, T, vocab] (T: 1, or the step's
    width where a row carries proposals): the token after its last position, or after each
    proposal it keeps. Rows with a constraint follow their slot's matcher in `matchers`."""
    for row in rows:
        if row.constraint is not None:
            if matchers is None:
                raise ValueError("this pipeline cannot constrain output")
            matchers.prepare(row.slot, row.constraint)
    if all(
        r.sampling is not None
        and r.sampling.plain_greedy
        and r.constraint is None
        and not (r.sampling.penalized and r.recent)
        for r in rows
    ):
        if logits.device.type == "cpu" and logits.dtype == torch.float32:  # NumPy's: no PyTorch call (see StageGraph)
            best = logits.numpy().argmax(axis=-1)
        else:
            best = logits.argmax(dim=-1).cpu().numpy()
        last = best.shape[1] - 1  # one argmax for the batch
        return [[Sampled(int(t)) for t in _kept(best[i, last - r.n_draft :], r.draft)] for i, r in enumerate(rows)]
    if logits.device.type != "cpu":
        logits = logits.float().cpu()
    out: list[list[Sampled]] = []
    for i, row in enumerate(rows):
        drawn: list[Sampled] = []
        if row.sampling is not None:
            first = logits.shape[1] - 1 - row.n_draft
            draft, n = row.draft, row.sampling.repeat_last_n
            for j in range(row.n_draft + 1):
                allowed = None
                if row.constraint is not None:
                    allowed = matchers.allowed(row.slot, logits.shape[-1])
                recent = (row.recent + draft[:j])[-n:] if j and n else row.recent
                position = row.start + len(row.tokens) - row.n_draft + j
                sampled = sample(logits[i, first + j], row.sampling, position, recent, allowed)
                if row.constraint is not None:
                    matchers.consume(row.slot, sampled.token)
                drawn.append(sampled)
                if j == row.n_draft or sampled.token != draft[j]:
                    break
        out.append(drawn)
    return out


def _kept(best, draft: list[int]) -> list[int]:
    """Greedy picks at a row's last positions, up to the first that is not the proposal after it."""
    for j, token in enumerate(draft):
        if best[j] != token:
            return best[: j + 1]
    return best


class LocalPipeline:
    """Stages that all live in this process, run one after another."""

    stages_overlap = False

    def __init__(self, stages: list[Stage], n_slots: int, ctx: int, kv_pages: int | None = None, window_step: int = 0):
        self.stages, self.n_slots, self.ctx = stages, n_slots, ctx
        self.kv_pages = pool_pages(n_slots, ctx) if kv_pages is None else kv_pages
        self.vocab_size = stages[0].cfg.vocab_size
        self.recurrent = any(stage.n_linear for stage in stages)
        for stage in stages:
            stage.allocate_cache(n_slots, ctx, self.kv_pages, window_step)
        self.ring_step = min((stage.ring_step for stage in stages if stage.ring_step), default=0)
        self.matchers = Matchers()
        self.on_result: Callable[[StepResult], None] = lambda result: None
        self.on_wake: Callable[[], None] = lambda: None
        objects_held_for_good()

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def submit(self, step: Step) -> None:
        slots = [r.slot for r in step.rows]
        starts = [r.start for r in step.rows]
        pages = [r.pages for r in step.rows]
        x = [r.tokens for r in step.rows]
        proposing = any(r.n_draft for r in step.rows)  # the logits of every position are sampled
        try:
            for stage in self.stages:
                x = stage(x, slots, starts, all_logits=proposing, pages=pages)
            result = StepResult(step.id, sample_rows(x, step.rows, self.matchers))
        except (ValueError, RuntimeError) as e:
            result = StepResult(step.id, error=PipelineError(str(e)))
        self.on_result(result)

    def use_vocabulary(self, vocabulary: Vocabulary) -> None:
        self.matchers.use_vocabulary(vocabulary)

    def free(self, slot: int) -> None:
        pass  # a slot's cache is simply overwritten by its next sequence

    def idle(self) -> None:
        release_scratch()  # the stages ran on this thread, in its scratch

    def status(self) -> dict:
        """The shape of Cluster.status(), for stages that all run in this process."""

        def total(d: str) -> int:
            return torch.cuda.mem_get_info(d)[1] if d.startswith("cuda") else psutil.virtual_memory().total

        devices = sorted({str(s.device) for s in self.stages})
        stages = [
            {
                "index": i,
                "device": str(s.device),
                "blocks": [s.start, s.end],
                "weight_bytes": sum(p.nbytes for p in s.parameters()),
                "kv_bytes": s.cache.nbytes if s.cache is not None else 0,
            }
            for i, s in enumerate(self.stages)
        ]
        return {
            "plan": "local",
            "ready": bool(self.stages),
            "broken": None,
            "load": {},
            "workers": [
                {
                    "name": "local",
                    "worker_id": "local",
                    "alive": True,
                    "state": "healthy",
                    "latency_ms": None,
                    "devices": [
                        {"name": d, "free": free_memory(d), "total": total(d), "compute": compute_line(d)}
                        for d in devices
                    ],
                    "stages": stages,
                }
            ],
        }

    def close(self) -> None:
        self.stages = []
        self.matchers.close()
        objects_let_go()
