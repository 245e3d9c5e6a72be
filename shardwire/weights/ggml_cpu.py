"""ggml's CPU kernels on the stored blocks, through ggml-python: llama.cpp's own products for every
GGUF type, weights used as stored, float32 activations (quantized inside the kernel where ggml
does it, as llama.cpp's CPU backend does). A block's experts run as one graph over all of them
(mul_mat_id), as llama.cpp runs them.

Where ggml has a repacked layout for a type on this CPU (its CPU_REPACK buffer: Q4_0 and Q4_K
interleaved 8 rows at a time on x86, other layouts on ARM), a weight can be copied into it once
at load, as llama.cpp does: the same bytes, read by kernels that multiply several rows at once.
The ggml that shardwire builds (kernels/) also reads repacked Q4_K with its tiled products for 8 rows or
more (tiled_reads_repacked), as it reads stored blocks: a prompt chunk then multiplies a
repacked Q4_K weight as fast as, and to the same bits as, the stored blocks.

The kernels are built into the package by its own build (kernels/build_backend.py: ggml-python's
bindings on llama.cpp's ggml, with shardwire's products). Where that build could not run, or
SHARDWIRE_GGML=0 turns them off, `available()` is False, MISSING says why, and the PyTorch formats
serve instead.

One module of this length: ggml's bindings, the lifetime of its contexts and graphs, and the modules
built on them (GGMLLinear, RepackedLinear, GGMLExperts) share one graph cache and the ctypes
plumbing.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from ..enums import GROUPED_TYPES
from .codecs import PLAIN
from .packed import GGUFLinear

OFF = "SHARDWIRE_GGML"  # =0: PyTorch's kernels only, as where ggml's could not be built
BUILT = Path(__file__).resolve().parents[1] / "_ggml"  # what kernels/build_backend.py left (or NOT_BUILT)


def _bindings():
    """ggml's bindings as the package's build left them, else None and why."""
    if os.environ.get(OFF) == "0":
        return None, f"turned off by {OFF}=0"
    lacking = _flags_lacking()
    if lacking:  # -march=native code would stop the process at its first such instruction
        return None, f"built on another CPU: this one lacks {' '.join(lacking)}; reinstall to build them here"
    try:
        from .. import _ggml
    except ImportError:
        _ggml = None
    except (OSError, RuntimeError) as e:  # the library is there and does not load
        return None, f"ggml's library does not load here ({e})"
    if not hasattr(_ggml, "lib"):
        not_built = BUILT / "NOT_BUILT"
        return None, not_built.read_text().strip() if not_built.is_file() else "this install was built without them"
    return _ggml, None


def _flags_lacking() -> list[str]:
    """The CPU flags the kernels were built with (shardwire/_ggml/BUILD) that this CPU lacks."""
    try:
        built = (BUILT / "BUILD").read_text().splitlines()
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    needed = next((line.split(":", 1)[1].split() for line in built if line.startswith("cpu flags:")), [])
    have = next((line.split(":", 1)[1].split() for line in info if line.startswith(("flags", "Features"))), [])
    return sorted(set(needed) - set(have)) if have else []


ggml, MISSING = _bindings()

log = logging.getLogger("shardwire.ggml")

_local = threading.local()

GRAPHS_KEPT = 64  # graphs a thread keeps built: per op, type and shape (decode's one row, prompt chunks, ...)
GRAPH_NODES = 4  # one operation on two inputs


GGML_LOG_WARN, GGML_LOG_ERROR = 3, 4


def _log(level: int, text: bytes, _user_data) -> None:
    """ggml's own messages: its warnings and errors to our log; its debug lines (one per repacked
    tensor) nowhere."""
    if level in (GGML_LOG_WARN, GGML_LOG_ERROR):
        log.warning("ggml: %s", text.decode(errors="replace").rstrip())


_log_callback = ggml.ggml_log_callback(_log) if ggml is not None else None  # kept alive for ggml


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether ggml's CPU kernels can be called in this process."""
    if ggml is None:
        return False
    ggml.ggml_log_set(_log_callback, None)
    ggml.ggml_cpu_init()
    return True


