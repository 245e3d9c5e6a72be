"""A worker's ring of stages (shardwire/worker/ring.py): releasing its plan when the next stage's
worker stopped reading (frozen, or behind a route that drops every packet; socket pairs stand in
for the links and a stage that makes a large activation for the model), and what an idle stage
keeps."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardwire.formats import open_model
from shardwire.loading import load_stage
from shardwire.pipeline import Row
from shardwire.quant import ggml_cpu
from shardwire.sampling import GREEDY
from shardwire.wire.conn import Connection
from shardwire.wire.messages import Forward, NextHop
from shardwire.worker.ring import IDLE_S, Ring, StageRunner
from shardwire.worker.weights import FoundWeights

from models import PROMPT, model_path
from resident import resident_bytes


class LargeActivations:
    """A stage whose output is far more than a socket buffer holds."""

    cache = None

    def __call__(self, x, slots, starts, pages=None):
        return torch.zeros(1, 1, 4 << 20)


def test_release_does_not_wait_for_a_send_the_next_stage_never_reads():
    to_next, next_side = socket.socketpair()
    to_coordinator, coordinator_side = socket.socketpair()
    assign = SimpleNamespace(plan="p", coordinator="c", n_slots=1, ctx=8, kv_pages=1, next=NextHop("127.0.0.1", 1))
    spec = SimpleNamespace(index=0, first=True, last=False)
    ring = Ring(
        assign,
        SimpleNamespace(vocab_size=16, dim=4),
        [StageRunner(spec, LargeActivations())],
        Connection(to_coordinator, "coordinator"),
        Connection(to_next, "next"),
        FoundWeights(),
        "worker",
        idle_timeout=300.0,
    )
    ring.start()
    step = Forward.of_rows("p", 1, [Row(0, 0, [3])])
    ring.enqueue(Connection(coordinator_side, "coordinator"), step, np.array([[3]], dtype=np.int32))
    deadline = time.monotonic() + 10
    while not ring.runners[0].queue.empty():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # the stage thread is now blocked sending 16 MiB nobody reads
    thread = ring.runners[0].thread
    started = time.monotonic()
    ring.release()
    assert time.monotonic() - started < 5
    assert not thread.is_alive()
    deadline = time.monotonic() + 5
    while to_next.fileno() != -1:  # the link's watcher closes it as it ends
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for s in (next_side, coordinator_side, to_coordinator):
        s.close()


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml-python is not installed")
def test_an_idle_stage_gives_back_the_scratch_memory_of_its_steps():
    """A stage that has had no step for IDLE_S keeps its weights and cache, not the intermediates
    of its graphs: the pages of its decode step's arena go back to the system."""
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
            ring.enqueue(coordinator, Forward.of_rows("p", start, [row]), np.array([tokens], dtype=np.int32))
            coordinator.recv()  # its result
        (graph,) = stage.graph._built.values()
        arena = graph.arena
        assert resident_bytes(arena.memory.ctypes.data, arena.nbytes) > 0
        time.sleep(IDLE_S + 0.5)
        assert resident_bytes(arena.memory.ctypes.data, arena.nbytes) == 0
        assert stage.cache is not None
    finally:
        ring.release()
