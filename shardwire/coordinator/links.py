"""One worker as the coordinator sees it: its address, its connection, and the thread that reads
what it sends back (results, step errors, PONGs)."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..wire.conn import Connection, RemoteError
from ..wire.frames import FrameError
from ..wire.messages import DeviceInfo, Ok, Pong, Result, parse_message

_HOST = re.compile(r"^[A-Za-z0-9._-]+$")


def parse_address(text: str, default_port: int = 50052) -> tuple[str, int]:
    """'host:port', 'host' or '[ipv6]:port' -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
        valid = bool(host) and all(c in "0123456789abcdefABCDEF:." for c in host)
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
        valid = bool(_HOST.match(host))
    if not valid:
        raise ValueError(f"bad worker address '{text}' (expected host:port)")
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad port in worker address '{text}'") from None
    if not 0 < number < 65536:
        raise ValueError(f"bad port in worker address '{text}'")
    return host, number


@dataclass
class LinkEvents:
    """What a link's reader reports, and to whom."""

    result: Callable[[Result], None]
    step_failed: Callable[[RemoteError, "WorkerLink"], None]
    lost: Callable[["WorkerLink", str], None]


@dataclass
class WorkerLink:
    name: str  # host:port, or "local" / "local:cpu" for the coordinator's own
    host: str
    port: int
    conn: Connection | None = None
    worker_id: str = ""
    devices: list[DeviceInfo] = field(default_factory=list)
    alive: bool = False
    reader: threading.Thread | None = None
    local: object | None = None  # the in-process Worker behind a local link
    latency_ms: float | None = None  # last heartbeat round trip
    stage_ms: dict[int, float] = field(default_factory=dict)  # stage index -> its decode compute, per its PONG
    last_pong: float = 0.0
    fingerprint: str | None = None  # its TLS certificate, once verified
    pin: str | None = None  # the certificate a local worker was started with
    lost_since: float | None = None  # when it was lost; None while it is part of the plan or never was

    @classmethod
    def at(cls, address: str) -> "WorkerLink":
        return cls(address, *parse_address(address))

    @property
    def watched(self) -> bool:
        """Serving a loaded plan: its reader runs and the heartbeat watches it."""
        return self.alive and self.reader is not None

    def drop(self) -> None:
        """Close this link on purpose (a reader inside it wakes and ends; Connection.close waits
        for it to leave the socket)."""
        self.alive = False
        self.reader = None
        if self.conn is not None:
            self.conn.close()

    def start_reader(self, events: LinkEvents) -> None:
        self.last_pong = time.monotonic()
        self.reader = threading.Thread(
            target=self._read, args=(self.conn, events), daemon=True, name=f"link-{self.name}"
        )
        self.reader.start()

    def _read(self, conn: Connection, events: LinkEvents) -> None:
        """Read `conn` until it ends, then close it; report the link lost unless it has been
        connected again since."""
        try:
            problem = self._read_until_lost(conn, events)
        finally:
            conn.close()
        if self.conn is conn:
            events.lost(self, problem)

    def _read_until_lost(self, conn: Connection, events: LinkEvents) -> str:
        while True:
            try:
                frame = conn.recv()
                msg = parse_message(frame)
            except RemoteError as e:
                if e.code in ("step", "next_hop"):  # one step failed; the worker carries on
                    events.step_failed(e, self)
                    continue
                return str(e)
            except (OSError, ConnectionError, FrameError) as e:
                return f"worker {self.name} is gone ({e})"
            if isinstance(msg, Result):
                events.result(msg)
            elif isinstance(msg, Pong):
                self.last_pong = time.monotonic()
                if msg.t:
                    self.latency_ms = (self.last_pong - msg.t) * 1000
                self.stage_ms = dict(map(tuple, msg.stages))
            elif not isinstance(msg, Ok):
                return f"worker {self.name} sent an unexpected {frame.type.name}"

    def status(self, stages: list, state: str) -> dict:
        """For GET /v1/cluster: this worker, its devices, and its (index, PlannedStage) stages."""
        return {
            "name": self.name,
            "worker_id": self.worker_id,
            "alive": self.alive,
            "state": state,
            "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
            "tls": self.fingerprint,  # the certificate verified on this link; None: plain TCP
            "devices": [{"name": d.name, "free": d.free, "total": d.total, "compute": d.compute} for d in self.devices],
            "stages": [
                {
                    "index": i,
                    "device": s.device.name,
                    "blocks": [s.start, s.end],
                    "weight_bytes": s.weight_bytes,
                    "kv_bytes": s.kv_bytes,
                    "workspace_bytes": s.workspace_bytes,
                    "weights": s.weights,
                    "formats": s.formats,
                    "step_ms": self.stage_ms.get(i),
                }
                for i, s in stages
            ],
        }