def _work_buffer(nbytes: int):
    """This thread's scratch for ggml's work (activations quantized for a kernel, ...): one for
    every graph it runs, as they run one at a time, grown to the largest asked for."""
    work = _local.__dict__.get("work")
    if work is None or work[0].nbytes < nbytes:
        memory = np.empty(max(nbytes, 1), dtype=np.uint8)
        work = _local.work = memory, memory.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    return work[1]


class _Built:
    """A ggml graph built once in a context of its own; a call points its tensors at data and
    computes it."""

    lends = False

    def __init__(self, nodes: int, tensors: int, nbytes: int = 0):
        """A context for up to `nodes` nodes and `tensors` tensors, or of `nbytes` where given."""
        mem = nbytes or ggml.ggml_tensor_overhead() * tensors + ggml.ggml_graph_overhead_custom(nodes, False) + 1024
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        self._nodes = nodes

    def _finish(self, y, threads: int) -> None:
        """Build the graph that computes y, and its plan for `threads`."""
        self.graph = ggml.ggml_new_graph_custom(self.ctx, self._nodes, False)
        ggml.ggml_build_forward_expand(self.graph, y)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)

    def _compute(self) -> None:
        self.plan.work_data = _work_buffer(self.plan.work_size)
        if ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan)) != 0:
            raise RuntimeError("ggml could not compute")

    def __del__(self):
        if ggml is not None and getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


class _Graph(_Built):
    """One operation on a weight W and one other tensor x, giving y. A graph on a repacked weight
    is built with one (`weight`): its buffer and kernel traits, which the plan's work size and
    the computation dispatch on, are the same for every weight of that type."""

    lends = True  # built with the repacked weight it runs on, if any
    OPS = {
        "mul_mat": lambda ctx, w, x: ggml.ggml_mul_mat(ctx, w, x),
        "copy": lambda ctx, w, x: ggml.ggml_cpy(ctx, w, x),
    }

    def __init__(self, op: str, qtype: int, K: int, N: int, n: int, weight: "_Repacked | None", threads: int):
        super().__init__(GRAPH_NODES, 4)
        self.w = ggml.ggml_new_tensor_2d(self.ctx, qtype, K, N)
        if weight is not None:
            weight.lend_to(self.w)
        self.x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, K, n)
        self.y = self.OPS[op](self.ctx, self.w, self.x)
        self._finish(self.y, threads)

    def run(self, w: int, x: int, y: int) -> None:
        self.w.contents.data, self.x.contents.data, self.y.contents.data = w, x, y
        self._compute()


def least_recently_used(kept: OrderedDict, key, limit: int, make, usable=lambda built: True):
    """kept[key] where it is there and usable, else make()'s, the least recently used dropped
    past `limit` kept."""
    built = kept.pop(key, None)
    if built is None or not usable(built):
        built = make()
        if len(kept) >= limit:
            kept.popitem(last=False)
    kept[key] = built
    return built


