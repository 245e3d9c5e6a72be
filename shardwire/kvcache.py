"""Per-sequence caches: keys and values of the attention blocks in a pool of pages that the
sequences' page tables point into, and, for gated delta-net blocks, their recurrent state in a
fixed number of slots (one per sequence)."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from functools import cached_property

import torch

from .config import ModelConfig
from .enums import PAGE, pages_for


def kv_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype keys and values are kept in for a stage computing in `compute`: float32 compute
    keeps them in float16, as llama.cpp does by default (half the memory; attention reads them
    back in float32); otherwise the compute dtype."""
    return torch.float16 if compute == torch.float32 else compute


def counting(n: int) -> array:
    """0, 1, ..., at least n - 1 as int32, shared: the pool positions of consecutive pages are a
    stretch of it, so a step reading them needs no list of its own."""
    global _counting
    if len(_counting) < n:
        _counting = array("i", range(max(n, 2 * len(_counting))))
    return _counting


_counting = array("i")
_rings: dict[tuple[int, int], array] = {}  # (first pool position, ring size) -> ring_row's list


def ring_row(first: int, size: int, n: int) -> array:
    """The pool positions of a ring's first `n` sequence positions (position p at first + p %
    size), as int32: a slice of a list kept per ring, grown by doubling."""
    with _tables_lock:
        row = _rings.get((first, size))
        if row is None or len(row) < n:
            row = array("i", [first + p % size for p in range(max(n, 2 * len(row or ())))])
            _rings[(first, size)] = row
        return row[:n]


def ring_slack(window: int, size: int) -> int:
    """The most positions a step may bring to a ring of `size` positions for blocks on a `window`:
    the positions written past a step's start, its own included, that leave every key its first
    row sees (and, for a step that goes back, the positions written past it before)."""
    return size - window + 1


def ring_size(window: int, step: int) -> int:
    """Positions a sequence's ring keeps for blocks on a `window` when a step brings at most
    `step` positions: every key a step's rows see, its own written first (whole pages)."""
    return pages_for(window - 1 + step) * PAGE


_TABLES_KEPT = 32  # page tables whose positions are kept: a decode step's sequences, as they grow
_table_positions: OrderedDict[tuple[int, ...], array] = OrderedDict()
_tables_lock = threading.Lock()  # a worker's stages run on threads of their own


def table_positions(pages: tuple[int, ...]) -> array:
    """The pool positions of a page table's pages, in order, as int32: kept for the next step,
    and a table one page longer than a kept one extends that one (which it replaces)."""
    with _tables_lock:
        found = _table_positions.pop(pages, None)
        if found is None:
            shorter = _table_positions.pop(pages[:-1], None)
            if shorter is not None:
                last = pages[-1] * PAGE
                found = shorter + counting(last + PAGE)[last : last + PAGE]
            else:
                found = array("i", [p * PAGE + i for p in pages for i in range(PAGE)])
            if len(_table_positions) >= _TABLES_KEPT:
                _table_positions.popitem(last=False)
        _table_positions[pages] = found
        return found


