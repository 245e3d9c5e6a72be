"""Packed on-device weight matrices and the converters that build them from GGUF blocks.

Every GGUF quantized type decodes to the same thing, `Groups` (codecs.py): small integers q [N, K] with a
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

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from .codecs import Groups, QuantError, unpack
from .kernels import (
    GROUP,
    bf16,
    cpu_int4_block,
    gather_cpu_int4,
    int4_mm,
    pack_int4,
    padded,
    padded_rows,
    unpack_cpu_int4_rows,
)

CHUNK_ELEMENTS = 1 << 21  # rows dequantized at once hold about this many values
CPU_KERNEL_MAX_ROWS = 8  # above this many rows of activations, dequantize and use a dense GEMM


def rows_per_chunk(K: int) -> int:
    """Rows dequantized together: a multiple of 64, so chunks start on int4 layout blocks."""
    return max(64, CHUNK_ELEMENTS // K // 64 * 64)


class PackedLinear(nn.Module):
    """A weight-only quantized linear layer: y = x W^T (+ bias), W [out_features, in_features].

    Subclasses give `kernel` (the fast path for a few rows of activations; None where there is
    none), `dequantize(a, b)` (rows a..b of W in `compute_dtype`) and `gather` (any rows of W in
    float32). On the CPU a prefill chunk (more than CPU_KERNEL_MAX_ROWS rows) runs a dense GEMM
    on W dequantized a chunk of rows at a time, which beats the weight-only kernels there.
    """

    fmt = "?"

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, compute_dtype: torch.dtype = torch.bfloat16
    ):
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

    def prefers_whole(self, rows: int) -> bool:
        """Whether a product costs more per row in pieces than whole: forward() on `rows` rows (on a
        CPU) decodes all of W, a chunk at a time, into a GEMM."""
        return rows > CPU_KERNEL_MAX_ROWS and self.can_dequantize

    def _chunk(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b for one GEMM of forward(), used before the next chunk is asked for."""
        return self.dequantize(a, b)

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
            N, step = self.out_features, rows_per_chunk(self.in_features)
            y = torch.cat([F.linear(x2, self._chunk(a, min(a + step, N))) for a in range(0, N, step)], -1)
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

    def __init__(
        self,
        planes: list[torch.Tensor],
        sz: torch.Tensor,
        coefs: tuple[int, ...],
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
    ):
        super().__init__(out_features, in_features, dtype)
        self.fmt = "int4" if len(planes) == 1 else "int8x2"
        self.planes = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in planes])
        self.sz = nn.Parameter(sz, requires_grad=False)
        self.coefs = coefs

    def kernel(self, x):
        x, N = bf16(x), self.out_features
        if len(self.planes) == 1:
            return int4_mm(x, self.planes[0], self.sz)[:, :N]
        y = 0
        for c, plane in zip(self.coefs, self.planes):
            y = y + c * int4_mm(x, plane, self.sz)[:, :N].float()
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
        q4s = [unpack_cpu_int4_rows(p, a, end)[: b - a] for p in self.planes]
        return self._weights(q4s, self.sz[:, a:b]).to(self.compute_dtype)

    def gather(self, index):
        return self._weights([gather_cpu_int4(p, index) for p in self.planes], self.sz[:, index])


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
        return torch.ops.aten._weight_int8pack_mm(bf16(x), self.q, self.scale)

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


# GGUF matrices -> packed modules


def in_features(raw: torch.Tensor, stored: str) -> int:
    """Columns of a matrix whose stored rows are `raw`."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[stored]]
    return raw.shape[1] // type_size * block


def _row_chunks(g: Groups):
    step = rows_per_chunk(g.q.shape[1])
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
        scale, zero = bf16(scale).float(), bf16(zero).float()
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
            q4s = [padded(q4, n_pad - done, 8) for q4 in q4s]
        for i, q4 in enumerate(q4s):
            planes[i].append(pack_int4(q4.to(device)))
        scales.append(scale)
        zeros.append(zero)
        done += n
    sz = torch.stack([padded(torch.cat(scales), n_pad, 0.0), padded(torch.cat(zeros), n_pad, 0.0)], -1)
    sz = bf16(sz).transpose(0, 1).contiguous().to(device)
    return Int4Linear([torch.cat(p) for p in planes], sz, coefs, N, K, dtype)


def pack_plain(raw: torch.Tensor, stored: str, fmt: str, device, dtype: torch.dtype) -> PackedLinear:
    """Stored rows of a matrix (uint8 [N, bytes per row], rows already in model order) -> its
    module in one of this module's formats (gguf, int8, int8x2, int4) on `device`; `dtype` is the
    stage's compute dtype. weights/pack.pack_matrix takes ggml's formats too."""
    device = torch.device(device)
    raw = raw.to(device)
    if fmt == "gguf":
        return GGUFLinear(raw, stored, in_features(raw, stored), dtype)
    g = unpack(raw, stored)
    if fmt == "int8":
        qs, scales = [], []
        for c in _row_chunks(g):
            w = c.dequantize()
            scale = bf16(w.abs().amax(1) / 127).float()
            qs.append(torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127).to(torch.int8))
            scales.append(scale)
        return Int8Linear(torch.cat(qs), bf16(torch.cat(scales)), dtype)
    if fmt == "int8x2":
        if stored != "Q8_0":
            raise QuantError(f"int8x2 holds Q8_0 weights, not {stored}")
        return _int4_module(g, map(_int8x2_planes, _row_chunks(g)), (16, 1), device, dtype)
    if fmt == "int4":
        exact = g.group == GROUP and g.bits <= 4
        return _int4_module(g, map(_int4_exact if exact else _int4_requant, _row_chunks(g)), (1,), device, dtype)
    raise QuantError(f"unknown weight format {fmt!r}")