def _kept(cls, *shape, weight=None):
    """This thread's built graph `cls(*shape, [weight,] threads)` (`weight` for the classes that
    lend repacked weights: one, or a tuple with None for the others): shared by every weight of
    that type, shape and layout (a call points it at its own data), LRU-kept."""
    graphs = _local.__dict__.setdefault("graphs", OrderedDict())
    layout = tuple(w is not None for w in weight) if isinstance(weight, tuple) else weight is not None
    key = (cls, *shape, layout, torch.get_num_threads())
    return least_recently_used(
        graphs, key, GRAPHS_KEPT, lambda: cls(*shape, *((weight,) if cls.lends else ()), key[-1])
    )


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
        self.qtype = int(GGMLQuantizationType[stored])
        self._row_bytes = raw.shape[1]
        # from this many rows (a prompt chunk) on, dequantize chunks into a GEMM instead (measured)
        self.gemm_rows = gemm_rows

    def _graph(self, op: str, rows: int, n: int) -> _Graph:
        """The built graph of `op` on `rows` rows of W and `n` rows of x."""
        return _kept(_Graph, op, self.qtype, self.in_features, rows, n)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._graph("mul_mat", self.out_features, x.shape[0]).run(self.raw.data_ptr(), x.data_ptr(), y.data_ptr())
        return y

    def prefers_whole(self, rows: int) -> bool:
        return self.gemm_rows is not None and rows >= self.gemm_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.prefers_whole(rows):
            return super().forward(x)  # dequantized chunks into a GEMM (PackedLinear.forward)
        shape = x.shape
        y = self.kernel(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def _rows(self, index) -> torch.Tensor:
        if self.stored in PLAIN:
            return self.raw[index].view(PLAIN[self.stored]).float()
        if self.stored in GROUPED_TYPES:
            return super().gather(index)
        rows = self.raw[index].contiguous()  # read by ggml's own dequantizer (no torch decoder reads these)
        out = torch.empty(rows.shape[0], self.in_features, dtype=torch.float32)
        self._graph("copy", rows.shape[0], rows.shape[0]).run(rows.data_ptr(), out.data_ptr(), out.data_ptr())
        return out

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


@lru_cache(maxsize=None)
def _repack_buffer_type():
    """ggml's CPU_REPACK buffer type, or None where this ggml has none."""
    if not available():
        return None
    address = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    extra_types = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    found = extra_types(ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU))
    i = 0
    while found[i]:
        if ggml.ggml_backend_buft_name(found[i]) == b"CPU_REPACK":
            return found[i]
        i += 1
    return None


def build() -> str | None:
    """What this ggml build brings that changes which kernels are fastest (its measurements are
    kept apart from another build's: the bindings' version names kernels/' changes to ggml);
    None without ggml."""
    if not available():
        return None
    parts = [ggml.ggml_version().decode(), f"bindings {ggml.__version__}"]
    parts.append("repacks" if _repack_buffer_type() is not None else "no repacks")
    parts.append("llamafile" if ggml.ggml_cpu_has_llamafile() else "no llamafile")
    if tiled_reads_repacked():
        parts.append("tiled repacked Q4_K")
    return ", ".join(parts)


def describe() -> str:
    """This ggml in a few words: its version, whose build, and what of the CPU its kernels use."""
    release = ggml.__version__.partition("+llamacpp.")[2].partition(".shardwire")[0]
    products = " + shardwire products" if own_products("gemm") or own_products("gemv") else ""
    return (
        f"ggml {ggml.ggml_version().decode()}"
        + (f" (llama.cpp {release})" if release else "")
        + f"{products}, {_isa()}"
    )


def _isa() -> str:
    """The widest vector instructions ggml was built for here (its build follows the CPU's)."""
    has = {name: bool(getattr(ggml, f"ggml_cpu_has_{name}")()) for name in _FEATURES}
    if has["avx512"]:
        found = "AVX-512" + "".join(f" {n.upper()}" for n in ("vnni", "bf16") if has[f"avx512_{n}"])
    elif has["avx2"]:
        found = "AVX2" + (" VNNI" if has["avx_vnni"] else "")
    elif has["neon"]:
        found = "NEON" + "".join(f" {n}" for n in ("dotprod", "matmul_int8", "sve") if has[n])
    else:
        found = "no vector extensions ggml uses"
    return found + (", AMX-INT8" if has["amx_int8"] else "")


_FEATURES = (
    "avx512",
    "avx512_vnni",
    "avx512_bf16",
    "avx2",
    "avx_vnni",
    "amx_int8",
    "neon",
    "dotprod",
    "matmul_int8",
    "sve",
)


@lru_cache(maxsize=None)
def tiled_reads_repacked() -> bool:
    """Whether this ggml's tiled products read repacked Q4_K (kernels/tiled_q4_Kx8.cpp, which
    shardwire's build adds; llama.cpp's own ggml has no such thing)."""
    if not available():
        return False
    try:
        getattr(ggml.lib, "ggml_compute_forward_mul_mat_tiled_q4_Kx8")
    except AttributeError:
        return False
    return True