class Addresses:
    """Where one step's keys and values go in the pool and where each row's keys are read from: a
    slice when the step is one sequence whose pages are consecutive (reading back is then a view),
    else pool positions (write: [B * T]; read: [B, n_keys], padded rows point at position 0 and
    are masked).

    Made in plain Python, as int64 and int32 lists that ggml's graphs read in place (write_at,
    read_at); PyTorch's attention gets them as tensors (write, read) on first use. Once a decode
    step's weights have gone through the caches each PyTorch call costs tens of microseconds,
    which a small model's step would pay many times over."""

    def __init__(self, write: slice | array, read: slice | array, n_keys: int, width: int, device):
        """`read`: each row's positions, `width` apart (whole pages)."""
        self._write, self._read, self.n_keys, self.width, self.device = write, read, n_keys, width, device

    @classmethod
    def of(cls, tables: list[list[int]], starts: list[int], T: int, n_keys: int, device) -> "Addresses":
        for table, start in zip(tables, starts):
            if len(table) < pages_for(start + T):
                raise ValueError(f"a page table of {len(table)} pages cannot hold positions up to {start + T}")
        n_pages = pages_for(n_keys)
        if len(tables) == 1:
            table, start = tables[0], starts[0]
            first = table[0] * PAGE
            if table[:n_pages] == list(range(table[0], table[0] + n_pages)):
                return cls(slice(first + start, first + start + T), slice(first, first + n_keys), n_keys, 0, device)
        width = n_pages * PAGE
        rows = [table_positions(tuple(table[:n_pages])) for table in tables]
        read = rows[0] if len(rows) == 1 else array("i")
        if len(rows) > 1:
            for positions in rows:
                read += positions
                read += array("i", bytes(4 * (width - len(positions))))
        write = array("q", [row[s + t] for row, s in zip(rows, starts) for t in range(T)])
        return cls(write, read, n_keys, width, device)

    @classmethod
    def of_ring(cls, slots: list[int], starts: list[int], T: int, n_keys: int, size: int, device) -> "Addresses":
        """Where a step's keys go and are read from in a pool of a ring of `size` positions per
        slot (slot s's at s * size): position p at p % size. Every row reads its keys up to its
        last position: those older than the ring's are stale, and the window masks them."""
        width = pages_for(n_keys) * PAGE
        rows = [ring_row(slot * size, size, width) for slot in slots]
        read = rows[0]  # ring_row's own copy
        for row in rows[1:]:
            read += row
        write = array("q", [slot * size + (s + t) % size for slot, s in zip(slots, starts) for t in range(T)])
        return cls(write, read, n_keys, width, device)

    @cached_property
    def _write64(self) -> array:
        if isinstance(self._write, slice):
            return array("q", range(self._write.start, self._write.stop))
        return self._write

    @property
    def write_at(self) -> int:
        """The address of the write positions as int64, [B * T]."""
        return self._write64.buffer_info()[0]

    @cached_property
    def _read32(self) -> tuple[array, int, int]:
        """The int32 positions (held here: the shared counting may be replaced meanwhile), the
        bytes to row 0's and from one row's to the next's."""
        if isinstance(self._read, slice):
            return counting(self._read.stop), 4 * self._read.start, 0
        return self._read, 0, 4 * self.width

    @property
    def read_at(self) -> tuple[int, int]:
        """The address of row 0's read positions as int32, and the bytes from one row's to the next's."""
        positions, first, row = self._read32
        return positions.buffer_info()[0] + first, row

    @cached_property
    def write(self) -> slice | torch.Tensor:
        """The write positions: a slice, or [B * T] int64."""
        if isinstance(self._write, slice):
            return self._write
        return torch.frombuffer(self._write, dtype=torch.int64).to(self.device)

    @cached_property
    def read(self) -> slice | torch.Tensor:
        """The read positions: a slice, or [B, n_keys] int64."""
        if isinstance(self._read, slice):
            return self._read
        rows = torch.frombuffer(self._read, dtype=torch.int32).view(-1, self.width)
        return rows[:, : self.n_keys].long().to(self.device)


