"""The coordinator's view of its workers: connect, describe, plan, assign, ship weights, and
the pipeline that sends steps into the ring and collects sampled tokens from its end."""
from __future__ import annotations

import logging
import re
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .cache import HashIndex, default_cache_dir
from .devices import default_dtype
from .formats import ModelFile, TensorReader
from .pipeline import PipelineError, Step, StepResult
from .plan import Plan, PlanDevice, PlanError, PlannedStage, make_plan
from .sampling import Sampled
from .wire.conn import AuthError, Connection, RemoteError, connect
from .wire.frames import FrameError, MessageType
from .wire.messages import Devices, Need, Result
from .wire.tls import ClientTLS, ServerTLS, TLSError, generate_certificate

log = logging.getLogger("shardwire.cluster")

WEIGHT_CHUNK = 8 << 20


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
class WorkerLink:
    """One worker as the coordinator sees it."""
    name: str  # host:port, or "local" / "local:cpu" for the coordinator's own
    host: str
    port: int
    conn: Connection | None = None
    worker_id: str = ""
    devices: list = field(default_factory=list)
    alive: bool = False
    reader: threading.Thread | None = None
    local: object | None = None  # the in-process Worker behind a local link
    latency_ms: float | None = None  # last heartbeat round trip
    last_pong: float = 0.0
    fingerprint: str | None = None  # its TLS certificate, once verified
    pin: str | None = None  # the certificate a local worker was started with
    lost_since: float | None = None  # when it was lost; None while it is part of the plan or never was

    def drop(self) -> None:
        """Close this link on purpose: its reader reports nothing."""
        self.alive = False
        self.reader = None  # only links serving a loaded plan are watched by the heartbeat
        if self.conn is not None and not self.conn.closed:
            self.conn.close()

    def status(self, stages: list[tuple[int, PlannedStage]]) -> dict:
        return {"name": self.name, "worker_id": self.worker_id, "alive": self.alive,
                "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
                "devices": [{"name": d.name, "free": d.free, "total": d.total} for d in self.devices],
                "stages": [{"index": i, "device": s.device.name, "blocks": [s.start, s.end],
                            "weight_bytes": s.weight_bytes, "kv_bytes": s.kv_bytes} for i, s in stages]}


