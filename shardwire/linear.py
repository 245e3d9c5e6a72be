"""Weight matrices as modules: a dense Linear, or a packed one (weights/packed.py) in its place, and
projections of the same input fused into one product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # one row: PyTorch's bf16 matrix-vector kernel reads the weights ~1.6x faster than
            # the general matmul it picks for linear()
            y = torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


Weight = torch.Tensor | nn.Module  # a dense tensor, or a packed module from weights/packed.py


def linear(weight: Weight, bias: torch.Tensor | None = None) -> nn.Module:
    """A Linear for a dense weight; a packed weight (weights/packed.PackedLinear) already is one.
    A weight -ot keeps on another device (model.Elsewhere) adds its bias there, in its dtype."""
    if isinstance(weight, torch.Tensor):
        return Linear(weight, bias)
    if bias is not None:
        held = getattr(weight, "inner", weight)
        if held is not weight:
            bias = bias.to(weight.where, weight.where_dtype)
        held.bias = nn.Parameter(bias, requires_grad=False)
    return weight


def fused(weights: list[Weight], biases: list[torch.Tensor | None]) -> nn.Module | None:
    """One Linear computing several projections of the same input at once (Q, K and V; gate
    and up), or None when a weight is packed and must stay on its own."""
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return None
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                for w, b in zip(weights, biases)
            ]
        )
    return Linear(torch.cat(weights), bias)
