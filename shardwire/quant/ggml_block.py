"""A dense block's rows on a CPU as ggml graphs, as llama.cpp's CPU backend computes them: first
the norm, the Q, K and V projections and RoPE; then attention over the cached keys and values, the
output projection and residual, the feed-forward norm, gate, up, SwiGLU, down and the second
residual. PyTorch only writes the new keys and values into the cache in between.

A decode step is a few rows against every weight of the model. Run one PyTorch or ggml call at
a time, its ~20 calls per block cost more than their arithmetic (PyTorch's dispatch, cold after
each block's weights went through the caches, cost 170 us a block at 1B width, half of it
attention's few small products), and every matrix starts its stream from a cold prefetcher;
two graphs per block stream the block's matrices back to back, as llama.cpp's graph does.

A prompt chunk goes through the same graphs in pieces of rows where every matrix multiplies a
piece as it is held (no dequantized GEMM that pieces would repeat). Attention takes each row
alone over exactly the keys it sees (a graph's shapes follow each call's key counts: the fields
that say them are rewritten before the graph runs), so each row meets the same kernels whether it
is decoded or read in a prompt, and the keys and values a reply left in the cache are the ones a
prompt holding it computes.

Attention in the graphs needs a plain block (no gate on its output); a gated one keeps PyTorch's
attention between a projection graph without RoPE and the rest.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from . import ggml_cpu
from .ggml_cpu import GGMLLinear, RepackedLinear, ggml

MAX_ROWS = 8  # rows (sequences of a decode step) the graphs take in one go
KEPT = 8  # graphs a block keeps built per kind: decode's row counts, a prompt's pieces
ALIGN = 64
PROMPT = "prompt"  # the arena of a prompt's pieces
FIRST_KEYS = 256  # keys a graph's attention is first built for; doubled as its sequences grow

_GGML_TYPES = {torch.float32: "GGML_TYPE_F32", torch.float16: "GGML_TYPE_F16", torch.bfloat16: "GGML_TYPE_BF16"}

PROJECT, FINISH, STEP, EACH, SHARED = "project", "finish", "step", "each", "shared"  # graph kinds, see BlockGraphs


class _Matrix:
    """One weight as a ggml graph takes it: type, shape, where its bytes are, and for a repacked
    weight the buffer its kernels dispatch on; plus the bias added after it."""

    def __init__(self, qtype: int, K: int, N: int, data: int, bias, repacked=None):
        self.qtype, self.K, self.N, self.data, self.bias, self.repacked = qtype, K, N, data, bias, repacked

    def tensor(self, ctx):
        t = ggml.ggml_new_tensor_2d(ctx, self.qtype, self.K, self.N)
        if self.repacked is not None:
            self.repacked.lend_to(t)
        else:
            t.contents.data = self.data
        return t


def _matrices(module: nn.Module, rows: list[int] | None = None) -> list[_Matrix] | None:
    """`module` as ggml matrices, split into consecutive row ranges of the given sizes (a fused
    dense projection holds several; None: one of all its rows); None if ggml cannot run it as it
    is held."""
    from ..model import Linear

    bias = getattr(module, "bias", None)
    if isinstance(module, RepackedLinear):
        found = [_Matrix(module._qtype, module.in_features, module.out_features, 0, bias, module._weight)]
    elif isinstance(module, GGMLLinear):
        found = [_Matrix(module._qtype, module.in_features, module.out_features, module.raw.data_ptr(), bias)]
    elif isinstance(module, Linear) and module.weight.dtype in _GGML_TYPES and module.weight.is_contiguous():
        w = module.weight
        qtype, K, row_bytes = getattr(ggml, _GGML_TYPES[w.dtype]), w.shape[1], w.shape[1] * w.element_size()
        found, start = [], 0
        for n in rows or [w.shape[0]]:
            b = None if bias is None else bias[start : start + n]
            found.append(_Matrix(qtype, K, n, w.data_ptr() + start * row_bytes, b))
            start += n
        return found if start == w.shape[0] else None
    else:
        return None
    return found if rows is None else None


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


class _Arena:
    """Memory for graph intermediates; a thread's graphs for a row count (or for a prompt's
    pieces) share one, as the blocks run one after another. Mapped apart, so that its pages can
    be given back between steps while the graphs keep pointing at it."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, ALIGN))
        self.memory = np.frombuffer(self.map, dtype=np.uint8)
        self.nbytes = nbytes

    def release(self) -> None:
        """Give its pages back (the next use finds them zeroed, which the graphs never read)."""
        self.map.madvise(mmap.MADV_DONTNEED)


