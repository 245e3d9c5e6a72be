"""Per-sequence KV cache: a fixed number of slots, each holding one sequence's keys and values."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for `n_layers` blocks, `n_slots` sequences and `ctx` positions each.

    A sequence owns one slot for its lifetime; positions are absolute within the sequence.
    """

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        ctx: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layers, n_slots, n_kv_heads, ctx, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots, self.ctx = n_slots, ctx

    @staticmethod
    def nbytes_for(n_layers: int, n_slots: int, n_kv_heads: int, ctx: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_slots * n_kv_heads * ctx * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(
        self,
        layer: int,
        rows: slice | torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        n_keys: int,
        start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H, T, D]) at `positions` ([B, T]) of the slots `rows` selects; return
        the first `n_keys` cached positions of those slots as ([B, H, n_keys, D], same).
        `rows` is a slice when the slots are consecutive, so reading back is a view, not a copy;
        `start` is given when B is 1, the positions start..start+T-1."""
        if start is not None:  # one sequence at consecutive positions: plain slice copies
            slot, t = rows.start, k.shape[2]
            self.k[layer, slot, :, start : start + t] = k[0]
            self.v[layer, slot, :, start : start + t] = v[0]
            return self.k[layer, slot : slot + 1, :, :n_keys], self.v[layer, slot : slot + 1, :, :n_keys]
        if isinstance(rows, slice):
            k_layer, v_layer = self.k[layer][rows], self.v[layer][rows]
            batch = torch.arange(k.shape[0], device=k.device)[:, None]
            k_layer[batch, :, positions] = k.transpose(1, 2)
            v_layer[batch, :, positions] = v.transpose(1, 2)
            return k_layer[:, :, :n_keys], v_layer[:, :, :n_keys]
        k_all, v_all = self.k[layer], self.v[layer]
        k_all[rows[:, None], :, positions] = k.transpose(1, 2)
        v_all[rows[:, None], :, positions] = v.transpose(1, 2)
        return k_all[rows, :, :n_keys], v_all[rows, :, :n_keys]

    @staticmethod
    def rows_for(slots: list[int], device) -> slice | torch.Tensor:
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return slice(first, first + len(slots))
        return torch.tensor(slots, device=device)

    def clear(self, slot: int) -> None:
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
