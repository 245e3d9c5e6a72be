"""Build a Stage from stored tensors: read only its layers, decode, undo llama.cpp's Q/K order."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import torch

from .config import ModelConfig
from .formats import ModelFile, TensorInfo, TensorReader
from .model import Stage
from .quant import to_torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose one of {', '.join(DTYPES)})")
    return DTYPES[name]


def undo_qk_interleave(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's converter permute: rows (head, pair, 2) -> (head, 2, pair)."""
    shape = t.shape
    return t.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def decode_tensor(cfg: ModelConfig, info: TensorInfo, raw: np.ndarray, qk_interleaved: bool) -> torch.Tensor:
    t = to_torch(raw, info.dtype, info.shape)
    if qk_interleaved:
        kind = info.name.split(".")[-2]
        if kind == "attn_q":
            t = undo_qk_interleave(t, cfg.n_heads)
        elif kind == "attn_k":
            t = undo_qk_interleave(t, cfg.n_kv_heads)
    return t


def build_stage(cfg: ModelConfig, start: int, end: int, first: bool, last: bool,
                tensors: Mapping[str, TensorInfo], read: Callable[[TensorInfo], np.ndarray],
                qk_interleaved: bool, device: str | torch.device, dtype: torch.dtype,
                progress: Callable[[int], None] | None = None) -> Stage:
    weights = {}
    for name, info in tensors.items():
        t = decode_tensor(cfg, info, read(info), qk_interleaved)
        # rope frequency factors keep full precision; everything else runs in the stage dtype.
        weights[name] = t.to(device=device, dtype=torch.float32 if name == "rope_freqs.weight" else dtype)
        if progress is not None:
            progress(info.nbytes)
    return Stage(cfg, start, end, weights, first, last).to(device)


def load_stage(model: ModelFile, start: int, end: int, *, first: bool | None = None,
               last: bool | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, reader: TensorReader | None = None,
               progress: Callable[[int], None] | None = None) -> Stage:
    """Blocks [start, end) of `model`, reading only the tensors that stage needs."""
    first = start == 0 if first is None else first
    last = end == model.config.n_layers if last is None else last
    reader = reader or TensorReader()
    tensors = model.stage_tensors(start, end, first, last)
    return build_stage(model.config, start, end, first, last, tensors, reader.read,
                       model.qk_interleaved, device, dtype, progress)