_NE, _NB, _DATA = (getattr(ggml.ggml_tensor, f).offset for f in ("ne", "nb", "data")) if ggml else (0, 0, 0)


class _Fields:
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
        self.placed: set[int] = set()  # addresses of the tensors whose data is set on each call

    def _word(self, t, field: int) -> int:
        return (ctypes.addressof(t.contents) + field - self.base) // 8

    def data(self, t, name: str, offset: int = 0) -> None:
        self._set.append((self._word(t, _DATA), self.index[name], 1, offset))
        self.placed.add(ctypes.addressof(t.contents))

    def follow(self, t, name: str, built: int, ne: tuple[int, ...] = (), nb: tuple[int, ...] = ()) -> None:
        """t's extents `ne` and strides `nb` are proportional to value `name`, which was `built` when t was made."""
        for field, dims in ((_NE, ne), (_NB, nb)):
            for i in dims:
                word = self._word(t, field + 8 * i)
                scale, rest = divmod(int(self.memory[word]), built)
                assert rest == 0, "a field that follows a count is a multiple of it"
                self._set.append((word, self.index[name], scale, 0))

    def freeze(self) -> None:
        at, self.which, self.scale, self.offset = (np.array(c, dtype=np.int64) for c in zip(*self._set))
        self.at = at

    def __call__(self, values: list[int]) -> None:
        self.memory[self.at] = self.scale * np.array(values, dtype=np.int64)[self.which] + self.offset


