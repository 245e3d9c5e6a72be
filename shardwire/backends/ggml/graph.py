"""ggml graphs built once and run many times from Python: each call rewrites the fields of the
tensors that change between calls (where inputs and outputs lie, and the shapes that follow a
sequence's length) in one write into the graph's memory, and places the intermediates in an
arena the graphs of a thread share, as they run one after another."""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import numpy as np
import torch

from ...weights import ggml_cpu
from ...weights.ggml_cpu import ggml

MAX_ROWS = 8  # rows (sequences of a decode step) a graph takes in one go; more are a prompt's pieces
ALIGN = 64
PROMPT = "prompt"  # the arena of every graph a prompt runs (the rest are a decode step's)

_NE, _NB, _DATA = (getattr(ggml.ggml_tensor, f).offset for f in ("ne", "nb", "data")) if ggml else (0, 0, 0)


class _Arena:
    """Memory for graph intermediates; a thread's graphs for a decode step's row count (or all
    that a prompt runs) share one, as they run one after another. Mapped apart, so that its pages
    can be given back between steps while the graphs keep pointing at it; where a graph needs
    more, a larger one takes the place of it and of every graph placed in it."""

    def __init__(self, nbytes: int):
        # private: given-back pages are freed, not kept in a shared-memory object
        self.map = mmap.mmap(-1, max(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.memory = np.frombuffer(self.map, dtype=np.uint8)
        self.nbytes = nbytes
        self.graphs: weakref.WeakSet = weakref.WeakSet()

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

    def word(self, t, field: int) -> int:
        """Where a field of tensor t lies in the context's memory, in words."""
        return (ctypes.addressof(t.contents) + field - self.base) // 8

    def data(self, t, name: str, offset: int = 0):
        self._set.append((self.word(t, _DATA), self.index[name], 1, offset))
        self.placed.add(ctypes.addressof(t.contents))
        return t

    def follow(self, t, name: str, built: int, ne: tuple[int, ...] = (), nb: tuple[int, ...] = ()):
        """t's extents `ne` and strides `nb` are proportional to value `name`, which was `built`
        when t was made."""
        for field, dims in ((_NE, ne), (_NB, nb)):
            for i in dims:
                word = self.word(t, field + 8 * i)
                scale, rest = divmod(int(self.memory[word]), built)
                assert rest == 0, "a field that follows a count is a multiple of it"
                self._set.append((word, self.index[name], scale, 0))
        return t

    def freeze(self) -> None:
        self.at, self.which, self.scale, self.offset = (np.array(c, dtype=np.int64) for c in zip(*self._set))
        del self._set

    def __call__(self, values: list[int]) -> None:
        self.memory[self.at] = self.scale * np.array(values, dtype=np.int64)[self.which] + self.offset


# ggml's CPU backend computes some nodes together with the next (RMS_NORM and the MUL that scales
# it, in one pass over each row): the first's inputs are still read, on every thread at once, while
# the second's output is written. So what a node reads stays where it is through the next node;
# placed over it, the output of the MUL overwrote rows of the norm's input that another thread had
# not read yet (prompts on 2 threads gave garbage).
FUSED = 1


class Graph(ggml_cpu._Built):
    """A graph whose call takes the values `names` lists, its intermediates in the thread's arena
    `arena` (a decode step's row count, or PROMPT). `build(graph)` makes its tensors (with
    graph.fields, inside() and then()) and returns the output; nodes marked with then() are
    computed in that order, before the output's own."""

    def __init__(self, build, names: list[str], arena: int | str, size: int, threads: int):
        # built twice: first in a context for `size` tensors and nodes, to learn what it takes, then
        # in a context of just that (a kept graph holds no more than it uses)
        trial = _Trial(size, size)
        self._make(trial, build, names, size)
        super().__init__(size, size, ggml.ggml_used_mem(trial.ctx) + ALIGN)
        del trial
        self._make(self, build, names, size)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)  # work size at the shapes built
        self.fields.freeze()
        self._place(arena)

    @staticmethod
    def _make(g, build, names: list[str], size: int) -> None:
        g.fields = Fields(g.ctx, names)
        g._inside, g._order = [], []
        y = build(g)
        g.graph = ggml.ggml_new_graph_custom(g.ctx, size, False)
        for t in [*g._order, y]:
            ggml.ggml_build_forward_expand(g.graph, t)

    # -- building -------------------------------------------------------------------------------

    def inside(self, t, host, offset: int):
        """t is computed straight into `host` (a tensor that no operation computes, which the
        graph reads later), at `offset`."""
        self._inside.append((t, host, offset))
        return t

    def then(self, t):
        """t is computed before what is marked after it, and before the output."""
        self._order.append(t)
        return t

    # -- placement --------------------------------------------------------------------------------

    def _place(self, key: int | str) -> None:
        """Give each intermediate memory in this thread's arena `key` from the node that first
        computes into it to the node after the last that reads it (through views too; FUSED), as
        ggml's graph allocator does: memory freed by then is reused. What is kept is where each
        tensor's data pointer lies in the context and its offset in the arena."""
        nodes = [ggml.ggml_graph_node(self.graph, i) for i in range(ggml.ggml_graph_n_nodes(self.graph))]
        inside = {_address(t): (host, offset) for t, host, offset in self._inside}
        placed = self.fields.placed
        size: dict[int, int] = {}  # root address -> bytes
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        located: dict[int, tuple] = {}  # tensor address -> (the tensor, its root's address, offset in it)

        def use(t, i: int) -> None:
            a = _address(t)
            if a not in located:
                at, r = 0, t
                while True:
                    if _address(r) in inside:
                        r, offset = inside[_address(r)]
                        at += offset
                    elif r.contents.view_src:
                        at += r.contents.view_offs
                        r = r.contents.view_src
                    else:
                        break
                outside = bool(r.contents.data) or _address(r) in placed  # weights, and each call's inputs
                located[a] = (t, None if outside else _address(r), at if not outside else r)
                if not outside:
                    size[_address(r)] = -(-ggml.ggml_nbytes(r) // ALIGN) * ALIGN
            root = located[a][1]
            if root is not None:
                first.setdefault(root, i)
                last[root] = i + FUSED

        for i, t in enumerate(nodes):
            use(t, i)
            for j in range(len(t.contents.src)):
                if t.contents.src[j]:
                    use(t.contents.src[j], i)
        offsets, top = _lay_out(size, first, last, len(nodes))
        words, at = [], []
        for a, (t, root, where) in located.items():
            if root is not None:
                words.append(self.fields.word(t, _DATA))
                at.append(offsets[root] + where)
            elif t.contents.view_src and a not in placed:  # a view of a weight: where it is for good
                t.contents.data = (where.contents.data or 0) + t.contents.view_offs
        self._words, self._offsets = np.array(words, dtype=np.int64), np.array(at, dtype=np.int64)
        del self._inside, self._order, self.fields.placed
        arenas = _local.__dict__.setdefault("arenas", {})
        arena = arenas.get(key)
        if arena is None or arena.nbytes < top:
            larger = arenas[key] = _Arena(top)
            for graph in list(arena.graphs) if arena is not None else []:
                graph._assign(larger)
            arena = larger
        self._assign(arena)

    def _assign(self, arena: _Arena) -> None:
        self.fields.memory[self._words] = arena.memory.ctypes.data + self._offsets
        arena.graphs.add(self)
        self.arena = arena

    def __call__(self, values: list[int]) -> None:
        self.fields(values)
        self._compute()


_local = threading.local()


class _Trial(ggml_cpu._Built):
    """A graph built only to measure its context."""

    inside, then = Graph.inside, Graph.then


def _address(t) -> int:
    return ctypes.addressof(t.contents)


def _lay_out(size: dict, first: dict, last: dict, steps: int) -> tuple[dict, int]:
    """Offsets for blocks of `size` bytes each live from step `first` to step `last`: a block takes
    the smallest free space that holds it, else the top; it frees its space after its last step.
    -> (offsets, the top)."""
    starting: dict[int, list] = {}
    ending: dict[int, list] = {}
    for a in size:
        starting.setdefault(first[a], []).append(a)
        ending.setdefault(last[a], []).append(a)
    offsets, free, top = {}, [], 0  # free: [offset, size] spaces below the top
    for i in range(steps):
        for a in starting.get(i, ()):
            fits = [b for b in free if b[1] >= size[a]]
            if fits:
                space = min(fits, key=lambda b: b[1])
                offsets[a] = space[0]
                space[0] += size[a]
                space[1] -= size[a]
            else:
                offsets[a], top = top, top + size[a]
        if i in ending:
            free = _merged(free + [[offsets[a], size[a]] for a in ending[i]])
    return offsets, top


def _merged(blocks: list[list[int]]) -> list[list[int]]:
    """Free blocks [offset, size] sorted, adjacent ones joined, empty ones dropped."""
    out: list[list[int]] = []
    for offset, size in sorted(b for b in blocks if b[1]):
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1][1] += size
        else:
            out.append([offset, size])
    return out


def scratch(name: str, rows: int, width: int) -> torch.Tensor:
    """This thread's float32 buffer `name` [rows, width] between a block's graphs (its queries,
    its attention), in a mapping of its own: every block of a prompt chunk writes the same pages,
    where fresh allocations would each be mapped and zeroed page by page as first written."""
    buffers = _local.__dict__.setdefault("scratch", {})
    n = rows * width
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < n * 4:
        buffer = buffers[name] = _Arena(n * 4)
    return torch.frombuffer(buffer.map, dtype=torch.float32, count=n).view(rows, width)


def scratch_held() -> dict[str, int]:
    """Bytes of each of this thread's scratch buffers, by name: what a prompt's rows hold between
    a block's graphs, which a plan's workspace counts (plan.workspace_bytes)."""
    return {name: buffer.nbytes for name, buffer in _local.__dict__.get("scratch", {}).items()}


def scratch_beside(t: torch.Tensor, name: str, rows: int, width: int) -> torch.Tensor:
    """One of this thread's two scratch buffers `name`, the one t is not in: a block's output
    beside its input, which is the block before's output."""
    first = scratch(f"{name} 0", rows, width)
    if first.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return first
    return scratch(f"{name} 1", rows, width)


def in_scratch(t: torch.Tensor) -> bool:
    """Whether t lies in this thread's scratch, which the next use overwrites."""
    if t.device.type != "cpu":
        return False
    at = t.untyped_storage().data_ptr()
    return any(
        b.memory.ctypes.data <= at < b.memory.ctypes.data + b.nbytes
        for b in _local.__dict__.get("scratch", {}).values()
    )


def release_graph_memory() -> None:
    """No intermediates of this thread's graphs, nor its scratch, stay resident (they come back
    as they are used)."""
    for arena in [*_local.__dict__.get("arenas", {}).values(), *_local.__dict__.get("scratch", {}).values()]:
        arena.release()
