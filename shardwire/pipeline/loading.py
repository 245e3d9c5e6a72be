"""Build a Stage from stored tensors: read only its layers, decode or pack them, undo llama.cpp's
Q/K order, bring a transformers checkpoint's tensors to the converter's form (as its family says)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch
from torch import nn

from .. import backends
from ..config import ModelConfig
from ..devices import large_allocations_unmapped, release_memory
from ..formats import ModelFile, TensorInfo, TensorReader
from ..formats.names import EXPERT_MATRICES, GROUPED_EXPERTS, expert_name, expert_of
from ..formats.tensors import copied
from ..model import Elsewhere, Linear, Stage
from ..models import family_of
from ..weights.codecs import PLAIN, raw_rows, to_torch
from ..weights.ggml_cpu import GGMLExperts, RepackError, repacked_experts
from ..weights.kernels import kernels_on
from ..weights.pack import pack_matrix
from ..weights.policy import EMBEDDING, weight_formats
from .plan import USED_AS_TENSORS, placed_apart


def undo_qk_interleave(t, n_heads: int):
    """Inverse of llama.cpp's converter permute: rows (head, pair, 2) -> (head, 2, pair), for a
    torch tensor or a numpy array."""
    shape = t.shape
    return t.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# Matrices multiplied a head's rows at a time (DeepSeek's per-head key and value matrices): as
# stored under ggml, not in a repacked layout, whose kernels take the whole matrix
_PER_HEAD = ("attn_k_b.weight", "attn_v_b.weight")
# Tensors kept in float32 whatever the stage's dtype (small, and precision matters)
_FULL_PRECISION = ("rope_freqs.weight", ".ssm_a", ".ssm_dt.bias")


def model_rows(cfg: ModelConfig, name: str, t: torch.Tensor, qk_interleaved: bool, itemsize: int = 0) -> torch.Tensor:
    """Rows of a stored tensor (decoded, or raw GGUF rows: blocks never cross rows) in model order;
    `itemsize`: raw rows of a plain type, elements of that many bytes."""
    family = family_of(cfg.arch)
    if cfg.hf_layout and family.from_transformers is not None:
        return family.from_transformers(cfg, name, t, itemsize)
    if qk_interleaved:
        kind = name.split(".")[-2]
        if kind == "attn_q":
            return undo_qk_interleave(t, cfg.n_heads)
        if kind == "attn_k":
            return undo_qk_interleave(t, cfg.n_kv_heads)
    return t


def decode_tensor(
    cfg: ModelConfig, info: TensorInfo, raw: np.ndarray, qk_interleaved: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    # arithmetic on the stored values before rounding to dtype
    if cfg.hf_layout and family_of(cfg.arch).needs_float32(cfg, info.name):
        t = model_rows(cfg, info.name, to_torch(raw, info.dtype, info.shape, torch.float32), qk_interleaved)
        return t if dtype is None else t.to(dtype)
    return model_rows(cfg, info.name, to_torch(raw, info.dtype, info.shape, dtype), qk_interleaved)


@dataclass(frozen=True, eq=False)
class Placement:
    """-ot: the block matrices `pattern` matches live on `device`, computing in `dtype` with that
    device's measured `fastest` formats."""

    pattern: str
    device: torch.device
    dtype: torch.dtype
    fastest: Mapping[str, str]

    def hold(self, module: nn.Module) -> nn.Module:
        return Elsewhere(module, self.device, self.dtype)


def build_stage(
    cfg: ModelConfig,
    start: int,
    end: int,
    first: bool,
    last: bool,
    tensors: Mapping[str, TensorInfo],
    read: Callable[[TensorInfo], np.ndarray],
    qk_interleaved: bool,
    device: str | torch.device,
    dtype: torch.dtype,
    progress: Callable[[int], None] | None = None,
    weights: str = "dequant",
    fastest: Mapping[str, str] | None = None,
    overrides: list[Placement] = (),
    release: Callable[[TensorInfo], None] | None = None,
) -> Stage:
    """`weights`: the stage's mode (weights/policy.py: fast | dequant | packed | compact), as the
    plan resolved it; `fastest`: the formats the device measured fastest, as the plan used them;
    `overrides`: where -ot keeps some block matrices instead (the first pattern that matches);
    `release(info)`, where given, is called once a tensor's stored bytes are used, so that their
    pages need not stay resident (TensorReader.release)."""
    device = torch.device(device)
    large_allocations_unmapped()
    apart = placed_apart(tensors, [(o.pattern, o) for o in overrides])
    here = {n: t for n, t in tensors.items() if n not in apart}
    formats = weight_formats(
        here, first, last, cfg.tied_embeddings, weights, device.type, kernels_on(device), fastest or {}
    )
    for o in dict.fromkeys(apart.values()):
        group = {n: tensors[n] for n, p in apart.items() if p is o}
        formats.update(
            weight_formats(group, False, False, False, weights, o.device.type, kernels_on(o.device), o.fastest)
        )
    for name in formats:
        if name.endswith(USED_AS_TENSORS):
            formats[name] = "dense"
        elif name.endswith(_PER_HEAD) and formats[name] == "repacked":
            formats[name] = "ggml"
    built, embedding = {}, None
    stacks: dict[tuple[int, str], tuple] = {}
    grouped = _grouped_blocks(formats, apart)
    for name, info in tensors.items():
        raw = read(info)
        fmt, where = formats[name], apart.get(name)
        on, dt = (where.device, where.dtype) if where else (device, dtype)
        expert = expert_of(name)
        if fmt in ("ggml", "repacked") and expert is not None:  # experts run as one ggml graph
            _stack(stacks, expert, raw, info, cfg.n_experts, where, fmt if expert[0] in grouped else "ggml")
        elif fmt == "dense":
            # a few small tensors keep full precision; everything else runs in the stage dtype.
            t = decode_tensor(cfg, info, raw, qk_interleaved, torch.float32 if name.endswith(_FULL_PRECISION) else dt)
            t = t.to(device=on)
            built[name] = where.hold(Linear(t)) if where else t
        else:
            itemsize = PLAIN[info.dtype].itemsize if info.dtype in PLAIN else 0
            # ggml's repack copies the stored rows into its own layout: they need no copy of ours
            # unless a token table is also made of them
            table_too = name == "token_embd.weight" and EMBEDDING in formats
            if fmt != "repacked" or table_too:
                raw = copied(raw, info, release)
            stored_rows = raw_rows(raw, info.dtype, tuple(info.shape))
            rows = model_rows(cfg, name, stored_rows, qk_interleaved, itemsize)
            module = pack_matrix(rows, info.dtype, fmt, on, dt)
            if name == "token_embd.weight" and not (last and cfg.tied_embeddings):
                embedding = module
            else:
                built[name] = where.hold(module) if where else module
            if name == "token_embd.weight" and EMBEDDING in formats:
                embedding = pack_matrix(rows, info.dtype, formats[EMBEDDING], device, dtype)
            del rows
        del raw
        if release is not None:
            release(info)
        if progress is not None:
            progress(info.nbytes)
    built.update(_experts_from_stacks(stacks, grouped, device, dtype))
    release_memory()
    stage = Stage(cfg, start, end, built, first, last, embedding=embedding, dtype=dtype).to(device)
    backends.attach(stage)
    return stage


