"""The coordinator's cluster: reach the workers and learn their devices, plan over them, load the
plan (each worker its stages, then a RemotePipeline over them), and recover from a lost worker
by planning again over whatever answers."""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..devices import stored_precision_dtype
from ..formats import ModelFile, TensorReader
from ..pipeline import PipelineError
from ..pipeline.plan import Plan, PlanDevice, PlanError, PlannedStage, make_plan
from ..weights.cache import HashIndex, default_cache_dir
from ..wire.conn import AuthError, connect
from ..wire.messages import Assign, Describe, Devices, Release
from ..wire.tls import TRUST_ON_FIRST_USE, ClientTLS, ServerTLS, TLSError, generate_certificate
from .health import Heartbeat
from .links import WorkerLink
from .remote import RemotePipeline
from .shipping import assign_and_ship, next_hop, stage_specs

log = logging.getLogger("shardwire.cluster")


class Cluster:
    def __init__(
        self,
        addresses: list[str],
        *,
        token: str | None = None,
        local_devices: list[str] = (),
        local_cpu: bool = False,
        cache_dir: Path | None = None,
        connect_timeout: float = 10.0,
        tls: ClientTLS | None = TRUST_ON_FIRST_USE,
        show_progress: bool = True,
    ):
        self.token, self.tls = token, tls
        self.connect_timeout = connect_timeout
        self.cache_dir = cache_dir or default_cache_dir()
        self.show_progress = show_progress
        self.links = [WorkerLink.at(a) for a in addresses]
        self._local_devices, self._local_cpu = list(local_devices), local_cpu
        self.model: ModelFile | None = None
        self.plan: Plan | None = None
        self.plan_id = ""
        self.pipeline: RemotePipeline | None = None
        self.load_stats: dict = {}
        self.stage_choices: dict[int, list[str]] = {}  # what each stage's start chose by measuring (READY)
        self.heartbeat = Heartbeat(lambda: self.links, self._answers)
        self.recovery_timeout = 60.0  # how long recovery waits for lost capacity to come back
        self.events: list[dict] = []  # recoveries and re-admissions, for the status endpoint
        self._recovering: list[str] | None = None  # while a recovery runs: the workers it started with lost
        self._plan_options: dict = {}
        self._id = uuid.uuid4().hex[:12]
        self._tls_dir: tempfile.TemporaryDirectory | None = None

    # -- connecting ----------------------------------------------------------------------

    def _start_local(self, name: str, devices: list[str], model: ModelFile) -> WorkerLink:
        from ..worker import Worker  # the coordinator runs its own stages as an in-process worker

        server_tls = pin = None
        if self.tls is not None:
            # Local stages reach remote workers as peers: they speak TLS too, with the
            # coordinator's own certificate when it has one, else a throwaway one.
            if self.tls.cert is not None:
                server_tls = ServerTLS(self.tls.cert, self.tls.key, self.tls.ca)
            else:  # one folder for every local stage's certificate, kept as long as the cluster
                self._tls_dir = self._tls_dir or tempfile.TemporaryDirectory(prefix="shardwire-tls-")
                cert, key, _ = generate_certificate(
                    Path(self._tls_dir.name), ["127.0.0.1"], name=name.replace(":", "-")
                )
                server_tls = ServerTLS(cert, key)
            pin = server_tls.fingerprint()
        # Local stages share the cluster's token: remote workers must accept them as peers.
        worker = Worker(
            host="127.0.0.1",
            port=0,
            devices=devices,
            token=self.token,
            cache_dir=self.cache_dir,
            model_dirs=[model.path.parent],
            tls=server_tls,
        )
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
            conn, challenge = connect(
                link.host, link.port, token=self.token, tls=tls, pin=link.pin, timeout=timeout or self.connect_timeout
            )
        except AuthError as e:
            raise AuthError(f"worker {link.name} refused: {e}") from None
        except TLSError as e:
            raise TLSError(f"worker {link.name} is not trusted: {e}") from None
        except (OSError, ConnectionError) as e:
            raise ConnectionError(f"worker {link.name} is unreachable: {e}") from None
        link.conn, link.worker_id, link.fingerprint = conn, challenge.worker_id, conn.fingerprint
        conn.send(Describe())
        link.devices = conn.expect(Devices).devices
        link.alive = True

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
        link = WorkerLink.at(address)
        link.lost_since = time.monotonic() - 2.0
        self.links.append(link)

    # -- planning ------------------------------------------------------------------------

    def plan_devices(
        self, dtype: str | None, links: list[WorkerLink] | None = None
    ) -> tuple[list[PlanDevice], PlanDevice | None]:
        devices, cpu = [], None
        for link in self.links if links is None else links:
            for d in link.devices:
                own = stored_precision_dtype(d.dtype, d.name, self.model and self.model.matrix_type)
                pd = PlanDevice(
                    link.name, d.name, d.free, dtype or own, d.kernels, d.fastest, d.products, d.row_products, d.compute
                )
                if link.name == "local:cpu":
                    cpu = pd
                else:
                    devices.append(pd)
        return devices, cpu

    def make_plan(
        self,
        *,
        tensor_split=None,
        n_gpu_layers=None,
        n_slots=1,
        ctx=4096,
        dtype: str | None = None,
        prefill_chunk: int = 512,
        weights: str = "dequant",
        overrides: list[tuple[str, str]] = (),
        kv_tokens: int | None = None,
        swa_full: bool = False,
    ) -> Plan:
        self._plan_options = dict(
            overrides=list(overrides),
            tensor_split=tensor_split,
            n_gpu_layers=n_gpu_layers,
            n_slots=n_slots,
            ctx=ctx,
            dtype=dtype,
            prefill_chunk=prefill_chunk,
            weights=weights,
            kv_tokens=kv_tokens,
            swa_full=swa_full,
        )
        return self._plan_on(self.links)

    def _plan_on(self, links: list[WorkerLink]) -> Plan:
        """A plan with the options of the first one, on the given workers. A --tensor-split
        that named more devices than are left falls back to splitting by free memory."""
        o = self._plan_options
        devices, cpu = self.plan_devices(o["dtype"], links)
        split = o["tensor_split"]
        if split is not None and len(split) > len(devices):
            split = None
        return make_plan(
            self.model,
            devices,
            cpu=cpu,
            tensor_split=split,
            n_gpu_layers=o["n_gpu_layers"],
            n_slots=o["n_slots"],
            ctx=o["ctx"],
            prefill_chunk=o["prefill_chunk"],
            weights=o["weights"],
            overrides=o["overrides"],
            kv_tokens=o["kv_tokens"],
            swa_full=o["swa_full"],
        )

    # -- loading -------------------------------------------------------------------------

    def load(self, plan: Plan) -> RemotePipeline:
        """Assign every worker its stages, ship the weights it lacks, wait until all are ready.
        After a recovery the same pipeline is pointed at the newly loaded stages."""
        plan.check_fits()
        self.plan, self.plan_id = plan, uuid.uuid4().hex[:16]
        model = self.model
        groups = self._stages_by_worker(plan)
        reader = TensorReader()
        try:
            names = {n for s in plan.stages for n in model.stage_tensors(s.start, s.end, s.first, s.last)}
            hashes = HashIndex(self.cache_dir).hashes([model.tensors[n] for n in sorted(names)], reader)
            stats: dict[str, int] = {}
            self.stage_choices = {}
            for i, (link, stages) in enumerate(groups):
                assign = Assign(
                    self.plan_id,
                    self._id,
                    model.config.to_dict(),
                    model.qk_interleaved,
                    plan.n_slots,
                    plan.ctx,
                    plan.prefill_chunk,
                    plan.kv_pages,
                    stage_specs(model, stages, hashes),
                    next_hop(groups[i + 1][0] if i + 1 < len(groups) else None),
                    plan.window_step,
                )
                ready = assign_and_ship(link, assign, model, reader, self.show_progress)
                self.stage_choices.update((report.index, report.choices) for report in ready.stages)
                for kind, n in ready.sources.items():
                    stats[kind] = stats.get(kind, 0) + n
            self.load_stats = stats
        finally:
            reader.close()
        if self.pipeline is None:
            self.pipeline = RemotePipeline(recover=self.recover, status=self.status, close=self.close)
        self.pipeline.attach(
            [link for link, _ in groups],
            self.plan_id,
            plan.n_slots,
            plan.ctx,
            plan.kv_pages,
            len(plan.stages),
            model.config.vocab_size,
            recurrent=bool(model.config.linear_blocks),
            ring_step=plan.ring_step(model.config),
        )
        for link, _ in groups:
            link.start_reader(self.pipeline.events)
        self.heartbeat.pipeline = self.pipeline
        self.heartbeat.start()
        return self.pipeline

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

    # -- recovering ----------------------------------------------------------------------

    def _reconnect(self, link: WorkerLink, timeout: float, lost_at: float) -> None:
        try:
            self._connect_link(link, timeout=timeout)
            link.lost_since = None
        except (OSError, ConnectionError):
            link.lost_since = link.lost_since or lost_at

    def recover(self, reason: str) -> dict:
        """After a failure (or to rebalance): reconnect to every worker that answers, plan over
        them and load. When what answers cannot hold the model, keep trying until
        recovery_timeout, then raise PipelineError naming what is lost and missing."""
        start = time.monotonic()
        lost = [l.name for l in self.links if not l.alive or l.lost_since is not None]
        deadline = start + self.recovery_timeout
        log.warning("recovering: %s", reason)
        self._recovering = lost
        try:
            return self._recover(reason, start, lost, deadline)
        finally:
            self._recovering = None

    def _recover(self, reason: str, start: float, lost: list[str], deadline: float) -> dict:
        first_pass = True
        while True:
            for link in self.links:
                link.drop()

            # All at once, and on the first pass the workers already counted lost get a second:
            # one frozen or behind a dead route would hold recovery for the whole connect timeout.
            # One left out is probed by the heartbeat, and the plan moves back when it answers.
            timeouts = [1.0 if first_pass and l.name in lost else self.heartbeat.dead_after for l in self.links]
            with ThreadPoolExecutor(max(1, len(self.links))) as pool:
                list(pool.map(self._reconnect, self.links, timeouts, [start] * len(self.links)))
            first_pass = False
            live = [l for l in self.links if l.alive]
            try:
                plan = self._plan_on(live)
                plan.check_fits()
                self.load(plan)
                break
            except (PlanError, PipelineError) as e:
                error = e
            if time.monotonic() >= deadline:
                missing = [l.name for l in self.links if not l.alive]
                self.events.append(
                    {
                        "at": time.time(),
                        "reason": reason,
                        "lost": missing,
                        "recovered": False,
                        "seconds": round(time.monotonic() - start, 3),
                        "error": str(error),
                    }
                )
                raise PipelineError(
                    f"could not recover within {self.recovery_timeout:.0f} s after: {reason}. "
                    f"Lost: {', '.join(missing) or 'none'}. {error}",
                    missing[0] if missing else None,
                )
            time.sleep(1.0)
        event = {
            "at": time.time(),
            "reason": reason,
            "lost": lost,
            "recovered": True,
            "seconds": round(time.monotonic() - start, 3),
            "replayed_tokens": 0,
            "plan": [[s.device.label, s.start, s.end] for s in plan.stages],
        }
        self.events.append(event)
        log.warning(
            "recovered in %.2f s on %d stage(s): %s",
            event["seconds"],
            len(plan.stages),
            ", ".join(f"{w} blocks {a}-{b - 1}" for w, a, b in event["plan"]),
        )
        return event

    # -- status and shutdown -------------------------------------------------------------

    def status(self) -> dict:
        """Workers, their devices, the blocks each holds, memory and last measured latency."""
        groups = {l.name: stages for l, stages in self._stages_by_worker(self.plan)} if self.plan else {}
        return {
            "plan": self.plan_id,
            "ready": self.pipeline is not None and self.pipeline.broken is None,
            "broken": None if self.pipeline is None else self.pipeline.broken,
            "load": self.load_stats,
            "recoveries": self.events[-20:],
            "workers": [l.status(groups.get(l.name, []), self._state(l, groups)) for l in self.links],
        }

    def _state(self, link: WorkerLink, groups: dict) -> str:
        """healthy | recovering | lost | rejoined (back in the plan after being lost) | idle (no stage)."""
        if self._recovering is not None:
            return "lost" if link.name in self._recovering else "recovering"
        if not link.alive or link.lost_since is not None:
            return "lost"
        if not groups.get(link.name):
            return "idle"
        return "rejoined" if any(link.name in e.get("lost", ()) for e in self.events) else "healthy"

    def wire_bytes(self) -> int:
        """Bytes on the coordinator's own connections; worker-to-worker traffic is not seen here."""
        return sum(l.conn.bytes_sent + l.conn.bytes_received for l in self.links if l.conn is not None)

    def close(self) -> None:
        self.heartbeat.stop()
        if self.pipeline is not None:
            self.pipeline.broken = self.pipeline.broken or "the coordinator closed its cluster"
        for link in self.links:
            if link.alive:
                try:
                    link.conn.send(Release())
                except OSError:
                    pass
            link.drop()
            if link.local is not None:
                link.local.close()