# shardwire's own products in the ggml shardwire builds (kernels/products.cpp), by the rows they
# take ("gemm": a prompt chunk, 16 rows or more; "gemv": one row) and the stored type they multiply
# (held as policy.PRODUCT_FORMATS says): each one's switch. Each stands in for ggml's kernel
# (tinyBLAS, the repack buffer's GEMM for Q4_0, the tiled products for Q4_K and Q6_K; ggml's dot
# products for one row).
OWN_PRODUCTS = {
    "gemm": {"Q8_0": 1 << 0, "Q4_0": 1 << 1, "F32": 1 << 2, "F16": 1 << 3, "Q4_K": 1 << 8, "Q6_K": 1 << 9},
    "gemv": {"Q8_0": 1 << 4, "F16": 1 << 5, "Q4_0": 1 << 6, "Q4_K": 1 << 7, "IQ2_XXS": 1 << 10, "IQ3_XXS": 1 << 11},
}


def _switches(name: str) -> int:
    function = getattr(ggml.lib, name)
    function.restype = ctypes.c_uint
    return function()


@lru_cache(maxsize=None)
def own_products(kind: str = "gemm") -> tuple[str, ...]:
    """The stored types this ggml has shardwire's own products of `kind` for: none in llama.cpp's
    own ggml, nor where shardwire's was built for a CPU without AVX-512."""
    if not available():
        return ()
    try:
        built = _switches("shardwire_products_built")
    except AttributeError:
        return ()
    return tuple(t for t, switch in OWN_PRODUCTS[kind].items() if built & switch)


def use_own_products(types, kind: str = "gemm") -> None:
    """shardwire's own products of `kind` for the stored `types`, ggml's kernels for the others
    (the other kind's stay as they are), from the next graph computed on (every thread of this
    process)."""
    if own_products(kind):
        others = _switches("shardwire_products_used") & ~sum(OWN_PRODUCTS[kind].values())
        ggml.lib.shardwire_products_use(ctypes.c_uint(others | sum(OWN_PRODUCTS[kind][t] for t in set(types))))


def own_products_used(kind: str = "gemm") -> tuple[str, ...]:
    """The stored types whose products of `kind` shardwire's own kernels take now."""
    if not own_products(kind):
        return ()
    used = _switches("shardwire_products_used")
    return tuple(t for t in own_products(kind) if used & OWN_PRODUCTS[kind][t])


def quantized(values: torch.Tensor, stored: str) -> torch.Tensor:
    """float32 `values` [out, in] as rows of `stored` blocks, quantized by ggml (uint8 [out, bytes a
    row]); not for the types that need an importance matrix."""
    rows, n = values.shape
    values = values.to(torch.float32).contiguous()  # ggml reads float32
    qtype = int(GGMLQuantizationType[stored])
    if ggml.ggml_quantize_requires_imatrix(qtype):
        raise ValueError(f"{stored} is quantized with an importance matrix")
    out = torch.empty(rows, ggml.ggml_row_size(qtype, n), dtype=torch.uint8)
    src = ctypes.cast(values.data_ptr(), ctypes.POINTER(ctypes.c_float))
    ggml.ggml_quantize_chunk(qtype, src, ctypes.c_void_p(out.data_ptr()), 0, rows, n, None)
    return out


class RepackError(ValueError):
    pass


