"""Which format multiplies one row of activations fastest on this machine, for each stored type:
measured once per CPU model, compute dtype, thread count and library versions, and kept on disk.

Decode reads every weight once per token, so the format that streams a matrix fastest decides
decode speed; which one that is differs by CPU (PyTorch's bf16 matrix-vector product is fast on
one and slow on another), so it is timed, never inferred from a CPU vendor or feature flag.
The candidates: the dense matrix in the compute dtype, PyTorch's packed kernel for the type, and
ggml's kernel on the stored blocks. Values do not change these kernels' speed, so the matrices
hold zero blocks.
"""

from __future__ import annotations

import json
import os
import platform
import time
from functools import lru_cache
from pathlib import Path

import torch

from ..devices import TORCH_DTYPES, large_allocations_unmapped
from ..enums import QUANT_TYPES
from ..model import Linear
from . import ggml_cpu
from .codecs import stored_nbytes
from .kernels import kernels_on
from .packed import pack_matrix
from .policy import FAST

MEASURED_TYPES = QUANT_TYPES + ("F16", "F32")
SHAPE = (4096, 2048)  # [out, in]: a 1B-class projection, larger than most CPUs' L2
SECONDS = 0.03  # per candidate, at least 3 runs


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(dtype: str) -> str:
    versions = f"torch {torch.__version__}, ggml {'yes' if ggml_cpu.available() else 'no'}"
    return f"{cpu_model()} | {dtype} | {torch.get_num_threads()} thread(s) | {versions} | caches emptied"


def last_level_cache_bytes() -> int:
    """The largest CPU cache, as sysfs lists it (64 MiB where it does not)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except (OSError, ValueError):
            pass
    return max(sizes, default=64 << 20)


@lru_cache(maxsize=None)
def _eviction_buffer() -> torch.Tensor:
    return torch.zeros(2 * last_level_cache_bytes(), dtype=torch.uint8)


def _seconds(call) -> float:
    """Median seconds of `call` with the caches emptied before each run, as when a model much
    larger than the caches streams its weights: a matrix that stays cached would time the cache."""
    call()
    evict, times, start = _eviction_buffer(), [], time.perf_counter()
    while time.perf_counter() - start < SECONDS or len(times) < 3:
        evict.add_(1)
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _seconds_per_row(module: torch.nn.Module, dtype: torch.dtype) -> float:
    x = torch.zeros(1, SHAPE[1], dtype=dtype)
    return _seconds(lambda: module(x))


def _candidates(stored: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    raw = torch.zeros(SHAPE[0], stored_nbytes(stored, SHAPE) // SHAPE[0], dtype=torch.uint8)
    out = {"dense": Linear(torch.zeros(SHAPE, dtype=dtype))}
    if stored in FAST and kernels_on("cpu"):
        out[FAST[stored]] = pack_matrix(raw, stored, FAST[stored], "cpu", dtype)
    if ggml_cpu.available():
        out["ggml"] = ggml_cpu.GGMLLinear(raw, stored, SHAPE[1], dtype)
    return out


def measure(dtype: str) -> dict[str, dict]:
    """For each stored type: every candidate's seconds per row, and the fastest."""
    torch_dtype = TORCH_DTYPES[dtype]
    out = {}
    for stored in MEASURED_TYPES:
        times = {fmt: _seconds_per_row(m, torch_dtype) for fmt, m in _candidates(stored, torch_dtype).items()}
        out[stored] = {"seconds": times, "fastest": min(times, key=times.get)}
    return out


def _cache_file() -> Path:
    from ..cache import default_cache_dir

    return default_cache_dir() / "kernels.json"


def _remembered(key: str, compute) -> dict:
    """known[key] from the cache file, computed and written there when missing."""
    path = _cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return known[key]


NO_GGML = (
    "ggml-python is not installed: CPU weights use PyTorch's kernels only, often several times slower "
    "to decode; pip install 'shardwire[cpu]' (needs cmake and a C compiler)"
)


@lru_cache(maxsize=None)
def fastest_formats(device: str, dtype: str) -> dict[str, str]:
    """Stored type -> the format that decodes fastest on `device` computing in `dtype`. Measured on
    CPUs (a few seconds the first time on a machine, then read from the cache); other devices
    have no measurement and get {}: the policy's defaults apply there."""
    if not device.startswith("cpu"):
        return {}
    measured = _remembered(_key(dtype), lambda: measure(dtype))
    return {stored: entry["fastest"] for stored, entry in measured.items()}


GEMM_ROWS = (16, 64, 256)  # the row counts at which ggml and dequantize-then-GEMM are compared


def _gemm_rows(stored: str, dtype: torch.dtype) -> dict:
    large_allocations_unmapped()  # as when stages are built: each dequantized chunk is mapped afresh
    shape = (SHAPE[0] // 2, SHAPE[1])
    raw = torch.zeros(shape[0], stored_nbytes(stored, shape) // shape[0], dtype=torch.uint8)
    module = ggml_cpu.GGMLLinear(raw, stored, shape[1], dtype)
    times = {}
    for n in GEMM_ROWS:
        x = torch.zeros(n, shape[1], dtype=dtype)
        module.gemm_rows = None
        ggml_s = _seconds(lambda: module(x))
        module.gemm_rows = 0
        gemm_s = _seconds(lambda: module(x))
        times[n] = {"ggml": ggml_s, "gemm": gemm_s}
    rows = next((n for n in GEMM_ROWS if times[n]["gemm"] < times[n]["ggml"]), None)
    return {"seconds": times, "rows": rows}


@lru_cache(maxsize=None)
def gemm_rows(stored: str, dtype: torch.dtype) -> int | None:
    """From how many rows of activations a matrix of `stored` on ggml is faster dequantized a chunk
    at a time into a GEMM in `dtype` (ggml's kernels on blocks that are not repacked are made for
    few rows); None: never, up to the largest count measured. Measured on first use per stored
    type, then read from the cache."""
    name = str(dtype).removeprefix("torch.")
    return _remembered(
        f"{_key(name)} | gemm rows {stored} (ggml dequantizes into scratch, v2)", lambda: _gemm_rows(stored, dtype)
    )["rows"]
