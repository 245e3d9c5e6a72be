"""Split planning: which blocks go on which device of which worker, and whether they fit.

Follows llama.cpp's layer split: the first n_layers - n_gpu_layers blocks stay on the
coordinator's CPU; the rest are divided over the devices in plan order (the --rpc workers'
devices, then the coordinator's own) in proportion to --tensor-split exactly as llama.cpp
divides them, or to each device's free memory when no split is given.

One module of this length: the split of the blocks and the cost of each stage are one computation (a
worker checks its stage with the same stage_cost), read together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..backends.ggml.latent import TIMED, expanded_workspace, turned_key_bytes, widened_bytes
from ..config import ModelConfig
from ..deltanet import CHUNK
from ..devices import parse_dtype
from ..enums import PAGE
from ..formats import ModelFile
from ..formats.tensors import COPY_PIECE
from ..kvcache import pool_pages, ring_size, ring_slack, stage_cache_nbytes, window_ring
from ..model import ffn_piece_rows
from ..weights.codecs import stored_nbytes
from ..weights.packed import CHUNK_ELEMENTS
from ..weights.policy import EMBEDDING, WeightModeError, held_label, modes_for, weight_formats, weight_nbytes


class PlanError(ValueError):
    """An impossible split; the message says what does not fit and by how much."""


@dataclass(frozen=True)
class PlanDevice:
    worker: str  # "host:port" of the worker, or "local" for the coordinator itself
    name: str  # device on that worker: "cpu", "cuda:0", "mps"
    free: int  # bytes available for this plan
    dtype: str = "float32"
    kernels: bool = False  # whether PyTorch's packed int4/int8 kernels run there, as its worker found
    fastest: tuple[tuple[str, str], ...] = ()  # (stored type, format) that decodes fastest, as measured there
    products: tuple[tuple[str, str], ...] = ()  # (stored type, whose product takes its prompt chunks), as measured
    row_products: tuple[tuple[str, str], ...] = ()  # (stored type, whose product takes one row), as measured
    compute: str = ""  # the kernels that compute there, as its worker names them (in_use.compute_line)

    def __post_init__(self):
        # given as maps or as pairs; kept as sorted pairs so the device stays hashable
        object.__setattr__(self, "fastest", tuple(sorted(dict(self.fastest).items())))
        object.__setattr__(self, "products", tuple(sorted(dict(self.products).items())))
        object.__setattr__(self, "row_products", tuple(sorted(dict(self.row_products).items())))

    def held(self, formats: dict[str, str]) -> str:
        """A stage's formats on this device as the plan shows them (policy.held_label)."""
        return " ".join(
            held_label(t, f, dict(self.products), dict(self.row_products)) for t, f in sorted(formats.items())
        )

    @property
    def type(self) -> str:
        return self.name.split(":")[0]

    @property
    def label(self) -> str:
        return f"{self.worker}/{self.name}"