class _Repacked:
    """One weight (or `experts` weights of one shape, one after another) in ggml's repack buffer,
    which reorders stored blocks into this CPU's kernel layout as they are written; memory of
    ggml's own, freed with this object."""

    def __init__(self, qtype: int, K: int, N: int, experts: int = 0):
        buffer_type = _repack_buffer_type()
        if buffer_type is None:
            raise RepackError("this ggml build has no repacked layouts")
        tensors = 1 + experts  # the weight, and one per expert written (write_expert)
        self.ctx = ggml.ggml_init(
            ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * tensors + 256, no_alloc=True)
        )
        if experts:
            self.tensor = ggml.ggml_new_tensor_3d(self.ctx, qtype, K, N, experts)
        else:
            self.tensor = ggml.ggml_new_tensor_2d(self.ctx, qtype, K, N)
        size = ggml.ggml_backend_buft_get_alloc_size(buffer_type, self.tensor)
        self.buffer = ggml.ggml_backend_buft_alloc_buffer(buffer_type, size)
        if not self.buffer:
            raise MemoryError(f"ggml could not allocate {size} bytes")
        ggml.ggml_backend_tensor_alloc(self.buffer, self.tensor, ggml.ggml_backend_buffer_get_base(self.buffer))
        # the buffer names the kernel for the type and shape here; writing into it without one crashes
        if not self.tensor.contents.extra:
            raise RepackError(f"ggml has no repacked layout for {GGMLQuantizationType(qtype).name} [{N}, {K}] here")
        self.nbytes = size

    def write(self, raw: torch.Tensor) -> None:
        ggml.ggml_backend_tensor_set(self.tensor, raw.data_ptr(), 0, raw.numel())

    def write_expert(self, e: int, raw: np.ndarray) -> None:
        """Expert e's stored blocks [rows, bytes a row], repacked into its part of the buffer (a
        tensor of its own there, which the buffer repacks as it is written): a block's experts
        are written one at a time, never all held as stored beside the repacked ones."""
        weight = self.tensor.contents
        t = ggml.ggml_new_tensor_2d(self.ctx, weight.type, weight.ne[0], weight.ne[1])
        ggml.ggml_backend_tensor_alloc(self.buffer, t, self.data + e * weight.nb[2])
        raw = np.ascontiguousarray(raw)
        ggml.ggml_backend_tensor_set(t, raw.ctypes.data, 0, raw.nbytes)

    def held(self) -> torch.Tensor:
        """Its bytes as a uint8 tensor (ggml's memory, not copied), kept alive by the view."""
        memory = (ctypes.c_uint8 * self.nbytes).from_address(self.data)
        memory.owner = self
        return torch.frombuffer(memory, dtype=torch.uint8)

    @property
    def data(self) -> int:
        return self.tensor.contents.data

    def lend_to(self, t) -> None:
        """Make graph tensor `t` run as this weight does (its buffer and kernel traits)."""
        t.contents.buffer, t.contents.extra, t.contents.data = self.buffer, self.tensor.contents.extra, self.data

    def __del__(self):
        if ggml is None:
            return
        if getattr(self, "buffer", None):
            ggml.ggml_backend_buffer_free(self.buffer)
        if getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)


def _expert_rows(weight: _Repacked) -> tuple[int, int, int]:
    """A repacked block of experts' shape as its stored buffer has it: [experts, rows, bytes a row]."""
    t = weight.tensor.contents
    return t.ne[2], t.ne[1], t.nb[1]


def repackable(stored: str, K: int, N: int) -> bool:
    """Whether ggml repacks a [N, K] matrix of `stored` blocks on this CPU."""
    if stored in PLAIN or not available():
        return False
    try:
        _Repacked(int(GGMLQuantizationType[stored]), K, N)
    except RepackError:
        return False
    return True


