"""ggml's CPU kernels on the stored blocks, through ggml-python: llama.cpp's own products for every
GGUF type, weights used as stored, float32 activations (quantized inside the kernel where ggml
does it, as llama.cpp's CPU backend does). A block's experts run as one graph over all of them
(mul_mat_id), as llama.cpp runs them.

Optional: without the `ggml-python` package (the `cpu` extra), `available()` is False and the
PyTorch formats serve instead.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from .codecs import PLAIN
from .packed import GGUFLinear

try:
    import ggml
except ImportError:  # the `cpu` extra is not installed
    ggml = None

GRAPHS_KEPT = 64  # graphs a thread keeps built: per op, type and shape (decode's one row, prompt chunks, ...)
GRAPH_NODES = 4  # one operation on two inputs


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether ggml's CPU kernels can be called in this process."""
    if ggml is None:
        return False
    ggml.ggml_cpu_init()
    return True


class _Built:
    """A ggml graph built once in a context of its own; a call points its tensors at data and
    computes it."""

    def __init__(self, nodes: int, tensors: int):
        mem = ggml.ggml_tensor_overhead() * tensors + ggml.ggml_graph_overhead_custom(nodes, False) + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        self._nodes = nodes

    def _finish(self, y, threads: int) -> None:
        """Build the graph that computes y, and its plan and work buffer for `threads`."""
        self.graph = ggml.ggml_new_graph_custom(self.ctx, self._nodes, False)
        ggml.ggml_build_forward_expand(self.graph, y)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)
        self.work = np.empty(max(self.plan.work_size, 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def _compute(self) -> None:
        if ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan)) != 0:
            raise RuntimeError("ggml could not compute")

    def __del__(self):
        if ggml is not None and getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


class _Graph(_Built):
    """One operation on a weight W and one other tensor x, giving y."""

    OPS = {
        "mul_mat": lambda ctx, w, x: ggml.ggml_mul_mat(ctx, w, x),
        "copy": lambda ctx, w, x: ggml.ggml_cpy(ctx, w, x),
    }

    def __init__(self, op: str, qtype: int, K: int, N: int, n: int, threads: int):
        super().__init__(GRAPH_NODES, 4)
        self.w = ggml.ggml_new_tensor_2d(self.ctx, qtype, K, N)
        self.x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, K, n)
        self.y = self.OPS[op](self.ctx, self.w, self.x)
        self._finish(self.y, threads)

    def run(self, w: int, x: int, y: int) -> None:
        self.w.contents.data, self.x.contents.data, self.y.contents.data = w, x, y
        self._compute()


_local = threading.local()


def _kept(cls, *shape):
    """This thread's built graph `cls(*shape, threads)`: shared by every weight of that type and
    shape (a call points it at its own data), LRU-kept."""
    graphs = _local.__dict__.setdefault("graphs", OrderedDict())
    key = (cls, *shape, torch.get_num_threads())
    graph = graphs.pop(key, None)
    if graph is None:
        graph = cls(*shape, key[-1])
        if len(graphs) >= GRAPHS_KEPT:
            graphs.popitem(last=False)
    graphs[key] = graph
    return graph


