"""A worker's ring of stages (shardwire/worker/ring.py): which thread runs a step, releasing its
plan when the next stage's worker stopped reading (frozen, or behind a route that drops every
packet; socket pairs stand in for the links and a stage that makes a large activation for the
model), and what an idle stage keeps."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from shardwire.backends import IDLE_S
from shardwire.formats import open_model
from shardwire.pipeline import Row
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY
from shardwire.weights import ggml_cpu
from shardwire.wire.conn import Connection
from shardwire.wire.messages import Forward, NextHop
from shardwire.worker.ring import SPIN_S, Ring, StageRunner, rest
from shardwire.worker.weights import FoundWeights

from models import PROMPT, model_path
from resident import resident_bytes


def enqueue(ring: Ring, conn: Connection, step: Forward, ids: list[list[int]]) -> None:
    """A FORWARD of token ids, as the worker's reader hands it on: checked, its payload read in."""
    payload, rows = ring.check_forward(step, 4 * sum(map(len, ids)))
    payload[:] = ids
    ring.enqueue(conn, step, payload, rows)


def first_stage_ring(stage):
    """A started ring of one first stage of width 4 whose links are socket pairs: (ring, its end of the
    link to the next stage, the next stage's end, its end of the coordinator's link, the coordinator's end)."""
    to_next, next_side = socket.socketpair()
    to_coordinator, coordinator_side = socket.socketpair()
    assign = SimpleNamespace(plan="p", coordinator="c", n_slots=1, ctx=8, kv_pages=1, next=NextHop("127.0.0.1", 1))
    spec = SimpleNamespace(index=0, first=True, last=False)
    ring = Ring(
        assign,
        SimpleNamespace(vocab_size=16, dim=4),
        [StageRunner(spec, stage)],
        Connection(to_coordinator, "coordinator"),
        Connection(to_next, "next"),
        FoundWeights(),
        "worker",
        idle_timeout=300.0,
    )
    ring.start()
    return ring, to_next, next_side, to_coordinator, coordinator_side


class LargeActivations:
    """A stage whose output is far more than a socket buffer holds."""

    cache = None

    def __call__(self, x, slots, starts, all_logits=False, pages=None):
        return torch.zeros(1, 1, 4 << 20)


class Hidden:
    """A stage whose hidden states come out in `made`."""

    cache = None

    def __init__(self, made: torch.dtype):
        self.made = made

    def __call__(self, x, slots, starts, all_logits=False, pages=None):
        return torch.arange(4 * len(slots), dtype=torch.float32).reshape(len(slots), 1, 4).to(self.made)


@pytest.mark.parametrize("made", [torch.float32, torch.bfloat16])
def test_the_next_stage_gets_the_hidden_states_the_stage_made(made):
    """The FORWARD to the next stage carries the step as it came (its id, rows) with the hidden
    states' own dtype and shape, and their bytes."""
    ring, to_next, next_side, to_coordinator, coordinator_side = first_stage_ring(Hidden(made))
    try:
        step = Forward.of_rows("p", 7, [Row(0, 0, [3], pages=[0])])
        enqueue(ring, Connection(coordinator_side, "coordinator"), step, [[3]])
        next_side.settimeout(10)
        frame = Connection(next_side, "next").recv()
        sent = Forward.parse(frame.header)
        assert (frame.request, sent.step, sent.rows) == (7, 7, [(0, 0, 1)])
        assert (sent.dtype, sent.shape) == (str(made).removeprefix("torch."), [1, 1, 4])
        assert bytes(frame.payload) == Hidden(made)(None, [0], [0]).view(torch.uint8).numpy().tobytes()
    finally:
        ring.release()
        for s in (next_side, coordinator_side, to_coordinator):
            s.close()


class Slow(Hidden):
    """A stage that takes `seconds` over a step of more than one token, and notes which thread
    ran each step, how many tokens it had, and in which order."""

    def __init__(self, seconds: float):
        super().__init__(torch.float32)
        self.seconds, self.ran = seconds, []

    def __call__(self, x, slots, starts, all_logits=False, pages=None):
        if len(x[0]) > 1:
            time.sleep(self.seconds)
        self.ran.append((threading.get_ident(), len(x[0])))
        return super().__call__(x, slots, starts, pages)


def test_a_decode_step_runs_on_the_reader_and_a_prompt_chunk_on_the_stages_thread():
    """A worker's only stage takes a decode step on the thread that read it (no hand-over to the
    stage's thread); a prompt chunk goes to the stage's thread, so that the reader keeps answering
    while it runs, and a decode step behind a queued chunk waits its turn there."""
    stage = Slow(0.5)
    ring, to_next, next_side, to_coordinator, coordinator_side = first_stage_ring(stage)
    coordinator = Connection(coordinator_side, "coordinator")
    try:
        for start, ids in ((0, [3, 4, 5]), (3, [6]), (4, [7])):
            enqueue(ring, coordinator, Forward.of_rows("p", start, [Row(0, start, ids, pages=[0])]), [ids])
        assert stage.ran == []  # the chunk sleeps on the stage's thread; the decode steps wait behind it
        next_stage = Connection(next_side, "next")
        assert [next_stage.recv().request for _ in range(3)] == [0, 3, 4]
        time.sleep(0.2)  # the stage's thread has nothing left
        enqueue(ring, coordinator, Forward.of_rows("p", 5, [Row(0, 5, [8], pages=[0])]), [[8]])
        assert next_stage.recv().request == 5
        stage_thread, here = ring.runners[0].thread.ident, threading.get_ident()
        assert stage.ran == [(stage_thread, 3), (stage_thread, 1), (stage_thread, 1), (here, 1)]
    finally:
        ring.release()
        for s in (next_side, coordinator_side, to_coordinator):
            s.close()


