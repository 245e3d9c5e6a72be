"""ggml's CPU kernels on the stored blocks, through ggml-python: llama.cpp's own products for every
GGUF type, weights used as stored, float32 activations (quantized inside the kernel where ggml
does it, as llama.cpp's CPU backend does).

Optional: without the `ggml-python` package (the `cpu` extra), `available()` is False and the
PyTorch formats serve instead.
"""

from __future__ import annotations

import ctypes
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

GRAPHS_KEPT = 8  # row counts whose graphs a matrix keeps built (decode's one row, the prefill chunk, ...)


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether ggml's CPU kernels can be called in this process."""
    if ggml is None:
        return False
    ggml.ggml_cpu_init()
    return True


class _Product:
    """A built ggml graph y = W x for a fixed number of rows of x: a call only points its
    tensors at the data and computes."""

    def __init__(self, qtype: int, K: int, N: int, n: int, threads: int):
        mem = ggml.ggml_tensor_overhead() * 4 + ggml.ggml_graph_overhead() + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        self.w = ggml.ggml_new_tensor_2d(self.ctx, qtype, K, N)
        self.x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, K, n)
        self.y = ggml.ggml_mul_mat(self.ctx, self.w, self.x)
        self.graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.graph, self.y)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)
        self.work = np.empty(max(self.plan.work_size, 1), dtype=np.uint8)
        self.plan.work_data = self.work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def run(self, w: int, x: int, y: int) -> None:
        self.w.contents.data, self.x.contents.data, self.y.contents.data = w, x, y
        if ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan)) != 0:
            raise RuntimeError("ggml could not compute a matrix product")

    def __del__(self):
        if ggml is not None and getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


class GGMLLinear(GGUFLinear):
    """The stored GGUF blocks (or F16/F32 rows), multiplied by ggml's CPU kernels."""

    fmt = "ggml"

    def __init__(
        self, raw: torch.Tensor, stored: str, in_features: int, dtype: torch.dtype, gemm_rows: int | None = None
    ):
        super().__init__(raw, stored, in_features, dtype)
        self._qtype = int(GGMLQuantizationType[stored])
        self._products: OrderedDict[tuple[int, int], _Product] = OrderedDict()
        # from this many rows (a prompt chunk) on, dequantize chunks into a GEMM instead (measured)
        self.gemm_rows = gemm_rows

    def _product(self, n: int) -> _Product:
        key = (n, torch.get_num_threads())
        product = self._products.pop(key, None)
        if product is None:
            product = _Product(self._qtype, self.in_features, self.out_features, n, key[1])
            if len(self._products) >= GRAPHS_KEPT:
                self._products.popitem(last=False)
        self._products[key] = product
        return product

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._product(x.shape[0]).run(self.raw.data_ptr(), x.data_ptr(), y.data_ptr())
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
        return self._rows(slice(a, b)).to(self.compute_dtype)

    def gather(self, index):
        return self._rows(index)
