"""A TCP relay that emulates a network link on loopback: a set one-way delay, a bandwidth cap,
and a byte count per direction.

    python -m benchmarks.relay --target 127.0.0.1:50052 --delay-ms 1 --rate-mbit 1000

Every byte that enters one side leaves the other side `delay` seconds after the link finished
sending it, the link sending at `rate` bytes/s, one direction independent of the other (a
full-duplex link). Each accepted connection gets its own upstream connection and its own pair
of directions; every connection through one relay shares that relay's counters.

Threads, not asyncio: asyncio's event loop sleeps in whole milliseconds (epoll), which would
turn a 0.2 ms delay into 1 ms. Each direction with shaping has a reader thread (stamps data as
it arrives) and a sender thread (sleeps until each chunk is due, with a 1 ns timer slack so
the kernel does not round the sleep up by its default 50 us). Queued data is bounded, so a
slow link pushes back on its sender as TCP would. Only loopback addresses are accepted.
With `nice`, the relay's threads run at that priority (the emulated network should not wait
for a CPU behind the processes it links; Linux, root).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ipaddress
import os
import socket
import threading
import time

MAX_QUEUED = 32 << 20  # bytes in flight per direction before the reader stops reading
CHUNK = 256 << 10
_PR_SET_TIMERSLACK = 29


def _precise_sleeps() -> None:
    """Make this thread's sleeps end on time (the default timer slack is 50 us)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _set_nice(nice: int | None) -> None:
    """This thread's nice value (Linux: per thread); ignored where not permitted."""
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (OSError, AttributeError):
            pass


def _check_loopback(host: str) -> None:
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        raise ValueError(f"relay: cannot resolve {host!r}") from None
    if not addr.is_loopback:
        raise ValueError(f"relay: {host} is not a loopback address; this relay only emulates links on loopback")


class Shaping:
    """The link's parameters; the harness may change them between runs (e.g. off while a model
    loads, on while it is measured)."""

    def __init__(self, delay_s: float = 0.0, rate: float | None = None, enabled: bool = True):
        self.delay_s, self.rate, self.enabled = delay_s, rate, enabled

    @property
    def active(self) -> bool:
        return self.enabled and (self.delay_s > 0 or bool(self.rate))


class Counter:
    def __init__(self):
        self.up = 0  # client -> target (towards the server)
        self.down = 0  # target -> client
        self.connections = 0

    def snapshot(self) -> dict:
        return {"up": self.up, "down": self.down, "connections": self.connections}


class _Direction:
    """One direction of one connection: src -> dst through the emulated link."""

    def __init__(self, relay: "Relay", src: socket.socket, dst: socket.socket, up: bool, done):
        self.relay, self.src, self.dst, self.up, self.done = relay, src, dst, up, done
        self.queue: collections.deque = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.link_free = 0.0  # when the emulated link finishes sending what it has
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="relay-read").start()
        threading.Thread(target=self._send, daemon=True, name="relay-send").start()

    def _count(self, n: int) -> None:
        if self.up:
            self.relay.counter.up += n
        else:
            self.relay.counter.down += n

    def _read(self) -> None:
        _set_nice(self.relay.nice)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        try:
            while True:
                n = self.src.recv_into(buf)
                if n == 0:
                    break
                now = time.perf_counter()
                self._count(n)
                shaping = self.relay.shaping
                with self.cond:
                    if not shaping.active and not self.queue:
                        # an unshaped link: pass through at once, from this thread
                        self.dst.sendall(view[:n])
                        continue
                    if shaping.active:
                        start = max(now, self.link_free)
                        self.link_free = start + (n / shaping.rate if shaping.rate else 0.0)
                        due = self.link_free + shaping.delay_s
                    else:  # shaping was just switched off: keep the order behind what is queued
                        due = now
                    while self.queued > MAX_QUEUED and not self.closed:
                        self.cond.wait(0.1)
                    self.queue.append((due, bytes(view[:n])))
                    self.queued += n
                    self.cond.notify_all()
        except OSError:
            pass
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify_all()

    def _send(self) -> None:
        _set_nice(self.relay.nice)
        _precise_sleeps()
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if not self.queue:
                        break
                    due, data = self.queue[0]
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        finally:
            self.done()


class Relay:
    """Listens on 127.0.0.1:port and relays every connection to target through the link."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        shaping: Shaping | None = None,
        max_connections: int = 64,
        nice: int | None = None,
    ):
        _check_loopback(target[0])
        _check_loopback(listen[0])
        self.target, self.nice = target, nice
        self.shaping = shaping or Shaping()
        self.counter = Counter()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(listen)
        self._sock.listen(64)
        self.host, self.port = self._sock.getsockname()[:2]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.port}").start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                self._slots.release()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open.update((client, server))
            self.counter.connections += 1
            remaining = [2]

            def done(client=client, server=server, remaining=remaining):
                with self._lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                    if last:
                        self._open.discard(client)
                        self._open.discard(server)
                for s in (client, server):  # one side closing ends both directions
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                if last:
                    client.close()
                    server.close()
                    self._slots.release()

            _Direction(self, client, server, True, done).start()
            _Direction(self, server, client, False, done).start()

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            socks = list(self._open)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="host:port to relay to (loopback)")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (default: %(default)s)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay in milliseconds")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="bandwidth cap in Mbit/s (0: none)")
    args = p.parse_args()
    relay = Relay(
        _address(args.target),
        listen=_address(args.listen),
        shaping=Shaping(args.delay_ms / 1000, args.rate_mbit * 1e6 / 8 if args.rate_mbit else None),
    )
    print(f"relay listening on {relay.address} -> {args.target}", flush=True)
    try:
        while True:
            time.sleep(5)
            c = relay.counter
            print(f"up {c.up} B, down {c.down} B, {c.connections} connections", flush=True)
    except KeyboardInterrupt:
        relay.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