class KVCache:
    """Keys and values of `n_layers` attention blocks in a pool of at most `n_pages` pages of PAGE
    positions, kept in `dtype`; update() returns them in the dtype they came in.

    A sequence's positions live in the pages of its table, in order: the coordinator hands pages
    out and tells every stage each row's table, so sequences may share the pages of a common
    prefix. The pool's memory follows the highest page in use (it grows by doubling), not the
    most it may hold.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
        recurrent: RecurrentState | None = None,
        v_dim: int | None = None,
    ):
        """`recurrent`: the state of the stage's delta-net blocks, kept (and counted) with it;
        `v_dim`: a value's width where it is not a key's (0: no values are kept, latent attention)."""
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.v_dim = head_dim if v_dim is None else v_dim
        self.n_pages, self.dtype, self.device = n_pages, dtype, device
        self.k = torch.zeros((n_layers, n_kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((n_layers, n_kv_heads, 0, self.v_dim), dtype=dtype, device=device)
        self.recurrent = recurrent
        self.window: KVCache | None = None  # the sliding-window blocks' cache, where the stage has some

    @staticmethod
    def nbytes_for(
        n_layers: int, n_kv_heads: int, n_pages: int, head_dim: int, dtype: torch.dtype, v_dim: int | None = None
    ) -> int:
        """The most the pool holds."""
        size = torch.empty((), dtype=dtype).element_size()
        widths = head_dim + (head_dim if v_dim is None else v_dim)
        return n_layers * n_kv_heads * n_pages * PAGE * widths * size

    @property
    def capacity(self) -> int:
        """Pages the pool holds now."""
        return self.k.shape[2] // PAGE

    @property
    def nbytes(self) -> int:
        held = self.k.nbytes + self.v.nbytes + (self.recurrent.nbytes if self.recurrent is not None else 0)
        return held + (self.window.nbytes if self.window is not None else 0)

    def reserve(self, n_pages: int) -> None:
        """Make pages [0, n_pages) usable: grow the pool (doubling) where it is smaller."""
        if n_pages > self.n_pages:
            raise ValueError(f"page {n_pages - 1} is outside the pool of {self.n_pages} pages")
        if n_pages <= self.capacity:
            return
        grown = min(self.n_pages, max(n_pages, 2 * self.capacity))
        for name, width in (("k", self.head_dim), ("v", self.v_dim)):
            old = getattr(self, name)
            shape = (self.n_layers, self.n_kv_heads, grown * PAGE, width)
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)
            del old

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: Addresses) -> None:
        """Store k, v ([B, KV, T, D]) where `at` says."""
        pools = [(self.k[layer], k)] + ([(self.v[layer], v)] if self.v_dim else [])
        for pool, new in pools:
            if isinstance(at.write, slice):
                pool[:, at.write] = new[0]
            else:  # index_copy_ and index_select: several times faster than indexing with a tensor
                H, D = new.shape[1], new.shape[3]
                pool.index_copy_(1, at.write, new.transpose(0, 1).reshape(H, -1, D).to(self.dtype))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: Addresses) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, KV, T, D]) where `at` says; return each row's keys and values up to
        the step's last position, ([B, KV, n_keys, D], same)."""
        self.write(layer, k, v, at)
        keys, values = self._read(self.k[layer], at), self._read(self.v[layer], at) if self.v_dim else v
        return keys.to(k.dtype), values.to(v.dtype)

    @staticmethod
    def _read(pool: torch.Tensor, at: Addresses) -> torch.Tensor:
        """Each row's entries of one layer's pool [KV, positions, D] up to the step's last position."""
        if isinstance(at.read, slice):
            return pool[None, :, at.read]
        shape = (pool.shape[0], *at.read.shape, pool.shape[2])
        return torch.index_select(pool, 1, at.read.flatten()).view(shape).transpose(0, 1)

    @staticmethod
    def rows_for(slots: list[int], device) -> slice | torch.Tensor:
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return slice(first, first + len(slots))
        return torch.tensor(slots, device=device)