class RepackedLinear(nn.Module):
    """The stored blocks of a matrix in ggml's repacked layout for this CPU, multiplied by the
    kernels made for it (for one row and for a prompt chunk's many; Q4_K chunks by the tiled
    products where tiled_reads_repacked()). The layout cannot be read back: such a matrix is
    never a token table."""

    fmt = "repacked"

    def __init__(self, raw: torch.Tensor, stored: str, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.stored, self.in_features, self.out_features = stored, in_features, raw.shape[0]
        self.compute_dtype = dtype
        self.qtype = int(GGMLQuantizationType[stored])
        self.layout = _Repacked(self.qtype, in_features, self.out_features)
        self.layout.write(raw.contiguous())
        # its bytes, as the stage's weights are counted (parameters): ggml's memory, not copied
        self.held = nn.Parameter(self.layout.held(), requires_grad=False)
        self.bias = None

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt} {self.stored}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x32 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(x32.shape[0], self.out_features, dtype=torch.float32)
        rows = x32.shape[0]
        graph = _kept(_Graph, "mul_mat", self.qtype, self.in_features, self.out_features, rows, weight=self.layout)
        self.layout.lend_to(graph.w)
        graph.run(self.layout.data, x32.data_ptr(), y.data_ptr())
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class _ExpertsGraph(_Built):
    """A block's experts in one ggml graph: for each row, its chosen experts' gate and up (ggml's
    mul_mat_id, which groups the rows by expert), SwiGLU, then down; the k outputs per row come
    back unsummed. Built with the repacked ones among the three (`lent`), whose buffer and kernel
    traits the plan and the computation dispatch on."""

    NODES = 32
    lends = True

    def __init__(
        self,
        types: tuple[int, int, int],
        D: int,
        F: int,
        E: int,
        k: int,
        n: int,
        biased: bool,
        clamped: tuple[float, float] | None,
        lent: tuple,
        threads: int,
    ):
        """biased: each matrix's product plus its expert's bias; clamped: (limit, alpha) of gpt-oss's
        clamped SwiGLU, else the SwiGLU."""
        super().__init__(self.NODES, self.NODES)
        ctx = self.ctx
        self.gate, self.up, self.down = expert_tensors(ctx, types, D, F, E, lent)
        self.x = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, D, 1, n)
        self.ids = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, k, n)
        self.biases = tuple(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, r, E) for r in (F, F, D)) if biased else ()

        made = []  # every tensor the graph computes before y: a call gives them memory for its own duration

        def product(i: int, w, x):
            out = ggml.ggml_mul_mat_id(ctx, w, x, self.ids)
            if biased:
                made.append(out)
                out = ggml.ggml_add_id(ctx, out, self.biases[i], self.ids)
            return out

        g, u = product(0, self.gate, self.x), product(1, self.up, self.x)  # [F, k, n]
        if clamped is None:
            h = ggml.ggml_swiglu_split(ctx, g, u)  # silu(g) * u
        else:
            h = ggml.ggml_swiglu_oai(ctx, g, u, clamped[1], clamped[0])
        self.y = product(2, self.down, h)  # [D, k, n]
        self.between = [*made, g, u, h]
        self.between_sizes = [ggml.ggml_nelements(t) for t in self.between]
        self._finish(self.y, threads)

    def run(self, weights: tuple, x: int, ids: int, y: int, biases: tuple = ()) -> None:
        """weights: gate, up and down, each the address of its stored blocks or its _Repacked;
        biases: the addresses of their [experts, rows] float32 biases, where built biased."""
        for t, weight in zip((self.gate, self.up, self.down), weights):
            point_at(t, weight)
        for t, bias in zip(self.biases, biases):
            t.contents.data = bias
        self.x.contents.data, self.ids.contents.data, self.y.contents.data = x, ids, y
        # a prompt's are large: held only while computing, not for as long as the graph is kept
        between = torch.empty(sum(self.between_sizes), dtype=torch.float32)
        at = 0
        for t, size in zip(self.between, self.between_sizes):
            t.contents.data = between[at:].data_ptr()
            at += size
        self._compute()


def point_at(t, weight) -> None:
    """Make graph tensor `t` read `weight`: a _Repacked lends it its buffer and kernel traits; an
    address is where its stored bytes lie."""
    if isinstance(weight, _Repacked):
        weight.lend_to(t)
    else:
        t.contents.data = weight


def expert_tensors(ctx, types: tuple[int, int, int], D: int, F: int, E: int, held: tuple) -> tuple:
    """A block's experts' gate, up and down as ggml tensors [D, F, E], [D, F, E], [F, D, E]; each
    on what `held` gives for it: a _Repacked (lent), the address of its stored blocks, or None
    (pointed at them on each call)."""
    shapes = ((D, F), (D, F), (F, D))
    out = []
    for qtype, (K, N), weight in zip(types, shapes, held):
        t = ggml.ggml_new_tensor_3d(ctx, qtype, K, N, E)
        if weight is not None:
            point_at(t, weight)
        out.append(t)
    return tuple(out)


