"""Releasing a worker's plan (shardwire/worker/ring.py) when the next stage's worker stopped
reading: frozen, or behind a route that drops every packet. Socket pairs stand in for the links
and a stage that makes a large activation for the model."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import torch

from shardwire.pipeline import Row
from shardwire.wire.conn import Connection
from shardwire.wire.messages import Forward, NextHop
from shardwire.worker.ring import Ring, StageRunner
from shardwire.worker.weights import FoundWeights


class LargeActivations:
    """A stage whose output is far more than a socket buffer holds."""

    cache = None

    def __call__(self, x, slots, starts):
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
    ring.enqueue(Connection(coordinator_side, "coordinator"), step, torch.tensor([[3]], dtype=torch.int32))
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
