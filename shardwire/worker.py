"""The worker: serves the stages a coordinator assigns it, forwarding activations straight to
the next stage's worker.

Threads: one accepts connections, one reads each connection, one computes each stage. A
FORWARD is validated against the plan and read straight into a tensor of the right size;
the stage's thread runs it and hands the result to the next stage (in this process, or over
the peer connection to the next worker), or samples and answers the coordinator if it is
the last stage. Nothing a peer sends can stop the worker: a bad frame closes that
connection only.
"""
from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__
from .cache import WeightCache, default_cache_dir
from .config import ConfigError, ModelConfig
from .devices import check_device, default_devices, default_dtype, free_memory, set_threads, torch_device
from .formats import TensorInfo, TensorReader, expected_shape, required_tensors
from .kvcache import KVCache
from .loading import build_stage, parse_dtype, weight_formats, weight_nbytes
from .model import Stage
from .pipeline import Row, sample_rows
from .quant import stored_nbytes
from .sampling import SamplingParams
from .wire.conn import AuthError, Connection, RemoteError, connect, server_handshake, tune
from .wire.frames import FrameError, Limits, MessageType
from .wire.messages import Assign, Forward, Free, StageSpec, TensorSpec, Weights
from .wire.tls import ClientTLS, ServerTLS

log = logging.getLogger("shardwire.worker")

_TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}


class PlanRejected(ValueError):
    """An ASSIGN this worker cannot take: wrong device, too big, inconsistent tensors."""


@dataclass
class _Runner:
    """One stage and the thread that runs it."""
    spec: StageSpec
    stage: Stage
    queue: "queue.Queue[tuple[Forward, torch.Tensor] | None]" = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None


@dataclass
class _Plan:
    id: str
    config: ModelConfig
    n_slots: int
    ctx: int
    runners: list[_Runner]
    coordinator: Connection
    next_conn: Connection | None
    next_address: str | None
    filled: list[int]  # per slot: positions already sent through the first stage
    reader: TensorReader
    sources: dict[str, int]
    coordinator_id: str = ""
    released: threading.Event = field(default_factory=threading.Event)


