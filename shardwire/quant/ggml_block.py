"""A dense block's arithmetic around attention as two ggml graphs on a CPU: the norm and the Q, K,
V projections; then the output projection and residual, the feed-forward norm, gate, up, SwiGLU,
down and the second residual. PyTorch keeps RoPE, the KV cache and attention in between.

A decode step is a few rows against every weight of the model. Run one PyTorch or ggml call at
a time, its ~20 calls per block cost more than their arithmetic, and every matrix starts its
stream from a cold prefetcher; two graphs per block stream the block's matrices back to back,
as llama.cpp's graph does. A prompt chunk goes through the same graphs in pieces of rows where
every matrix multiplies a piece as it is held (no dequantized GEMM that pieces would repeat):
each row then meets the same kernels (ggml's norm and SwiGLU round unlike PyTorch's) whether it
is decoded or read in a prompt, so the keys and values a reply left in the cache are the ones a
prompt holding it computes.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from . import ggml_cpu
from .ggml_cpu import GGMLLinear, RepackedLinear, ggml

MAX_ROWS = 8  # rows (sequences of a decode step) the graphs take in one go
KEPT = 6  # (thread, row count) pairs a block keeps its graphs built for: decode's, a prompt's pieces
ALIGN = 64
PROMPT = "prompt"  # the arena of a prompt's pieces

_GGML_TYPES = {torch.float32: "GGML_TYPE_F32", torch.float16: "GGML_TYPE_F16", torch.bfloat16: "GGML_TYPE_BF16"}


class _Matrix:
    """One weight as a ggml graph takes it: type, shape, where its bytes are, and for a repacked
    weight the buffer its kernels dispatch on; plus the bias added after it."""

    def __init__(self, qtype: int, K: int, N: int, data: int, bias, repacked=None):
        self.qtype, self.K, self.N, self.data, self.bias, self.repacked = qtype, K, N, data, bias, repacked

    def tensor(self, ctx):
        t = ggml.ggml_new_tensor_2d(ctx, self.qtype, self.K, self.N)
        if self.repacked is not None:
            self.repacked.lend_to(t)
        else:
            t.contents.data = self.data
        return t


def _matrices(module: nn.Module, rows: list[int] | None = None) -> list[_Matrix] | None:
    """`module` as ggml matrices, split into consecutive row ranges of the given sizes (a fused
    dense projection holds several; None: one of all its rows); None if ggml cannot run it as it
    is held."""
    from ..model import Linear

    bias = getattr(module, "bias", None)
    if isinstance(module, RepackedLinear):
        found = [_Matrix(module._qtype, module.in_features, module.out_features, 0, bias, module._weight)]
    elif isinstance(module, GGMLLinear):
        found = [_Matrix(module._qtype, module.in_features, module.out_features, module.raw.data_ptr(), bias)]
    elif isinstance(module, Linear) and module.weight.dtype in _GGML_TYPES and module.weight.is_contiguous():
        w = module.weight
        qtype, K, row_bytes = getattr(ggml, _GGML_TYPES[w.dtype]), w.shape[1], w.shape[1] * w.element_size()
        found, start = [], 0
        for n in rows or [w.shape[0]]:
            b = None if bias is None else bias[start : start + n]
            found.append(_Matrix(qtype, K, n, w.data_ptr() + start * row_bytes, b))
            start += n
        return found if start == w.shape[0] else None
    else:
        return None
    return found if rows is None else None


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


class _Arena:
    """Memory for graph intermediates; a thread's graphs for a row count (or for a prompt's
    pieces) share one, as the blocks run one after another. Mapped apart, so that its pages can
    be given back between steps while the graphs keep pointing at it."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, ALIGN))
        self.memory = np.frombuffer(self.map, dtype=np.uint8)
        self.nbytes = nbytes

    def release(self) -> None:
        """Give its pages back (the next use finds them zeroed, which the graphs never read)."""
        self.map.madvise(mmap.MADV_DONTNEED)