class Cluster:
    def __init__(self, addresses: list[str], *, token: str | None = None, local_devices: list[str] = (),
                 local_cpu: bool = False, cache_dir: Path | None = None, connect_timeout: float = 10.0,
                 tls: ClientTLS | None = None, show_progress: bool = True):
        self.token, self.tls = token, tls
        self.connect_timeout = connect_timeout
        self.cache_dir = cache_dir or default_cache_dir()
        self.show_progress = show_progress
        self.links = [WorkerLink(a, *parse_address(a)) for a in addresses]
        self._local_devices, self._local_cpu = list(local_devices), local_cpu
        self.model: ModelFile | None = None
        self.plan: Plan | None = None
        self.plan_id = ""
        self.pipeline: RemotePipeline | None = None
        self.load_stats: dict = {}
        self.heartbeat_interval = 1.0
        self.dead_after = 5.0  # seconds without a PONG before a worker counts as gone
        self.stall_timeout = 30.0  # seconds without any step result while steps are in flight
        self.recovery_timeout = 60.0  # how long recovery waits for lost capacity to come back
        self.events: list[dict] = []  # recoveries and re-admissions, for the status endpoint
        self.rebalance_due = False  # a lost worker answers again
        self._plan_options: dict = {}
        self._last_probe = 0.0
        self._id = uuid.uuid4().hex[:12]
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # -- connecting ----------------------------------------------------------------------

    def _start_local(self, name: str, devices: list[str], model: ModelFile) -> WorkerLink:
        from .worker import Worker  # the coordinator runs its own stages as an in-process worker
        folder = model.path.parent
        server_tls = pin = None
        if self.tls is not None:
            # Local stages reach remote workers as peers: they speak TLS too, with the
            # coordinator's own certificate when it has one, else a throwaway one.
            if self.tls.cert is not None:
                server_tls = ServerTLS(self.tls.cert, self.tls.key, self.tls.ca)
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="shardwire-tls-")
                cert, key, _ = generate_certificate(Path(self._tmp.name), ["127.0.0.1"], name=name.replace(":", "-"))
                server_tls = ServerTLS(cert, key)
            pin = server_tls.fingerprint()
        # Local stages share the cluster's token: remote workers must accept them as peers.
        worker = Worker(host="127.0.0.1", port=0, devices=devices, token=self.token,
                        cache_dir=self.cache_dir, model_dirs=[folder], tls=server_tls)
        port = worker.bind()
        worker.start()
        return WorkerLink(name, "127.0.0.1", port, local=worker, pin=pin)

    def connect(self, model: ModelFile) -> None:
        """Reach every worker and learn its devices; a worker that cannot be reached is an error
        naming it."""
        self.model = model
        if self._local_cpu and not any(l.name == "local:cpu" for l in self.links):
            self.links.insert(0, self._start_local("local:cpu", ["cpu"], model))
        if self._local_devices and not any(l.name == "local" for l in self.links):
            self.links.append(self._start_local("local", self._local_devices, model))
        for link in self.links:
            self._connect_link(link)

    def _connect_link(self, link: WorkerLink, timeout: float | None = None) -> None:
        try:
            tls = self.tls
            if tls is not None and link.local is not None:  # our own certificate: trust exactly it
                tls = ClientTLS(pins={link.pin}, cert=tls.cert, key=tls.key)
            conn, challenge = connect(link.host, link.port, token=self.token, tls=tls, pin=link.pin,
                                      timeout=timeout or self.connect_timeout)
        except AuthError as e:
            raise AuthError(f"worker {link.name} refused: {e}") from None
        except TLSError as e:
            raise TLSError(f"worker {link.name} is not trusted: {e}") from None
        except (OSError, ConnectionError) as e:
            raise ConnectionError(f"worker {link.name} is unreachable: {e}") from None
        link.conn, link.worker_id, link.fingerprint = conn, challenge.worker_id, conn.fingerprint
        conn.send(MessageType.DESCRIBE)
        link.devices = Devices.parse(conn.expect(MessageType.DEVICES).header).devices
        link.alive = True

    # -- planning ------------------------------------------------------------------------

    def plan_devices(self, dtype: str | None, links: list[WorkerLink] | None = None
                     ) -> tuple[list[PlanDevice], PlanDevice | None]:
        devices, cpu = [], None
        for link in self.links if links is None else links:
            for d in link.devices:
                pd = PlanDevice(link.name, d.name, d.free, dtype or d.dtype or default_dtype(d.name))
                if link.name == "local:cpu":
                    cpu = pd
                else:
                    devices.append(pd)
        return devices, cpu

    def make_plan(self, *, tensor_split=None, n_gpu_layers=None, n_slots=1, ctx=4096,
                  dtype: str | None = None, prefill_chunk: int = 512, weights: str = "dequant") -> Plan:
        self._plan_options = dict(tensor_split=tensor_split, n_gpu_layers=n_gpu_layers, n_slots=n_slots, ctx=ctx,
                                  dtype=dtype, prefill_chunk=prefill_chunk, weights=weights)
        return self._plan_on(self.links)

    def _plan_on(self, links: list[WorkerLink]) -> Plan:
        """A plan with the options of the first one, on the given workers. A --tensor-split
        that named more devices than are left falls back to splitting by free memory."""
        o = self._plan_options
        devices, cpu = self.plan_devices(o["dtype"], links)
        split = o["tensor_split"]
        if split is not None and len(split) > len(devices):
            split = None
        return make_plan(self.model, devices, cpu=cpu, tensor_split=split, n_gpu_layers=o["n_gpu_layers"],
                         n_slots=o["n_slots"], ctx=o["ctx"], prefill_chunk=o["prefill_chunk"], weights=o["weights"])

    # -- loading -------------------------------------------------------------------------

    def load(self, plan: Plan, pipeline: "RemotePipeline | None" = None) -> "RemotePipeline":
        """Assign every worker its stages, ship the weights it lacks, wait until all are ready.
        A given `pipeline` (one that broke) is pointed at the newly loaded stages."""
        plan.check_fits()
        self.plan, self.plan_id = plan, uuid.uuid4().hex[:16]
        model = self.model
        reader = TensorReader()
        try:
            names = {n for s in plan.stages for n in model.stage_tensors(s.start, s.end, s.first, s.last)}
            hashes = HashIndex(self.cache_dir).hashes([model.tensors[n] for n in sorted(names)], reader)
            groups = self._stages_by_worker(plan)
            stats = {"file": 0, "cache": 0, "streamed": 0}
            for i, (link, stages) in enumerate(groups):
                nxt = groups[i + 1][0] if i + 1 < len(groups) else None
                ready = self._assign(link, stages, nxt, hashes, reader)
                for kind, n in ready.get("sources", {}).items():
                    stats[kind] = stats.get(kind, 0) + n
            self.load_stats = stats
        finally:
            reader.close()
        if pipeline is None:
            pipeline = RemotePipeline(self)
        pipeline.attach(groups[0][0], groups[-1][0], plan, self.plan_id)
        self.pipeline = pipeline
        for link, _ in groups:
            self._start_reader(link, pipeline)
        if self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, daemon=True, name="heartbeat")
            self._heartbeat_thread.start()
        return pipeline

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            self.heartbeat()

    def _stages_by_worker(self, plan: Plan) -> list[tuple[WorkerLink, list[tuple[int, PlannedStage]]]]:
        by_name = {l.name: l for l in self.links}
        groups: list[tuple[WorkerLink, list]] = []
        for i, stage in enumerate(plan.stages):
            link = by_name[stage.device.worker]
            if groups and groups[-1][0] is link:
                groups[-1][1].append((i, stage))
            else:
                groups.append((link, [(i, stage)]))
        return groups

    def _assign(self, link: WorkerLink, stages, nxt: WorkerLink | None, hashes: dict[str, str],
                reader: TensorReader) -> dict:
        model = self.model
        specs = []
        for index, stage in stages:
            tensors = []
            for name, info in model.stage_tensors(stage.start, stage.end, stage.first, stage.last).items():
                tensors.append({"name": name, "dtype": info.dtype, "shape": list(info.shape),
                                "nbytes": info.nbytes, "hash": hashes[name], "file": info.path.name,
                                "file_size": info.path.stat().st_size, "offset": info.offset})
            specs.append({"index": index, "device": stage.device.name, "start": stage.start, "end": stage.end,
                          "first": stage.first, "last": stage.last, "dtype": stage.device.dtype,
                          "weights": stage.weights,
                          "tensors": tensors})
        header = {"plan": self.plan_id, "coordinator": self._id, "config": model.config.to_dict(),
                  "qk_interleaved": model.qk_interleaved,
                  "n_slots": self.plan.n_slots, "ctx": self.plan.ctx, "stages": specs,
                  "next": None if nxt is None else {"host": nxt.host, "port": nxt.port,
                                                    "fingerprint": nxt.fingerprint}}
        conn = link.conn
        try:
            conn.send(MessageType.ASSIGN, header)
            need = Need.parse(conn.expect(MessageType.NEED).header)
            by_hash = {}
            for s in specs:
                for t in s["tensors"]:
                    by_hash[t["hash"]] = model.tensors[t["name"]]
            total = sum(by_hash[h].nbytes for h in need.hashes if h in by_hash)
            with _progress(self.show_progress and total > 0, f"sending weights to {link.name}", total) as bar:
                for digest in need.hashes:
                    if digest not in by_hash:
                        raise FrameError(f"worker {link.name} asked for weights it was not assigned")
                    data = reader.read(by_hash[digest])
                    for offset in range(0, len(data), WEIGHT_CHUNK):
                        chunk = data[offset:offset + WEIGHT_CHUNK]
                        conn.send(MessageType.WEIGHTS, {"hash": digest, "offset": offset, "total": len(data)}, chunk)
                        bar(len(chunk))
            return conn.expect(MessageType.READY).header
        except RemoteError as e:
            raise PipelineError(str(e), link.name) from None
        except (OSError, ConnectionError) as e:
            raise PipelineError(f"worker {link.name} failed while loading: {e}", link.name) from None

    # -- running -------------------------------------------------------------------------

    def _start_reader(self, link: WorkerLink, pipeline: "RemotePipeline") -> None:
        link.last_pong = time.monotonic()

        def run():
            while True:
                try:
                    frame = link.conn.recv()
                except RemoteError as e:
                    if e.code in ("step", "next_hop"):  # one step failed; the worker carries on
                        pipeline._on_step_error(e, link)
                        continue
                    pipeline._on_link_lost(link, str(e))
                    return
                except (OSError, ConnectionError, FrameError) as e:
                    pipeline._on_link_lost(link, f"worker {link.name} is gone ({e})")
                    return
                if frame.type == MessageType.RESULT:
                    pipeline._on_result(Result.parse(frame.header))
                elif frame.type == MessageType.PONG:
                    sent = frame.header.get("t")
                    link.last_pong = time.monotonic()
                    if isinstance(sent, float):
                        link.latency_ms = (link.last_pong - sent) * 1000
                elif frame.type != MessageType.OK:
                    pipeline._on_link_lost(link, f"worker {link.name} sent an unexpected {frame.type.name}")
                    return
        link.reader = threading.Thread(target=run, daemon=True, name=f"link-{link.name}")
        link.reader.start()

    def heartbeat(self) -> None:
        """Ping every live worker (their PONGs update each link's latency); declare gone a worker
        that stopped answering, and the pipeline stalled if steps stopped coming back; look
        for lost workers that answer again."""
        now = time.monotonic()
        pipeline = self.pipeline
        for link in self.links:
            if not (link.alive and link.reader is not None):
                continue
            if now - link.last_pong > self.dead_after and pipeline is not None:
                pipeline._on_link_lost(link, f"worker {link.name} stopped answering "
                                             f"(no heartbeat for {now - link.last_pong:.1f} s)")
                link.drop()
                continue
            try:
                link.conn.send(MessageType.PING, {"t": now})
            except OSError:
                pass
        if pipeline is not None and pipeline.broken is None:
            stalled = pipeline.stalled_for(now)
            if stalled > self.stall_timeout:
                pipeline._break(f"no step result for {stalled:.1f} s: a link between workers may have stopped "
                                "carrying data")
        lost = [l for l in self.links if l.lost_since is not None and now - l.lost_since > 1.0]
        if (lost and pipeline is not None and pipeline.broken is None and not self.rebalance_due
                and now - self._last_probe > 2.0):
            self._last_probe = now
            link = lost[int(now) % len(lost)]  # one probe per round, so a black hole cannot stall pings
            if self._answers(link):
                log.info("worker %s answers again; the plan will move stages back onto it", link.name)
                self.rebalance_due = True
                pipeline.on_wake()

    def _answers(self, link: WorkerLink) -> bool:
        try:
            conn, _ = connect(link.host, link.port, token=self.token, timeout=1.0, tls=self.tls, pin=link.pin)
        except (OSError, ConnectionError):
            return False
        conn.close()
        return True

    def add_worker(self, address: str) -> None:
        """Admit a new worker: the next rebalance may place stages on it."""
        if any(l.name == address for l in self.links):
            return
        link = WorkerLink(address, *parse_address(address))
        link.lost_since = time.monotonic() - 2.0
        self.links.append(link)

    def recover(self, reason: str) -> dict:
        """After a failure (or to rebalance): reconnect to every worker that answers, plan over
        them and load. When what answers cannot hold the model, keep trying until
        recovery_timeout, then raise PipelineError naming what is lost and missing."""
        start = time.monotonic()
        lost = [l.name for l in self.links if not l.alive or l.lost_since is not None]
        deadline = start + self.recovery_timeout
        log.warning("recovering: %s", reason)
        while True:
            for link in self.links:
                link.drop()
            for link in self.links:
                try:
                    # a worker that cannot answer within dead_after now would be declared gone anyway
                    self._connect_link(link, timeout=self.dead_after)
                    link.lost_since = None
                except (OSError, ConnectionError):
                    link.lost_since = link.lost_since or start
            live = [l for l in self.links if l.alive]
            try:
                plan = self._plan_on(live)
                plan.check_fits()
                self.load(plan, self.pipeline)
                break
            except (PlanError, PipelineError) as e:
                error = e
            if time.monotonic() >= deadline:
                missing = [l.name for l in self.links if not l.alive]
                event = {"at": time.time(), "reason": reason, "lost": missing, "recovered": False,
                         "seconds": round(time.monotonic() - start, 3), "error": str(error)}
                self.events.append(event)
                raise PipelineError(f"could not recover within {self.recovery_timeout:.0f} s after: {reason}. "
                                    f"Lost: {', '.join(missing) or 'none'}. {error}",
                                    missing[0] if missing else None)
            time.sleep(1.0)
        self.rebalance_due = False
        event = {"at": time.time(), "reason": reason, "lost": lost, "recovered": True,
                 "seconds": round(time.monotonic() - start, 3), "replayed_tokens": 0,
                 "plan": [[s.device.label, s.start, s.end] for s in plan.stages]}
        self.events.append(event)
        log.warning("recovered in %.2f s on %d stage(s): %s", event["seconds"], len(plan.stages),
                    ", ".join(f"{w} blocks {a}-{b - 1}" for w, a, b in event["plan"]))
        return event

    def status(self) -> dict:
        """Workers, their devices, the blocks each holds, memory and last measured latency."""
        groups = {l.name: stages for l, stages in self._stages_by_worker(self.plan)} if self.plan else {}
        return {"plan": self.plan_id, "ready": self.pipeline is not None and self.pipeline.broken is None,
                "broken": None if self.pipeline is None else self.pipeline.broken,
                "load": self.load_stats, "recoveries": self.events[-20:],
                "workers": [l.status(groups.get(l.name, [])) for l in self.links]}

    def close(self) -> None:
        self._stop.set()
        if self.pipeline is not None:
            self.pipeline.broken = self.pipeline.broken or "the coordinator closed its cluster"
        for link in self.links:
            if link.alive:
                try:
                    link.conn.send(MessageType.RELEASE)
                except OSError:
                    pass
            link.drop()
            if link.local is not None:
                link.local.close()