def _scratch(slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable buffer number `slot`: a prompt chunk's dequantized rows land in the
    same memory for every matrix, instead of fresh allocations the OS must fault in each time."""
    buffers = _local.__dict__.setdefault("buffers", {})
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = buffers.get(slot)
    if buffer is None or buffer.numel() < n:
        buffer = buffers[slot] = torch.empty(n, dtype=torch.uint8)
    return buffer[:n].view(dtype).view(shape)


class GGMLLinear(GGUFLinear):
    """The stored GGUF blocks (or F16/F32 rows), multiplied by ggml's CPU kernels."""

    fmt = "ggml"

    def __init__(
        self, raw: torch.Tensor, stored: str, in_features: int, dtype: torch.dtype, gemm_rows: int | None = None
    ):
        super().__init__(raw, stored, in_features, dtype)
        self._qtype = int(GGMLQuantizationType[stored])
        self._row_bytes = raw.shape[1]
        # from this many rows (a prompt chunk) on, dequantize chunks into a GEMM instead (measured)
        self.gemm_rows = gemm_rows

    def _graph(self, op: str, rows: int, n: int) -> _Graph:
        """The built graph of `op` on `rows` rows of W and `n` rows of x."""
        return _kept(_Graph, op, self._qtype, self.in_features, rows, n)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._graph("mul_mat", self.out_features, x.shape[0]).run(self.raw.data_ptr(), x.data_ptr(), y.data_ptr())
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.gemm_rows is not None and rows >= self.gemm_rows:
            return super().forward(x)  # dequantized chunks into a GEMM (PackedLinear.forward)
        shape = x.shape
        y = self.kernel(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _rows(self, index) -> torch.Tensor:
        if self.stored in PLAIN:
            return self.raw[index].view(PLAIN[self.stored]).float()
        return super().gather(index)

    def dequantize(self, a=0, b=None):
        return self._chunk(a, self.out_features if b is None else b).clone()

    def _chunk(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b of W in the compute dtype, decoded by ggml's own (vectorized) dequantizers into
        this thread's scratch buffer: valid until the next chunk."""
        if self.stored in PLAIN:
            return _scratch(1, (b - a, self.in_features), self.compute_dtype).copy_(
                self.raw[a:b].view(PLAIN[self.stored])
            )
        out = _scratch(0, (b - a, self.in_features), torch.float32)
        graph = self._graph("copy", b - a, b - a)  # W[a:b] copied into x, float32
        graph.run(self.raw.data_ptr() + a * self._row_bytes, out.data_ptr(), out.data_ptr())
        if self.compute_dtype == torch.float32:
            return out
        return _scratch(1, out.shape, self.compute_dtype).copy_(out)

    def gather(self, index):
        return self._rows(index)


class _ExpertsGraph(_Built):
    """A block's experts in one ggml graph: for each row, its chosen experts' gate and up (ggml's
    mul_mat_id, which groups the rows by expert), SwiGLU, then down; the k outputs per row come
    back unsummed."""

    NODES = 16

    def __init__(self, types: tuple[int, int, int], D: int, F: int, E: int, k: int, n: int, threads: int):
        super().__init__(self.NODES, self.NODES)
        self.gate = ggml.ggml_new_tensor_3d(self.ctx, types[0], D, F, E)
        self.up = ggml.ggml_new_tensor_3d(self.ctx, types[1], D, F, E)
        self.down = ggml.ggml_new_tensor_3d(self.ctx, types[2], F, D, E)
        self.x = ggml.ggml_new_tensor_3d(self.ctx, ggml.GGML_TYPE_F32, D, 1, n)
        self.ids = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_I32, k, n)
        g = ggml.ggml_mul_mat_id(self.ctx, self.gate, self.x, self.ids)  # [F, k, n]
        u = ggml.ggml_mul_mat_id(self.ctx, self.up, self.x, self.ids)
        h = ggml.ggml_swiglu_split(self.ctx, g, u)  # silu(g) * u
        self.y = ggml.ggml_mul_mat_id(self.ctx, self.down, h, self.ids)  # [D, k, n]
        self.between = (g, u, h)  # intermediates: a call gives them memory for its own duration
        self.between_size = F * k * n
        self._finish(self.y, threads)

    def run(self, weights: tuple[int, int, int], x: int, ids: int, y: int) -> None:
        self.gate.contents.data, self.up.contents.data, self.down.contents.data = weights
        self.x.contents.data, self.ids.contents.data, self.y.contents.data = x, ids, y
        # a prompt's are large: held only while computing, not for as long as the graph is kept
        between = torch.empty(3, self.between_size, dtype=torch.float32)
        for i, t in enumerate(self.between):
            t.contents.data = between[i].data_ptr()
        self._compute()


class GGMLExperts(nn.Module):
    """Every expert of a block as stored: gate, up and down each one uint8 buffer [experts, rows,
    bytes per row] in its GGUF type, run by ggml for the experts each row chose and nothing else."""

    fmt = "ggml"

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, stored: tuple[str, str, str]):
        super().__init__()
        self.gate, self.up, self.down, self.stored = gate, up, down, stored
        self._types = tuple(int(GGMLQuantizationType[s]) for s in stored)
        self.n_experts, self.ffn_dim = gate.shape[0], gate.shape[1]
        self.dim = down.shape[1]

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [rows, dim], each row's chosen experts [rows, k] and their weights -> [rows, dim]."""
        n, k = chosen.shape
        x32 = x.to(torch.float32).contiguous()
        ids = chosen.to(torch.int32).contiguous()
        y = torch.empty(n, k, self.dim, dtype=torch.float32)
        graph = _kept(_ExpertsGraph, self._types, self.dim, self.ffn_dim, self.n_experts, k, n)
        pointers = (self.gate.data_ptr(), self.up.data_ptr(), self.down.data_ptr())
        graph.run(pointers, x32.data_ptr(), ids.data_ptr(), y.data_ptr())
        return torch.einsum("nkd,nk->nd", y, weights.to(torch.float32)).to(x.dtype)