@pytest.mark.parametrize("tokens", [[3], [3, 4]])
def test_release_does_not_wait_for_a_send_the_next_stage_never_reads(tokens):
    """Whether the reader that ran the step (a decode step) or the stage's thread (a prompt chunk)
    is the one blocked sending to it."""
    ring, to_next, next_side, to_coordinator, coordinator_side = first_stage_ring(LargeActivations())
    step = Forward.of_rows("p", 1, [Row(0, 0, tokens)])
    reader = threading.Thread(target=enqueue, args=(ring, Connection(coordinator_side, "c"), step, [tokens]))
    reader.start()
    deadline = time.monotonic() + 10
    while not ring.runners[0].queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # the step is now blocked sending 16 MiB nobody reads
    thread = ring.runners[0].thread
    started = time.monotonic()
    ring.release()
    assert time.monotonic() - started < 5
    reader.join(5)
    assert not thread.is_alive() and not reader.is_alive()
    deadline = time.monotonic() + 5
    while to_next.fileno() != -1:  # the link's watcher closes it as it ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for s in (next_side, coordinator_side, to_coordinator):
        s.close()


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
def test_an_idle_stage_gives_back_the_scratch_memory_of_its_steps():
    """A stage that has had no step for IDLE_S keeps its weights and cache, not the intermediates
    of its graphs: the pages of its decode step's arena go back to the system, from the reader
    that ran the step once it has spun SPIN_S and slept IDLE_S without a frame (rest), and the
    prompt chunk's from the stage's thread."""
    model = open_model(model_path("llama", "Q4_0"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"Q4_0": "repacked"})
    stage.allocate_cache(1, 32)
    to_coordinator, coordinator_side = socket.socketpair()
    assign = SimpleNamespace(plan="p", coordinator="c", n_slots=1, ctx=32, kv_pages=stage.cache.n_pages, next=None)
    spec = SimpleNamespace(index=0, first=True, last=True)
    ring = Ring(
        assign,
        model.config,
        [StageRunner(spec, stage)],
        Connection(to_coordinator, "coordinator"),
        None,
        FoundWeights(),
        "worker",
        idle_timeout=300.0,
    )
    ring.start()
    coordinator = Connection(coordinator_side, "coordinator")
    try:
        for start, tokens in ((0, PROMPT[:5]), (5, PROMPT[5:6])):  # a prompt chunk, then a decode step
            row = Row(0, start, tokens, GREEDY, pages=stage.own_pages(0, start + len(tokens)))
            enqueue(ring, coordinator, Forward.of_rows("p", start, [row]), [tokens])
            coordinator.recv()  # its result
        (graph,) = stage.runner._built.values()  # the decode step's, which ran on this thread
        arena = graph.arena
        assert resident_bytes(arena.memory.ctypes.data, arena.nbytes) > 0
        started = time.monotonic()
        rest(ring.coordinator)
        assert time.monotonic() - started >= SPIN_S + IDLE_S - 0.01
        assert resident_bytes(arena.memory.ctypes.data, arena.nbytes) == 0
        assert stage.cache is not None
    finally:
        ring.release()


def test_a_reader_told_not_to_poll_sleeps_at_once():
    """`shardwire worker --poll-ms 0`: after a step the reader sleeps in poll straight away (and
    still gives back its scratch after IDLE_S without a frame)."""
    ours, theirs = socket.socketpair()
    try:
        used, started = time.process_time(), time.monotonic()
        rest(Connection(ours, "coordinator"), 0)
        assert IDLE_S - 0.01 <= time.monotonic() - started < IDLE_S + 0.8 * SPIN_S
        assert time.process_time() - used < 0.8 * SPIN_S
    finally:
        ours.close()
        theirs.close()


def test_release_gives_the_plans_objects_back_to_the_cycle_collector():
    """A worker holds a loaded plan's objects out of the collector's passes
    (devices.objects_held_for_good); releasing the plan gives them back, and collects them: a
    stage that a cycle keeps alive is gone after release."""
    import gc
    import weakref

    stage = LargeActivations()
    stage.itself = stage  # a cycle: only the collector frees it
    ring, *links = first_stage_ring(stage)
    gone = weakref.ref(stage)
    del stage
    gc.freeze()
    ring.release()
    assert gc.get_freeze_count() == 0
    assert gone() is None
    for s in links:
        s.close()