class WindowCache(KVCache):
    """Keys and values of the blocks that see a sliding window of `window` positions, in a ring
    per slot (as llama.cpp's sliding-window cache keeps them): `size` positions, enough for a
    step of `step` new positions whose rows see the `window` - 1 before them. A sequence's
    position p is at p % size of its slot's ring, so a step may go back only as far as the
    positions written after it left every key it needs: a sequence that starts past 0 must have
    written its positions before in this slot (no prefix of another sequence is reused)."""

    def __init__(self, n_layers, n_kv_heads, head_dim, n_slots, window, step, dtype, device, v_dim=None):
        size = ring_size(window, step)
        super().__init__(n_layers, n_kv_heads, head_dim, n_slots * size // PAGE, dtype, device, None, v_dim)
        self.size, self.window_size = size, window
        self.reach = [0] * n_slots  # one past the furthest position written since the slot's sequence began

    @staticmethod
    def nbytes_for(n_layers, n_kv_heads, n_slots, window, step, head_dim, dtype, v_dim=None) -> int:
        positions = n_slots * ring_size(window, step)
        return KVCache.nbytes_for(n_layers, n_kv_heads, positions // PAGE, head_dim, dtype, v_dim)

    @property
    def step(self) -> int:
        """The most positions a step may bring."""
        return ring_slack(self.window_size, self.size)

    def addresses(self, slots: list[int], starts: list[int], T: int, n_keys: int, device) -> Addresses:
        """Where a step's rows (slot and first position, T positions each) write and read: refused
        where a slot's ring no longer holds every key its rows see."""
        spans: dict[int, tuple[int, int]] = {}
        for slot, start in zip(slots, starts):
            lo, hi = spans.get(slot, (start, start + T))
            spans[slot] = (min(lo, start), max(hi, start + T))
        for slot, (lo, hi) in spans.items():
            reach = self.reach[slot] if lo else 0
            if lo > reach or max(reach, hi) - lo > self.step:
                held = max(0, reach - self.size)
                raise ValueError(
                    f"slot {slot}: the sliding window's cache holds positions [{held}, {reach}) of "
                    f"{self.size}; a step over [{lo}, {hi}) needs those from {max(0, lo - self.window_size + 1)}: "
                    "replay the sequence from 0, or keep every position (--swa-full)"
                )
        for slot, (lo, hi) in spans.items():
            self.reach[slot] = max(self.reach[slot] if lo else 0, hi)
        self.reserve((max(spans) + 1) * self.size // PAGE)
        return Addresses.of_ring(slots, starts, T, n_keys, self.size, device)


class RecurrentState:
    """What a gated delta-net block remembers of a sequence, per slot: the last kernel - 1 inputs
    of its causal convolution, and the delta rule's state, a [k_dim, v_dim] matrix per value head
    held transposed, [v_dim, k_dim], as ggml's gated_delta_net holds it (float32: it accumulates
    over the whole sequence).

    Unlike a KV cache this state cannot be truncated: it holds every position folded together.
    A slot's state is valid only for the positions it has consumed; a sequence that starts again
    at position 0 (a new sequence, or a replay after recovery) starts from zeros. A step that
    checks proposals keeps a copy of its slots' state from before it, with the inputs it fed
    (keep); a next step that starts inside it (some proposals refused) takes the copy back and
    feeds again the inputs of the positions kept (rewind). Any other start but the next position
    is refused."""

    def __init__(self, cfg: ModelConfig, n_layers: int, n_slots: int, dtype: torch.dtype, device):
        self.conv = torch.zeros(
            n_layers, n_slots, cfg.conv_channels, cfg.ssm_conv_kernel - 1, dtype=dtype, device=device
        )
        self.delta = torch.zeros(
            n_layers, n_slots, cfg.ssm_v_heads, cfg.ssm_v_dim, cfg.ssm_k_dim, dtype=torch.float32, device=device
        )
        self.consumed: list[int | None] = [0] * n_slots  # positions folded in; None: unknown (a failed step)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> keep()'s copy, made on first use
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (position of its copy, inputs fed since)

    @staticmethod
    def nbytes_for(cfg: ModelConfig, n_layers: int, n_slots: int, dtype: torch.dtype) -> int:
        conv = cfg.conv_channels * (cfg.ssm_conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        delta = cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim * 4
        return n_layers * n_slots * (conv + delta)

    @property
    def nbytes(self) -> int:
        copies = sum(conv.nbytes + delta.nbytes for conv, delta in self.copies.values())
        return self.conv.nbytes + self.delta.nbytes + copies

    def keep(self, slot: int, start: int, inputs: torch.Tensor) -> None:
        """Before a step that feeds `inputs` (a row's token ids or hidden states) at `start`:
        copy the slot's state, so that a later step may start at any of those positions. Only
        the slots of sequences that speculate hold a copy (as much again as their state)."""
        if slot in self.copies:
            conv, delta = self.copies[slot]
            conv.copy_(self.conv[:, slot])
            delta.copy_(self.delta[:, slot])
        else:
            self.copies[slot] = (self.conv[:, slot].clone(), self.delta[:, slot].clone())
        self.kept[slot] = (start, inputs)

    def rewind(self, slot: int, start: int) -> tuple[int, torch.Tensor] | None:
        """Where a step starts at `start` inside the slot's last kept step: its state as it was
        before that step, and (where it was, the inputs to feed again up to `start`). None where
        the state has nothing to take back."""
        kept = self.kept.pop(slot, None)
        if start == 0 or start == self.consumed[slot] or kept is None:
            return None
        at, inputs = kept
        if self.consumed[slot] != at + len(inputs) or not at <= start < at + len(inputs):
            return None  # begin() says why the start is refused
        conv, delta = self.copies[slot]
        self.conv[:, slot] = conv
        self.delta[:, slot] = delta
        self.consumed[slot] = at
        return at, inputs[: start - at]

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
        self.kept.pop(slot, None)


def pool_pages(n_slots: int, ctx: int, kv_tokens: int | None = None) -> int:
    """Pages of a KV pool: enough for every slot's whole context, or `kv_tokens` positions (never
    less than one whole context)."""
    whole = n_slots * pages_for(ctx)
    return whole if kv_tokens is None else max(pages_for(ctx), min(whole, pages_for(kv_tokens)))


def stage_cache_nbytes(
    cfg: ModelConfig, start: int, end: int, n_slots: int, n_pages: int, dtype: torch.dtype, window_step: int = 0
) -> int:
    """The most the caches of blocks [start, end) computing in `dtype` hold: keys and values of
    the attention blocks in a pool of `n_pages` (those on a sliding window in a ring per slot,
    where `window_step` gives the most positions a step brings), the recurrent state of the
    delta-net ones."""
    n_linear = sum(cfg.linear(b) for b in range(start, end))
    window_step = window_ring(cfg, start, end, window_step, n_slots, n_pages)
    n_window = sum(window_blocks(cfg, start, end)) if window_step else 0
    heads, k_dim, v_dim = cfg.cache_widths
    keys = kv_dtype(dtype)
    kv = KVCache.nbytes_for(end - start - n_linear - n_window, heads, n_pages, k_dim, keys, v_dim)
    if n_window:
        kv += WindowCache.nbytes_for(n_window, heads, n_slots, cfg.sliding_window, window_step, k_dim, keys, v_dim)
    return kv + (RecurrentState.nbytes_for(cfg, n_linear, n_slots, dtype) if n_linear else 0)


def window_ring(cfg: ModelConfig, start: int, end: int, step: int, n_slots: int, n_pages: int) -> int:
    """`step` where the blocks of [start, end) on a sliding window keep their keys in a ring per
    slot (WindowCache) sized for steps of that many positions; 0 where they keep every position,
    as the other blocks: there are none, delta-net blocks are beside them (their state takes a
    step in one pass, the rings in pieces), or the slots' rings would hold as much as the pool of
    `n_pages`."""
    if not step or not any(window_blocks(cfg, start, end)) or any(cfg.linear(b) for b in range(start, end)):
        return 0
    return step if n_slots * ring_size(cfg.sliding_window, step) < n_pages * PAGE else 0


def window_blocks(cfg: ModelConfig, start: int, end: int) -> list[bool]:
    """Of blocks [start, end), which attend to a sliding window (and keep their keys apart)."""
    return [cfg.sliding(b) and not cfg.linear(b) for b in range(start, end)]
