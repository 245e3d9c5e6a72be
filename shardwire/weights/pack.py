"""A stored matrix as the module of the format its device runs it in: PyTorch's (packed.py) or
ggml's (ggml_cpu.py, its stored blocks or this CPU's repacked layout)."""

from __future__ import annotations

import torch

from .ggml_cpu import GGMLLinear, RepackedLinear, RepackError
from .measure import gemm_rows
from .packed import PackedLinear, in_features, pack_plain


def pack_matrix(raw: torch.Tensor, stored: str, fmt: str, device, dtype: torch.dtype) -> PackedLinear:
    """Stored rows of a matrix (uint8 [N, bytes per row], rows already in model order) -> its
    module in format `fmt` on `device`; `dtype` is the stage's compute dtype. The module keeps
    the type it was stored as in `.stored`."""
    module = _pack(raw, stored, fmt, torch.device(device), dtype)
    module.stored = stored
    return module


def _pack(raw: torch.Tensor, stored: str, fmt: str, device: torch.device, dtype: torch.dtype) -> PackedLinear:
    if fmt == "repacked":
        try:
            return RepackedLinear(raw.to(device), stored, in_features(raw, stored), dtype)
        except RepackError:  # a shape this CPU's layout does not take: the stored blocks serve as
            # they are, in memory of the module's own (rows for a repack may view the mapped file)
            return _pack(raw.clone(), stored, "ggml", device, dtype)
    if fmt == "ggml":
        rows = gemm_rows(stored, dtype) if device.type == "cpu" else None
        return GGMLLinear(raw.to(device), stored, in_features(raw, stored), dtype, rows)
    return pack_plain(raw, stored, fmt, device, dtype)