def repacked_experts(stored: str, K: int, N: int, experts: int) -> _Repacked:
    """Room for a block's `experts` [N, K] matrices of `stored` blocks in ggml's repacked layout,
    written with write_expert; RepackError where this CPU has no such layout for them."""
    return _Repacked(int(GGMLQuantizationType[stored]), K, N, experts)


class GGMLExperts(nn.Module):
    """Every expert of a block as stored: gate, up and down each one uint8 buffer [experts, rows,
    bytes per row] in its GGUF type, or its experts written into ggml's repacked layout
    (repacked_experts, as llama.cpp holds a CPU's experts): run by ggml for the experts each row
    chose and nothing else; a repacked matrix's one-row kernels decode, and ggml's tiled products
    take an expert's rows from 8 on where this ggml reads the layout so."""

    def __init__(self, gate, up, down, stored: tuple[str, str, str]):
        super().__init__()
        self.stored = stored
        self._types = tuple(int(GGMLQuantizationType[s]) for s in stored)
        self._weights = [gate, up, down]
        held = [m.held().view(*_expert_rows(m)) if isinstance(m, _Repacked) else m for m in self._weights]
        self.gate, self.up, self.down = held  # each matrix's bytes, [experts, rows, bytes per row]
        self.n_experts, self.ffn_dim = self.gate.shape[0], self.gate.shape[1]
        self.dim = self.down.shape[1]
        self.fmt = "repacked" if any(isinstance(w, _Repacked) for w in self._weights) else "ggml"
        self.clamped: tuple[float, float] | None = None  # (limit, alpha) of a clamped SwiGLU; None: SwiGLU
        self.biases: tuple[torch.Tensor, ...] = ()  # gate's, up's and down's [experts, rows], where they have them

    def set_activation(self, activation: str, biases: list, cfg) -> None:
        """The block's activation (BlockVariant.activation: silu, or clamped_swiglu with
        ModelConfig's limit and alpha) and its experts' biases (gate's, up's, down's, or Nones)."""
        if activation not in ("silu", "clamped_swiglu"):
            raise ValueError(f"ggml's experts compute silu or clamped_swiglu, not {activation}")
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("experts with biases on some of gate, up and down but not all")
        self.clamped = (cfg.swiglu_limit, cfg.swiglu_alpha) if activation == "clamped_swiglu" else None
        self.biases = tuple(b.float().cpu().contiguous() for b in biases) if biases[0] is not None else ()

    def tensors(self, ctx) -> tuple:
        """Gate, up and down as ggml tensors on the bytes this module holds (expert_tensors)."""
        return expert_tensors(ctx, self._types, self.dim, self.ffn_dim, self.n_experts, self._held())

    def _held(self) -> tuple:
        """Each matrix as ggml takes it: its _Repacked, or the address of its stored blocks."""
        return tuple(w if isinstance(w, _Repacked) else w.data_ptr() for w in self._weights)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [rows, dim], each row's chosen experts [rows, k] and their weights -> [rows, dim]."""
        n, k = chosen.shape
        x32 = x.to(torch.float32).contiguous()
        ids = chosen.to(torch.int32).contiguous()
        y = torch.empty(n, k, self.dim, dtype=torch.float32)
        lent = tuple(w if isinstance(w, _Repacked) else None for w in self._weights)
        shape = (self._types, self.dim, self.ffn_dim, self.n_experts, k, n, bool(self.biases), self.clamped)
        graph = _kept(_ExpertsGraph, *shape, weight=lent)
        graph.run(self._held(), x32.data_ptr(), ids.data_ptr(), y.data_ptr(), tuple(b.data_ptr() for b in self.biases))
        return torch.einsum("nkd,nk->nd", y, weights.to(torch.float32)).to(x.dtype)
