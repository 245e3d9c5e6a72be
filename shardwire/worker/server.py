"""The worker's server: bind, accept, TLS and the HELLO handshake with a back-off for repeated
failures, then one thread per connection reading its messages and dispatching them.

Nothing a peer sends can stop the worker: a bad frame closes that connection only.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from .. import __version__
from ..config import ConfigError
from ..constrain import Vocabulary
from ..devices import check_device, default_devices, free_memory, objects_held_for_good, set_threads, torch_device
from ..models import config_from_dict
from ..weights.cache import WeightCache, default_cache_dir
from ..weights.in_use import compute_line
from ..weights.kernels import kernels_on
from ..weights.measure import fastest_formats, prompt_products, row_products
from ..weights.policy import default_dtype
from ..wire.conn import AuthError, Connection, RemoteError, server_handshake, tune
from ..wire.frames import FrameError, Limits, MessageType
from ..wire.messages import (
    Assign,
    Describe,
    DeviceInfo,
    Devices,
    Forward,
    Free,
    Ok,
    Ping,
    Pong,
    Ready,
    Release,
    StageReport,
    Vocab,
    parse_message,
)
from ..wire.tls import ClientTLS, ServerTLS
from .admission import Admission, Pending, shut_down
from .assign import PlanRejected, build_ring, check_assign
from .ring import SPIN_S, Ring, rest
from .weights import WeightSources

log = logging.getLogger("shardwire.worker")

COORDINATOR_SILENT = 10.0  # coordinators ping every second; one silent this long is gone


class InsecureBind(ValueError):
    """Listening beyond this machine without a token."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AuthBackoff:
    """After repeated authentication failures from an address, each new attempt waits."""

    def __init__(self):
        self._failures: dict[str, tuple[int, float]] = {}  # address -> (recent failures, last time)

    def wait(self, address: str, interrupted: threading.Event) -> None:
        count, last = self._failures.get(address, (0, 0.0))
        if count >= 3 and time.monotonic() - last < 600:
            interrupted.wait(min(2.0 ** (count - 3), 30.0))

    def failed(self, address: str) -> None:
        count, last = self._failures.get(address, (0, 0.0))
        if time.monotonic() - last > 600:
            count = 0
        if len(self._failures) > 10000:
            self._failures.clear()
        self._failures[address] = (count + 1, time.monotonic())

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)


