"""Stored tensor bytes -> PyTorch: plain views, dequantized tensors, and packed on-device weights.

Every GGUF quantized type decodes to the same thing, `Groups`: small integers q [N, K] with a
scale (and, for affine types, an offset) per group of columns, w = scale * q + offset. A weight
matrix then lives on its device in one of these formats:

  dense   dequantized to the compute dtype; F.linear.
  int4    4 bits, groups of 32, bf16 (scale, zero): PyTorch's int4 kernels. Q4_0, Q4_1 and Q4_K
          map onto it exactly up to the bf16 rounding of scale and zero; Q2_K and Q3_K (groups
          of 16) are requantized onto it.
  int8x2  8 bits, groups of 32 (Q8_0 exactly): two 4-bit planes, q = 16 * hi + lo + 8, that
          share one (scale, zero) table, run as two int4 matmuls.
  int8    8 bits, one scale per row: PyTorch's int8 kernel. Q5_0, Q5_1, Q5_K and Q6_K are
          requantized onto it (the rounding adds a few percent to the type's own error).
  gguf    the stored blocks, dequantized a chunk of rows at a time just before use.

Packed modules share the interface of model.Linear (forward(x), optional bias) and also give
dequantized rows, so an embedding table can be gathered from them.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

# Plain types are viewed directly; everything else goes through gguf's dequantizers.
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SUPPORTED_TYPES = frozenset(_PLAIN) | {
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


class QuantError(ValueError):
    pass


def stored_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this stored type and (PyTorch-order) shape occupies in a file."""
    n = 1
    for d in shape:
        n *= d
    if dtype in _PLAIN:
        return n * torch.empty((), dtype=_PLAIN[dtype]).element_size()
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    return n // block * type_size


def _check(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    if dtype not in SUPPORTED_TYPES:
        raise QuantError(f"tensor type {dtype} is not supported (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    expected = stored_nbytes(dtype, shape)
    if raw.nbytes != expected:
        raise QuantError(f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, got {raw.nbytes}")


def to_torch(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes -> a CPU tensor of `shape`: plain types keep their dtype, quantized become float32."""
    _check(raw, dtype, shape)
    if dtype in _PLAIN:
        # frombuffer on a read-only mapping warns; the tensor is copied before anyone writes to it.
        return torch.frombuffer(bytearray(raw), dtype=_PLAIN[dtype]).reshape(shape)
    qtype = GGMLQuantizationType[dtype]
    rows = raw.reshape(-1, raw.nbytes // (int(np.prod(shape[:-1])) if len(shape) > 1 else 1))
    return torch.from_numpy(quants.dequantize(rows, qtype).astype(np.float32, copy=False)).reshape(shape)


def raw_rows(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A quantized matrix's stored bytes as a uint8 tensor [rows, bytes per row] (a copy)."""
    _check(raw, dtype, shape)
    return torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(shape[0], -1))


# ---------------------------------------------------------------------------------------------
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
        return Groups(self.q[index], self.scale[index], None if self.offset is None else self.offset[index],
                      self.group, self.lo, self.bits)


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
    qs = b[..., start + 4:start + 20]
    q = torch.cat([qs & 15, qs >> 4], -1) | (_bits32(b[..., start:start + 4]) << 4)
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
    "Q4_0": (_q4_0, 32, -8, 4), "Q4_1": (_q4_1, 32, 0, 4),
    "Q5_0": (lambda b: _q5(b, False), 32, -16, 5), "Q5_1": (lambda b: _q5(b, True), 32, 0, 5),
    "Q8_0": (_q8_0, 32, -128, 8), "Q2_K": (_q2_k, 16, 0, 2), "Q3_K": (_q3_k, 16, -4, 3),
    "Q4_K": (_q4_k, 32, 0, 4), "Q5_K": (_q5_k, 32, 0, 5), "Q6_K": (_q6_k, 16, -32, 6),
}


def unpack(raw: torch.Tensor, dtype: str) -> Groups:
    """Stored rows (uint8 [N, bytes per row], any device) -> Groups."""
    decode, group, lo, bits = _DECODERS[dtype]
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    N = raw.shape[0]
    q, scale, offset = decode(raw.view(N, -1, type_size))
    return Groups(q.reshape(N, -1), scale.reshape(N, -1), None if offset is None else offset.reshape(N, -1),
                  group, lo, bits)


# ---------------------------------------------------------------------------------------------
# Kernels: PyTorch's int4 (groups of 32) and int8 (per row) weight-only matmuls. The int4 weight
# layout differs by device: the CPU op packs [N, K] int32, the CUDA one [N, K/2] uint8 pairs.

GROUP = 32
CHUNK_ELEMENTS = 1 << 21  # rows dequantized at once hold about this many values
CPU_KERNEL_MAX_ROWS = 8  # above this many rows of activations, dequantize and use a dense GEMM


def kernels_on(device: torch.device | str) -> bool:
    """Whether the int4/int8 kernels run on `device` (CPU, or CUDA with bf16 tensor cores)."""
    device = torch.device(device)
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    return False


def _inner_k_tiles(K: int) -> int:
    return next(t for t in (8, 4, 2) if K % (t * 16) == 0)


def _pack_int4(q4: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [n, K] (n a multiple of 16, or of 8 on CUDA) -> the device's int4 kernel layout."""
    if q4.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 2)
    pairs = ((q4[:, ::2] << 4) | q4[:, 1::2]).to(torch.uint8)  # untested here: no CUDA on the dev machine
    return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(q4.shape[1]))


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)


