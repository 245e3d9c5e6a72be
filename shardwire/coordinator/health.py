"""The coordinator's heartbeat: ping every worker serving the plan, declare gone one that stops
answering, notice a ring that stops returning results, and probe lost workers until one answers
again."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..wire.messages import Ping
from .links import WorkerLink
from .remote import RemotePipeline

log = logging.getLogger("shardwire.cluster")


class Heartbeat:
    def __init__(self, links: Callable[[], list[WorkerLink]], answers: Callable[[WorkerLink], bool]):
        self._links, self._answers = links, answers
        self.interval = 1.0
        self.dead_after = 5.0  # seconds without a PONG before a worker counts as gone
        self.stall_timeout = 30.0  # seconds without any step result while steps are in flight
        self.pipeline: RemotePipeline | None = None
        self._last_probe = 0.0
        self._probing = threading.Lock()  # one probe at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self) -> None:
        now = time.monotonic()
        pipeline = self.pipeline
        links = self._links()
        for link in links:
            if not link.watched:
                continue
            if now - link.last_pong > self.dead_after and pipeline is not None:
                pipeline.link_lost(
                    link, f"worker {link.name} stopped answering (no heartbeat for {now - link.last_pong:.1f} s)"
                )
                link.drop()
                continue
            try:
                link.conn.send(Ping(now))
            except OSError:
                pass
        if pipeline is None or pipeline.broken is not None:
            return
        stalled = pipeline.stalled_for(now)
        if stalled > self.stall_timeout:
            pipeline.fail(f"no step result for {stalled:.1f} s: a link between workers may have stopped carrying data")
            return
        lost = [l for l in links if l.lost_since is not None and now - l.lost_since > 1.0]
        if lost and not pipeline.rebalance_due and now - self._last_probe > 2.0 and self._probing.acquire(False):
            self._last_probe = now
            link = lost[int(now) % len(lost)]
            # Off this thread: a worker behind a dead route takes the probe's whole timeout to
            # fail, and the pings to everyone else must not wait for it.
            threading.Thread(target=self._probe, args=(link, pipeline), daemon=True, name="probe").start()

    def _probe(self, link: WorkerLink, pipeline: RemotePipeline) -> None:
        try:
            if self._answers(link):
                log.info("worker %s answers again; the plan will move stages back onto it", link.name)
                pipeline.want_rebalance()
        finally:
            self._probing.release()