class Worker:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 50052,
        devices: list[str] | None = None,
        mem: int | None = None,
        cache_dir: Path | None = None,
        cache_max_bytes: int | None = None,
        model_dirs: list[Path] = (),
        token: str | None = None,
        threads: int | None = None,
        limits: Limits | None = None,
        max_connections: int = 64,
        max_pending: int = 64,
        max_pending_per_address: int = 8,
        handshake_timeout: float = 5.0,
        idle_timeout: float = 300.0,
        poll: float = SPIN_S,
        tls: ServerTLS | None = None,
        insecure: bool = False,
    ):
        if not is_loopback(host) and token is None and not insecure:
            raise InsecureBind(
                f"refusing to listen on {host} without authentication: anyone who can reach this port could "
                "run code paths on this machine and read every prompt. Either set a shared token (env "
                "SHARDWIRE_TOKEN, --token-file, or --token) on the workers and the coordinator, or pass "
                "--insecure to accept the risk on a network you trust."
            )
        if insecure and token is None and not is_loopback(host):
            log.warning(
                "listening on %s WITHOUT authentication (--insecure): anyone who reaches this port can use this worker",
                host,
            )
        self.host, self.port = host, port
        self.tls = tls
        self._tls_context = tls.context() if tls is not None else None
        # Reaching the next stage: present our certificate; trust the fingerprint the plan names.
        self.peer_tls = ClientTLS(ca=tls.client_ca, cert=tls.cert, key=tls.key) if tls is not None else ClientTLS()
        self.idle_timeout = idle_timeout
        self.poll = poll  # seconds a reader polls its link after a decode step it ran (ring.rest)
        self._backoff = AuthBackoff()
        self.devices = [check_device(d) for d in (devices or default_devices())]
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("each device may be listed once (name CPU devices cpu:0, cpu:1, ...)")
        self.mem = mem
        self.cache = WeightCache(cache_dir or default_cache_dir(), cache_max_bytes)
        self.weights = WeightSources(self.cache, [Path(d) for d in model_dirs])
        self.token = token
        self.limits = limits or Limits()
        self.handshake_timeout = handshake_timeout
        self._admission = Admission(max_pending, max_pending_per_address, handshake_timeout)
        self.worker_id = f"{socket.gethostname()}/{uuid.uuid4().hex[:8]}"
        self._slots = threading.BoundedSemaphore(max_connections)  # authenticated links
        self._max_connections = max_connections
        self._ring: Ring | None = None
        self._ring_lock = threading.RLock()
        self._listener: socket.socket | None = None
        self._closing = False
        self._threads: set[threading.Thread] = set()  # the accepting one and each connection's
        self._connected: set[int] = set()  # descriptors of authenticated connections still served
        self._threads_lock = threading.Lock()
        set_threads(threads)

    # -- lifecycle -----------------------------------------------------------------------

    def bind(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        self._listener = sock
        self.port = sock.getsockname()[1]
        return self.port

    def serve_forever(self) -> None:
        if self._listener is None:
            self.bind()
        while not self._closing:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                raise
            pending = self._admission.admit(sock, addr[0])
            if pending is None:
                sock.close()
                continue
            self._spawn(self._serve_connection, (sock, addr, pending), f"conn-{addr[0]}:{addr[1]}")

    def _spawn(self, target, args: tuple, name: str) -> threading.Thread:
        def run():
            try:
                target(*args)
            finally:
                with self._threads_lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, daemon=True, name=name)
        with self._threads_lock:  # started (Thread.start waits for that) before close() can see it
            self._threads.add(t)
            t.start()
        return t

    def start(self) -> threading.Thread:
        if self._listener is None:
            self.bind()
        return self._spawn(self.serve_forever, (), "shardwire-worker")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting, release the stages, and wait up to `wait_s` for the threads serving
        connections (their peers have closed or been told to) to end: a process that exits with
        one still inside a socket or a kernel can abort in the interpreter's shutdown."""
        self._closing = True
        self._admission.close()
        if self._listener is not None:
            for stop in (lambda: self._listener.shutdown(socket.SHUT_RDWR), self._listener.close):
                try:  # shutdown wakes a thread blocked in accept(); close alone does not on Linux
                    stop()
                except OSError:
                    pass
        self._release()
        deadline = time.monotonic() + wait_s
        with self._threads_lock:
            for fd in self._connected:
                shut_down(fd)
            others = [t for t in self._threads if t is not threading.current_thread()]
        for t in others:
            t.join(max(0.0, deadline - time.monotonic()))

    def describe(self) -> Devices:
        devices = []
        for d in self.devices:
            free, dtype = free_memory(d), default_dtype(d)
            devices.append(
                DeviceInfo(
                    d,
                    min(free, self.mem) if self.mem else free,
                    self.mem or free,
                    dtype,
                    kernels_on(torch_device(d)),
                    fastest_formats(d, dtype),
                    prompt_products(d, dtype),
                    row_products(d, dtype),
                    compute_line(d),
                )
            )
        return Devices(self.worker_id, __version__, devices)

    # -- connections ---------------------------------------------------------------------

    def _serve_connection(self, sock: socket.socket, addr, pending: Pending) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        conn = Connection(sock, peer, self.limits)
        slot, served = False, None
        try:
            tune(sock)
            sock.settimeout(self.handshake_timeout)
            self._backoff.wait(addr[0], pending.dropped)
            if self._tls_context is not None:
                try:
                    sock = self._tls_context.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as e:
                    (log.info if pending.dropped.is_set() else log.warning)("%s: TLS handshake failed: %s", peer, e)
                    return
                conn = Connection(sock, peer, self.limits)
            try:
                hello = server_handshake(conn, self.token, self.worker_id)
            except AuthError:
                self._backoff.failed(addr[0])
                conn.send_error("auth", "authentication failed")
                raise
            self._backoff.succeeded(addr[0])
            self._admission.finished(pending)
            if pending.dropped.is_set():
                return
            slot = self._slots.acquire(blocking=False)
            if not slot:
                log.warning("%s refused: %d links are open already", peer, self._max_connections)
                conn.send_error("busy", "the worker has too many connections open")
                return
            # Coordinators ping every second and upstream workers ping their peer link; a
            # connection silent for this long is half-open.
            sock.settimeout(self.idle_timeout)
            log.info("%s connected as %s", peer, hello.role)
            with self._threads_lock:
                if self._closing:
                    return
                served = sock.fileno()
                self._connected.add(served)
            self._read_loop(conn, hello.role)
        except (ConnectionError, TimeoutError, socket.timeout) as e:
            if isinstance(e, AuthError):
                log.warning("%s: %s", peer, e)
            else:
                log.info("%s disconnected: %s", peer, e)
        except FrameError as e:
            log.warning("%s sent a bad frame: %s", peer, e)
            conn.send_error("bad_frame", str(e))
        except RemoteError as e:
            log.info("%s reported: %s", peer, e)
        except OSError as e:
            log.info("%s: connection error: %s", peer, e)
        except Exception:  # nothing a peer sends may take the worker down
            log.exception("%s: unexpected error; closing this connection", peer)
            conn.send_error("internal", "internal error")
        finally:
            self._admission.finished(pending)
            with self._threads_lock:  # before the descriptor is closed and may be reused
                self._connected.discard(served)
            conn.close()
            if slot:
                self._slots.release()
            self._release(owner=conn)

    def _read_loop(self, conn: Connection, role: str) -> None:
        pending: dict = {}

        def payload_into(mtype, header, nbytes):
            if mtype != MessageType.FORWARD:
                return None
            msg, ring = Forward.parse(header), self._ring
            if ring is None:
                raise FrameError(f"FORWARD for plan {msg.plan!r}, which this worker does not hold")
            payload, rows = ring.check_forward(msg, nbytes)
            pending["forward"] = (ring, msg, payload, rows)
            return payload.view(np.uint8).reshape(-1)

        stepped = False  # this reader ran the last step itself
        while True:
            if stepped:
                rest(conn, self.poll)
                stepped = False
            frame = conn.recv(payload_into)
            if frame.type == MessageType.FORWARD:
                ring, msg, payload, rows = pending.pop("forward", (None, None, None, None))
                if msg is None:
                    raise FrameError("FORWARD without its payload")
                stepped = ring.enqueue(conn, msg, payload, rows)
                continue
            msg = parse_message(frame)
            if isinstance(msg, Ping):
                ring = self._ring
                conn.send(Pong(msg.t, ring.stage_times() if ring is not None else []), request=frame.request)
            elif role != "coordinator":
                raise FrameError(f"a peer may not send {frame.type.name}")
            elif isinstance(msg, Describe):
                conn.send(self.describe(), request=frame.request)
            elif isinstance(msg, Assign):
                self._assign(conn, msg, frame.request)
            elif isinstance(msg, Free):
                # A slot's cache needs no clearing: the next sequence starts at position 0 and
                # attends only to what it wrote. FREE travels outside the ring and may overtake
                # the next sequence's first FORWARD, so it must not touch what the ring holds.
                log.debug("slot %d is free", msg.slot)
            elif isinstance(msg, Vocab):
                ring = self._ring
                if ring is None or ring.id != msg.plan:
                    log.warning("ignoring the vocabulary for plan %s, which this worker does not hold", msg.plan)
                    continue
                try:
                    ring.matchers.use_vocabulary(Vocabulary.from_payload(frame.payload, msg.n, msg.eos))
                except ValueError as e:
                    raise FrameError(f"VOCAB: {e}") from None
            elif isinstance(msg, Release):
                self._release(owner=conn)
                conn.send(Ok(), request=frame.request)
            else:
                raise FrameError(f"unexpected {frame.type.name}")

    # -- plans ---------------------------------------------------------------------------

    def _assign(self, conn: Connection, assign: Assign, request: int) -> None:
        try:
            cfg = config_from_dict(assign.config)
            check_assign(assign, cfg, self.devices, self.mem)
        except (PlanRejected, ConfigError) as e:
            conn.send_error("plan", f"worker {self.worker_id} rejects the plan: {e}", request=request)
            return
        with self._ring_lock:
            current = self._ring
            if current is not None and current.coordinator is not conn and assign.coordinator != current.coordinator_id:
                holder = current.coordinator
                if not holder.closed and time.monotonic() - holder.last_heard < COORDINATOR_SILENT:
                    conn.send_error(
                        "busy", f"worker {self.worker_id} is serving another coordinator's plan", request=request
                    )
                    return
                holder.close()  # gone without closing (its machine died or lost its route): half-open
            self._release()
        found = self.weights.gather(conn, assign, request)
        try:
            ring = build_ring(
                assign,
                cfg,
                found,
                conn,
                worker_id=self.worker_id,
                token=self.token,
                limits=self.limits,
                peer_tls=self.peer_tls,
                idle_timeout=self.idle_timeout,
            )
        except (OSError, ValueError, RuntimeError) as e:
            found.reader.close()
            conn.send_error("load", f"worker {self.worker_id} could not load its stages: {e}", request=request)
            return
        objects_held_for_good()
        ring.start()
        with self._ring_lock:
            self._ring = ring
        self.cache.evict(keep={t.hash for s in assign.stages for t in s.tensors})
        reports = []
        for r in ring.runners:
            held = sum(p.nbytes for p in r.stage.parameters())
            reports.append(StageReport(r.spec.index, held, r.stage.cache.nbytes, r.stage.choices))
        conn.send(Ready(reports, found.bytes_by_source(assign)), request=request)
        log.info(
            "plan %s loaded: %s",
            ring.id,
            ", ".join(
                f"stage {r.spec.index} blocks {r.spec.start}-{r.spec.end - 1} on {r.spec.device}" for r in ring.runners
            ),
        )

    def _release(self, owner: Connection | None = None) -> None:
        """Drop the plan (only if `owner` is the coordinator that assigned it, when given)."""
        with self._ring_lock:
            ring = self._ring
            if ring is None or (owner is not None and ring.coordinator is not owner):
                return
            self._ring = None
        if owner is not None:
            log.info("coordinator %s is done; releasing plan %s", owner.peer, ring.id)
        ring.release()
