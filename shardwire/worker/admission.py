"""Connections that have not finished the handshake (TLS, then HELLO) get a small budget of their
own, per source address and in total, and a deadline for the whole handshake. When the total is
full, the oldest unfinished connection of the address holding the most is dropped to admit the
new one: strangers who open connections and leave them silent (or write a byte at a time) can only
push out each other, and a coordinator at another address always gets through within about one
deadline. An address over its own share has its new connection closed at once instead: dropping
its oldest would only let it churn the worker's CPU (a thread per connection) as fast as it can
reconnect. Authenticated links are never counted here."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

log = logging.getLogger("shardwire.worker")


@dataclass(eq=False)
class Pending:
    fd: int
    address: str
    since: float = field(default_factory=time.monotonic)
    dropped: threading.Event = field(default_factory=threading.Event)


def shut_down(fd: int) -> None:
    """Shut a connection's socket down by its descriptor (wrapped in TLS or not): a thread blocked
    reading or writing it wakes with an error. The caller makes sure `fd` is still that socket."""
    try:
        view = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        view.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        view.detach()


class Admission:
    def __init__(self, total: int = 64, per_address: int = 8, deadline: float = 5.0):
        self.total, self.per_address, self.deadline = total, per_address, deadline
        self._pending: dict[str, list[Pending]] = defaultdict(list)  # address -> oldest first
        self._count = 0
        self._refusals: dict[str, tuple[int, float]] = {}  # address -> (refused, since)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._reap, name="shardwire-handshake-deadline", daemon=True).start()

    def admit(self, sock: socket.socket, address: str) -> Pending | None:
        """The new connection's place in the budget, or None when its address has used its share
        (the caller closes it)."""
        entry = Pending(sock.fileno(), address)
        with self._lock:
            if len(self._pending.get(address, ())) >= self.per_address:
                self._refused(address)
                return None
            if self._count >= self.total:
                busiest = max(self._pending.values(), key=len)
                self._drop(busiest[0], "too many unfinished handshakes")
            self._pending[address].append(entry)
            self._count += 1
        return entry

    def _refused(self, address: str) -> None:
        """Say so once a minute per address, not once per connection: a flood must not flood the log."""
        now = time.monotonic()
        count, since = self._refusals.get(address, (0, now))
        if now - since > 60 or count == 0:
            log.warning(
                "%s: over its share of %d unfinished handshakes; closing its new connections (%d in the last minute)",
                address,
                self.per_address,
                count + 1,
            )
            count, since = 0, now
        if len(self._refusals) > 10000:
            self._refusals.clear()
        self._refusals[address] = (count + 1, since)

    def finished(self, entry: Pending) -> None:
        """The handshake ended (authenticated, failed or dropped): it no longer counts. Called
        before the connection's socket is closed, so a drop never reaches a reused descriptor."""
        with self._lock:
            self._remove(entry)

    def close(self) -> None:
        """Drop every unfinished handshake (the worker is closing) and stop the deadline's thread."""
        self._closed.set()
        with self._lock:
            for entry in [e for queue in self._pending.values() for e in queue]:
                self._drop(entry, "the worker is closing")

    def _remove(self, entry: Pending) -> bool:
        queue = self._pending.get(entry.address)
        if queue is None or entry not in queue:
            return False
        queue.remove(entry)
        if not queue:
            del self._pending[entry.address]
        self._count -= 1
        return True

    def _drop(self, entry: Pending, why: str) -> None:
        """Wake the connection's thread wherever it waits (a read, the TLS handshake, a back-off)
        so it closes at once."""
        if not self._remove(entry):
            return
        log.debug("%s: closed before its handshake finished: %s", entry.address, why)
        entry.dropped.set()
        shut_down(entry.fd)

    def _reap(self) -> None:
        while not self._closed.wait(min(0.25, self.deadline / 4)):
            now = time.monotonic()
            with self._lock:
                late = [e for queue in self._pending.values() for e in queue if now - e.since > self.deadline]
                for entry in late:
                    self._drop(entry, f"no handshake within {self.deadline:g} s")
