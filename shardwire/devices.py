"""The compute devices of this machine, their dtypes and free memory."""
from __future__ import annotations

import os

import psutil
import torch


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


def default_dtype(device: str) -> str:
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "mps":
        return "float16"
    # CPUs with native bf16 dot products read half the bytes per token at no loss of speed;
    # elsewhere bf16 arithmetic is emulated and float32 is faster.
    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"


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
