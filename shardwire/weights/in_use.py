"""Which kernels compute on a device, in the one line every command prints at start, and the
warning where shardwire's fast CPU kernels are missing."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from urllib.parse import unquote, urlparse

import torch

from . import ggml_cpu

# Decode of the 1B-layout Q4_0, Q8_0 and F16 files in one process against llama.cpp's on the same
# files (an AMD EPYC with AVX2), installed by the README's command: PyTorch's kernels alone, and
# the kernels the install builds (README, "Set-up"; benchmarks/results/zen3-readme-install*).
WITHOUT_KERNELS, WITH_KERNELS = "0.25-0.63x", "0.99-1.03x"


def compute_line(device: str) -> str:
    """What computes on `device`: "ggml 0.9.4 (llama.cpp 0.3.36) + shardwire products, AVX-512
    VNNI", "PyTorch 2.13.0 only (...)", "PyTorch 2.13.0, CUDA 12.8, NVIDIA H100"."""
    if device.startswith("cpu"):
        if ggml_cpu.available():
            return ggml_cpu.describe()
        return (
            f"PyTorch {torch.__version__} only (shardwire's CPU kernels are missing: {_first_words(ggml_cpu.MISSING)})"
        )
    if device.startswith("cuda"):
        return f"PyTorch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(device)}"
    return f"PyTorch {torch.__version__}, {device}"


def _first_words(reason: str, most: int = 120) -> str:
    """A reason's first line, cut to `most` characters (the line crosses the wire, capped there)."""
    line = reason.splitlines()[0] if reason else ""
    return line if len(line) <= most else line[: most - 3] + "..."


def missing_kernels_warning() -> str | None:
    """What a CPU loses without shardwire's kernels and how to get them; None where they run."""
    if ggml_cpu.available():
        return None
    if ggml_cpu.MISSING.startswith("turned off"):
        why, remedy = ggml_cpu.MISSING, f"unset {ggml_cpu.OFF} to use them"
    else:
        why = f"missing ({_first_words(ggml_cpu.MISSING, 400)})"
        remedy = f"with a C/C++ compiler and cmake installed, build them: {reinstall_command()}"
    return (
        f"shardwire's CPU kernels are {why}: CPU weights run on PyTorch's kernels, which decoded at "
        f"{WITHOUT_KERNELS} llama.cpp's speed where the kernels give {WITH_KERNELS}; {remedy}"
    )


def reinstall_command() -> str:
    """The pip command that builds this install of shardwire again, kernels included."""
    pip = f"{sys.executable} -m pip install"
    found = (d.read_text("direct_url.json") for d in metadata.distributions(name="shardwire"))
    try:  # the installed one says where it came from; a source tree's egg-info says nothing
        origin = json.loads(next((text for text in found if text), "{}"))
    except ValueError:
        origin = {}
    url = urlparse(origin.get("url", ""))
    if url.scheme == "file" and "dir_info" in origin:
        path = unquote(url.path)
        return f"{pip} -e {path}" if origin["dir_info"].get("editable") else f"{pip} --force-reinstall --no-deps {path}"
    return f"{pip} --force-reinstall --no-deps --no-binary shardwire shardwire"