class InsecureBind(ValueError):
    """Listening beyond this machine without a token."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Worker:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 50052, devices: list[str] | None = None,
                 mem: int | None = None, cache_dir: Path | None = None, cache_max_bytes: int | None = None,
                 model_dirs: list[Path] = (), token: str | None = None, threads: int | None = None,
                 limits: Limits | None = None, max_connections: int = 64, handshake_timeout: float = 10.0,
                 idle_timeout: float = 300.0, tls: ServerTLS | None = None, insecure: bool = False):
        if not is_loopback(host) and token is None and not insecure:
            raise InsecureBind(
                f"refusing to listen on {host} without authentication: anyone who can reach this port could "
                "run code paths on this machine and read every prompt. Either set a shared token (env "
                "SHARDWIRE_TOKEN, --token-file, or --token) on the workers and the coordinator, or pass "
                "--insecure to accept the risk on a network you trust.")
        if insecure and token is None and not is_loopback(host):
            log.warning("listening on %s WITHOUT authentication (--insecure): anyone who reaches this port "
                        "can use this worker", host)
        self.host, self.port = host, port
        self.tls = tls
        self._tls_context = tls.context() if tls is not None else None
        # Reaching the next stage: present our certificate; trust the fingerprint the plan names.
        self.peer_tls = ClientTLS(ca=tls.client_ca, cert=tls.cert, key=tls.key) if tls is not None else ClientTLS()
        self.idle_timeout = idle_timeout
        self._failures: dict[str, tuple[int, float]] = {}  # address -> (recent auth failures, last time)
        self.devices = [check_device(d) for d in (devices or default_devices())]
        if len(set(self.devices)) != len(self.devices):
            raise ValueError("each device may be listed once (name CPU devices cpu:0, cpu:1, ...)")
        self.mem = mem
        self.cache = WeightCache(cache_dir or default_cache_dir(), cache_max_bytes)
        self.model_dirs = [Path(d) for d in model_dirs]
        self.token = token
        self.limits = limits or Limits()
        self.handshake_timeout = handshake_timeout
        self.worker_id = f"{socket.gethostname()}/{uuid.uuid4().hex[:8]}"
        self._slots = threading.BoundedSemaphore(max_connections)
        self._plan: _Plan | None = None
        self._plan_lock = threading.RLock()
        self._listener: socket.socket | None = None
        self._closing = False
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
            if not self._slots.acquire(blocking=False):
                log.warning("connection from %s refused: too many connections", addr[0])
                sock.close()
                continue
            threading.Thread(target=self._serve_connection, args=(sock, addr), daemon=True,
                             name=f"conn-{addr[0]}:{addr[1]}").start()

    def start(self) -> threading.Thread:
        if self._listener is None:
            self.bind()
        t = threading.Thread(target=self.serve_forever, name="shardwire-worker", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        self._release_plan()

    def describe(self) -> dict:
        devices = []
        for d in self.devices:
            free = free_memory(d)
            devices.append({"name": d, "free": min(free, self.mem) if self.mem else free,
                            "total": self.mem or free, "dtype": default_dtype(d)})
        return {"worker_id": self.worker_id, "version": __version__, "devices": devices}

    # -- connections ---------------------------------------------------------------------

    def _serve_connection(self, sock: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        conn = Connection(sock, peer, self.limits)
        try:
            tune(sock)
            sock.settimeout(self.handshake_timeout)
            self._slow_down(addr[0])
            if self._tls_context is not None:
                try:
                    sock = self._tls_context.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as e:
                    log.warning("%s: TLS handshake failed: %s", peer, e)
                    return
                conn = Connection(sock, peer, self.limits)
            try:
                hello = server_handshake(conn, self.token, self.worker_id)
            except AuthError:
                self._note_failure(addr[0])
                conn.send_error("auth", "authentication failed")
                raise
            self._failures.pop(addr[0], None)
            # Coordinators ping every second and upstream workers ping their peer link; a
            # connection silent for this long is half-open.
            sock.settimeout(self.idle_timeout)
            log.info("%s connected as %s", peer, hello.role)
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
            conn.close()
            self._slots.release()
            with self._plan_lock:
                if self._plan is not None and self._plan.coordinator is conn:
                    log.info("coordinator %s is gone; releasing plan %s", peer, self._plan.id)
                    self._release_plan()

    def _slow_down(self, address: str) -> None:
        """After repeated authentication failures from an address, each new attempt waits."""
        count, last = self._failures.get(address, (0, 0.0))
        if count >= 3 and time.monotonic() - last < 600:
            time.sleep(min(2.0 ** (count - 3), 30.0))

    def _note_failure(self, address: str) -> None:
        count, last = self._failures.get(address, (0, 0.0))
        if time.monotonic() - last > 600:
            count = 0
        if len(self._failures) > 10000:
            self._failures.clear()
        self._failures[address] = (count + 1, time.monotonic())

    def _read_loop(self, conn: Connection, role: str) -> None:
        pending: dict = {}

        def payload_into(mtype, header, nbytes):
            if mtype != MessageType.FORWARD:
                return None
            msg = self._check_forward(Forward.parse(header), nbytes)
            tensor = torch.empty(msg.shape, dtype=_TORCH_DTYPES[msg.dtype])
            pending["forward"] = (msg, tensor)
            return tensor.view(torch.uint8).numpy().reshape(-1)

        while True:
            frame = conn.recv(payload_into)
            t = frame.type
            if t == MessageType.FORWARD:
                msg, tensor = pending.pop("forward", (None, None))
                if msg is None:  # a FORWARD without payload
                    raise FrameError("FORWARD without its payload")
                self._enqueue(conn, msg, tensor)
            elif t == MessageType.PING:
                conn.send(MessageType.PONG, {"t": frame.header.get("t", 0)}, request=frame.request)
            elif role != "coordinator":
                raise FrameError(f"a peer may not send {t.name}")
            elif t == MessageType.DESCRIBE:
                conn.send(MessageType.DEVICES, self.describe(), request=frame.request)
            elif t == MessageType.ASSIGN:
                self._assign(conn, Assign.parse(frame.header), frame.request)
            elif t == MessageType.FREE:
                self._free(Free.parse(frame.header).slot)
            elif t == MessageType.RELEASE:
                with self._plan_lock:
                    if self._plan is not None and self._plan.coordinator is conn:
                        self._release_plan()
                conn.send(MessageType.OK, {}, request=frame.request)
            else:
                raise FrameError(f"unexpected {t.name}")

    # -- the data path -------------------------------------------------------------------

    def _check_forward(self, msg: Forward, nbytes: int) -> Forward:
        plan = self._plan
        if plan is None or msg.plan != plan.id:
            raise FrameError(f"FORWARD for plan {msg.plan!r}, which this worker does not hold")
        if nbytes != msg.payload_nbytes():
            raise FrameError(f"FORWARD payload of {nbytes} bytes does not match its shape {msg.shape} {msg.dtype}")
        first = plan.runners[0].spec
        if first.first != (msg.dtype == "int32"):
            raise FrameError("FORWARD: the first stage takes int32 token ids, later stages hidden states")
        if not first.first and msg.shape[2] != plan.config.dim:
            raise FrameError(f"FORWARD: hidden size {msg.shape[2]} is not the model's {plan.config.dim}")
        for slot, start, n in msg.rows:
            if slot >= plan.n_slots:
                raise FrameError(f"FORWARD: slot {slot} is outside the plan's {plan.n_slots} slots")
            if start + n > plan.ctx:
                raise FrameError(f"FORWARD: positions up to {start + n} exceed the context of {plan.ctx}")
            if start > plan.filled[slot]:
                raise FrameError(f"FORWARD: slot {slot} holds {plan.filled[slot]} positions, "
                                 f"a step cannot start at {start}")
        if plan.runners[-1].spec.last:
            for s in msg.sampling:
                if s is not None:
                    try:
                        SamplingParams.from_dict(s)
                    except (TypeError, ValueError) as e:
                        raise FrameError(f"FORWARD: bad sampling parameters: {e}") from None
        for slot, start, n in msg.rows:
            plan.filled[slot] = start + n
        return msg

    def _enqueue(self, conn: Connection, msg: Forward, tensor: torch.Tensor) -> None:
        plan = self._plan
        if plan is None:
            return
        if tensor.dtype == torch.int32 and tensor.numel() and (
                int(tensor.min()) < 0 or int(tensor.max()) >= plan.config.vocab_size):
            # a well-formed frame with a bad request in it: refuse the step, keep the link
            conn.send_error("step", f"worker {self.worker_id}: token ids must be in "
                                    f"[0, {plan.config.vocab_size})", request=msg.step)
            return
        plan.runners[0].queue.put((msg, tensor))

    def _run_stage(self, plan: _Plan, index: int) -> None:
        runner = plan.runners[index]
        while True:
            item = runner.queue.get()
            if item is None:
                return
            msg, x = item
            try:
                slots = [r[0] for r in msg.rows]
                starts = [r[1] for r in msg.rows]
                if x.dtype == torch.int32:
                    x = x.long()
                out = runner.stage(x, slots, starts)
                if index + 1 < len(plan.runners):
                    plan.runners[index + 1].queue.put((msg, out))
                elif plan.next_conn is not None:
                    self._send_next(plan, msg, out)
                else:
                    self._send_result(plan, msg, out)
            except (RuntimeError, ValueError) as e:
                log.error("step %d failed on stage %d: %s", msg.step, runner.spec.index, e)
                plan.coordinator.send_error("step", f"worker {self.worker_id} stage {runner.spec.index}: {e}",
                                            request=msg.step)
            except OSError as e:
                plan.coordinator.send_error("next_hop", f"worker {self.worker_id} cannot reach the next stage "
                                                        f"at {plan.next_address}: {e}", request=msg.step)
            except Exception as e:  # a stage thread must outlive any one step
                log.exception("step %d failed on stage %d", msg.step, runner.spec.index)
                plan.coordinator.send_error("step", f"worker {self.worker_id} stage {runner.spec.index}: "
                                                    f"{type(e).__name__}: {e}", request=msg.step)

    def _send_next(self, plan: _Plan, msg: Forward, out: torch.Tensor) -> None:
        out = out.contiguous()
        if out.device.type != "cpu":
            out = out.cpu()
        wire = Forward(msg.plan, msg.step, msg.rows, msg.sampling, msg.recent,
                       str(out.dtype).removeprefix("torch."), list(out.shape))
        plan.next_conn.send(MessageType.FORWARD, wire.to_header(), out.view(torch.uint8).numpy(),
                            request=msg.step)

    def _send_result(self, plan: _Plan, msg: Forward, logits: torch.Tensor) -> None:
        rows = [Row(slot, start, [0] * n, SamplingParams.from_dict(s) if s is not None else None, recent)
                for (slot, start, n), s, recent in zip(msg.rows, msg.sampling, msg.recent)]
        sampled = sample_rows(logits, rows)
        tokens = [s.token if s is not None else None for s in sampled]
        logprobs = [[s.logprob, [list(t) for t in s.top]] if s is not None and s.logprob is not None else None
                    for s in sampled]
        plan.coordinator.send(MessageType.RESULT, {"step": msg.step, "tokens": tokens, "logprobs": logprobs},
                              request=msg.step)

    def _watch_next(self, plan: _Plan) -> None:
        """Keep the link to the next stage alive and read what comes back on it: PONGs, or an
        error about a frame we sent, which the coordinator must hear about."""
        conn = plan.next_conn

        def ping():
            while not conn.closed and not plan.released.wait(self.idle_timeout / 3):
                try:
                    conn.send(MessageType.PING, {"t": time.monotonic()})
                except OSError:
                    return
        threading.Thread(target=ping, daemon=True, name="next-hop-ping").start()
        while True:
            try:
                frame = conn.recv()
            except RemoteError as e:
                plan.coordinator.send_error("next_hop", f"worker {self.worker_id}: the next stage reports: {e}",
                                            request=e.request)
                continue
            except (OSError, ConnectionError, FrameError) as e:
                if self._plan is plan and not conn.closed:
                    plan.coordinator.send_error("next_hop", f"worker {self.worker_id} lost the next stage at "
                                                            f"{plan.next_address}: {e}")
                return
            if frame.type != MessageType.PONG:
                log.warning("next stage sent an unexpected %s", frame.type.name)

    def _free(self, slot: int) -> None:
        """A sequence left this slot. Its cache needs no clearing: the next sequence starts at
        position 0 and attends only to what it wrote. FREE travels outside the ring and may
        overtake the next sequence's first FORWARD, so it must not touch `filled`."""
        log.debug("slot %d is free", slot)

    # -- plans ---------------------------------------------------------------------------

    def _assign(self, conn: Connection, assign: Assign, request: int) -> None:
        try:
            cfg = ModelConfig.from_dict(assign.config)
            self._validate_assign(assign, cfg)
        except (PlanRejected, ConfigError) as e:
            conn.send_error("plan", f"worker {self.worker_id} rejects the plan: {e}", request=request)
            return
        with self._plan_lock:
            current = self._plan
            if (current is not None and current.coordinator is not conn and not current.coordinator.closed
                    and (not assign.coordinator or assign.coordinator != current.coordinator_id)):
                conn.send_error("busy", f"worker {self.worker_id} is serving another coordinator's plan",
                                request=request)
                return
            self._release_plan()
        sources, kinds, reader = self._gather_weights(conn, assign, request)
        try:
            runners = []
            for spec in assign.stages:
                tensors = {t.name: sources[t.hash] for t in spec.tensors}
                stage = build_stage(cfg, spec.start, spec.end, spec.first, spec.last, tensors, reader.read,
                                    assign.qk_interleaved, torch_device(spec.device), parse_dtype(spec.dtype),
                                    weights=spec.weights)
                stage.allocate_cache(assign.n_slots, assign.ctx)
                runners.append(_Runner(spec, stage))
            next_conn = next_address = None
            if assign.next_host is not None:
                next_address = f"{assign.next_host}:{assign.next_port}"
                tls = self.peer_tls if assign.next_fingerprint else None
                next_conn, _ = connect(assign.next_host, assign.next_port, token=self.token, role="peer",
                                       limits=self.limits, tls=tls, pin=assign.next_fingerprint)
        except (OSError, ValueError, RuntimeError) as e:
            reader.close()
            conn.send_error("load", f"worker {self.worker_id} could not load its stages: {e}", request=request)
            return
        counts = {"file": 0, "cache": 0, "streamed": 0}
        for spec in assign.stages:
            for t in spec.tensors:
                counts[kinds[t.hash]] += t.nbytes
        plan = _Plan(assign.plan, cfg, assign.n_slots, assign.ctx, runners, conn, next_conn, next_address,
                     [0] * assign.n_slots, reader, counts, assign.coordinator)
        for i, runner in enumerate(runners):
            runner.thread = threading.Thread(target=self._run_stage, args=(plan, i), daemon=True,
                                             name=f"stage-{runner.spec.index}")
            runner.thread.start()
        if next_conn is not None:
            threading.Thread(target=self._watch_next, args=(plan,), daemon=True, name="next-hop").start()
        with self._plan_lock:
            self._plan = plan
        self.cache.evict(keep={t.hash for s in assign.stages for t in s.tensors})
        stages = [{"index": r.spec.index, "weight_bytes": sum(p.nbytes for p in r.stage.parameters()),
                   "kv_bytes": r.stage.cache.nbytes} for r in runners]
        conn.send(MessageType.READY, {"stages": stages, "sources": counts}, request=request)
        log.info("plan %s loaded: %s", plan.id, ", ".join(f"stage {r.spec.index} blocks {r.spec.start}-{r.spec.end - 1} "
                                                          f"on {r.spec.device}" for r in runners))

    def _validate_assign(self, assign: Assign, cfg: ModelConfig) -> None:
        for spec in assign.stages:
            if spec.device not in self.devices:
                raise PlanRejected(f"device {spec.device} is not one of this worker's ({', '.join(self.devices)})")
            if spec.end > cfg.n_layers or spec.first != (spec.start == 0) or spec.last != (spec.end == cfg.n_layers):
                raise PlanRejected(f"stage {spec.index} blocks [{spec.start}, {spec.end}) do not fit the model")
            names = {t.name for t in spec.tensors}
            missing = set(required_tensors(cfg, spec.start, spec.end, spec.first, spec.last)) - names
            if missing:
                raise PlanRejected(f"stage {spec.index} lacks tensor {sorted(missing)[0]}")
            for t in spec.tensors:
                self._validate_tensor(cfg, spec, t)
        budget: dict[str, int] = {}
        for spec in assign.stages:
            dtype = parse_dtype(spec.dtype)
            tensors = {t.name: t for t in spec.tensors}
            weights = weight_nbytes(tensors, weight_formats(cfg, tensors, spec.first, spec.last, spec.weights,
                                                            spec.device.split(":")[0], dtype), dtype)
            kv = KVCache.nbytes_for(spec.end - spec.start, assign.n_slots, cfg.n_kv_heads, assign.ctx,
                                    cfg.head_dim, dtype)
            budget[spec.device] = budget.get(spec.device, 0) + weights + kv
        for device, need in budget.items():
            free = free_memory(device)
            have = min(free, self.mem) if self.mem else free
            if need > have:
                raise PlanRejected(f"{device} needs {need / 2**30:.2f} GiB for its stages, has "
                                   f"{have / 2**30:.2f} GiB")

    @staticmethod
    def _validate_tensor(cfg: ModelConfig, spec: StageSpec, t: TensorSpec) -> None:
        expected = expected_shape(cfg, t.name)
        if expected is None:
            raise PlanRejected(f"unknown tensor {t.name}")
        if tuple(t.shape) != expected:
            raise PlanRejected(f"tensor {t.name} has shape {t.shape}, expected {list(expected)}")
        block = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if block is not None and not spec.start <= int(block) < spec.end:
            raise PlanRejected(f"tensor {t.name} is outside stage blocks [{spec.start}, {spec.end})")
        if t.nbytes != stored_nbytes(t.dtype, tuple(t.shape)):
            raise PlanRejected(f"tensor {t.name}: {t.nbytes} bytes do not match {t.dtype} {t.shape}")

    def _gather_weights(self, conn: Connection, assign: Assign, request: int
                        ) -> tuple[dict[str, TensorInfo], dict[str, str], TensorReader]:
        """Find every tensor locally (own model file, then cache) and ask for the rest.
        Returns where each tensor (by hash) is, and which kind of source it came from."""
        reader = TensorReader()
        sources: dict[str, TensorInfo] = {}
        kinds: dict[str, str] = {}
        specs = {t.hash: t for s in assign.stages for t in s.tensors}
        for digest, t in specs.items():
            info = self._own_copy(t, reader)
            kind = "file"
            if info is None:
                path = self.cache.lookup(digest, t.nbytes)
                info = TensorInfo(t.name, t.dtype, tuple(t.shape), path, 0, t.nbytes) if path else None
                kind = "cache"
            if info is not None:
                sources[digest] = info
                kinds[digest] = kind
        needed = sorted(set(specs) - set(sources))
        conn.send(MessageType.NEED, {"hashes": needed}, request=request)
        writers = {}
        try:
            while len(writers) < len(needed) or any(not w.done for w in writers.values()):
                frame = conn.expect(MessageType.WEIGHTS)
                chunk = Weights.parse(frame.header)
                if chunk.hash not in needed or chunk.total != specs[chunk.hash].nbytes:
                    raise FrameError("WEIGHTS for a tensor that was not asked for")
                writer = writers.get(chunk.hash)
                if writer is None:
                    writer = writers[chunk.hash] = self.cache.writer(chunk.hash, chunk.total)
                writer.write(chunk.offset, frame.payload)
                if writer.done:
                    path = writer.finish()
                    t = specs[chunk.hash]
                    sources[chunk.hash] = TensorInfo(t.name, t.dtype, tuple(t.shape), path, 0, t.nbytes)
                    kinds[chunk.hash] = "streamed"
        except BaseException:
            for w in writers.values():
                if not w.done:
                    w.abort()
            raise
        return sources, kinds, reader

    def _own_copy(self, t: TensorSpec, reader: TensorReader) -> TensorInfo | None:
        for path in self._candidates(t.file):
            try:
                if path.stat().st_size != t.file_size:
                    continue
            except OSError:
                continue
            info = TensorInfo(t.name, t.dtype, tuple(t.shape), path, t.offset, t.nbytes)
            if t.offset + t.nbytes <= t.file_size and self.cache.index.hashes([info], reader)[t.name] == t.hash:
                return info
        return None

    def _candidates(self, name: str) -> list[Path]:
        """Files called `name` directly in a model folder or one level down."""
        found = []
        for folder in self.model_dirs:
            if (folder / name).is_file():
                found.append(folder / name)
            try:
                found += [d / name for d in folder.iterdir() if d.is_dir() and (d / name).is_file()]
            except OSError:
                pass
        return found

    def _release_plan(self) -> None:
        with self._plan_lock:
            plan, self._plan = self._plan, None
        if plan is None:
            return
        plan.released.set()
        for runner in plan.runners:
            runner.queue.put(None)
        for runner in plan.runners:
            if runner.thread is not None and runner.thread is not threading.current_thread():
                runner.thread.join(timeout=30)
            runner.stage.cache = None
        if plan.next_conn is not None:
            plan.next_conn.close()
        plan.runners.clear()
        plan.reader.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