class _Part(ggml_cpu._Built):
    """One graph of a block for `rows` rows: its inputs, output and call-dependent shapes set
    through its fields on each call, intermediates in the thread's arena. `build(part)` makes
    the tensors (using part.fields, part.share, part.inside, part.before) and returns the output."""

    def __init__(self, build, names: list[str], rows: int, size: int, threads: int, arenas: dict):
        super().__init__(size, size)
        self.fields = _Fields(self.ctx, names)
        self._groups: dict[int, str] = {}  # tensor address -> the region it shares with others
        self._inside: list[tuple] = []  # (tensor, host, offset): placed within another tensor
        self._before: list = []  # nodes the graph computes before the rest, in order
        self._hosts: list = []
        self.y = build(self)
        self.graph = ggml.ggml_new_graph_custom(self.ctx, size, False)
        for t in self._before:
            ggml.ggml_build_forward_expand(self.graph, t)
        ggml.ggml_build_forward_expand(self.graph, self.y)
        self.plan = ggml.ggml_graph_plan(self.graph, threads, None)  # work size at the shapes built
        self.fields.freeze()
        self.arena = self._place(rows, arenas)

    def share(self, t, group: str):
        """t lives in a region shared by its group (tensors computed one after another, each used
        only before the next one of its group is)."""
        self._groups[ctypes.addressof(t.contents)] = group
        return t

    def inside(self, t, host, offset: int):
        """t is computed straight into `host` (a tensor the graph reads later), at `offset`."""
        self._inside.append((t, host, offset))
        return t

    def host(self, t):
        """An intermediate that no operation computes (filled through tensors placed inside it)."""
        self._hosts.append(t)
        return t

    def before(self, t):
        self._before.append(t)
        return t

    def _place(self, rows: int, arenas: dict) -> _Arena:
        nodes = [ggml.ggml_graph_node(self.graph, i) for i in range(ggml.ggml_graph_n_nodes(self.graph))]
        elsewhere = self.fields.placed | {ctypes.addressof(t.contents) for t, _, _ in self._inside}
        regions: dict[str, list] = {}
        for t in [*self._hosts, *nodes]:
            address = ctypes.addressof(t.contents)
            if t.contents.data or t.contents.view_src or address in elsewhere:
                continue
            regions.setdefault(self._groups.get(address, str(address)), []).append(t)
        sizes = {g: max(-(-ggml.ggml_nbytes(t) // ALIGN) * ALIGN for t in ts) for g, ts in regions.items()}
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
                t.contents.data = t.contents.view_src.contents.data + t.contents.view_offs
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


def _capacity(n: int) -> int:
    return max(FIRST_KEYS, 1 << (n - 1).bit_length())


class BlockGraphs:
    """The graphs of a dense block, built per kind, row count and thread on first use:
    PROJECT (norm, Q, K, V, and RoPE when `attends`), then either FINISH (the rest after
    PyTorch's attention) or attention and the rest for one row per sequence (EACH: a decode
    step) or for rows of one sequence (SHARED: a prompt's piece, whose rows share one gathering
    of the keys)."""

    def __init__(self, block: nn.Module, qkv: list[_Matrix], out: _Matrix, ffn: list[_Matrix], piece: int | None):
        # no reference to the block, which holds this: its weights are freed with it, not by the
        # cycle collector some time later
        attn = block.attn
        self.attn_norm = _f32(block.attn_norm.weight)
        self.ffn_norm = _f32(block.ffn_norm.weight)
        self.eps_attn, self.eps_ffn = block.attn_norm.eps, block.ffn_norm.eps
        self.qkv, self.out, self.gate, self.up, self.down = qkv, out, *ffn
        for m in [*qkv, out, *ffn]:
            m.bias = _f32(m.bias)
        self.dim = self.attn_norm.shape[0]
        self.qkv_width = sum(m.N for m in qkv)
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.attends = not attn.gated
        self.q_norm = (
            None if attn.q_norm is None else (_f32(attn.q_norm.weight), _f32(attn.k_norm.weight), attn.q_norm.eps)
        )
        self.piece = piece  # rows of a prompt chunk a graph takes at once; None: prompts go through the modules
        self._built: dict[str, OrderedDict] = {}
        self.rope: tuple | None = None  # (rotated dims, base, frequency factors or None)

    def _set_rope(self, inv_freq: torch.Tensor, base: float) -> None:
        """The stage's RoPE frequencies, as ggml computes them: base^(-2i/dims), each divided by a
        factor (Llama 3.1's or linear scaling; none where every factor is 1)."""
        dims = 2 * inv_freq.shape[0]
        plain = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        factors = (plain / inv_freq.double()).float()
        self.rope = (dims, base, None if torch.allclose(factors, torch.ones_like(factors)) else factors.contiguous())

    @classmethod
    def of(cls, block: nn.Module, inv_freq: torch.Tensor, rope_base: float) -> "BlockGraphs | None":
        """The graphs for a block of the dense kind whose weights ggml can all run as held; its
        stage's RoPE frequencies and base."""
        from ..model import Attention, FeedForward, ffn_piece_rows, prefers_whole

        attn, ffn = block.attn, block.ffn
        if not ggml_cpu.available() or not isinstance(attn, Attention) or not isinstance(ffn, FeedForward):
            return None
        H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        Q = 2 * H if attn.gated else H
        if attn.wqkv is not None:
            qkv = _matrices(attn.wqkv, [Q * D, KV * D, KV * D])
        else:
            parts = [_matrices(m) for m in (attn.wq, attn.wk, attn.wv)]
            qkv = None if None in parts else [p[0] for p in parts]
        out = _matrices(attn.wo)
        if ffn.gate_up is not None:
            half = ffn.gate_up.weight.shape[0] // 2
            gate_up = _matrices(ffn.gate_up, [half, half])
        else:
            g, u = _matrices(ffn.gate), _matrices(ffn.up)
            gate_up = None if g is None or u is None else g + u
        down = _matrices(ffn.down)
        if qkv is None or out is None or gate_up is None or down is None:
            return None
        piece = ffn_piece_rows(down[0].K) // MAX_ROWS * MAX_ROWS
        whole = any(prefers_whole(m, piece) for m in block.modules())
        graphs = cls(block, qkv, out[0], [*gate_up, down[0]], None if whole else piece)
        graphs._set_rope(inv_freq, rope_base)
        return graphs

    def takes(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.dim
        return x.dtype == torch.float32 and x.device.type == "cpu" and (rows <= MAX_ROWS or self.piece is not None)

    # -- building ---------------------------------------------------------------------------------

    @staticmethod
    def _linear(ctx, m: _Matrix, h):
        y = ggml.ggml_mul_mat(ctx, m.tensor(ctx), h)
        if m.bias is None:
            return y
        return ggml.ggml_add(ctx, y, BlockGraphs._vector(ctx, m.bias))

    @staticmethod
    def _vector(ctx, t: torch.Tensor):
        v = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, t.shape[0])
        v.contents.data = t.data_ptr()
        return v

    def _norm(self, ctx, x, weight: torch.Tensor, eps: float):
        return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, eps), self._vector(ctx, weight))

    @staticmethod
    def _input(part, name: str, *shape: int, kind=None):
        t = getattr(ggml, f"ggml_new_tensor_{len(shape)}d")(
            part.ctx, ggml.GGML_TYPE_F32 if kind is None else kind, *shape
        )
        part.fields.data(t, name)
        return t

    def _rotate(self, ctx, t, heads: int, rows: int, positions, norm: tuple | None):
        """RoPE (after a per-head norm, where the model has one) on [heads * D, rows]."""
        t = ggml.ggml_reshape_3d(ctx, t, self.head_dim, heads, rows)
        if norm is not None:
            t = self._norm(ctx, t, *norm)
        dims, base, factors = self.rope
        factors = None if factors is None else self._vector(ctx, factors)
        mode = ggml.GGML_ROPE_TYPE_NEOX
        t = ggml.ggml_rope_ext(ctx, t, positions, factors, dims, mode, 0, base, 1.0, 0.0, 1.0, 32.0, 1.0)
        return ggml.ggml_reshape_2d(ctx, t, self.head_dim * heads, rows)

    def _build_project(self, part, rows: int):
        ctx = part.ctx
        x = self._input(part, "x", self.dim, rows)
        h = self._norm(ctx, x, self.attn_norm, self.eps_attn)
        outs = [self._linear(ctx, m, h) for m in self.qkv]
        if self.attends:
            positions = self._input(part, "positions", rows, kind=ggml.GGML_TYPE_I32)
            q_norm, k_norm = (
                (None, None)
                if self.q_norm is None
                else ((self.q_norm[0], self.q_norm[2]), (self.q_norm[1], self.q_norm[2]))
            )
            outs[0] = self._rotate(ctx, outs[0], self.heads, rows, positions, q_norm)
            outs[1] = self._rotate(ctx, outs[1], self.kv_heads, rows, positions, k_norm)
        y = outs[0]
        for o in outs[1:]:
            y = ggml.ggml_concat(ctx, y, o, 0)
        part.fields.data(y, "out")
        return y

    def _build_rest(self, part, rows: int, attn):
        """Output projection and residual, then the feed-forward and its residual."""
        ctx = part.ctx
        x = self._input(part, "x", self.dim, rows)
        mid = ggml.ggml_add(ctx, x, self._linear(ctx, self.out, attn))
        h = self._norm(ctx, mid, self.ffn_norm, self.eps_ffn)
        swiglu = ggml.ggml_swiglu_split(ctx, self._linear(ctx, self.gate, h), self._linear(ctx, self.up, h))
        y = ggml.ggml_add(ctx, mid, self._linear(ctx, self.down, swiglu))
        part.fields.data(y, "out")
        return y

    def _build_finish(self, part, rows: int):
        return self._build_rest(part, rows, self._input(part, "attn", self.out.K, rows))

    def _gather(self, part, pool: str, index, n: str, built: int, pool_type: int):
        """A head-major pool [KV, positions, D] read at `index`'s positions: [D, n, KV] in float32."""
        ctx, D, KV = part.ctx, self.head_dim, self.kv_heads
        t = ggml.ggml_new_tensor_3d(ctx, pool_type, D, built, KV)
        part.fields.data(t, pool)
        part.fields.follow(t, "pool", built, ne=(1,), nb=(2, 3))
        got = ggml.ggml_get_rows(ctx, t, index)
        part.fields.follow(got, n, built, ne=(1,), nb=(2, 3))
        return got

    def _index(self, part, name: str, n: str, built: int):
        """A sequence's cache positions, int32; every kv head reads the same list."""
        t = ggml.ggml_new_tensor_2d(part.ctx, ggml.GGML_TYPE_I32, built, self.kv_heads)
        t.contents.nb[1] = 0
        part.fields.data(t, name)
        part.fields.follow(t, n, built, ne=(0,))
        return t

    def _keys_values(self, part, n: str, built: int, pool_type: int, group: str | None):
        """A sequence's first n keys and values, [D, n, KV] each in float32 (read at the
        positions value `index0`/`index<r>` points at)."""
        idx = self._index(part, "index0" if group is None else "index" + n[1:], n, built)
        keys = self._gather(part, "k", idx, n, built, pool_type)
        values = self._gather(part, "v", idx, n, built, pool_type)
        if group is not None:  # one row's, used before the next row's are gathered
            part.share(keys, f"{group} keys")
            part.share(values, f"{group} values")
        return keys, values

    def _attend_row(self, part, r: int, keys, values, n: str, built: int):
        """Row r's heads over `keys` and `values` (their first n), [D, H // KV, KV]. Each kv
        head's group of query heads in one product; the values weighted one key after another
        (an outer product), so a row's sums never depend on how many keys follow."""
        ctx, H, KV, D = part.ctx, self.heads, self.kv_heads, self.head_dim
        q = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, D, H // KV, KV)
        part.fields.data(q, "qkv", r * self.qkv_width * 4)
        scores = part.share(ggml.ggml_mul_mat(ctx, keys, q), "scores")
        part.fields.follow(scores, n, built, ne=(0,), nb=(1, 2, 3))
        probs = part.share(ggml.ggml_soft_max_ext(ctx, scores, None, 1 / math.sqrt(D), 0.0), "probs")
        part.fields.follow(probs, n, built, ne=(0,), nb=(1, 2, 3))
        turned = ggml.ggml_transpose(ctx, probs)
        part.fields.follow(turned, n, built, ne=(1,), nb=(0, 2, 3))
        return part.before(ggml.ggml_out_prod(ctx, values, turned))

    def _build_each(self, part, rows: int, built: int, pool_type: int):
        """Attention alone for `rows` sequences' one row each, into its output [rows, H * D]."""
        for r in range(rows):
            keys, values = self._keys_values(part, f"n{r}", built, pool_type, "row")
            out = self._attend_row(part, r, keys, values, f"n{r}", built)
            part.fields.data(out, "out", r * self.heads * self.head_dim * 4)
        return out

    def _build_step(self, part, rows: int, built: int, pool_type: int):
        """A decode step's rows (one per sequence): attention, then the rest of the block."""
        attn = part.host(ggml.ggml_new_tensor_2d(part.ctx, ggml.GGML_TYPE_F32, self.heads * self.head_dim, rows))
        for r in range(rows):
            keys, values = self._keys_values(part, f"n{r}", built, pool_type, "row")
            part.inside(
                self._attend_row(part, r, keys, values, f"n{r}", built), attn, r * self.heads * self.head_dim * 4
            )
        return self._build_rest(part, rows, attn)

    def _build_shared(self, part, rows: int, built: int, pool_type: int):
        """Attention alone for `rows` consecutive rows of one sequence (a prompt's), into its output
        [rows, H * D]: their keys are gathered once (as many as the last row sees) and each row
        takes the first it sees."""
        ctx, D, KV = part.ctx, self.head_dim, self.kv_heads
        gathered = self._keys_values(part, "seen", built, pool_type, None)
        for r in range(rows):
            n = f"n{r}"
            first = []
            for t in gathered:
                view = ggml.ggml_view_3d(ctx, t, D, built, KV, t.contents.nb[1], t.contents.nb[2], 0)
                part.fields.follow(view, n, built, ne=(1,))
                part.fields.follow(view, "seen", built, nb=(2, 3))
                first.append(view)
            out = self._attend_row(part, r, *first, n, built)
            part.fields.data(out, "out", r * self.heads * D * 4)
        return out

    # -- running ----------------------------------------------------------------------------------

    _BUILD = {
        PROJECT: _build_project,
        FINISH: _build_finish,
        STEP: _build_step,
        EACH: _build_each,
        SHARED: _build_shared,
    }

    @staticmethod
    def _names(kind: str, rows: int) -> list[str]:
        """The values a graph of `kind` takes on each call, in order."""
        if kind == PROJECT:
            return ["x", "positions", "out"]
        if kind == FINISH:
            return ["x", "attn", "out"]
        counts = [f"n{r}" for r in range(rows)]
        if kind == STEP:
            return ["x", "qkv", "out", "k", "v", "pool", *counts, *(f"index{r}" for r in range(rows))]
        if kind == EACH:
            return ["qkv", "out", "k", "v", "pool", *counts, *(f"index{r}" for r in range(rows))]
        return ["qkv", "out", "k", "v", "pool", "seen", "index0", *counts]

    def _part(self, kind: str, rows: int, keys: int = 0, pool_type: int = 0) -> _Part:
        """The graph of `kind` for `rows` rows on this thread, built for at least `keys` keys a row."""
        kept = self._built.setdefault(kind, OrderedDict())
        key = (threading.get_ident(), rows, pool_type)
        part = kept.pop(key, None)
        if part is None or part.keys < keys:
            if MAX_ROWS < rows < self.piece:
                self._part(kind, self.piece, keys, pool_type)  # first: the prompt arena gets the largest size
            capacity = _capacity(keys) if keys else 0
            threads, arenas = torch.get_num_threads(), _local.__dict__.setdefault("arenas", {})
            build = self._BUILD[kind]
            part = _Part(
                lambda p: build(self, p, rows, capacity, pool_type) if capacity else build(self, p, rows),
                self._names(kind, rows),
                rows,
                64 + 16 * rows * (kind in (STEP, EACH, SHARED)),
                threads,
                arenas,
            )
            part.keys = capacity
            if len(kept) >= KEPT:
                kept.popitem(last=False)
        kept[key] = part
        return part

    def _pieces(self, rows: int) -> list[tuple[int, int]]:
        """A decode step's few rows at once, a prompt chunk's a piece at a time."""
        step = rows if rows <= MAX_ROWS else self.piece
        return [(a, min(a + step, rows)) for a in range(0, rows, step)]

    def project(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """attn_norm(x) through Q, K and V (queries and keys turned by RoPE where `attends`):
        [B, T, dim] -> [B, T, q | k | v]."""
        rows = x.numel() // self.dim
        flat = x.reshape(rows, self.dim).contiguous()
        out = torch.empty(rows, self.qkv_width, dtype=torch.float32)
        x_at, out_at, positions = flat.data_ptr(), out.data_ptr(), ctx.positions32.data_ptr()
        for a, b in self._pieces(rows):
            self._part(PROJECT, b - a)([x_at + a * self.dim * 4, positions + 4 * a, out_at + a * self.qkv_width * 4])
        return out.view(*x.shape[:-1], self.qkv_width)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x + o(attn), then that plus the feed-forward of its norm."""
        rows = x.numel() // self.dim
        flat = x.reshape(rows, self.dim).contiguous()
        attn = attn.reshape(rows, -1).contiguous()
        out = torch.empty_like(flat)
        width = attn.shape[1]
        for a, b in self._pieces(rows):
            at = [
                flat.data_ptr() + a * self.dim * 4,
                attn.data_ptr() + a * width * 4,
                out.data_ptr() + a * self.dim * 4,
            ]
            self._part(FINISH, b - a)(at)
        return out.view(x.shape)

    def __call__(self, x: torch.Tensor, attention: nn.Module, cache, layer: int, ctx) -> torch.Tensor:
        """The block on x [B, T, dim]; `attention` (the block's) where attention is not in the graphs."""
        qkv = self.project(x, ctx)
        pool_type = getattr(ggml, _GGML_TYPES.get(cache.dtype, ""), None)
        if not self.attends or pool_type is None:
            return self.finish(x, attention.attend(qkv, cache, layer, ctx))
        B, T, _ = x.shape
        H, KV = self.heads, self.kv_heads
        heads = qkv.view(B, T, H + 2 * KV, self.head_dim)
        cache.write(layer, heads[:, :, H : H + KV].transpose(1, 2), heads[:, :, H + KV :].transpose(1, 2), ctx.at)
        return self._attend_finish(x, qkv, cache, layer, ctx, pool_type)

    def _attend_finish(self, x, qkv, cache, layer: int, ctx, pool_type: int) -> torch.Tensor:
        B, T, _ = x.shape
        qkv_at, qkv_row = qkv.data_ptr(), self.qkv_width * 4
        pools = [cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), cache.k.shape[2]]
        index = ctx.at.read32
        index_at, index_row = index.data_ptr(), index.stride(0) * 4
        counts = ctx.key_counts
        if T == 1 and B <= MAX_ROWS:  # a decode step: one graph for the rest of the block
            seen = [c[0] for c in counts]
            flat = x.reshape(B, self.dim).contiguous()
            out = torch.empty_like(flat)
            at = [flat.data_ptr(), qkv_at, out.data_ptr(), *pools, *seen]
            self._part(STEP, B, max(seen), pool_type)(at + [index_at + s * index_row for s in range(B)])
            return out.view(x.shape)
        # more rows: their attention a few at a time (graphs of a few sizes, whatever the number
        # of rows), then the rest in pieces
        attn = torch.empty(B * T, self.heads * self.head_dim, dtype=torch.float32)
        attn_at, attn_row = attn.data_ptr(), attn.shape[1] * 4
        if T == 1:  # many sequences' decode step
            for a in range(0, B, MAX_ROWS):
                seen = [c[0] for c in counts[a : a + MAX_ROWS]]
                at = [qkv_at + a * qkv_row, attn_at + a * attn_row, *pools, *seen]
                at += [index_at + s * index_row for s in range(a, a + len(seen))]
                self._part(EACH, len(seen), max(seen), pool_type)(at)
        else:  # prompts: rows of one sequence share their keys
            for s in range(B):
                for a in range(0, T, MAX_ROWS):
                    seen, first = counts[s][a : a + MAX_ROWS], s * T + a
                    at = [qkv_at + first * qkv_row, attn_at + first * attn_row, *pools, max(seen)]
                    self._part(SHARED, len(seen), max(seen), pool_type)(at + [index_at + s * index_row, *seen])
        return self.finish(x, attn)
