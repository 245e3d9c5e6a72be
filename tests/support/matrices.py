"""Random matrices stored as each GGUF type, with gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import torch

from shardwire_kit.writer import quantize


def matrix(dtype: str, rows: int = 72, cols: int = 512, seed: int = 0):
    """(original float32, stored rows as uint8 [rows, bytes], gguf's dequantization) of a random
    matrix. 72 rows pad to 80: one 64-row layout block and a 16-row tail."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data, qtype = quantize(w, dtype)
    assert qtype.name == dtype
    from gguf.quants import dequantize

    return w, torch.from_numpy(data.reshape(rows, -1).copy()), torch.from_numpy(dequantize(data, qtype))
