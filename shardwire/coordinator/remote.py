"""The pipeline the engine drives when stages live on workers: steps go to the first stage's
worker as FORWARD frames; sampled tokens come back from the last one's as RESULTs.

It knows only the links it is given and the callbacks to recover, report status and close;
the cluster reports what its links' readers and its heartbeat see through the public methods
below."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np

from ..constrain import Vocabulary
from ..pipeline import PipelineError, Step, StepResult
from ..wire.conn import RemoteError
from ..wire.messages import Forward, Free, Result, Vocab
from .links import LinkEvents, WorkerLink

log = logging.getLogger("shardwire.cluster")


class RemotePipeline:
    stages_overlap = True  # each stage's worker takes the next step while the next stage runs this one

    def __init__(self, *, recover: Callable[[str], dict], status: Callable[[], dict], close: Callable[[], None]):
        self._recover, self._status, self._close = recover, status, close
        self.on_result: Callable[[StepResult], None] = lambda result: None
        self.on_wake: Callable[[], None] = lambda: None  # called when the pipeline breaks or wants rebalancing
        self.broken: str | None = None
        self.rebalance_due = False  # a lost worker answers again
        self.links: list[WorkerLink] = []
        self.recurrent, self.ring_step = False, 0
        self._in_flight: dict[int, Step] = {}
        self._lock = threading.Lock()
        self._last_progress = time.monotonic()
        self._vocabulary: Vocabulary | None = None

    def attach(
        self,
        links: list[WorkerLink],
        plan_id: str,
        n_slots: int,
        ctx: int,
        kv_pages: int,
        n_stages: int,
        vocab_size: int,
        recurrent: bool = False,
        ring_step: int = 0,
    ) -> None:
        """Point the pipeline at a loaded plan over `links`, first stage's worker first."""
        self.links, self.plan_id = links, plan_id
        self.n_slots, self.ctx, self.n_stages, self.vocab_size = n_slots, ctx, n_stages, vocab_size
        self.kv_pages = kv_pages
        self.recurrent, self.ring_step = recurrent, ring_step
        self.broken, self.rebalance_due = None, False
        if self._vocabulary is not None:
            self._send_vocabulary()

    @property
    def events(self) -> LinkEvents:
        return LinkEvents(self.result, self.step_failed, self.link_lost)

    # -- the engine's side -------------------------------------------------------------------

    def submit(self, step: Step) -> None:
        if self.broken is not None:
            raise PipelineError(self.broken)
        first = self.links[0]
        payload = np.array([r.tokens for r in step.rows], dtype=np.int32)
        with self._lock:
            if not self._in_flight:
                self._last_progress = time.monotonic()
            self._in_flight[step.id] = step
        try:
            first.conn.send(Forward.of_rows(self.plan_id, step.id, step.rows), payload, request=step.id)
        except OSError as e:
            self.link_lost(first, f"worker {first.name} is gone ({e})")

    def use_vocabulary(self, vocabulary: Vocabulary) -> None:
        """Send the grammar matchers' vocabulary to the worker that samples, now and after every recovery."""
        self._vocabulary = vocabulary
        self._send_vocabulary()

    def _send_vocabulary(self) -> None:
        last, vocab = self.links[-1], self._vocabulary
        try:
            last.conn.send(Vocab(self.plan_id, len(vocab.tokens), list(vocab.eos)), vocab.to_payload())
        except OSError as e:
            self.link_lost(last, f"worker {last.name} is gone ({e})")

    def free(self, slot: int) -> None:
        if self.broken is not None:
            return
        for link in self.links:
            if link.alive:
                try:
                    link.conn.send(Free(slot))
                except OSError:
                    pass

    def idle(self) -> None:
        pass  # each worker gives back its own scratch when it has had no step for IDLE_S

    def recover(self) -> dict:
        """Bring the pipeline back on whatever capacity answers, or raise PipelineError."""
        return self._recover(self.broken or "rebalancing onto a worker that is back")

    def status(self) -> dict:
        return self._status()

    def close(self) -> None:
        self.broken = self.broken or "the coordinator closed its cluster"
        self._close()

    # -- what the links and the heartbeat report ---------------------------------------------

    def result(self, result: Result) -> None:
        with self._lock:
            step = self._in_flight.pop(result.step, None)
            self._last_progress = time.monotonic()
        if step is not None:
            self.on_result(StepResult(step.id, result.sampled()))

    def step_failed(self, error: RemoteError, link: WorkerLink) -> None:
        with self._lock:
            step = self._in_flight.pop(error.request, None)
        if step is not None:
            self.on_result(StepResult(step.id, error=PipelineError(str(error), link.name)))

    def link_lost(self, link: WorkerLink, message: str) -> None:
        if not link.alive:
            return  # closed on purpose, or already reported
        link.alive = False
        link.lost_since = time.monotonic()
        self.fail(message, link.name)

    def fail(self, message: str, worker: str | None = None) -> None:
        """Give up on every step in flight; recovery starts from scratch."""
        if self.broken is None:
            self.broken = message
            log.error("%s", message)
        with self._lock:
            failed = list(self._in_flight)
            self._in_flight.clear()
        for step_id in failed:
            self.on_result(StepResult(step_id, error=PipelineError(message, worker)))
        self.on_wake()

    def want_rebalance(self) -> None:
        self.rebalance_due = True
        self.on_wake()

    def stalled_for(self, now: float) -> float:
        with self._lock:
            return now - self._last_progress if self._in_flight else 0.0