@dataclass
class PlannedStage:
    device: PlanDevice
    start: int
    end: int
    first: bool
    last: bool
    weight_bytes: int = 0
    kv_bytes: int = 0
    workspace_bytes: int = 0  # a prompt chunk's activations or a tensor being loaded, and a CPU's kernel code
    weights: str = "dequant"  # fast | dequant | packed | compact: how its weights live on the device
    formats: dict[str, str] = field(default_factory=dict)  # stored type -> on-device format(s)
    # -ot: (pattern, device of this stage's worker) for block matrices kept apart from `device`,
    # and what they take there
    overrides: tuple[tuple[str, PlanDevice], ...] = ()
    elsewhere: dict[PlanDevice, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes


class OverrideError(ValueError):
    pass


def parse_overrides(specs: list[str] | None) -> list[tuple[str, str]]:
    """llama.cpp's -ot values, `REGEX=DEVICE[,REGEX=DEVICE...]`, as (pattern, device) pairs."""
    out = []
    for spec in specs or ():
        for item in spec.split(","):
            pattern, sep, device = item.strip().rpartition("=")
            if not sep or not pattern or not device:
                raise OverrideError(f"--override-tensor '{item}' is not REGEX=DEVICE")
            try:
                re.compile(pattern)
            except re.error as e:
                raise OverrideError(f"--override-tensor '{item}': bad regular expression ({e})") from None
            out.append((pattern, device.strip().lower()))
    return out


# Tensors the model uses as they are, not as a matrix product: never packed, and kept with their
# stage where -ot moves the matrices beside them (the experts' biases go to the experts' products
# from there)
USED_AS_TENSORS = ("ssm_conv1d.weight", "_exps.bias", "attn_sinks.weight")


def placed_apart(tensors: dict, overrides) -> dict[str, object]:
    """Block matrices the first matching -ot pattern (searched in the name, as llama.cpp does)
    keeps on another device: name -> that pattern's target. Norms, the embedding, the head and
    the tensors used as they are (USED_AS_TENSORS) stay with their stage."""
    if not overrides:
        return {}
    compiled = [(re.compile(p), target) for p, target in overrides]
    out = {}
    for name, info in tensors.items():
        if not name.startswith("blk.") or len(info.shape) < 2 or name.endswith(USED_AS_TENSORS):
            continue
        target = next((t for rx, t in compiled if rx.search(name)), None)
        if target is not None:
            out[name] = target
    return out


@dataclass
class Plan:
    stages: list[PlannedStage]
    n_slots: int
    ctx: int
    prefill_chunk: int = 512  # the most tokens per row of a step, which each stage's workspace is sized for
    kv_pages: int = 0  # pages in each stage's KV pool (0: every slot's whole context)
    notes: list[str] = field(default_factory=list)
    swa_full: bool = False  # blocks on a sliding window keep every position (else a ring per slot)

    def __post_init__(self):
        self.kv_pages = self.kv_pages or pool_pages(self.n_slots, self.ctx)

    @property
    def window_step(self) -> int:
        """The most positions a step brings, for which blocks on a sliding window keep their keys
        in a ring per slot (kvcache.WindowCache); 0: they keep every position."""
        return 0 if self.swa_full else self.prefill_chunk

    def ring_step(self, cfg: ModelConfig) -> int:
        """Where the model's blocks on a sliding window keep only their window (a ring per slot):
        the most positions a step may bring them; else 0."""
        step = window_ring(cfg, 0, cfg.n_layers, self.window_step, self.n_slots, self.kv_pages)
        return ring_slack(cfg.sliding_window, ring_size(cfg.sliding_window, step)) if step else 0

    def shortfalls(self) -> list[tuple[PlannedStage, PlanDevice, int]]:
        """(stage, device, bytes short) for each stage whose device, or a device holding its -ot
        matrices, needs more than it has free."""
        need: dict[PlanDevice, int] = {}
        for s in self.stages:
            need[s.device] = need.get(s.device, 0) + s.total_bytes
            for device, n in s.elsewhere.items():
                need[device] = need.get(device, 0) + n
        return [(s, d, need[d] - d.free) for s in self.stages for d in (s.device, *s.elsewhere) if need[d] > d.free]

    def check_fits(self) -> None:
        short = self.shortfalls()
        if short:
            lines = [
                f"{s.device.label} needs {gib(s.total_bytes)} (weights {gib(s.weight_bytes)}, "
                f"KV cache {gib(s.kv_bytes)}, workspace {gib(s.workspace_bytes)}) but has "
                f"{gib(s.device.free)} free: short by {gib(by)}"
                if d == s.device
                else f"{d.label} needs {gib(s.elsewhere[d])} for the matrices -ot keeps there from blocks "
                f"{s.start}-{s.end - 1} but has {gib(d.free)} free: short by {gib(by)}"
                for s, d, by in short
            ]
            raise PlanError("the model does not fit: " + "; ".join(lines))

    def table(self) -> str:
        rows = [("stage", "device", "blocks", "weights", "KV cache", "workspace", "free", "fits", "weight formats")]
        short = {id(s) for s, d, _ in self.shortfalls() if d == s.device}
        for i, s in enumerate(self.stages):
            blocks = f"{s.start}-{s.end - 1}" if s.end > s.start else "-"
            extra = ("+embd" if s.first else "") + ("+head" if s.last else "")
            formats = s.device.held(s.formats)
            rows.append(
                (
                    str(i),
                    s.device.label,
                    blocks + extra,
                    gib(s.weight_bytes),
                    gib(s.kv_bytes),
                    gib(s.workspace_bytes),
                    gib(s.device.free),
                    "no" if id(s) in short else "yes",
                    f"{s.weights} ({formats})",
                )
            )
            for pattern, device in s.overrides:
                held = s.elsewhere.get(device, 0)
                rows.append(("", f"-> {device.label}", f"/{pattern}/", gib(held), "", "", gib(device.free), "", ""))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        total = sum(s.weight_bytes + sum(s.elsewhere.values()) for s in self.stages)
        lines.append(
            f"{len(self.stages)} stage(s), {self.n_slots} sequence slot(s) x {self.ctx} tokens, "
            f"KV pages for {self.kv_pages * PAGE} positions in all, weights {gib(total)} in all"
        )
        return "\n".join(lines + self.compute_lines() + self.notes)

    def compute_lines(self) -> list[str]:
        """A line for each device of the plan naming the kernels that compute there."""
        devices = dict.fromkeys(s.device for s in self.stages)
        devices.update(dict.fromkeys(d for s in self.stages for _, d in s.overrides))
        return [f"kernels on {d.label}: {d.compute}" for d in devices if d.compute]


def gib(n: int) -> str:
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def split_blocks(n_blocks: int, proportions: list[float]) -> list[int]:
    """How many consecutive blocks each device gets, as llama.cpp's layer split does."""
    total = sum(proportions)
    if total <= 0 or any(p < 0 for p in proportions):
        raise PlanError("tensor split proportions must be non-negative and not all zero")
    bounds, acc = [], 0.0
    for p in proportions:
        acc += p / total
        bounds.append(acc)
    counts = [0] * len(proportions)
    for block in range(n_blocks):
        position = block / n_blocks
        device = next((i for i, b in enumerate(bounds) if position < b - 1e-9), len(bounds) - 1)
        counts[device] += 1
    return counts


def split_blocks_evenly(n_blocks: int, weights: list[float]) -> list[int]:
    """Blocks in proportion to `weights`, rounded by largest remainder: devices with nearly equal
    free memory get equal shares, whatever the last few MiB say."""
    total = sum(weights)
    exact = [n_blocks * w / total for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n_blocks - sum(counts)]:
        counts[i] += 1
    return counts


def split_blocks_by_bytes(block_bytes: list[int], weights: list[float]) -> list[int]:
    """Consecutive blocks per device, each device's share of the blocks' bytes following `weights`:
    a block goes where the middle of its bytes falls. Blocks of one size (every block of most
    models, dense or mixture-of-experts) are divided by count as split_blocks_evenly does."""
    if len(set(block_bytes)) <= 1:
        return split_blocks_evenly(len(block_bytes), weights)
    total, bounds, acc = sum(block_bytes), [], 0.0
    for w in weights:
        acc += w / sum(weights)
        bounds.append(acc)
    counts, done = [0] * len(weights), 0
    for size in block_bytes:
        middle = (done + size / 2) / total
        counts[next((i for i, b in enumerate(bounds) if middle < b - 1e-12), len(bounds) - 1)] += 1
        done += size
    return counts


# Bytes per value of a chunk of packed rows being dequantized for a prompt chunk's GEMM: by
# PyTorch (the unpacked integers, float32 weights and their copy in the compute dtype, with the
# allocator's slack), or by ggml into one float32 scratch buffer (plus its copy in a 16-bit
# compute dtype). Dense and repacked weights multiply a chunk as they are held, and so do ggml's
# in float32, where a block's graphs take a prompt a piece at a time (the plan assumes ggml's
# kernels do; a CPU that measured a dequantized GEMM faster for a type at a piece's rows,
# weights/measure.gemm_rows, takes the whole chunk that way and needs this too).
DEQUANT_BYTES_PER_VALUE = 16
GGML_DEQUANT_BYTES_PER_VALUE = 4


# The code of the kernels a CPU stage runs, resident in its process once it computes (measured:
# 12-14 MiB with torch 2.13 and ggml on x86)
CPU_RUNTIME_BYTES = 16 << 20

# the formats whose module keeps the stored bytes it is given (copied out of the file once)
HELD_AS_STORED = ("ggml", "gguf")


def dequant_bytes_per_value(formats, dtype: torch.dtype) -> int:
    """What the formats a stage's matrices are held in dequantize per value for a prompt chunk."""
    size = torch.empty((), dtype=dtype).element_size()
    ggml = 0 if dtype == torch.float32 else GGML_DEQUANT_BYTES_PER_VALUE + size
    return max([{"dense": 0, "repacked": 0, "ggml": ggml}.get(f, DEQUANT_BYTES_PER_VALUE) for f in formats] or [0])


def workspace_bytes(
    cfg: ModelConfig, chunk: int, last: bool, dtype: torch.dtype, device_type: str, dequant_per_value: int = 0
) -> int:
    """Peak activations of one prefill chunk: the FFN's gate and up (SwiGLU in place; on a CPU a
    piece of the chunk's rows at a time, backends/ggml/block.py), attention scores, logits, the
    residual stream's copies, the queries and the heads' output (ModelConfig.attention_widths), and
    where matrices are dequantized a chunk of rows at a time (`dequant_per_value` bytes each) those
    rows and the product's pieces, which are joined in a copy. A CPU computes attention one query
    row at a time (model.attention): its scores are a row's; other devices may fall back to the
    plain product with a mask, so they count them."""
    size = torch.empty((), dtype=dtype).element_size()
    if device_type != "cpu" or dequant_per_value or chunk <= ffn_piece_rows(cfg.ffn_dim):
        ffn = 2 * chunk * cfg.ffn_dim * size
    else:  # a piece of rows at a time, through a block's ggml graph with all its intermediates
        ffn = (3 * cfg.ffn_dim + 5 * cfg.dim) * ffn_piece_rows(cfg.ffn_dim) * size
    scores = 0 if device_type == "cpu" else cfg.n_heads * chunk * chunk * 4
    if cfg.linear_blocks:  # the chunked delta rule, per value head and token: float32 vectors and
        # three rows of the chunk's [CHUNK, CHUNK] matrices
        per_token = 8 * max(cfg.ssm_k_dim, cfg.ssm_v_dim) + 3 * CHUNK
        scores = max(scores, chunk * cfg.ssm_v_heads * per_token * 4)
    logits = cfg.vocab_size * 4 * 2 if last else 0
    dequant = CHUNK_ELEMENTS * dequant_per_value + chunk * max(cfg.ffn_dim, cfg.dim) * size if dequant_per_value else 0
    rows = (2 * cfg.dim + sum(cfg.attention_widths)) * chunk * size
    return ffn + scores + logits + rows + dequant


@dataclass
class StageCost:
    """What a stage needs on its device."""

    weight_bytes: int
    kv_bytes: int
    workspace_bytes: int
    formats: dict[str, str]  # stored type -> its on-device format(s), "+"-joined
    elsewhere: dict = field(default_factory=dict)  # -ot target device -> bytes of the matrices it holds

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes


def _formats_on(device: PlanDevice, tensors: dict, first: bool, last: bool, tied: bool, weights: str) -> dict:
    return weight_formats(tensors, first, last, tied, weights, device.type, device.kernels, dict(device.fastest))


def stage_cost(
    cfg: ModelConfig,
    tensors: dict,
    stage: PlannedStage,
    weights: str,
    n_slots: int,
    kv_pages: int,
    chunk: int,
    window_step: int = 0,
) -> StageCost:
    """What `stage` needs on its device with its `tensors` (anything with .dtype and .shape, by
    name) held as `weights` says (fast | dequant | packed | compact). The planner and a worker
    checking an ASSIGN against its memory both count with this."""
    dtype = parse_dtype(stage.device.dtype)
    apart = placed_apart(tensors, stage.overrides)
    here = {n: t for n, t in tensors.items() if n not in apart}
    formats = _formats_on(stage.device, here, stage.first, stage.last, cfg.tied_embeddings, weights)
    weight_bytes = weight_nbytes(here, formats, dtype)
    elsewhere: dict = {}
    for device in dict.fromkeys(apart.values()):
        group = {n: tensors[n] for n, d in apart.items() if d == device}
        on_device = _formats_on(device, group, False, False, cfg.tied_embeddings, weights)
        elsewhere[device] = weight_nbytes(group, on_device, parse_dtype(device.dtype))
        formats.update(on_device)
    by_type: dict[str, str] = {}
    for name, fmt in formats.items():
        info = tensors["token_embd.weight" if name == EMBEDDING else name]
        if len(info.shape) > 1:
            kind = by_type.setdefault(info.dtype, fmt)
            if fmt not in kind.split("+"):
                by_type[info.dtype] = kind + "+" + fmt
    head = stage.last and cfg.tied_embeddings  # where token_embd is also the head; a token table is only looked up
    products = [f for n, f in formats.items() if n != EMBEDDING and (n != "token_embd.weight" or head)]
    activations = workspace_bytes(
        cfg, chunk, stage.last, dtype, stage.device.type, dequant_bytes_per_value(products, dtype)
    )
    # while loading, what of the tensor being built is resident beside the weights built: a piece of
    # one held as stored on a CPU (formats.tensors.copied), else its stored bytes
    loading = max(
        (
            COPY_PIECE
            if stage.device.type == "cpu" and formats.get(n) in HELD_AS_STORED
            else stored_nbytes(t.dtype, tuple(t.shape))
            for n, t in tensors.items()
        ),
        default=0,
    )
    runtime = CPU_RUNTIME_BYTES if stage.device.type == "cpu" else 0
    if cfg.kv_lora_rank and stage.device.type == "cpu" and dtype == torch.float32:
        # where ggml's graphs may run a prompt's latent attention in expanded form (its choice is
        # measured at the worker's start): the key matrices it holds turned, and what it computes in
        # and each head's key and value matrices widened to Q8_0, where the start finds that faster
        for i in range(stage.start, stage.end):
            k_b, v_b = (getattr(tensors.get(f"blk.{i}.attn_{m}_b.weight"), "dtype", None) for m in "kv")
            weight_bytes += turned_key_bytes(cfg, k_b) + widened_bytes(cfg, k_b, v_b)
        activations += expanded_workspace(cfg, chunk, kv_pages * PAGE)
        # the start's timing of both forms (choose_form), before the cache is allocated
        rows, seen = TIMED
        timing = workspace_bytes(cfg, rows, False, dtype, "cpu") + expanded_workspace(cfg, rows, seen)
        loading = max(loading, timing + seen * (cfg.kv_lora_rank + cfg.rope_dim) * 2)
    return StageCost(
        weight_bytes,
        # keys and values, the delta-net state
        stage_cache_nbytes(cfg, stage.start, stage.end, n_slots, kv_pages, dtype, window_step),
        max(activations, loading) + runtime,
        by_type,
        elsewhere,
    )


def cost_stage(
    model: ModelFile, stage: PlannedStage, n_slots: int, kv_pages: int, chunk: int, weights: str, window_step: int = 0
) -> None:
    """Fill in what a planned stage needs with its weights held as `weights` says."""
    tensors = model.stage_tensors(stage.start, stage.end, stage.first, stage.last)
    cost = stage_cost(model.config, tensors, stage, weights, n_slots, kv_pages, chunk, window_step)
    stage.weights, stage.formats, stage.elsewhere = weights, cost.formats, cost.elsewhere
    stage.weight_bytes, stage.kv_bytes, stage.workspace_bytes = cost.weight_bytes, cost.kv_bytes, cost.workspace_bytes


def _choose_weights(
    model: ModelFile,
    stages: list[PlannedStage],
    weights: str,
    n_slots: int,
    kv_pages: int,
    chunk: int,
    window_step: int = 0,
) -> None:
    """Cost every stage; with auto, each device gets the fastest mode that fits it."""
    by_device: dict[PlanDevice, list[PlannedStage]] = {}
    for stage in stages:
        by_device.setdefault(stage.device, []).append(stage)
    for device, group in by_device.items():
        try:
            modes = modes_for(weights, device.kernels)
        except WeightModeError as e:
            raise PlanError(str(e)) from None
        for mode in modes:
            for stage in group:
                cost_stage(model, stage, n_slots, kv_pages, chunk, mode, window_step)
            if sum(s.total_bytes for s in group) <= device.free:
                break


def _targets(stage: PlannedStage, overrides, every: list[PlanDevice]) -> tuple[tuple[str, PlanDevice], ...]:
    """The stage's -ot patterns with the devices of its own worker they name."""
    out = []
    for pattern, name in overrides:
        if name == stage.device.name:
            continue  # already there
        found = [d for d in every if d.worker == stage.device.worker and d.name == name]
        if not found:
            have = ", ".join(d.name for d in every if d.worker == stage.device.worker)
            raise PlanError(
                f"--override-tensor {pattern}={name}: {stage.device.worker} has no device {name} (it has {have}); "
                f"start that worker with --device listing it"
            )
        out.append((pattern, found[0]))
    return tuple(out)


def make_plan(
    model: ModelFile,
    devices: list[PlanDevice],
    *,
    cpu: PlanDevice | None = None,
    tensor_split: list[float] | None = None,
    n_gpu_layers: int | None = None,
    n_slots: int = 1,
    ctx: int = 4096,
    prefill_chunk: int = 512,
    weights: str = "dequant",
    overrides: list[tuple[str, str]] = (),
    kv_tokens: int | None = None,
    swa_full: bool = False,
) -> Plan:
    """Plan blocks over `devices` (in order); `cpu` is the coordinator's CPU, which takes the
    blocks that are not offloaded. `weights` (auto | fast | dequant | packed | compact) says how
    quantized weights live on the devices; auto picks, per device, the fastest that fits.
    `overrides` (-ot): (pattern, device name) pairs; the block matrices a pattern matches live on
    that device of their stage's worker, which holds only such matrices and no blocks of its own.
    `kv_tokens`: the most positions the KV pages of all sequences hold together (default: every
    slot's whole context)."""
    n = model.config.n_layers
    block_bytes = model.block_nbytes()
    every = devices + ([cpu] if cpu is not None else [])
    targets = {name for _, name in overrides}
    # a worker's -ot targets hold only what the patterns send them, where it has other devices
    takers = {d.worker for d in devices if d.name not in targets}
    devices = [d for d in devices if d.name not in targets or d.worker not in takers]
    ctx = min(ctx, model.config.context_length)
    offloaded = n if n_gpu_layers is None else max(0, min(n_gpu_layers, n))
    if offloaded and not devices:
        raise PlanError("no devices to place blocks on: give workers with --rpc or local devices with --device")
    if offloaded < n and cpu is None:
        raise PlanError(
            f"--n-gpu-layers {offloaded} keeps {n - offloaded} block(s) on the coordinator's "
            "CPU, which this plan does not have"
        )
    counts: list[int] = []
    if tensor_split is not None:
        if len(tensor_split) > len(devices):
            raise PlanError(f"--tensor-split has {len(tensor_split)} entries for {len(devices)} device(s)")
        counts = split_blocks(offloaded, list(tensor_split) + [0.0] * (len(devices) - len(tensor_split)))
    elif devices:
        free = [float(d.free) for d in devices]
        counts = split_blocks_by_bytes(block_bytes[n - offloaded :], free if sum(free) > 0 else [1.0] * len(devices))
    placements: list[tuple[PlanDevice, int]] = []
    if offloaded < n:
        placements.append((cpu, n - offloaded))
    placements += [(d, c) for d, c in zip(devices, counts) if c > 0]
    stages, start = [], 0
    for device, count in placements:
        stage = PlannedStage(device, start, start + count, first=start == 0, last=start + count == n)
        stage.overrides = _targets(stage, overrides, every)
        stages.append(stage)
        start += count
    kv_pages = pool_pages(n_slots, ctx, kv_tokens)
    plan = Plan(stages, n_slots, ctx, prefill_chunk, kv_pages, swa_full=swa_full)
    _choose_weights(model, stages, weights, n_slots, kv_pages, prefill_chunk, plan.window_step)
    cfg = model.config
    if cfg.n_experts:
        experts = sum(t.nbytes for name, t in model.tensors.items() if "_exps." in name)
        plan.notes.append(
            f"mixture of experts: {cfg.n_experts} experts per block, {cfg.n_experts_used} run per token; "
            f"expert tensors are {gib(experts)} of the file's {gib(sum(block_bytes))} in blocks"
        )
    if cfg.sliding_blocks:
        n, window = len(cfg.sliding_blocks), cfg.sliding_window
        if plan.ring_step(cfg):
            ring = ring_size(window, plan.window_step)
            kept = f"{ring} positions a sequence, in a ring (a prompt prefix is reused in its slot)"
        else:
            kept = "every position, as the other blocks"
        plan.notes.append(
            f"sliding window: {n} of {cfg.n_layers} blocks see the last {window} positions; they keep {kept}"
        )
    workers = [s.device.worker for s in stages]
    for i, w in enumerate(workers):
        if w in workers[:i] and workers[i - 1] != w:
            raise PlanError(f"the stages of worker {w} must be consecutive in the plan; list its devices together")
    return plan
