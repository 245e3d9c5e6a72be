"""Per-sequence caches: a fixed number of slots, each holding one sequence's keys and values for
the attention blocks and, for gated delta-net blocks, their recurrent state."""

from __future__ import annotations

import torch

from .config import ModelConfig


def kv_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype keys and values are kept in for a stage computing in `compute`: float32 compute
    keeps them in float16, as llama.cpp does by default (half the memory; attention reads them
    back in float32); otherwise the compute dtype."""
    return torch.float16 if compute == torch.float32 else compute


class KVCache:
    """Keys and values for `n_layers` blocks, `n_slots` sequences and `ctx` positions each, kept
    in `dtype`; update() returns them in the dtype they came in.

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
        recurrent: RecurrentState | None = None,
    ):
        """`recurrent`: the state of the stage's delta-net blocks, kept (and counted) with it."""
        shape = (n_layers, n_slots, n_kv_heads, ctx, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots, self.ctx = n_slots, ctx
        self.recurrent = recurrent

    @staticmethod
    def nbytes_for(n_layers: int, n_slots: int, n_kv_heads: int, ctx: int, head_dim: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * n_slots * n_kv_heads * ctx * head_dim * size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self.recurrent.nbytes if self.recurrent is not None else 0)

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
        keys, values = self._update(layer, rows, positions, k.to(self.k.dtype), v.to(self.v.dtype), n_keys, start)
        return keys.to(k.dtype), values.to(v.dtype)

    def _update(self, layer, rows, positions, k, v, n_keys, start):
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
        if self.recurrent is not None:
            self.recurrent.clear(slot)


class RecurrentState:
    """What a gated delta-net block remembers of a sequence, per slot: the last kernel - 1 inputs
    of its causal convolution, and the delta rule's state, a [k_dim, v_dim] matrix per value head
    (float32: it accumulates over the whole sequence).

    Unlike a KV cache this state cannot be truncated or rewound: it holds every position folded
    together. A slot's state is valid only for the positions it has consumed; a sequence that
    starts again at position 0 (a new sequence, or a replay after recovery) starts from zeros,
    and any other start but the next position is refused. Whatever reuses or rewinds cached
    positions (prefix reuse, speculative decoding) must keep a copy or replay from the start."""

    def __init__(self, cfg: ModelConfig, n_layers: int, n_slots: int, dtype: torch.dtype, device):
        self.conv = torch.zeros(
            n_layers, n_slots, cfg.conv_channels, cfg.ssm_conv_kernel - 1, dtype=dtype, device=device
        )
        self.delta = torch.zeros(
            n_layers, n_slots, cfg.ssm_v_heads, cfg.ssm_k_dim, cfg.ssm_v_dim, dtype=torch.float32, device=device
        )
        self.consumed: list[int | None] = [0] * n_slots  # positions folded in; None: unknown (a failed step)

    @staticmethod
    def nbytes_for(cfg: ModelConfig, n_layers: int, n_slots: int, dtype: torch.dtype) -> int:
        conv = cfg.conv_channels * (cfg.ssm_conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        delta = cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim * 4
        return n_layers * n_slots * (conv + delta)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.delta.nbytes

    def begin(self, slots: list[int], starts: list[int], n_tokens: int) -> None:
        """Before a step: reset the slots whose sequence starts at 0, check that the others
        continue where they stopped. Their state is unknown until end() says the step is done."""
        for slot, start in zip(slots, starts):
            if start == 0:
                self.clear(slot)
            elif self.consumed[slot] != start:
                held = self.consumed[slot]
                raise ValueError(
                    f"slot {slot}: the recurrent state holds {'an unknown number of' if held is None else held} "
                    f"positions, not {start}; it cannot be rewound or skipped ahead: replay the sequence from 0"
                )
            self.consumed[slot] = None
        self._pending = [(slot, start + n_tokens) for slot, start in zip(slots, starts)]

    def end(self) -> None:
        for slot, consumed in self._pending:
            self.consumed[slot] = consumed

    def clear(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.delta[:, slot].zero_()
        self.consumed[slot] = 0


def stage_cache_nbytes(cfg: ModelConfig, start: int, end: int, n_slots: int, ctx: int, dtype: torch.dtype) -> int:
    """Bytes of the caches of blocks [start, end) computing in `dtype`: keys and values of the
    attention blocks, the recurrent state of the delta-net ones."""
    n_linear = sum(cfg.linear(b) for b in range(start, end))
    kv = KVCache.nbytes_for(end - start - n_linear, n_slots, cfg.n_kv_heads, ctx, cfg.head_dim, kv_dtype(dtype))
    return kv + (RecurrentState.nbytes_for(cfg, n_linear, n_slots, dtype) if n_linear else 0)