class RemotePipeline:
    """Steps go to the first stage's worker; sampled tokens come back from the last one's."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.on_result = lambda result: None
        self.on_wake = lambda: None  # called when the pipeline breaks or wants rebalancing
        self._in_flight: dict[int, Step] = {}
        self._lock = threading.Lock()
        self._last_progress = time.monotonic()
        self.broken: str | None = None

    def attach(self, first: WorkerLink, last: WorkerLink, plan: Plan, plan_id: str) -> None:
        self.first, self.last, self.plan_id = first, last, plan_id
        self.n_slots, self.ctx, self.n_stages = plan.n_slots, plan.ctx, len(plan.stages)
        self.vocab_size = self.cluster.model.config.vocab_size
        self.broken = None

    @property
    def rebalance_due(self) -> bool:
        return self.cluster.rebalance_due

    def recover(self) -> dict:
        """Bring the pipeline back on whatever capacity answers (see Cluster.recover), or raise."""
        return self.cluster.recover(self.broken or "rebalancing onto a worker that is back")

    def stalled_for(self, now: float) -> float:
        with self._lock:
            return now - self._last_progress if self._in_flight else 0.0

    def _break(self, message: str, worker: str | None = None) -> None:
        """Give up on every step in flight; recovery starts from scratch."""
        if self.broken is None:
            self.broken = message
            log.error("%s", message)
        with self._lock:
            failed = list(self._in_flight)
            self._in_flight.clear()
        for step_id in failed:
            self.on_result(StepResult(step_id, error=PipelineError(message, worker)))
        self.on_wake()

    def submit(self, step: Step) -> None:
        if self.broken is not None:
            raise PipelineError(self.broken)
        header = {"plan": self.plan_id, "step": step.id,
                  "rows": [[r.slot, r.start, len(r.tokens)] for r in step.rows],
                  "sampling": [r.sampling.to_dict() if r.sampling is not None else None for r in step.rows],
                  "recent": [r.recent for r in step.rows],
                  "dtype": "int32", "shape": [len(step.rows), step.width]}
        payload = np.array([r.tokens for r in step.rows], dtype=np.int32)
        with self._lock:
            if not self._in_flight:
                self._last_progress = time.monotonic()
            self._in_flight[step.id] = step
        try:
            self.first.conn.send(MessageType.FORWARD, header, payload, request=step.id)
        except OSError as e:
            self._on_link_lost(self.first, f"worker {self.first.name} is gone ({e})")

    def free(self, slot: int) -> None:
        if self.broken is not None:
            return
        for link in self.cluster.links:
            if link.alive:
                try:
                    link.conn.send(MessageType.FREE, {"slot": slot})
                except OSError:
                    pass

    def _on_result(self, result: Result) -> None:
        with self._lock:
            step = self._in_flight.pop(result.step, None)
            self._last_progress = time.monotonic()
        if step is None:
            return
        sampled = []
        for token, lp in zip(result.tokens, result.logprobs):
            if token is None:
                sampled.append(None)
            elif lp is None:
                sampled.append(Sampled(token))
            else:
                sampled.append(Sampled(token, lp[0], [tuple(t) for t in lp[1]]))
        self.on_result(StepResult(step.id, sampled))

    def _on_step_error(self, error: RemoteError, link: WorkerLink) -> None:
        with self._lock:
            step = self._in_flight.pop(error.request, None)
        if step is not None:
            self.on_result(StepResult(step.id, error=PipelineError(str(error), link.name)))

    def _on_link_lost(self, link: WorkerLink, message: str) -> None:
        if not link.alive:
            return  # closed on purpose, or already reported
        link.alive = False
        link.lost_since = time.monotonic()
        self._break(message, link.name)

    def close(self) -> None:
        self.cluster.close()


class _progress:
    """A rich progress bar on stderr, or nothing; used as `with _progress(...) as advance:`."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total
        self._progress = None

    def __enter__(self):
        if not self.enabled or not sys.stderr.isatty():
            return lambda n: None
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
        self._progress.start()
        task = self._progress.add_task(self.label, total=self.total)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False