class _Part(ggml_cpu._Built):
    """One of a block's two graphs for `rows` rows: inputs and output pointed at the caller's
    tensors on each call, intermediates in the thread's arena."""

    def __init__(self, build, rows: int, threads: int, arenas: dict):
        super().__init__(64, 64)
        self.inputs, self.y = build(self.ctx, rows)
        self._finish(self.y, threads)  # the plan's work size does not depend on where data lies
        self.y.contents.data = 1  # placed by the caller: not an intermediate
        self.arena = self._place(rows, arenas)

    def _place(self, rows: int, arenas: dict) -> _Arena:
        nodes = [ggml.ggml_graph_node(self.graph, i) for i in range(ggml.ggml_graph_n_nodes(self.graph))]
        unplaced = [t for t in nodes if not t.contents.data]
        sizes = [-(-ggml.ggml_nbytes(t) // ALIGN) * ALIGN for t in unplaced]
        key = rows if rows <= MAX_ROWS else PROMPT  # a prompt's pieces of every size share one
        arena = arenas.get(key)
        if arena is None or arena.nbytes < sum(sizes):
            arena = arenas[key] = _Arena(sum(sizes))  # graphs built on a smaller one keep theirs
        at = arena.memory.ctypes.data
        for t, size in zip(unplaced, sizes):
            t.contents.data = at
            at += size
        return arena

    def __call__(self, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        for t, x in zip(self.inputs, inputs):
            t.contents.data = x.data_ptr()
        self.y.contents.data = out.data_ptr()
        self._compute()
        return out


_local = threading.local()


def release_prompt_memory() -> None:
    """After a step with a prompt chunk: the intermediates of its pieces need not stay resident."""
    arena = _local.__dict__.get("arenas", {}).get(PROMPT)
    if arena is not None:
        arena.release()


class BlockGraphs:
    """The two graphs of a dense block (attention projections; output projection through the
    feed-forward), built per row count and thread on first use."""

    def __init__(self, block: nn.Module, qkv: list[_Matrix], out: _Matrix, ffn: list[_Matrix], piece: int | None):
        # no reference to the block, which holds this: its weights are freed with it, not by the
        # cycle collector some time later
        self.attn_norm = _f32(block.attn_norm.weight)
        self.ffn_norm = _f32(block.ffn_norm.weight)
        self.eps_attn, self.eps_ffn = block.attn_norm.eps, block.ffn_norm.eps
        self.qkv, self.out, self.gate, self.up, self.down = qkv, out, *ffn
        for m in [*qkv, out, *ffn]:
            m.bias = _f32(m.bias)
        self.dim = self.attn_norm.shape[0]
        self.qkv_width = sum(m.N for m in qkv)
        self.piece = piece  # rows of a prompt chunk a graph takes at once; None: prompts go through the modules
        self._built: OrderedDict[tuple[int, int], tuple[_Part, _Part]] = OrderedDict()

    @classmethod
    def of(cls, block: nn.Module) -> "BlockGraphs | None":
        """The graphs for a block of the dense kind whose weights ggml can all run as held."""
        from ..model import Attention, FeedForward, ffn_piece_rows, prefers_whole

        attn, ffn = block.attn, block.ffn
        if not ggml_cpu.available() or not isinstance(attn, Attention) or not isinstance(ffn, FeedForward):
            return None
        H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if attn.wqkv is not None:
            qkv = _matrices(attn.wqkv, [H * D, KV * D, KV * D])
        else:
            parts = [_matrices(m) for m in (attn.wq, attn.wk, attn.wv)]
            qkv = None if None in parts else [p[0] for p in parts]
        out = _matrices(attn.wo)
        if ffn.gate_up is not None:
            half = ffn.gate_up.weight.shape[0] // 2
            gate_up = _matrices(ffn.gate_up, [half, half])
        else:
            g, u = _matrices(ffn.gate), _matrices(ffn.up)
            gate_up = None if g is None or u is None else g + u
        down = _matrices(ffn.down)
        if qkv is None or out is None or gate_up is None or down is None:
            return None
        piece = ffn_piece_rows(down[0].K) // MAX_ROWS * MAX_ROWS
        whole = any(prefers_whole(m, piece) for m in block.modules())
        return cls(block, qkv, out[0], [*gate_up, down[0]], None if whole else piece)

    def takes(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.dim
        return x.dtype == torch.float32 and x.device.type == "cpu" and (rows <= MAX_ROWS or self.piece is not None)

    # -- the two graphs ---------------------------------------------------------------------

    @staticmethod
    def _linear(ctx, m: _Matrix, h):
        y = ggml.ggml_mul_mat(ctx, m.tensor(ctx), h)
        if m.bias is None:
            return y
        b = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, m.N)
        b.contents.data = m.bias.data_ptr()
        return ggml.ggml_add(ctx, y, b)

    def _vector(self, ctx, t: torch.Tensor):
        v = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, t.shape[0])
        v.contents.data = t.data_ptr()
        return v

    def _norm(self, ctx, x, weight: torch.Tensor, eps: float):
        return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, eps), self._vector(ctx, weight))

    def _build_project(self, ctx, rows: int):
        x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, self.dim, rows)
        h = self._norm(ctx, x, self.attn_norm, self.eps_attn)
        outs = [self._linear(ctx, m, h) for m in self.qkv]
        y = outs[0]
        for o in outs[1:]:
            y = ggml.ggml_concat(ctx, y, o, 0)
        return [x], y

    def _build_finish(self, ctx, rows: int):
        x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, self.dim, rows)
        attn = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, self.out.K, rows)
        mid = ggml.ggml_add(ctx, x, self._linear(ctx, self.out, attn))
        h = self._norm(ctx, mid, self.ffn_norm, self.eps_ffn)
        swiglu = ggml.ggml_swiglu_split(ctx, self._linear(ctx, self.gate, h), self._linear(ctx, self.up, h))
        return [x, attn], ggml.ggml_add(ctx, mid, self._linear(ctx, self.down, swiglu))

    # --------------------------------------------------------------------------------------------

    def _parts(self, rows: int) -> tuple[_Part, _Part]:
        if MAX_ROWS < rows < self.piece:
            self._parts(self.piece)  # first, so that the prompt arena has the largest piece's size
        key = (threading.get_ident(), rows)
        parts = self._built.pop(key, None)
        if parts is None:
            threads, arenas = torch.get_num_threads(), _local.__dict__.setdefault("arenas", {})
            parts = (
                _Part(self._build_project, rows, threads, arenas),
                _Part(self._build_finish, rows, threads, arenas),
            )
            if len(self._built) >= KEPT:
                self._built.popitem(last=False)
        self._built[key] = parts
        return parts

    def _through(self, part: int, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """Graph `part` (0: project, 1: finish) over the rows of `inputs` into `out`, [rows, ...]
        each: a decode step's few rows at once, a prompt chunk's a piece at a time."""
        rows = out.shape[0]
        if rows <= MAX_ROWS:
            return self._parts(rows)[part](out, *inputs)
        for a in range(0, rows, self.piece):
            b = min(a + self.piece, rows)
            self._parts(b - a)[part](out[a:b], *(t[a:b] for t in inputs))
        return out

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """attn_norm(x) through Q, K and V: [..., dim] -> [..., q | k | v]."""
        rows = x.numel() // self.dim
        out = torch.empty(rows, self.qkv_width, dtype=torch.float32)
        self._through(0, out, x.reshape(rows, self.dim).contiguous())
        return out.view(*x.shape[:-1], self.qkv_width)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x + o(attn), then that plus the feed-forward of its norm."""
        rows = x.numel() // self.dim
        flat = x.reshape(rows, self.dim).contiguous()
        out = self._through(1, torch.empty_like(flat), flat, attn.reshape(rows, -1).contiguous())
        return out.view(x.shape)
