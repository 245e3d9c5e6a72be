"""GGUF's stored blocks, decoded: plain tensors viewed, quantized ones dequantized (every type, by
gguf's dequantizers: bit for bit ggml's own) or, for the grouped types, split into `Groups` (small
integers with a scale and offset per group of columns) in torch on any device."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ..enums import GROUPED_TYPES, PLAIN_TYPES, STORED_TYPES

# Plain types are viewed directly; everything else goes through gguf's dequantizers.
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
assert tuple(PLAIN) == PLAIN_TYPES


class QuantError(ValueError):
    pass


def stored_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this stored type and (PyTorch-order) shape occupies in a file."""
    n = 1
    for d in shape:
        n *= d
    if dtype in PLAIN:
        return n * torch.empty((), dtype=PLAIN[dtype]).element_size()
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    return n // block * type_size


def _check(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    if dtype not in STORED_TYPES:
        raise QuantError(f"tensor type {dtype} is not supported (supported: {', '.join(sorted(STORED_TYPES))})")
    expected = stored_nbytes(dtype, shape)
    if raw.nbytes != expected:
        raise QuantError(f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, got {raw.nbytes}")


def to_torch(raw: np.ndarray, dtype: str, shape: tuple[int, ...], into: torch.dtype | None = None) -> torch.Tensor:
    """Raw bytes -> a CPU tensor of `shape` that owns its memory, in `into` (default: plain types
    keep their dtype, quantized become float32). A plain type is converted as it is copied out of
    `raw`: a large F16 table costs its converted copy alone, not a copy of the stored bytes too."""
    _check(raw, dtype, shape)
    if dtype in PLAIN:
        with warnings.catch_warnings():  # read-only: only read here, by the conversion or clone below
            warnings.simplefilter("ignore", UserWarning)
            stored = torch.frombuffer(raw, dtype=PLAIN[dtype]).reshape(shape)
        return stored.clone() if into in (None, stored.dtype) else stored.to(into)
    qtype = GGMLQuantizationType[dtype]
    rows = raw.reshape(-1, raw.nbytes // (int(np.prod(shape[:-1])) if len(shape) > 1 else 1))
    t = torch.from_numpy(quants.dequantize(rows, qtype).astype(np.float32, copy=False)).reshape(shape)
    return t if into is None else t.to(into)


def raw_rows(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A quantized matrix's stored bytes as a uint8 tensor [rows, bytes per row]: a view of `raw`,
    which may be the file's read-only mapping (what keeps them copies them; formats.tensors.copied)."""
    _check(raw, dtype, shape)
    with warnings.catch_warnings():  # maybe read-only: the caller only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw.reshape(shape[0], -1))


# GGUF blocks -> Groups, in torch (any device). Bit for bit what gguf.quants.dequantize gives.


@dataclass
class Groups:
    q: torch.Tensor  # [N, K] int8 for symmetric types, uint8 for affine ones
    scale: torch.Tensor  # [N, K // group] float32
    offset: torch.Tensor | None  # [N, K // group] float32 (affine types), else None
    group: int
    lo: int  # the smallest value q can take; q spans 2 ** bits values from it
    bits: int

    def dequantize(self) -> torch.Tensor:
        N, K = self.q.shape
        w = self.q.view(N, K // self.group, self.group).float().mul_(self.scale[..., None])
        if self.offset is not None:
            w.add_(self.offset[..., None])
        return w.view(N, K)

    def rows(self, index) -> "Groups":
        return Groups(
            self.q[index],
            self.scale[index],
            None if self.offset is None else self.offset[index],
            self.group,
            self.lo,
            self.bits,
        )


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _shift(b: torch.Tensor, shifts, dim: int) -> torch.Tensor:
    """b with a new axis at `dim` holding b >> s for each s."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device)
    shape = [1] * (b.dim() + 1)
    shape[dim] = len(shifts)
    return b.unsqueeze(dim) >> s.view(shape)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [..., 32] bits, bit i of the little-endian word at i."""
    return (_shift(qh, range(8), -1) & 1).flatten(-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and mins from 12 bytes."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)
    return sc.float(), mn.float()


def _q4_0(b):
    qs = b[..., 2:18]
    return torch.cat([qs & 15, qs >> 4], -1).to(torch.int8) - 8, _f16(b[..., 0:2]), None


def _q4_1(b):
    qs = b[..., 4:20]
    return torch.cat([qs & 15, qs >> 4], -1), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5(b, affine: bool):
    start = 4 if affine else 2
    qs = b[..., start + 4 : start + 20]
    q = torch.cat([qs & 15, qs >> 4], -1) | (_bits32(b[..., start : start + 4]) << 4)
    if affine:
        return q, _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return q.to(torch.int8) - 16, _f16(b[..., 0:2]), None


def _q8_0(b):
    return b[..., 2:34].contiguous().view(torch.int8), _f16(b[..., 0:2]), None


def _q2_k(b):
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    q = (_shift(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), -2) & 3).flatten(-3)
    return q, d * (sc & 15).float(), -(dmin * (sc >> 4).float())


def _q3_k(b):
    hmask, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    low = (_shift(s[..., 0:8], (0, 4), -2) & 15).flatten(-2)
    high = (_shift(s[..., 8:12], (0, 2, 4, 6), -2) & 3).flatten(-2)
    sc = (low | (high << 4)).to(torch.int8) - 32
    ql = (_shift(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), -2) & 3).flatten(-3)
    qh = (_shift(hmask, range(8), -2) & 1).flatten(-2) ^ 1  # the offset is 0 where the mask bit is 1
    return ql.to(torch.int8) - (qh << 2).to(torch.int8), _f16(b[..., 108:110]) * sc.float(), None


def _q4_k(b):
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:144]
    q = (_shift(qs.unflatten(-1, (4, 32)), (0, 4), -2) & 15).flatten(-3)
    return q, _f16(b[..., 0:2]) * sc, -(_f16(b[..., 2:4]) * mn)


def _q5_k(b):
    sc, mn = _k_scales(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:176]
    ql = (_shift(qs.unflatten(-1, (4, 32)), (0, 4), -2) & 15).flatten(-3)
    q = ql | ((_shift(qh, range(8), -2) & 1).flatten(-2) << 4)
    return q, _f16(b[..., 0:2]) * sc, -(_f16(b[..., 2:4]) * mn)


def _q6_k(b):
    ql, qh, sc = b[..., 0:128], b[..., 128:192], b[..., 192:208]
    low = (_shift(ql.unflatten(-1, (2, 64)), (0, 4), -2) & 15).flatten(-3)
    high = (_shift(qh.unflatten(-1, (2, 32)), (0, 2, 4, 6), -2) & 3).flatten(-3)
    q = (low | (high << 4)).to(torch.int8) - 32
    return q, _f16(b[..., 208:210]) * sc.contiguous().view(torch.int8).float(), None


# type: (decoder, values per group, smallest q, bits)
_DECODERS = {
    "Q4_0": (_q4_0, 32, -8, 4),
    "Q4_1": (_q4_1, 32, 0, 4),
    "Q5_0": (lambda b: _q5(b, False), 32, -16, 5),
    "Q5_1": (lambda b: _q5(b, True), 32, 0, 5),
    "Q8_0": (_q8_0, 32, -128, 8),
    "Q2_K": (_q2_k, 16, 0, 2),
    "Q3_K": (_q3_k, 16, -4, 3),
    "Q4_K": (_q4_k, 32, 0, 4),
    "Q5_K": (_q5_k, 32, 0, 5),
    "Q6_K": (_q6_k, 16, -32, 6),
}
assert set(_DECODERS) == set(GROUPED_TYPES)


def unpack(raw: torch.Tensor, dtype: str) -> Groups:
    """Stored rows of a grouped type (uint8 [N, bytes per row], any device) -> Groups."""
    if dtype not in _DECODERS:
        raise QuantError(f"{dtype} blocks are not scaled groups of integers: they are read by ggml or dequantized")
    decode, group, lo, bits = _DECODERS[dtype]
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    N = raw.shape[0]
    q, scale, offset = decode(raw.view(N, -1, type_size))
    return Groups(
        q.reshape(N, -1), scale.reshape(N, -1), None if offset is None else offset.reshape(N, -1), group, lo, bits
    )


# grouped types whose blocks hold the same values as Q8_0 blocks: their scale as stored, their
# integers as bytes
WIDENS = ("Q4_0", "Q5_0")


def widened_to_q8_0(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """Stored rows of Q4_0 or Q5_0 blocks (uint8 [N, bytes per row]) as rows of Q8_0 blocks of the
    same values, exactly: ggml's short products run faster on Q8_0 (latent.choose_widening)."""
    if dtype not in WIDENS:
        raise QuantError(f"{dtype} blocks do not widen to Q8_0 exactly")
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    blocks = raw.reshape(raw.shape[0], -1, type_size)
    q, _, _ = _DECODERS[dtype][0](blocks)
    return torch.cat([blocks[..., 0:2], q.to(torch.int8).view(torch.uint8)], -1).reshape(raw.shape[0], -1)