def _unpack_cpu_int4(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of the CPU packing: blocks of `block` rows store, for each column, bytes whose low
    nibbles are the block's first half of rows and high nibbles its second half; a last partial
    block stores adjacent row pairs."""
    n, K = packed.shape[0], packed.shape[1] * 2
    full = n // block * block
    body = packed[:full].reshape(-1, K, block // 2)
    out = [torch.cat([body & 15, body >> 4], 2).transpose(1, 2).reshape(full, K)]
    if n > full:
        tail = packed[full:].reshape(K, (n - full) // 2)
        out.append(torch.stack([tail & 15, tail >> 4], 2).reshape(K, n - full).t())
    return torch.cat(out)


@lru_cache(maxsize=None)
def cpu_int4_block() -> int | None:
    """Rows per block of this CPU's int4 layout (it follows the vector width), checked by packing
    a probe; None if it is none we know, and then packed int4 weights are never unpacked."""
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (144, 64), dtype=torch.int32, generator=g)
    packed = _pack_int4(probe)
    for block in (64, 32, 16):
        if torch.equal(_unpack_cpu_int4(packed, block).int(), probe):
            return block
    return None


def _rows_per_chunk(K: int) -> int:
    """Rows dequantized together: a multiple of 64, so chunks start on int4 layout blocks."""
    return max(64, CHUNK_ELEMENTS // K // 64 * 64)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def _padded(t: torch.Tensor, n: int, value) -> torch.Tensor:
    return t if t.shape[0] == n else torch.cat([t, t.new_full((n - t.shape[0], *t.shape[1:]), value)])


def padded_rows(n: int) -> int:
    """Rows an int4 matrix of n rows is stored with (the kernels take multiples of 16 or 8)."""
    return -(-n // 16) * 16


def _unpack_cpu_int4_rows(packed: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Values 0..15 of rows [a, b) of a CPU-packed matrix; a is a multiple of 64 and b is too, or
    the end (a layout block never straddles such a boundary)."""
    return _unpack_cpu_int4(packed[a:b], cpu_int4_block())


def _gather_cpu_int4(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Values 0..15 of rows `index` of a CPU-packed matrix, [len(index), K]."""
    block = cpu_int4_block()
    n, half = packed.shape
    full = n // block * block
    k = torch.arange(2 * half, device=index.device)
    index = index.long()
    # full blocks: byte k * block/2 + j % (block/2) of the row's block, high nibble for the 2nd half
    j = index % block
    pos = (index - j)[:, None] * half + k * (block // 2) + (j % (block // 2))[:, None]
    high = j >= block // 2
    # the last partial block: adjacent pairs of rows, high nibble for the odd one
    t = (index - full).clamp(min=0)
    tail = full * half + k * max((n - full) // 2, 1) + (t // 2)[:, None]
    in_tail = index >= full
    pos = torch.where(in_tail[:, None], tail, pos)
    high = torch.where(in_tail, t % 2 == 1, high)
    byte = packed.reshape(-1)[pos]
    return torch.where(high[:, None], byte >> 4, byte & 15)


# ---------------------------------------------------------------------------------------------
# Packed linear layers


class PackedLinear(nn.Module):
    """A weight-only quantized linear layer: y = x W^T (+ bias), W [out_features, in_features].

    Subclasses give `kernel` (the fast path for a few rows of activations; None where there is
    none), `dequantize(a, b)` (rows a..b of W in `compute_dtype`) and `gather` (any rows of W in
    float32). On the CPU a prefill chunk (more than CPU_KERNEL_MAX_ROWS rows) runs a dense GEMM
    on W dequantized a chunk of rows at a time, which beats the weight-only kernels there.
    """

    fmt = "?"

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype,
                 compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype  # the stage's: what rows() returns
        self.compute_dtype = compute_dtype
        self.bias: nn.Parameter | None = None

    def kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def dequantize(self, a: int = 0, b: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def can_dequantize(self) -> bool:
        return True

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W for token ids (an embedding lookup), in the stage's dtype."""
        return self.gather(ids.reshape(-1)).to(self.dtype).view(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = None
        if x2.shape[0] <= CPU_KERNEL_MAX_ROWS or x.device.type != "cpu" or not self.can_dequantize:
            y = self.kernel(x2)
        if y is None:
            x2 = x2.to(self.compute_dtype)
            N, step = self.out_features, _rows_per_chunk(self.in_features)
            y = torch.cat([F.linear(x2, self.dequantize(a, min(a + step, N))) for a in range(0, N, step)], -1)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


class Int4Linear(PackedLinear):
    """4-bit planes in groups of 32 that share one bf16 (scale, zero) table [K/32, N, 2]:
    W = sum_i c_i * ((q_i - 8) * scale + zero). One plane (c = 1) is the int4 format; two
    (c = 16, 1) hold 8 bits (int8x2)."""

    def __init__(self, planes: list[torch.Tensor], sz: torch.Tensor, coefs: tuple[int, ...],
                 out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__(out_features, in_features, dtype)
        self.fmt = "int4" if len(planes) == 1 else "int8x2"
        self.planes = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in planes])
        self.sz = nn.Parameter(sz, requires_grad=False)
        self.coefs = coefs

    def kernel(self, x):
        x, N = _bf16(x), self.out_features
        if len(self.planes) == 1:
            return _int4_mm(x, self.planes[0], self.sz)[:, :N]
        y = 0
        for c, plane in zip(self.coefs, self.planes):
            y = y + c * _int4_mm(x, plane, self.sz)[:, :N].float()
        return y

    @property
    def can_dequantize(self) -> bool:
        return self.sz.device.type == "cpu" and cpu_int4_block() is not None

    def _weights(self, q4s: list[torch.Tensor], sz: torch.Tensor) -> torch.Tensor:
        """float32 W from plane values 0..15 and their (scale, zero) [K/32, n, 2], in place."""
        n = q4s[0].shape[0]
        w = q4s[0].view(n, -1, GROUP).float().sub_(8)
        for c, q4 in zip(self.coefs[1:], q4s[1:]):
            w.mul_(self.coefs[0] // c).add_(q4.view(n, -1, GROUP).float().sub_(8))
        sz = sz.float().transpose(0, 1)  # [n, K/32, 2]
        return w.mul_(sz[..., :1]).add_(sum(self.coefs) * sz[..., 1:]).view(n, -1)

    def dequantize(self, a=0, b=None):
        b = self.out_features if b is None else b
        end = b if b < self.out_features else self.sz.shape[1]
        q4s = [_unpack_cpu_int4_rows(p, a, end)[:b - a] for p in self.planes]
        return self._weights(q4s, self.sz[:, a:b]).to(self.compute_dtype)

    def gather(self, index):
        return self._weights([_gather_cpu_int4(p, index) for p in self.planes], self.sz[:, index])


class Int8Linear(PackedLinear):
    """8-bit weights with one bf16 scale per row: W = q * scale."""

    fmt = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__(q.shape[0], q.shape[1], dtype)
        self.q = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def kernel(self, x):
        if x.device.type != "cpu":
            return None  # not every CUDA build has the op: dequantize chunks instead
        return torch.ops.aten._weight_int8pack_mm(_bf16(x), self.q, self.scale)

    def dequantize(self, a=0, b=None):
        return (self.q[a:b].float() * self.scale[a:b, None].float()).to(self.compute_dtype)

    def gather(self, index):
        return self.q[index].float() * self.scale[index, None].float()


class GGUFLinear(PackedLinear):
    """The stored GGUF blocks, dequantized a chunk of rows at a time just before use."""

    fmt = "gguf"

    def __init__(self, raw: torch.Tensor, stored: str, in_features: int, dtype: torch.dtype):
        super().__init__(raw.shape[0], in_features, dtype, compute_dtype=dtype)
        self.raw = nn.Parameter(raw, requires_grad=False)
        self.stored = stored

    def dequantize(self, a=0, b=None):
        return unpack(self.raw[a:b], self.stored).dequantize().to(self.compute_dtype)

    def gather(self, index):
        return unpack(self.raw[index], self.stored).dequantize()


# ---------------------------------------------------------------------------------------------
# GGUF matrices -> packed modules


def _row_chunks(g: Groups):
    step = _rows_per_chunk(g.q.shape[1])
    for a in range(0, g.q.shape[0], step):
        yield g.rows(slice(a, a + step))


def _int4_exact(g: Groups):
    """4-bit groups of 32: scale * q + offset = scale * (q4 - 8) + zero, with q4 = q - lo."""
    zero = (g.lo + 8) * g.scale
    return [(g.q.to(torch.int16) - g.lo).to(torch.uint8)], g.scale, zero if g.offset is None else zero + g.offset


def _int4_requant(g: Groups, refits: int = 3):
    """Any groups -> 4 bits in groups of 32: start from min and max, then alternate between the
    integers nearest to the weights under the bf16 (scale, zero) and the least-squares (scale,
    zero) for those integers. Q3_K's two 16-value sub-blocks of a group land on one grid with
    0.45x of Q3_K's own rms error added (0.55x from min and max alone); Q2_K's with 0.19x."""
    w = g.dequantize()
    N, K = w.shape
    w = w.view(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scale, zero = (hi - lo) / 15, lo + 8 * (hi - lo) / 15
    for i in range(refits + 1):
        scale, zero = _bf16(scale).float(), _bf16(zero).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        u = torch.round((w - zero[..., None]) / safe[..., None]).clamp(-8, 7)
        if i == refits:
            break
        su, suu, sx, sux = u.sum(-1), (u * u).sum(-1), w.sum(-1), (u * w).sum(-1)
        det = GROUP * suu - su * su
        ok = det > 0
        scale = torch.where(ok, (GROUP * sux - su * sx) / torch.where(ok, det, 1.0), scale)
        zero = torch.where(ok, (sx - scale * su) / GROUP, zero)
    return [(u + 8).to(torch.uint8).view(N, K)], scale, zero


def _int8x2_planes(g: Groups):
    """Q8_0: q = 16 * (hi - 8) + (lo - 8) + 8 with u = q + 128 = 16 * hi + lo. The two planes share
    (scale, zero = 8 * scale / 17): 16 * zero + zero adds the 8 * scale the split leaves out."""
    u = (g.q.to(torch.int16) + 128).to(torch.uint8)
    return [u >> 4, u & 15], g.scale, g.scale * (8 / 17)


def _int4_module(g: Groups, chunks, coefs, device: torch.device, dtype: torch.dtype) -> Int4Linear:
    N, K = g.q.shape
    n_pad = padded_rows(N)
    planes: list[list[torch.Tensor]] = [[] for _ in coefs]
    scales, zeros, done = [], [], 0
    for q4s, scale, zero in chunks:
        n = q4s[0].shape[0]
        if done + n == N:  # the last chunk: padding rows hold zero weights (q = 8, scale = zero = 0)
            q4s = [_padded(q4, n_pad - done, 8) for q4 in q4s]
        for i, q4 in enumerate(q4s):
            planes[i].append(_pack_int4(q4.to(device)))
        scales.append(scale)
        zeros.append(zero)
        done += n
    sz = torch.stack([_padded(torch.cat(scales), n_pad, 0.0), _padded(torch.cat(zeros), n_pad, 0.0)], -1)
    sz = _bf16(sz).transpose(0, 1).contiguous().to(device)
    return Int4Linear([torch.cat(p) for p in planes], sz, coefs, N, K, dtype)


def pack_matrix(raw: torch.Tensor, stored: str, fmt: str, device, dtype: torch.dtype) -> PackedLinear:
    """Stored rows of a matrix (uint8 [N, bytes per row], rows already in model order) -> its
    module in format `fmt` on `device`; `dtype` is the stage's compute dtype."""
    device = torch.device(device)
    K = raw.shape[1] // GGML_QUANT_SIZES[GGMLQuantizationType[stored]][1] * \
        GGML_QUANT_SIZES[GGMLQuantizationType[stored]][0]
    raw = raw.to(device)
    if fmt == "gguf":
        return GGUFLinear(raw, stored, K, dtype)
    g = unpack(raw, stored)
    if fmt == "int8":
        qs, scales = [], []
        for c in _row_chunks(g):
            w = c.dequantize()
            scale = _bf16(w.abs().amax(1) / 127).float()
            qs.append(torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127).to(torch.int8))
            scales.append(scale)
        return Int8Linear(torch.cat(qs), _bf16(torch.cat(scales)), dtype)
    if fmt == "int8x2":
        if stored != "Q8_0":
            raise QuantError(f"int8x2 holds Q8_0 weights, not {stored}")
        return _int4_module(g, map(_int8x2_planes, _row_chunks(g)), (16, 1), device, dtype)
    if fmt == "int4":
        exact = g.group == GROUP and g.bits <= 4
        return _int4_module(g, map(_int4_exact if exact else _int4_requant, _row_chunks(g)), (1,), device, dtype)
    raise QuantError(f"unknown weight format {fmt!r}")


# ---------------------------------------------------------------------------------------------
# Which format each stored type gets, and what it costs on the device

WEIGHT_MODES = ("auto", "fast", "dequant", "packed", "compact")
# packed: the fastest format whose error stays within the stored type's own
FAST = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q2_K": "int4", "Q3_K": "int4", "Q8_0": "int8x2",
        "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8"}
# compact: the fast format where it costs at most ~1.11x the stored bytes, else the stored blocks
COMPACT = {t: f if f in ("int4", "int8x2") and t not in ("Q2_K", "Q3_K") else "gguf" for t, f in FAST.items()}


def kernels_for(device_type: str) -> bool:
    """Whether a device of this type has the int4/int8 kernels (planning; see kernels_on)."""
    return device_type in ("cpu", "cuda")


# fast: packed where its kernel beats a dense matrix-vector product on the device, else dense.
# On a CPU computing in bf16, Q8_0's two int4 planes decode at 0.83x of the dense bf16 product
# (benchmarks/bench_packed.py speed --types Q8_0), and a prompt's dense GEMM skips dequantizing chunks.
DENSE_WHEN_FAST = {("cpu", torch.bfloat16): frozenset({"Q8_0"})}


def matrix_format(stored: str, shape: tuple[int, ...], mode: str, kernels: bool, device_type: str,
                  dtype: torch.dtype) -> str:
    """How a weight matrix stored as `stored` lives on a device: 'dense' or a packed format."""
    if stored in _PLAIN or len(shape) != 2 or mode == "dequant":
        return "dense"
    if mode == "fast" and (not kernels or stored in DENSE_WHEN_FAST.get((device_type, dtype), ())):
        return "dense"
    fmt = (COMPACT if mode == "compact" else FAST)[stored]
    return fmt if kernels or fmt == "gguf" else "gguf"


def format_nbytes(fmt: str, stored: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Device bytes of a tensor in format `fmt` (dense: in `dtype`)."""
    n = math.prod(shape)
    if fmt == "dense":
        return n * torch.empty((), dtype=dtype).element_size()
    if fmt == "gguf":
        return stored_nbytes(stored, shape)
    N, K = shape
    if fmt == "int8":
        return N * K + 2 * N
    n_pad = padded_rows(N)
    planes = 2 if fmt == "int8x2" else 1
    return planes * n_pad * K // 2 + K // GROUP * n_pad * 4


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise), so that the resident
    size after loading is what the stage holds."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@lru_cache(maxsize=None)
def large_allocations_unmapped() -> None:
    """Serve every CPU allocation of 1 MiB or more by its own mapping, returned when freed: glibc
    otherwise raises that threshold to the largest block freed so far and keeps such transients
    (dequantized chunks, prefill activations) in its heap, and a stage's resident size drifts
    above its tensors by whatever the loading and the prefill happened to free."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
