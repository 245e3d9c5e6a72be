"""Experts as OpenAI's gpt-oss checkpoints hold them, read as shardwire holds experts (one
[rows, columns] matrix per expert, formats.names.expert_name): as transformers saves them, all of a
block's in one tensor, transposed, gate and up interleaved (gate_up_proj [experts, dim, 2 ffn],
gate the even columns), their biases likewise; or as OpenAI publishes them, in MXFP4
(gate_up_proj_blocks and _scales, not transposed, gate the even rows), which become ggml's MXFP4
blocks as stored. No file holds these matrices as they are: each is a TensorInfo derived from
the stored ones when read."""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Mapping

import numpy as np

from .names import expert_name
from .tensors import TensorInfo

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_ITEMS = {2: np.uint16, 4: np.uint32}  # a plain type's elements, by size, as bytes ggml or PyTorch reads
_HALVES = (("ffn_gate_exps", 0), ("ffn_up_exps", 1))  # gate_up's even rows (or columns), then its odd ones


def experts(stored: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """The folder's expert tensors (`stored`: all its tensors, by their names there), each with
    the canonical tensors it makes (empty: read with another)."""
    own: dict[str, dict[str, TensorInfo]] = {}
    for name, info in stored.items():
        m = _EXPERTS.match(name)
        if m is None:
            continue
        block, matrix, kind = int(m[1]), m[2], m[3] or ""
        if kind == "_bias":
            own[name] = _biases(block, matrix, info)
        elif kind == "_blocks":
            scales = stored.get(name.removesuffix("_blocks") + "_scales")
            if scales is None:
                raise ValueError(f"{info.path}: '{name}' has no _scales beside it")
            own[name], own[scales.name] = _mxfp4_experts(block, matrix, info, scales), {}
        elif kind == "":
            own[name] = _experts(block, matrix, info)
    return own


def _itemsize(info: TensorInfo) -> int:
    size = info.nbytes // math.prod(info.shape)
    if size not in _ITEMS:
        raise ValueError(f"{info.path}: '{info.name}' is {info.dtype}, not a 16- or 32-bit float")
    return size


def _transposed_rows(raw: np.ndarray, shape: tuple[int, int], itemsize: int, start: int, step: int) -> np.ndarray:
    """A stored [rows, columns] matrix transposed, every step-th of its rows from start, as bytes."""
    matrix = raw.view(_ITEMS[itemsize]).reshape(shape)
    return np.ascontiguousarray(matrix.T[start::step]).view(np.uint8).reshape(-1)


def _columns(raw: np.ndarray, shape: tuple[int, int], itemsize: int, start: int, step: int) -> np.ndarray:
    """Every step-th column from start of a stored [rows, columns] matrix, as bytes."""
    matrix = raw.view(_ITEMS[itemsize]).reshape(shape)
    return np.ascontiguousarray(matrix[:, start::step]).view(np.uint8).reshape(-1)


def _experts(block: int, matrix: str, info: TensorInfo) -> dict[str, TensorInfo]:
    E, K, N = info.shape  # each expert's [in, out]
    size, out = _itemsize(info), {}
    for e, part in enumerate(info.split(E)):
        if matrix == "down_proj":
            made = [("ffn_down_exps", 0, 1)]
        else:
            made = [(kind, start, 2) for kind, start in _HALVES]
        for kind, start, step in made:
            rows = N // step
            derive = partial(_transposed_rows, shape=(K, N), itemsize=size, start=start, step=step)
            name = expert_name(block, kind, e)
            out[name] = TensorInfo.derived(name, info.dtype, (rows, K), rows * K * size, (part,), derive)
    return out


def _biases(block: int, matrix: str, info: TensorInfo) -> dict[str, TensorInfo]:
    if matrix == "down_proj":
        return {f"blk.{block}.ffn_down_exps.bias": info.renamed(f"blk.{block}.ffn_down_exps.bias")}
    E, N = info.shape
    size, out = _itemsize(info), {}
    for kind, start in _HALVES:
        name = f"blk.{block}.{kind}.bias"
        derive = partial(_columns, shape=(E, N), itemsize=size, start=start, step=2)
        out[name] = TensorInfo.derived(name, info.dtype, (E, N // 2), E * N // 2 * size, (info,), derive)
    return out


def _mxfp4_rows(blocks: np.ndarray, scales: np.ndarray, rows: int, groups: int, start: int, step: int) -> np.ndarray:
    """OpenAI's MXFP4 rows (each 32 values a scale byte, apart, and 16 bytes holding values 2i and
    2i + 1 in their low and high nibbles), every step-th from start, as ggml's MXFP4 blocks: the
    scale byte, then 16 bytes holding values i and i + 16."""
    nibbles = blocks.reshape(rows, groups, 16)[start::step]
    values = np.empty((*nibbles.shape[:2], 32), dtype=np.uint8)
    values[..., 0::2], values[..., 1::2] = nibbles & 0x0F, nibbles >> 4
    out = np.empty((*nibbles.shape[:2], 17), dtype=np.uint8)
    out[..., 0] = scales.reshape(rows, groups)[start::step]
    out[..., 1:] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(-1)


def _mxfp4_experts(block: int, matrix: str, blocks: TensorInfo, scales: TensorInfo) -> dict[str, TensorInfo]:
    E, R, groups, width = blocks.shape  # each expert's [out, in / 32, 16]
    if width != 16 or tuple(scales.shape) != (E, R, groups) or blocks.dtype != "U8" or scales.dtype != "U8":
        raise ValueError(f"{blocks.path}: '{blocks.name}' and its _scales are not MXFP4 blocks of one matrix")
    made = [("ffn_down_exps", 0, 1)] if matrix == "down_proj" else [(kind, start, 2) for kind, start in _HALVES]
    out = {}
    for e, (b, s) in enumerate(zip(blocks.split(E), scales.split(E))):
        for kind, start, step in made:
            rows = R // step
            derive = partial(_mxfp4_rows, rows=R, groups=groups, start=start, step=step)
            name = expert_name(block, kind, e)
            out[name] = TensorInfo.derived(name, "MXFP4", (rows, groups * 32), rows * groups * 17, (b, s), derive)
    return out
