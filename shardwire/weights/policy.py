"""Which on-device format each stored weight gets under each --weights mode, and what it costs.

Modes: dequant (every matrix dense in the compute dtype), packed (the fastest packed format
whose error stays within the stored type's own), compact (packed only where that costs at most
~1.11x the stored bytes, else the stored blocks), fast (packed where its kernel beats the dense
product on the device, else dense). `auto` is not a mode a stage is built with: the plan tries
`modes_for("auto", ...)` in order, per device, and takes the first that fits.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..enums import CODEBOOK_TYPES, STAGE_WEIGHT_MODES, WEIGHT_MODES
from . import ggml_cpu
from .codecs import PLAIN, stored_nbytes
from .kernels import GROUP, padded_rows

FAST = {
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q2_K": "int4",
    "Q3_K": "int4",
    "Q8_0": "int8x2",
    "Q5_0": "int8",
    "Q5_1": "int8",
    "Q5_K": "int8",
    "Q6_K": "int8",
}
COMPACT = {t: f if f in ("int4", "int8x2") and t not in ("Q2_K", "Q3_K") else "gguf" for t, f in FAST.items()}

# The format whose matrices shardwire's own products (of a prompt chunk, and of one row for Q8_0,
# F16, Q4_0, Q4_K, IQ2_XXS and IQ3_XXS) multiply, by stored type (the others are multiplied by
# ggml's kernels alone)
PRODUCT_FORMATS = {
    "Q8_0": "ggml", "Q4_0": "repacked", "F32": "ggml", "F16": "ggml", "Q4_K": "repacked", "Q6_K": "ggml",
    "IQ2_XXS": "ggml", "IQ3_XXS": "ggml",
}  # fmt: skip


def held_label(stored: str, fmt: str, products: dict[str, str], row_products: dict[str, str] | None = None) -> str:
    """How a stored type is held and multiplied, as the plan and the benchmark show it: "Q4_K:repacked",
    and with whose products take one row and its prompt chunks where that was measured:
    "F16:ggml/shardwire-gemv/shardwire-gemm"."""
    label = f"{stored}:{fmt}"
    if PRODUCT_FORMATS.get(stored) in fmt.split("+"):
        for kind, chosen in (("gemv", row_products or {}), ("gemm", products)):
            if stored in chosen:
                label += f"/{chosen[stored]}-{kind}"
    return label


EMBEDDING = "token_embd.weight (embedding)"  # the token table, where a stage holds it apart from its head


class WeightModeError(ValueError):
    pass


def modes_for(requested: str, kernels: bool) -> list[str]:
    """The modes to try, fastest first, for what the user asked on a device with or without the
    packed kernels: auto is fast, packed, compact where the kernels run, else dequant, compact."""
    if requested not in WEIGHT_MODES:
        raise WeightModeError(f"unknown --weights '{requested}' (choose one of {', '.join(WEIGHT_MODES)})")
    if requested != "auto":
        return [requested]
    return ["fast", "packed", "compact"] if kernels else ["dequant", "compact"]


def matrix_format(
    stored: str,
    shape: tuple[int, ...],
    mode: str,
    kernels: bool,
    fastest: Mapping[str, str],
) -> str:
    """How a weight matrix stored as `stored` lives on a device: 'dense' or a packed format.
    `fastest` is what the device measured for decode (weights/measure.py; empty where nothing was
    measured): fast takes it, and compact runs its stored blocks through ggml where ggml won."""
    if mode not in STAGE_WEIGHT_MODES:
        raise WeightModeError(f"a stage is built with one of {', '.join(STAGE_WEIGHT_MODES)}, not {mode!r}")
    if len(shape) != 2 or mode == "dequant":
        return "dense"
    if mode == "fast" and stored in fastest:
        return fastest[stored]
    if stored in PLAIN:
        return "dense"
    if stored in CODEBOOK_TYPES:  # ggml's kernels, where they run here; no PyTorch kernel reads these blocks
        return fastest[stored] if fastest.get(stored) in ("ggml", "repacked") else "dense"
    if mode == "fast" and not kernels:
        return "dense"
    fmt = (COMPACT if mode == "compact" else FAST)[stored]
    if fmt == "gguf" or not kernels:
        return fastest[stored] if fastest.get(stored) in ("ggml", "repacked") else "gguf"
    return fmt


def format_nbytes(fmt: str, stored: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Device bytes of a tensor in format `fmt` (dense: in `dtype`)."""
    n = math.prod(shape)
    if fmt == "dense":
        return n * torch.empty((), dtype=dtype).element_size()
    if fmt in ("gguf", "ggml", "repacked"):
        return stored_nbytes(stored, shape)
    N, K = shape
    if fmt == "int8":
        return N * K + 2 * N
    n_pad = padded_rows(N)
    planes = 2 if fmt == "int8x2" else 1
    return planes * n_pad * K // 2 + K // GROUP * n_pad * 4


def weight_formats(
    tensors: Mapping,
    first: bool,
    last: bool,
    tied_embeddings: bool,
    mode: str,
    device_type: str,
    kernels: bool,
    fastest: Mapping[str, str],
) -> dict[str, str]:
    """How each tensor of a stage (anything with .dtype and .shape, by name) lives on a device of
    `device_type`, with or without the packed kernels, with what it measured fastest: 'dense' or
    a packed format, plus EMBEDDING when the token table needs a copy of its own beside the head."""
    tied_head = last and tied_embeddings
    out = {}
    for name, info in tensors.items():
        fmt = matrix_format(info.dtype, tuple(info.shape), mode, kernels, fastest)
        if name == "token_embd.weight" and not tied_head and fmt not in ("dense", "gguf"):
            # an embedding only gathers rows: the stored blocks serve it as they are (a plain
            # type's rows and a codebook type's through ggml's module, which reads them without a
            # converted copy)
            if info.dtype in CODEBOOK_TYPES:
                fmt = "ggml"
            elif info.dtype not in PLAIN:
                fmt = "gguf"
            elif fmt != "ggml":
                fmt = "dense"
        out[name] = fmt
    # a tied head serves as the table too, unless its rows cannot be read back (int4 on CUDA, a
    # repacked layout)
    head = out.get("token_embd.weight")
    if first and tied_head and (head == "repacked" or head in ("int4", "int8x2") and device_type != "cpu"):
        stored = tensors["token_embd.weight"].dtype
        out[EMBEDDING] = "ggml" if stored in CODEBOOK_TYPES else "gguf"
    return out


def weight_nbytes(tensors: Mapping, formats: Mapping[str, str], dtype: torch.dtype) -> int:
    """Device bytes of a stage's weights in the given formats."""
    total = 0
    for name, fmt in formats.items():
        info = tensors["token_embd.weight" if name == EMBEDDING else name]
        total += format_nbytes(
            fmt, info.dtype, tuple(info.shape), torch.float32 if name == "rope_freqs.weight" else dtype
        )
    return total


def default_dtype(device: str) -> str:
    """A device's own compute dtype, before the model's weights are considered (see
    stored_precision_dtype)."""
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "mps":
        return "float16"
    if ggml_cpu.available():
        return "float32"  # as llama.cpp's CPU backend: weights stay as stored, activations in float32
    # PyTorch alone: CPUs with native bf16 dot products read half the bytes of a dequantized
    # weight per token; elsewhere bf16 arithmetic is emulated and float32 is faster.
    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"
