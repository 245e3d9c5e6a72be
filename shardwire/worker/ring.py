"""A loaded plan on a worker: one thread per stage, and the hop to the next stage's worker.

A FORWARD is checked against the plan before its payload is read (straight into a tensor of
the right size); the stage threads run it in turn and hand the result to the next stage in
this process, over the peer connection to the next worker, or, after the last stage, sample
and answer the coordinator with a RESULT.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..averages import moved
from ..backends import IDLE_S, release_scratch
from ..config import ModelConfig
from ..constrain import Matchers
from ..devices import objects_let_go, release_memory
from ..model import Stage
from ..pipeline import Row, sample_rows
from ..sampling import SamplingParams
from ..wire.conn import Connection, RemoteError
from ..wire.frames import FrameError
from ..wire.messages import Assign, Forward, Ping, Pong, Result, StageSpec
from .weights import FoundWeights

# how a payload is held as it is read: NumPy has no bfloat16, whose bits it holds as uint16
_HELD_AS = {"int32": np.int32, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}

# After a decode step it ran itself (Ring.enqueue) a worker's reader spins this long for the next
# one before it sleeps: a sleeping CPU takes tens to hundreds of microseconds to wake (most on
# VMs), once per hop of every token.
SPIN_S = 0.05

log = logging.getLogger("shardwire.worker")


@dataclass
class StageRunner:
    """One stage and the thread that runs it."""

    spec: StageSpec
    stage: Stage
    # (the step, its payload, the rows to sample where this worker's last stage samples), or None to stop
    queue: "queue.SimpleQueue[tuple[Forward, torch.Tensor | list[list[int]], list[Row] | None] | None]" = field(
        default_factory=queue.SimpleQueue
    )
    thread: threading.Thread | None = None
    step_ms: float | None = None  # its compute in a decode step: a moving average

    def measured(self, seconds: float) -> None:
        self.step_ms = moved(self.step_ms, seconds * 1000)


class Ring:
    def __init__(
        self,
        assign: Assign,
        config: ModelConfig,
        runners: list[StageRunner],
        coordinator: Connection,
        next_conn: Connection | None,
        weights: FoundWeights,
        worker_id: str,
        idle_timeout: float,
    ):
        self.id, self.coordinator_id = assign.plan, assign.coordinator
        self.config, self.n_slots, self.ctx = config, assign.n_slots, assign.ctx
        self.runners, self.coordinator, self.next_conn = runners, coordinator, next_conn
        self.next_address = assign.next.address if assign.next is not None else None
        self.weights, self.worker_id, self.idle_timeout = weights, worker_id, idle_timeout
        self.n_pages = assign.kv_pages
        self.matchers = Matchers()  # grammar matchers, used when this worker's last stage samples
        self.released = threading.Event()
        self._queued = self._done = 0  # steps put on the first stage's queue, and of those done (one writer each)
        self._stepping = threading.Lock()  # held by a reader running a step itself

    @property
    def first_takes_ids(self) -> bool:
        return self.runners[0].spec.first

    def start(self) -> None:
        for i, runner in enumerate(self.runners):
            runner.thread = threading.Thread(
                target=self._run_stage, args=(i,), daemon=True, name=f"stage-{runner.spec.index}"
            )
            runner.thread.start()
        if self.next_conn is not None:
            threading.Thread(target=self._watch_next, daemon=True, name="next-hop").start()

    # -- steps in ----------------------------------------------------------------------------

    def check_forward(self, msg: Forward, nbytes: int) -> tuple[np.ndarray, list[Row] | None]:
        """Check a FORWARD against the plan before its payload is read; returns the array to read
        the payload into and, where this worker's last stage samples, the step's rows to sample
        (their parameters parsed here, once)."""
        if msg.plan != self.id:
            raise FrameError(f"FORWARD for plan {msg.plan!r}, which this worker does not hold")
        if nbytes != msg.payload_nbytes():
            raise FrameError(f"FORWARD payload of {nbytes} bytes does not match its shape {msg.shape} {msg.dtype}")
        if self.first_takes_ids != (msg.dtype == "int32"):
            raise FrameError("FORWARD: the first stage takes int32 token ids, later stages hidden states")
        if not self.first_takes_ids and msg.shape[2] != self.config.dim:
            raise FrameError(f"FORWARD: hidden size {msg.shape[2]} is not the model's {self.config.dim}")
        for slot, start, n in msg.rows:
            if slot >= self.n_slots:
                raise FrameError(f"FORWARD: slot {slot} is outside the plan's {self.n_slots} slots")
            if start + n > self.ctx:
                raise FrameError(f"FORWARD: positions up to {start + n} exceed the context of {self.ctx}")
        if any(page >= self.n_pages for table in msg.pages for page in table):
            raise FrameError(f"FORWARD: a page id is outside the plan's pool of {self.n_pages} pages")
        rows = None
        if self.runners[-1].spec.last:
            try:
                rows = _rows_to_sample(msg)
            except (TypeError, ValueError) as e:
                raise FrameError(f"FORWARD: bad sampling parameters: {e}") from None
        return np.empty(msg.shape, dtype=_HELD_AS[msg.dtype]), rows

    def enqueue(self, conn: Connection, msg: Forward, x: np.ndarray, rows: list[Row] | None) -> bool:
        """Take a step for the first stage, with what check_forward() gave: its payload goes in as
        token ids (lists, which ggml's graph reads without a PyTorch call) or hidden states. A
        decode step for a worker's only stage, which has nothing queued, runs here on the reader
        (no hand-over to the stage's thread, a wake-up per hop); anything longer is queued, so
        that the reader keeps answering pings. -> whether it ran here."""
        if msg.dtype == "int32":
            payload = x.tolist()
            if any(min(row) < 0 or max(row) >= self.config.vocab_size for row in payload):
                # a well-formed frame with a bad request in it: refuse the step, keep the link
                message = f"worker {self.worker_id}: token ids must be in [0, {self.config.vocab_size})"
                conn.send_error("step", message, request=msg.step)
                return False
        else:
            payload = torch.from_numpy(x)
            payload = payload.view(torch.bfloat16) if msg.dtype == "bfloat16" else payload
        if len(self.runners) == 1 and msg.shape[1] == 1 and self._queued == self._done:
            with self._stepping:
                if not self.released.is_set():
                    self._step(0, msg, payload, rows)
            return True
        self._queued += 1
        self.runners[0].queue.put((msg, payload, rows))
        return False

    # -- stage threads -----------------------------------------------------------------------

    def _run_stage(self, index: int) -> None:
        runner = self.runners[index]
        while True:
            try:
                item = runner.queue.get(timeout=IDLE_S)
            except queue.Empty:  # at rest the stage holds its weights and cache, not a step's scratch
                release_scratch()
                item = runner.queue.get()
            if item is None:
                return
            self._step(index, *item)
            if index == 0:
                self._done += 1

    def _step(self, index: int, msg: Forward, x, rows: list[Row] | None) -> None:
        """Stage `index` on a step, its output handed on; a failure is reported, never raised."""
        runner = self.runners[index]
        try:
            slots, starts = [r[0] for r in msg.rows], [r[1] for r in msg.rows]
            began = time.perf_counter()
            out = runner.stage(x, slots, starts, all_logits=msg.drafts is not None, pages=msg.pages)
            if msg.drafts is not None or msg.shape[1] == 1:  # a decode step, checking proposals or not
                runner.measured(time.perf_counter() - began)
            if index + 1 < len(self.runners):
                self.runners[index + 1].queue.put((msg, out, rows))
            elif self.next_conn is not None:
                self._send_next(msg, out)
            else:
                self._send_result(msg, out, rows)
        except (RuntimeError, ValueError) as e:
            log.error("step %d failed on stage %d: %s", msg.step, runner.spec.index, e)
            self._report(msg.step, "step", f"stage {runner.spec.index}: {e}")
        except OSError as e:
            self._report(msg.step, "next_hop", f"cannot reach the next stage at {self.next_address}: {e}")
        except Exception as e:  # a stage's thread, and a reader, must outlive any one step
            log.exception("step %d failed on stage %d", msg.step, runner.spec.index)
            self._report(msg.step, "step", f"stage {runner.spec.index}: {type(e).__name__}: {e}")

    def stage_times(self) -> list[list]:
        """[stage index, ms] of each stage that has run a decode step, for PONG."""
        return [[r.spec.index, round(r.step_ms, 3)] for r in self.runners if r.step_ms is not None]

    def _report(self, step: int, code: str, message: str) -> None:
        self.coordinator.send_error(code, f"worker {self.worker_id} {message}", request=step)

    def _send_next(self, msg: Forward, out: torch.Tensor) -> None:
        if out.device.type != "cpu":
            out = out.cpu()
        if not out.is_contiguous():
            out = out.contiguous()
        wire = msg.passing_on(str(out.dtype).removeprefix("torch."), list(out.shape))
        data = out.view(torch.uint8).numpy() if out.dtype == torch.bfloat16 else out.numpy().view(np.uint8)
        self.next_conn.send(wire, data, request=msg.step)

    def _send_result(self, msg: Forward, logits: torch.Tensor, rows: list[Row]) -> None:
        sampled = sample_rows(logits, rows, self.matchers)
        self.coordinator.send(Result.of_sampled(msg.step, sampled), request=msg.step)

    def _watch_next(self) -> None:
        """Keep the link to the next stage alive and read what comes back on it: PONGs, or an
        error about a frame we sent, which the coordinator must hear about."""
        conn = self.next_conn

        def ping():
            while not conn.closed and not self.released.wait(self.idle_timeout / 3):
                try:
                    conn.send(Ping(time.monotonic()))
                except OSError:
                    return

        threading.Thread(target=ping, daemon=True, name="next-hop-ping").start()
        try:
            while True:
                try:
                    frame = conn.recv()
                except RemoteError as e:
                    self._report(e.request, "next_hop", f"reports from the next stage: {e}")
                    continue
                except (OSError, ConnectionError, FrameError) as e:
                    if not self.released.is_set() and not conn.closed:
                        self._report(0, "next_hop", f"lost the next stage at {self.next_address}: {e}")
                    return
                if frame.type != Pong.TYPE:
                    log.warning("next stage sent an unexpected %s", frame.type.name)
        finally:
            conn.close()

    # -- release ------------------------------------------------------------------------------

    def release(self) -> None:
        """Stop the stage threads and free the plan's memory, once a step a reader runs is done.
        The link to the next stage is closed first, so a stage blocked sending to a next stage
        that stopped reading (frozen, or behind a dead route) wakes at once instead of holding
        the stages."""
        self.released.set()
        if self.next_conn is not None:
            self.next_conn.close()
        with self._stepping:
            pass
        self._stop_runners()
        self.matchers.close()
        self.weights.reader.close()
        objects_let_go()
        gc.collect()  # a stage that cycles keep alive would stay beside the next plan's until the collector ran
        release_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _stop_runners(self) -> None:
        """Stop each stage's thread and drop the stages (in a call of its own: a loop's variable
        would keep the last stage referenced through the collection that follows)."""
        for runner in self.runners:
            runner.queue.put(None)
        for runner in self.runners:
            if runner.thread is not None and runner.thread is not threading.current_thread():
                runner.thread.join(timeout=30)
            runner.stage.cache = None
        self.runners.clear()


def rest(conn: Connection, spin: float = SPIN_S) -> None:
    """What a reader that ran a step itself (Ring.enqueue) does before it reads again: spin
    `spin` seconds for the next frame, then sleep up to IDLE_S; no frame by then, it gives back
    the scratch memory of its steps, as an idle stage's thread does."""
    if not conn.readable(spin, spin=True) and not conn.readable(IDLE_S):
        release_scratch()


def _rows_to_sample(msg: Forward) -> list[Row]:
    """The step's rows as the sampler takes them (ValueError or TypeError for bad parameters)."""
    drafts = msg.drafts or [[]] * len(msg.rows)
    return [
        Row(
            slot,
            start,
            [0] * (n - len(draft)) + draft,
            SamplingParams.from_dict(s) if s is not None else None,
            recent,
            constraint,
            n_draft=len(draft),
        )
        for (slot, start, n), s, recent, constraint, draft in zip(
            msg.rows, msg.sampling, msg.recent, msg.row_constraints(), drafts
        )
    ]
