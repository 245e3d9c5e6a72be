"""The coordinator's heartbeat (shardwire/coordinator/health.py) over stand-in links: probing a
lost worker never holds up the pings to the others, and one that answers again is moved back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from shardwire.coordinator.health import Heartbeat


@dataclass
class Conn:
    pings: list = field(default_factory=list)

    def send(self, message):
        self.pings.append(message)


@dataclass
class Link:
    name: str
    watched: bool
    lost_since: float | None = None
    last_pong: float = field(default_factory=time.monotonic)
    conn: Conn = field(default_factory=Conn)


class Pipeline:
    broken = None
    rebalance_due = False

    def stalled_for(self, now):
        return 0.0

    def want_rebalance(self):
        self.rebalance_due = True


def heartbeat(answers) -> tuple[Heartbeat, Link, Link]:
    serving = Link("10.0.0.1:50052", watched=True)
    lost = Link("10.0.0.2:50052", watched=False, lost_since=time.monotonic() - 5)
    beat = Heartbeat(lambda: [serving, lost], answers)
    beat.pipeline = Pipeline()
    return beat, serving, lost


def test_probing_a_worker_behind_a_dead_route_does_not_hold_up_the_pings():
    probes, release = [], threading.Event()

    def black_hole(link):  # the probe's whole timeout goes by
        probes.append(link.name)
        release.wait(5)
        return False

    beat, serving, lost = heartbeat(black_hole)
    try:
        for n in range(3):
            started = time.monotonic()
            beat.beat()
            assert time.monotonic() - started < 0.5
            assert len(serving.conn.pings) == n + 1
            beat._last_probe -= 5  # as if the next probe were due: still one at a time
        assert probes == [lost.name]
    finally:
        release.set()


def test_a_lost_worker_that_answers_again_is_moved_back():
    beat, _, _ = heartbeat(lambda link: True)
    beat.beat()
    deadline = time.monotonic() + 5
    while not beat.pipeline.rebalance_due:
        assert time.monotonic() < deadline
        time.sleep(0.01)
