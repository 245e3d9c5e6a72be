"""The compute devices of this machine, their dtypes, free memory and the CPU allocator."""

from __future__ import annotations

import ctypes
import gc
import os
from functools import lru_cache

import psutil
import torch

from .enums import COMPUTE_DTYPES

TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    """A compute dtype by name."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose one of {', '.join(COMPUTE_DTYPES)})")
    return TORCH_DTYPES[name]


def default_devices() -> list[str]:
    """Every accelerator found, else the CPU."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        return ["mps"]
    return ["cpu"]


def check_device(name: str) -> str:
    """Validate a device name against what this machine has."""
    if name == "cpu" or name.startswith("cpu:"):
        return name
    if name.startswith("cuda"):
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device {name} not found on this machine")
        return f"cuda:{index}"
    if name == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError("device mps not found on this machine")
        return name
    raise ValueError(f"unknown device '{name}' (use cpu, cuda:N or mps)")


def torch_device(name: str) -> torch.device:
    # "cpu:1" names a second CPU device for planning; PyTorch has one CPU.
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def stored_precision_dtype(dtype: str, device: str, stored: str | None) -> str:
    """The compute dtype a device uses for a model whose matrices are mostly stored as `stored`:
    its own `dtype`, unless that would round those weights below their stored precision (an F32
    file computes in float32; F16 weights never become bf16). The user's --dtype overrides this."""
    if stored == "F32":
        return "float32"
    if stored == "F16" and dtype == "bfloat16":
        return "float32" if device.startswith("cpu") else "float16"
    return dtype


@lru_cache(maxsize=None)
def attention_without_cudnn() -> None:
    """Keep scaled_dot_product_attention off PyTorch's cuDNN backend (for the whole process): it
    builds an execution graph for every new shape, which decode meets at every new KV length,
    and keeps the graphs per thread. Measured on an H200 (torch 2.11): about 40 ms per new length,
    so each sequence decoded ~5x slower than the ~8 ms a 1B model's token takes, until the thread
    running the stage had seen every length once. Flash, memory-efficient and math kernels need
    no such build. The price: masked attention over grouped K/V heads (a prefill chunk) runs on
    the math kernel, and a 1B model's 256-token prefill took 26 ms instead of 12."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def free_memory(device: str) -> int:
    """Bytes free for new tensors on `device`."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    if device == "mps":
        return int(psutil.virtual_memory().available)
    return int(psutil.virtual_memory().available)


def set_threads(n: int | None) -> None:
    if n:
        torch.set_num_threads(n)
        os.environ.setdefault("OMP_NUM_THREADS", str(n))


@lru_cache(maxsize=None)
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


def objects_held_for_good() -> None:
    """After a stage is built: what the process holds now (the stage's modules, tensors and graphs)
    lives as long as its plan, so the cycle collector's full passes, which a decode loop's
    allocations set off, stop walking it (they took 4% of a DeepSeek-V3 layout's decode step,
    benchmarks/results/zen4-cells-decode). objects_let_go undoes it when a plan is released."""
    gc.collect()
    gc.freeze()


def objects_let_go() -> None:
    """A released plan's objects back under the cycle collector."""
    gc.unfreeze()


@lru_cache(maxsize=None)
def large_allocations_unmapped() -> None:
    """Serve every CPU allocation of 256 KiB or more by its own mapping, returned when freed: glibc
    otherwise raises that threshold to the largest block freed so far and keeps such transients
    (dequantized chunks, prefill activations, a prompt piece's rows) in its heap, and a stage's
    resident size drifts above its tensors by whatever the loading and the prefill happened to
    free (measured: a 1B prompt chunk left 8 MiB free but resident in the heap with 1 MiB)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 18)  # M_MMAP_THRESHOLD
