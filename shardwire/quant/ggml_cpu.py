"""ggml's CPU kernels on the stored blocks, through ggml-python: llama.cpp's own products for every
GGUF type, weights used as stored, float32 activations (quantized inside the kernel where ggml
does it, as llama.cpp's CPU backend does).

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


class _Graph:
    """A built ggml graph of one operation on a weight W and one other tensor x, giving y: a call
    only points the three at data and computes."""

    OPS = {
        "mul_mat": lambda ctx, w, x: ggml.ggml_mul_mat(ctx, w, x),
        "copy": lambda ctx, w, x: ggml.ggml_cpy(ctx, w, x),
    }

    def __init__(self, op: str, qtype: int, K: int, N: int, n: int, threads: int):
        mem = ggml.ggml_tensor_overhead() * 4 + ggml.ggml_graph_overhead_custom(GRAPH_NODES, False) + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        self.w = ggml.ggml_new_tensor_2d(self.ctx, qtype, K, N)
        self.x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, K, n)
        self.y = self.OPS[op](self.ctx, self.w, self.x)
        self.graph = ggml.ggml_new_graph_custom(self.ctx, GRAPH_NODES, False)
        ggml.ggml_build_forward_expand(self.graph, self.y)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)
        self.work = np.empty(max(self.plan.work_size, 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def run(self, w: int, x: int, y: int) -> None:
        self.w.contents.data, self.x.contents.data, self.y.contents.data = w, x, y
        if ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan)) != 0:
            raise RuntimeError("ggml could not compute")

    def __del__(self):
        if ggml is not None and getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


_local = threading.local()


def _graph(op: str, qtype: int, K: int, N: int, n: int) -> _Graph:
    """This thread's built graph of `op` on a [N, K] weight of `qtype` and `n` rows of x: shared
    by every matrix of that type and shape (a call points it at its own data), LRU-kept."""
    graphs = _local.__dict__.setdefault("graphs", OrderedDict())
    key = (op, qtype, K, N, n, torch.get_num_threads())
    graph = graphs.pop(key, None)
    if graph is None:
        graph = _Graph(op, qtype, K, N, n, key[-1])
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
        return _graph(op, self._qtype, self.in_features, rows, n)

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
