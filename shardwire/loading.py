"""Build a Stage from stored tensors: read only its layers, decode or pack them, undo llama.cpp's
Q/K order."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import torch

from .config import ModelConfig
from .formats import ModelFile, TensorInfo, TensorReader
from .model import Stage
from .quant import (WEIGHT_MODES, format_nbytes, kernels_on, large_allocations_unmapped, matrix_format, pack_matrix,
                    raw_rows, release_memory, to_torch)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose one of {', '.join(DTYPES)})")
    return DTYPES[name]


def undo_qk_interleave(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's converter permute: rows (head, pair, 2) -> (head, 2, pair)."""
    shape = t.shape
    return t.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def model_rows(cfg: ModelConfig, name: str, t: torch.Tensor, qk_interleaved: bool) -> torch.Tensor:
    """Rows of a stored tensor (decoded, or raw GGUF rows: blocks never cross rows) in model order."""
    if qk_interleaved:
        kind = name.split(".")[-2]
        if kind == "attn_q":
            return undo_qk_interleave(t, cfg.n_heads)
        if kind == "attn_k":
            return undo_qk_interleave(t, cfg.n_kv_heads)
    return t


def decode_tensor(cfg: ModelConfig, info: TensorInfo, raw: np.ndarray, qk_interleaved: bool) -> torch.Tensor:
    return model_rows(cfg, info.name, to_torch(raw, info.dtype, info.shape), qk_interleaved)


# -- weight formats ----------------------------------------------------------------------

EMBEDDING = "token_embd.weight (embedding)"  # the token table, where a stage holds it apart from its head


def resolve_weights(mode: str, device: torch.device | str) -> str:
    """--weights for one device when no plan chose: auto is fast where the kernels run."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown --weights '{mode}' (choose one of {', '.join(WEIGHT_MODES)})")
    if mode == "auto":
        return "fast" if kernels_on(device) else "dequant"
    return mode


def weight_formats(cfg: ModelConfig, tensors: Mapping[str, TensorInfo], first: bool, last: bool, mode: str,
                   device_type: str, dtype: torch.dtype) -> dict[str, str]:
    """How each tensor of a stage lives on a device of `device_type` computing in `dtype` under
    weights `mode` (fast | dequant | packed | compact): 'dense' or a packed format of quant.py,
    by tensor name, plus EMBEDDING when the token table needs a copy of its own beside the head."""
    kernels = device_type in ("cpu", "cuda")
    tied_head = last and cfg.tied_embeddings
    out = {}
    for name, info in tensors.items():
        fmt = matrix_format(info.dtype, tuple(info.shape), mode, kernels, device_type, dtype)
        if name == "token_embd.weight" and not tied_head and fmt != "dense":
            fmt = "gguf"  # an embedding only gathers rows: the stored blocks serve it as they are
        out[name] = fmt
    # a tied head serves as the table too, unless its rows cannot be read back (int4 on CUDA)
    head = out.get("token_embd.weight")
    if first and tied_head and head in ("int4", "int8x2") and device_type != "cpu":
        out[EMBEDDING] = "gguf"
    return out


def weight_nbytes(tensors: Mapping[str, TensorInfo], formats: Mapping[str, str], dtype: torch.dtype) -> int:
    """Device bytes of a stage's weights in the given formats."""
    total = 0
    for name, fmt in formats.items():
        info = tensors["token_embd.weight" if name == EMBEDDING else name]
        total += format_nbytes(fmt, info.dtype, tuple(info.shape),
                               torch.float32 if name == "rope_freqs.weight" else dtype)
    return total


def build_stage(cfg: ModelConfig, start: int, end: int, first: bool, last: bool,
                tensors: Mapping[str, TensorInfo], read: Callable[[TensorInfo], np.ndarray],
                qk_interleaved: bool, device: str | torch.device, dtype: torch.dtype,
                progress: Callable[[int], None] | None = None, weights: str = "dequant") -> Stage:
    """`weights`: dequant (every tensor decoded to `dtype`), packed or compact (quant.py's
    formats), or auto (packed where the kernels run, else dequant)."""
    device = torch.device(device)
    mode = resolve_weights(weights, device)
    large_allocations_unmapped()
    formats = weight_formats(cfg, tensors, first, last, mode, device.type if kernels_on(device) else "none", dtype)
    built, embedding = {}, None
    for name, info in tensors.items():
        raw = read(info)
        fmt = formats[name]
        if fmt == "dense":
            t = decode_tensor(cfg, info, raw, qk_interleaved)
            # rope frequency factors keep full precision; everything else runs in the stage dtype.
            built[name] = t.to(device=device, dtype=torch.float32 if name == "rope_freqs.weight" else dtype)
        else:
            rows = model_rows(cfg, name, raw_rows(raw, info.dtype, tuple(info.shape)), qk_interleaved)
            module = pack_matrix(rows, info.dtype, fmt, device, dtype)
            if name == "token_embd.weight" and not (last and cfg.tied_embeddings):
                embedding = module
            else:
                built[name] = module
            if name == "token_embd.weight" and EMBEDDING in formats:
                embedding = pack_matrix(rows, info.dtype, formats[EMBEDDING], device, dtype)
            del rows
        if progress is not None:
            progress(info.nbytes)
    release_memory()
    return Stage(cfg, start, end, built, first, last, embedding=embedding, dtype=dtype).to(device)


def load_stage(model: ModelFile, start: int, end: int, *, first: bool | None = None,
               last: bool | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, reader: TensorReader | None = None,
               progress: Callable[[int], None] | None = None, weights: str = "dequant") -> Stage:
    """Blocks [start, end) of `model`, reading only the tensors that stage needs."""
    first = start == 0 if first is None else first
    last = end == model.config.n_layers if last is None else last
    reader = reader or TensorReader()
    tensors = model.stage_tensors(start, end, first, last)
    return build_stage(model.config, start, end, first, last, tensors, reader.read,
                       model.qk_interleaved, device, dtype, progress, weights)
