"""An ASSIGN on a worker: check it against the model and this worker's devices and memory,
build its stages from the weights found, and link them to the next stage's worker."""

from __future__ import annotations

from ..config import ModelConfig
from ..devices import free_memory, parse_dtype, torch_device
from ..formats import expected_shape, required_tensors
from ..pipeline.loading import Placement, build_stage
from ..pipeline.plan import PlanDevice, PlannedStage, gib, stage_cost
from ..weights.codecs import stored_nbytes
from ..weights.kernels import kernels_on
from ..wire.conn import Connection, connect
from ..wire.frames import Limits
from ..wire.messages import Assign, StageSpec, TensorSpec
from ..wire.tls import ClientTLS
from .ring import Ring, StageRunner
from .weights import FoundWeights


class PlanRejected(ValueError):
    """An ASSIGN this worker cannot take: wrong device, too big, inconsistent tensors."""


def check_assign(assign: Assign, cfg: ModelConfig, devices: list[str], mem: int | None) -> None:
    """Every stage on a device of this worker, with the tensors its blocks need in the shapes the
    model says, and all of it within each device's memory as the plan counts it."""
    need: dict[str, int] = {}
    for spec in assign.stages:
        if spec.device not in devices:
            raise PlanRejected(f"device {spec.device} is not one of this worker's ({', '.join(devices)})")
        if spec.end > cfg.n_layers or spec.first != (spec.start == 0) or spec.last != (spec.end == cfg.n_layers):
            raise PlanRejected(f"stage {spec.index} blocks [{spec.start}, {spec.end}) do not fit the model")
        missing = set(required_tensors(cfg, spec.start, spec.end, spec.first, spec.last)) - {
            t.name for t in spec.tensors
        }
        if missing:
            raise PlanRejected(f"stage {spec.index} lacks tensor {sorted(missing)[0]}")
        for t in spec.tensors:
            _check_tensor(cfg, spec, t)
        for o in spec.overrides:
            if o.device not in devices:
                raise PlanRejected(
                    f"--override-tensor device {o.device} is not one of this worker's ({', '.join(devices)})"
                )
        planned = PlannedStage(
            _plan_device(spec.device, spec.dtype, spec.fastest), spec.start, spec.end, spec.first, spec.last
        )
        planned.overrides = tuple((o.pattern, _plan_device(o.device, o.dtype, o.fastest)) for o in spec.overrides)
        tensors = {t.name: t for t in spec.tensors}
        cost = stage_cost(
            cfg,
            tensors,
            planned,
            spec.weights,
            assign.n_slots,
            assign.kv_pages,
            assign.prefill_chunk,
            assign.window_step,
        )
        need[spec.device] = need.get(spec.device, 0) + cost.total_bytes
        for device, n in cost.elsewhere.items():
            need[device.name] = need.get(device.name, 0) + n
    for device, n in need.items():
        free = free_memory(device)
        have = min(free, mem) if mem else free
        if n > have:
            raise PlanRejected(f"{device} needs {gib(n)} for its stages, has {gib(have)}")


def _plan_device(name: str, dtype: str, fastest: dict[str, str]) -> PlanDevice:
    return PlanDevice("", name, 0, dtype, kernels_on(torch_device(name)), fastest)


def _check_tensor(cfg: ModelConfig, spec: StageSpec, t: TensorSpec) -> None:
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


def build_ring(
    assign: Assign,
    cfg: ModelConfig,
    found: FoundWeights,
    coordinator: Connection,
    *,
    worker_id: str,
    token: str | None,
    limits: Limits,
    peer_tls: ClientTLS,
    idle_timeout: float,
) -> Ring:
    """Load every stage of the plan and connect to the next stage's worker; raises OSError,
    ValueError or RuntimeError when that cannot be done."""
    runners = []
    for spec in assign.stages:
        tensors = {t.name: found.infos[t.hash] for t in spec.tensors}
        stage = build_stage(
            cfg,
            spec.start,
            spec.end,
            spec.first,
            spec.last,
            tensors,
            found.reader.read,
            assign.qk_interleaved,
            torch_device(spec.device),
            parse_dtype(spec.dtype),
            weights=spec.weights,
            fastest=spec.fastest,
            overrides=[
                Placement(o.pattern, torch_device(o.device), parse_dtype(o.dtype), o.fastest) for o in spec.overrides
            ],
            release=found.reader.release,
        )
        stage.allocate_cache(assign.n_slots, assign.ctx, assign.kv_pages, assign.window_step)
        runners.append(StageRunner(spec, stage))
    found.reader.close()  # the stages hold their weights; a mapping some still view stays alive
    next_conn = None
    if assign.next is not None:
        nxt = assign.next
        next_conn, _ = connect(
            nxt.host,
            nxt.port,
            token=token,
            role="peer",
            limits=limits,
            tls=peer_tls if nxt.fingerprint else None,
            pin=nxt.fingerprint,
        )
    return Ring(assign, cfg, runners, coordinator, next_conn, found, worker_id, idle_timeout)