def _stack(
    stacks: dict, expert: tuple[int, str, int], raw: np.ndarray, info: TensorInfo, n_experts: int, where, fmt: str
) -> None:
    """Copy one expert's stored matrix into its block's buffer [experts, rows, bytes per row], or
    write it into the block's repacked experts where `fmt` is repacked and this CPU has the layout."""
    block, matrix, e = expert
    rows = info.shape[0]
    if (block, matrix) not in stacks:
        buffer = None
        if fmt == "repacked":
            try:
                buffer = repacked_experts(info.dtype, info.shape[1], rows, n_experts)
            except RepackError:  # no repacked layout for the type or shape here: as stored
                pass
        if buffer is None:
            buffer = torch.empty((n_experts, rows, info.nbytes // rows), dtype=torch.uint8)
        stacks[block, matrix] = buffer, info.dtype, where, info.nbytes
    buffer, stored, placed, nbytes = stacks[block, matrix]
    if stored != info.dtype or raw.size != nbytes or placed is not where:
        raise ValueError(f"tensor '{info.name}' is {info.dtype} {list(info.shape)}, unlike its block's other experts")
    if isinstance(buffer, torch.Tensor):
        np.copyto(buffer[e].numpy(), raw.reshape(rows, -1))
    else:
        buffer.write_expert(e, raw.reshape(rows, -1))


def _grouped_blocks(formats: Mapping[str, str], apart: Mapping[str, Placement]) -> set[int]:
    """The blocks whose experts run as one ggml graph: all three matrices on ggml, in one place
    (only these may be written straight into a repacked layout)."""
    kinds: dict[int, set] = {}
    for name, fmt in formats.items():
        if (expert := expert_of(name)) is not None:
            kinds.setdefault(expert[0], set()).add((fmt in ("ggml", "repacked"), id(apart.get(name))))
    return {block for block, seen in kinds.items() if len(seen) == 1 and next(iter(seen))[0]}


def _experts_from_stacks(stacks: dict, grouped: set[int], device: torch.device, dtype: torch.dtype) -> dict:
    """A block of `grouped` gets one module for all its experts; otherwise each expert's matrix
    is a module of its own."""
    out = {}
    for block in sorted({b for b, _ in stacks}):
        parts = [stacks.get((block, m)) for m in EXPERT_MATRICES]
        if block in grouped:
            buffers, stored, where = [b for b, *_ in parts], tuple(s for _, s, *_ in parts), parts[0][2]
            module = GGMLExperts(*buffers, stored)
            out[f"blk.{block}.{GROUPED_EXPERTS}"] = where.hold(module) if where else module
            continue
        for m, part in zip(EXPERT_MATRICES, parts):
            if part is not None:
                buffer, stored, where, _ = part
                on = where.device if where else device
                for e in range(buffer.shape[0]):
                    module = pack_matrix(buffer[e], stored, "ggml", on, dtype)
                    out[expert_name(block, m, e)] = where.hold(module) if where else module
    return out


def load_stage(
    model: ModelFile,
    start: int,
    end: int,
    *,
    first: bool | None = None,
    last: bool | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    reader: TensorReader | None = None,
    progress: Callable[[int], None] | None = None,
    weights: str = "dequant",
    fastest: Mapping[str, str] | None = None,
    overrides: list[Placement] = (),
) -> Stage:
    """Blocks [start, end) of `model`, reading only the tensors that stage needs."""
    first = start == 0 if first is None else first
    last = end == model.config.n_layers if last is None else last
    own_reader = reader is None
    reader = reader or TensorReader()
    tensors = model.stage_tensors(start, end, first, last)
    stage = build_stage(
        model.config,
        start,
        end,
        first,
        last,
        tensors,
        reader.read,
        model.qk_interleaved,
        device,
        dtype,
        progress,
        weights,
        fastest,
        overrides,
        reader.release,
    )
    if own_reader:
        reader.close()  # what views the file keeps its mapping alive
    return stage
