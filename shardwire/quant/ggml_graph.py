"""ggml graphs built once and run many times from Python: each call rewrites the fields of the
tensors that change between calls (where inputs and outputs lie, and the shapes that follow a
sequence's length) in one write into the graph's memory, and places the intermediates in an
arena the graphs of a thread share, as they run one after another."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from . import ggml_cpu
from .ggml_cpu import ggml

MAX_ROWS = 8  # rows (sequences of a decode step) a graph takes in one go; more are a prompt's pieces
ALIGN = 64
PROMPT = "prompt"  # the arena of a prompt's pieces

_NE, _NB, _DATA = (getattr(ggml.ggml_tensor, f).offset for f in ("ne", "nb", "data")) if ggml else (0, 0, 0)


class _Arena:
    """Memory for graph intermediates; a thread's graphs for a row count (or for a prompt's
    pieces) share one. Mapped apart, so that its pages can be given back between steps while the
    graphs keep pointing at it."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, ALIGN))
        self.memory = np.frombuffer(self.map, dtype=np.uint8)
        self.nbytes = nbytes

    def release(self) -> None:
        """Give its pages back (the next use finds them zeroed, which the graphs never read)."""
        self.map.madvise(mmap.MADV_DONTNEED)


class Fields:
    """The tensor fields a graph sets on each call, written at once into its context's memory:
    data pointers (an input's address plus an offset) and the extents and strides that follow a
    count (a row's keys, the cache pool's positions). Each is `scale * value + offset` of one of
    the call's values, named at build."""

    def __init__(self, ctx, names: list[str]):
        self.base = ggml.ggml_get_mem_buffer(ctx)
        words = ggml.ggml_get_mem_size(ctx) // 8
        self.memory = np.ctypeslib.as_array((ctypes.c_int64 * words).from_address(self.base))
        self.index = {name: i for i, name in enumerate(names)}
        self._set: list[tuple[int, int, int, int]] = []  # (word, value, scale, offset)
        self.placed: set[int] = set()  # the tensors whose data is set on each call

    def _word(self, t, field: int) -> int:
        return (ctypes.addressof(t.contents) + field - self.base) // 8

    def data(self, t, name: str, offset: int = 0):
        self._set.append((self._word(t, _DATA), self.index[name], 1, offset))
        self.placed.add(ctypes.addressof(t.contents))
        return t

    def follow(self, t, name: str, built: int, ne: tuple[int, ...] = (), nb: tuple[int, ...] = ()):
        """t's extents `ne` and strides `nb` are proportional to value `name`, which was `built`
        when t was made."""
        for field, dims in ((_NE, ne), (_NB, nb)):
            for i in dims:
                word = self._word(t, field + 8 * i)
                scale, rest = divmod(int(self.memory[word]), built)
                assert rest == 0, "a field that follows a count is a multiple of it"
                self._set.append((word, self.index[name], scale, 0))
        return t

    def freeze(self) -> None:
        self.at, self.which, self.scale, self.offset = (np.array(c, dtype=np.int64) for c in zip(*self._set))

    def __call__(self, values: list[int]) -> None:
        self.memory[self.at] = self.scale * np.array(values, dtype=np.int64)[self.which] + self.offset


class Graph(ggml_cpu._Built):
    """A graph for `rows` rows whose call takes the values `names` lists. `build(graph)` makes its
    tensors (with graph.fields and the placement hints below) and returns the output; nodes
    marked with then() are computed in that order, before the output's own."""

    def __init__(self, build, names: list[str], rows: int, size: int, threads: int):
        super().__init__(size, size)
        self.fields = Fields(self.ctx, names)
        self._groups: dict[int, str] = {}  # tensor address -> the region it shares with others
        self._inside: list[tuple] = []  # (tensor, host, offset): placed within another tensor
        self._order: list = []
        self._hosts: list = []
        self._scope = 0
        self._scope_ends: set[int] = set()
        y = build(self)
        self.graph = ggml.ggml_new_graph_custom(self.ctx, size, False)
        for t in [*self._order, y]:
            ggml.ggml_build_forward_expand(self.graph, t)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)  # work size at the shapes built
        self.fields.freeze()
        self.arena = self._place(rows)

    # -- placement hints ------------------------------------------------------------------------

    def share(self, t, group: str):
        """t lives in a region shared by its group (tensors computed one after another, each used
        only before the next one of its group is)."""
        self._groups[ctypes.addressof(t.contents)] = f"{self._scope % 2} {group}"
        return t

    def inside(self, t, host, offset: int):
        """t is computed straight into `host` (a tensor the graph reads later), at `offset`."""
        self._inside.append((t, host, offset))
        return t

    def host(self, t, group: str):
        """An intermediate that no operation computes (filled through tensors placed inside it)."""
        self._hosts.append(t)
        return self.share(t, group)

    def then(self, t):
        self._order.append(t)
        return t

    def end_scope(self, t):
        """t ends a scope (a block): the intermediates of the next scope but one may take the
        memory of this one's, as the next scope reads only its output t."""
        self._scope += 1
        self._scope_ends.add(ctypes.addressof(t.contents))
        return self.then(t)

    def _place(self, rows: int) -> _Arena:
        nodes = [ggml.ggml_graph_node(self.graph, i) for i in range(ggml.ggml_graph_n_nodes(self.graph))]
        elsewhere = self.fields.placed | {ctypes.addressof(t.contents) for t, _, _ in self._inside}
        regions: dict[str, list] = {}
        scope, ordinal = 0, 0
        for t in [*self._hosts, *nodes]:
            address = ctypes.addressof(t.contents)
            if not (t.contents.data or t.contents.view_src or address in elsewhere):
                alone = f"{scope % 2} #{ordinal}" if self._scope_ends else str(address)
                regions.setdefault(self._groups.get(address, alone), []).append(t)
            ordinal += 1
            if address in self._scope_ends:
                scope, ordinal = scope + 1, 0
        sizes = {g: max(-(-ggml.ggml_nbytes(t) // ALIGN) * ALIGN for t in ts) for g, ts in regions.items()}
        arenas = _local.__dict__.setdefault("arenas", {})
        key = rows if rows <= MAX_ROWS else PROMPT  # a prompt's pieces of every size share one
        arena = arenas.get(key)
        if arena is None or arena.nbytes < sum(sizes.values()):
            arena = arenas[key] = _Arena(sum(sizes.values()))  # graphs built on a smaller one keep theirs
        at = arena.memory.ctypes.data
        for group, ts in regions.items():
            for t in ts:
                t.contents.data = at
            at += sizes[group]
        for t, host, offset in self._inside:
            t.contents.data = host.contents.data + offset
        for t in nodes:
            if t.contents.view_src:
                t.contents.data = (t.contents.view_src.contents.data or 0) + t.contents.view_offs
        return arena

    def __call__(self, values: list[int]) -> None:
        self.fields(values)
        self._compute()


_local = threading.local()


def release_prompt_memory() -> None:
    """After a step with a prompt chunk: the intermediates of its pieces need not stay resident."""
    arena = _local.__dict__.get("arenas", {}).get(PROMPT)
    if arena is not None:
        arena.release()
