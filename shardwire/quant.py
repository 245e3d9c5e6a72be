"""Turning stored tensor bytes (GGUF types, safetensors dtypes) into PyTorch tensors."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

# Plain types are viewed directly; everything else goes through gguf's dequantizers.
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SUPPORTED_TYPES = frozenset(_PLAIN) | {
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


class QuantError(ValueError):
    pass


def stored_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this stored type and (PyTorch-order) shape occupies in a file."""
    n = 1
    for d in shape:
        n *= d
    if dtype in _PLAIN:
        return n * torch.empty((), dtype=_PLAIN[dtype]).element_size()
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    return n // block * type_size


def to_torch(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes -> a CPU tensor of `shape`: plain types keep their dtype, quantized become float32."""
    if dtype not in SUPPORTED_TYPES:
        raise QuantError(f"tensor type {dtype} is not supported (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    expected = stored_nbytes(dtype, shape)
    if raw.nbytes != expected:
        raise QuantError(f"{dtype} tensor of shape {list(shape)} needs {expected} bytes, got {raw.nbytes}")
    if dtype in _PLAIN:
        # frombuffer on a read-only mapping warns; the tensor is copied before anyone writes to it.
        return torch.frombuffer(bytearray(raw), dtype=_PLAIN[dtype]).reshape(shape)
    qtype = GGMLQuantizationType[dtype]
    rows = raw.reshape(-1, raw.nbytes // (int(np.prod(shape[:-1])) if len(shape) > 1 else 1))
    return torch.from_numpy(quants.dequantize(rows, qtype).astype(np.float32, copy=False)).reshape(shape)
