"""Multi-head latent attention (model.LatentAttention: DeepSeek-V2/V3, Kimi K2) in ggml's graphs,
in two forms. The absorbed form, llama.cpp's, attends over the cached latents themselves: each
row's every head multiplies kv_lora_rank + rope_dim values per key (576 in DeepSeek-V3) and its
queries and outputs pass through each head's key and value matrix. The expanded form decompresses
each head's keys and values from the latents once for a prompt chunk and attends at the head's
width (192 and 128 values per key in DeepSeek-V3): a third of the arithmetic per row and key, for
the decompression of every key the chunk sees. So it pays for a chunk of many rows, more the
longer the context: the 1B-class DeepSeek-V3 layout in Q4_K_M reads a 4096-token prompt about
twice as fast (benchmarks/latent_forms.py). Decode steps stay absorbed, and so does a prompt's
chunk of fewer rows than choose_form found the expanded form faster from on this CPU, at the
chunk's context (Crossover).

Both forms cache the same latents; they differ in the rounding of the attention of a prompt's rows.
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType
from torch import nn

from ...model import dense_weight
from ...weights import ggml_cpu
from ...weights.codecs import WIDENS, widened_to_q8_0
from ...weights.ggml_cpu import ggml
from .block import (
    FINISH,
    MAX_ROWS,
    SHARED,
    STORE,
    BlockGraphs,
    FeedForwardGraphs,
    _f32,
    _feed_forward,
    _input,
    _linear,
    _matrices,
    _Matrix,
    _norm,
    _piece,
    _vector,
    layer_pools,
    point_at,
    pool_type,
)
from .graph import Graph, scratch

# a prompt in expanded form: PLAIN (STORE with each head's plain queries out), UNPACK (a group of
# heads' keys and values decompressed from the cached latents), EXPANDED (a head's attention for
# rows of one sequence over them), OUTPUT (FINISH without the value matrices)
PLAIN, UNPACK, EXPANDED, OUTPUT = "plain", "unpack", "expanded", "output"

# the rows of a sequence's prompt chunk the two forms are timed at, after each of PREFIXES cached
# positions, the least time of REPEATS each
ROWS, PREFIXES, REPEATS = (16, 64, 256), (512, 2048), 3
TIMED = ROWS[-1], PREFIXES[-1] + ROWS[-1]  # the largest chunk timed: its rows, the positions it sees


@dataclass(frozen=True)
class Crossover:
    """How many seconds the absorbed form takes beyond the expanded form for a prompt chunk's
    `rows` rows of a sequence that sees `seen` positions, fitted as a*rows*seen + b*seen + c*rows
    + d: attention over every key for each row (a: the expanded form's is a third of the
    arithmetic), the keys and values decompressed once a chunk (b: the expanded form's cost), each
    row's queries and output through every head's key and value matrix (c: the absorbed form's),
    and what each call costs. The expanded form runs where that is positive: from a number of rows
    that grows with the context, and never from fewer rows than were timed (`least`): decode steps
    stay absorbed."""

    a: float
    b: float
    c: float
    d: float
    least: int = 1

    def rows_from(self, seen: int) -> int | None:
        """From how many rows a sequence's chunk over `seen` positions runs expanded (None: none)."""
        gain = self.a * seen + self.c  # what each more row saves in expanded form
        if gain <= 0:
            return None
        return max(self.least, math.floor(-(self.b * seen + self.d) / gain) + 1)

    def expands(self, rows: int, seen: int) -> bool:
        least = self.rows_from(seen)
        return least is not None and rows >= least

    @classmethod
    def fit(cls, times: dict[tuple[int, int], tuple[float, float]]) -> "Crossover":
        """The fit to (rows, seen) -> (absorbed, expanded) seconds, each point's difference taken
        relative to its times (least squares), so that short chunks weigh as much as long ones."""
        design, target = [], []
        for (rows, seen), (absorbed, expanded) in times.items():
            scale = 2 / (absorbed + expanded)
            design.append([rows * seen * scale, seen * scale, rows * scale, scale])
            target.append([(absorbed - expanded) * scale])
        design, target = (torch.tensor(t, dtype=torch.float64) for t in (design, target))
        return cls(*torch.linalg.lstsq(design, target).solution.flatten().tolist(), min(r for r, _ in times))


ALWAYS = Crossover(0.0, 0.0, 1.0, 0.0)  # every chunk of a prompt expanded (tests, benchmarks)


class LatentGraphs(BlockGraphs):
    """A block of multi-head latent attention in the graphs. In absorbed form (a decode step, and
    a prompt's rows where choose_form found it faster), as llama.cpp's: the queries through their
    bottleneck, each head's plain part taken into the latent space through its key matrix (k_b)
    beside its rotated part, attending over the cached latents with the rotated key part every
    head shares (one key head of kv_lora_rank + rope_dim, whose first kv_lora_rank values are its
    value), the latent each head reads out through its value matrix (v_b), then the output
    projection. In expanded form, the plain queries, each head's keys and values decompressed from
    the cached latents, attention at the heads' own widths, then the output projection. RoPE turns
    each adjacent pair (GGML_ROPE_TYPE_NORM), as DeepSeek trains it."""

    POOLS = ("k",)  # the cache keeps no values: they are the keys' latent part
    PROMPT_ONLY = (SHARED, UNPACK, EXPANDED)

    def __init__(self, block: nn.Module, projections: dict, out: _Matrix, ffn, piece: int | None):
        FeedForwardGraphs.__init__(self, block, ffn, piece)
        attn = block.attn
        self.attn_norm, self.eps_attn = _f32(block.attn_norm.weight), block.attn_norm.eps
        self.projections, self.out = projections, out
        for m in [*projections.values(), out]:
            m.bias = _f32(m.bias)
        q_a_norm = getattr(attn, "q_a_norm", None)  # where the queries go through a bottleneck
        self.q_a_norm = None if q_a_norm is None else (_f32(q_a_norm.weight), q_a_norm.eps)
        self.kv_a_norm = _f32(attn.kv_a_norm.weight), attn.kv_a_norm.eps
        # each head's key and value matrices: [nope, latent, H] and [latent, v, H] as ggml sees them
        self.k_b, self.v_b = (_per_head(m, attn.n_heads) for m in (attn.k_b, attn.v_b))
        self.latent, self.rope_dim, self.nope, self.v_dim = attn.latent, attn.rope_dim, attn.nope, attn.v_dim
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, 1, attn.latent + attn.rope_dim
        self.gated, self.head_norms, self.sinks, self.window = False, None, None, 0
        self.scale = attn.scale
        self.attn_width = self.heads * self.latent
        self._place(block)
        # the expanded form of a prompt: where it runs (None: never; choose_form measures it), and
        # each head's key matrix the other way round, which it multiplies the cached latents by
        self.crossover: Crossover | None = None
        self._key_matrix, self.k_b_t = attn.k_b, None
        # each head's key and value matrices' modules, and their Q8_0 copies where they are held so
        # (widen)
        self._per_head_modules, self._widened = (attn.k_b, attn.v_b), []

    @classmethod
    def of(cls, block: nn.Module, inv_freq: torch.Tensor, rope_base: float, gain: float = 1.0) -> "LatentGraphs | None":
        if not ggml_cpu.available():
            return None
        attn, ffn = block.attn, _feed_forward(block.ffn)
        names = ("wq_a", "wq_b", "wkv_a") if hasattr(attn, "wq_a") else ("wq", "wkv_a")
        found = {name: _matrices(getattr(attn, name)) for name in names}
        out = _matrices(attn.wo)
        if ffn is None or out is None or any(m is None for m in found.values()):
            return None
        graphs = cls(block, {name: m[0] for name, m in found.items()}, out[0], ffn, _piece(ffn, list(block.modules())))
        graphs._set_rope(inv_freq, rope_base, gain)
        return graphs

    @staticmethod
    def _tensor_3d(ctx, held):
        """A per-head matrix (_per_head) as a ggml tensor [columns, rows per head, heads]."""
        m, heads, dense = held
        if m is None:
            t = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, dense.shape[1], dense.shape[0] // heads, heads)
            t.contents.data = dense.data_ptr()
            return t
        t = ggml.ggml_new_tensor_3d(ctx, m.qtype, m.K, m.N // heads, heads)
        point_at(t, m.data)
        return t

    def _turn(self, ctx, t, heads: int, rows: int, positions):
        """RoPE on each adjacent pair of t [rope_dim, heads, rows] (a view is made contiguous)."""
        dims, base, factors, gain = self.rope
        factors = None if factors is None else _vector(ctx, factors)
        t = ggml.ggml_cont(ctx, t)
        return ggml.ggml_rope_ext(ctx, t, positions, factors, dims, 0, 0, base, 1.0, 0.0, gain, 32.0, 1.0)

    def _project(self, ctx, x, rows: int, positions, plain: bool = False) -> list:
        """The absorbed queries [heads * (latent + rope_dim), rows] (`plain`: each head's own,
        [heads * (nope + rope_dim), rows]) and the cached keys [latent + rope_dim, rows] (no values)."""
        H, L, R, N = self.heads, self.latent, self.rope_dim, self.nope
        h = _norm(ctx, x, self.attn_norm, self.eps_attn)
        p = self.projections
        if self.q_a_norm is not None:
            q = _linear(ctx, p["wq_b"], _norm(ctx, _linear(ctx, p["wq_a"], h), *self.q_a_norm))
        else:
            q = _linear(ctx, p["wq"], h)
        q = ggml.ggml_reshape_3d(ctx, q, N + R, H, rows)
        q_nope = ggml.ggml_view_3d(ctx, q, N, H, rows, q.contents.nb[1], q.contents.nb[2], 0)
        q_rot = ggml.ggml_view_3d(ctx, q, R, H, rows, q.contents.nb[1], q.contents.nb[2], N * 4)
        q_rot = self._turn(ctx, q_rot, H, rows, positions)  # [R, H, rows]
        if plain:  # each head's plain and rotated part as they are, [N + R, H, rows]
            query = ggml.ggml_concat(ctx, ggml.ggml_cont(ctx, q_nope), q_rot, 0)
        else:  # each head's plain part through its key matrix: [N, rows, H] x [N, L, H] -> [L, rows, H]
            heads_first = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, q_nope, 0, 2, 1, 3))
            absorbed = ggml.ggml_mul_mat(ctx, self._tensor_3d(ctx, self.k_b), heads_first)
            absorbed = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, absorbed, 0, 2, 1, 3))  # [L, H, rows]
            query = ggml.ggml_concat(ctx, absorbed, q_rot, 0)  # [L + R, H, rows]
        kv = _linear(ctx, p["wkv_a"], h)  # [L + R, rows]
        latent = ggml.ggml_view_2d(ctx, kv, L, rows, kv.contents.nb[1], 0)
        latent = _norm(ctx, ggml.ggml_cont(ctx, latent), *self.kv_a_norm)
        k_rot = ggml.ggml_view_3d(ctx, kv, R, 1, rows, kv.contents.nb[1], kv.contents.nb[1], L * 4)
        k_rot = ggml.ggml_reshape_2d(ctx, self._turn(ctx, k_rot, 1, rows, positions), R, rows)
        key = ggml.ggml_concat(ctx, latent, k_rot, 0)  # [L + R, rows]
        return [ggml.ggml_reshape_2d(ctx, query, query.contents.ne[0] * H, rows), key, None]

    def _pair(self, g: Graph, gathered: list, n: str, built: int) -> tuple:
        """The keys, and their latent part as the values (one key head: its stride between heads unused)."""
        keys = gathered[0]
        values = ggml.ggml_view_3d(g.ctx, keys, self.latent, built, 1, keys.contents.nb[1], keys.contents.nb[2], 0)
        return keys, g.fields.follow(values, n, built, ne=(1,))

    def _output(self, ctx, attn):
        """Each head's latent [latent, heads, rows] through its value matrix, then the output
        projection. (attn may be a call's input, which no view may read: the graphs place a view's
        data once, at build, and an input's moves with each call.)"""
        H, rows = self.heads, attn.contents.ne[1]
        latents = ggml.ggml_reshape_3d(ctx, ggml.ggml_cont(ctx, attn), self.latent, H, rows)
        heads_first = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, latents, 0, 2, 1, 3))  # [latent, rows, H]
        read = ggml.ggml_mul_mat(ctx, self._tensor_3d(ctx, self.v_b), heads_first)  # [v, rows, H]
        read = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, read, 0, 2, 1, 3))  # [v, H, rows]
        return _linear(ctx, self.out, ggml.ggml_reshape_2d(ctx, read, self.v_dim * H, rows))

    # -- the expanded form ----------------------------------------------------------------------------

    def query_width(self, form: str = STORE) -> int:
        return self.heads * ((self.nope if form == PLAIN else self.latent) + self.rope_dim)

    def _build_plain(self, g: Graph, rows: int, built: int, kind: int):
        return self._build_store(g, rows, built, kind, plain=True)

    def _build_unpack(self, g: Graph, rows: int, built: int, kind: int):
        """The keys and values of `rows` heads in turn, from the "seen" cached positions listed at
        "index0": each head's keys [nope + rope_dim, seen] ("keys": its key matrix on each cached
        latent, the rotated part every head shares after it) and values [seen, v] ("values", a
        column per value: what attention's weights multiply). "kbt" and "vb": the heads' matrices."""
        ctx, L, R, N, V, follow = g.ctx, self.latent, self.rope_dim, self.nope, self.v_dim, g.fields.follow
        pool = self._pool(g, "k", built, kind)
        gathered = self._gather(g, pool, self._index(g, "index0", "seen", built), "seen", built)  # [L + R, seen, 1]
        nb = gathered.contents.nb[1]
        latent = follow(ggml.ggml_view_2d(ctx, gathered, L, built, nb, 0), "seen", built, ne=(1,))
        latent = follow(ggml.ggml_cont(ctx, latent), "seen", built, ne=(1,), nb=(2, 3))
        key_matrices = g.fields.data(ggml.ggml_new_tensor_2d(ctx, self.k_b_t_type, L, N * rows), "kbt")
        plain = follow(ggml.ggml_mul_mat(ctx, key_matrices, latent), "seen", built, ne=(1,), nb=(2, 3))
        plain = ggml.ggml_view_3d(ctx, plain, N, rows, built, N * 4, N * rows * 4, 0)  # [N, heads, seen]
        plain = follow(ggml.ggml_permute(ctx, plain, 0, 2, 1, 3), "seen", built, ne=(1,))  # [N, seen, heads]
        rotated = ggml.ggml_view_3d(ctx, gathered, R, built, 1, nb, nb * built, L * 4)
        rotated.contents.ne[2], rotated.contents.nb[2] = rows, 0  # every head reads the one
        rotated = follow(rotated, "seen", built, ne=(1,))
        keys = follow(ggml.ggml_concat(ctx, plain, rotated, 0), "seen", built, ne=(1,), nb=(2, 3))
        g.then(g.fields.data(keys, "keys"))
        value_matrices = g.fields.data(ggml.ggml_new_tensor_2d(ctx, self.v_b_type, L, V * rows), "vb")
        values = follow(ggml.ggml_mul_mat(ctx, value_matrices, latent), "seen", built, ne=(1,), nb=(2, 3))
        columns = follow(ggml.ggml_transpose(ctx, values), "seen", built, ne=(0,), nb=(2, 3))  # [seen, v * heads]
        return g.fields.data(follow(ggml.ggml_cont(ctx, columns), "seen", built, ne=(0,), nb=(1, 2, 3)), "values")

    def _build_expanded(self, g: Graph, rows: int, built: int, kind: int):
        """One head's attention for `rows` rows of a sequence: their queries ("q", a row's every
        head's apart) over UNPACK's keys and values, each row seeing the keys its "mask" row does
        not hide; each row's output [v] into "o" (a row's every head's apart)."""
        ctx, D, V, H, follow = g.ctx, self.nope + self.rope_dim, self.v_dim, self.heads, g.fields.follow
        keys = follow(_input(g, "keys", D, built), "seen", built, ne=(1,), nb=(2, 3))
        values = follow(_input(g, "values", built, V), "seen", built, ne=(0,), nb=(1, 2, 3))
        query = _input(g, "q", D, rows)
        _strided(query, H * D * 4)
        scores = ggml.ggml_mul_mat(ctx, keys, ggml.ggml_cont(ctx, query))
        follow(scores, "seen", built, ne=(0,), nb=(1, 2, 3))
        mask = follow(_input(g, "mask", built, rows), "seen", built, ne=(0,), nb=(1, 2, 3))
        weights = follow(
            ggml.ggml_soft_max_ext(ctx, scores, mask, self.scale, 0.0), "seen", built, ne=(0,), nb=(1, 2, 3)
        )
        out = ggml.ggml_mul_mat(ctx, values, weights)  # [v, rows], written a row's every head's apart
        _strided(out, H * V * 4)
        return g.fields.data(out, "o")

    def _build_output(self, g: Graph, rows: int):
        """The rest of the block after attention in expanded form: x + o(attn), then that plus the
        feed-forward of its norm (the heads' outputs [heads * v, rows] are no latents to read out)."""
        x, attn = _input(g, "x", self.dim, rows), _input(g, "attn", self.heads * self.v_dim, rows)
        out = self.residual_ffn(g.ctx, ggml.ggml_add(g.ctx, x, _linear(g.ctx, self.out, attn)))
        return g.fields.data(out, "out")

    _BUILD = {
        **BlockGraphs._BUILD,
        PLAIN: _build_plain,
        UNPACK: _build_unpack,
        EXPANDED: _build_expanded,
        OUTPUT: _build_output,
    }

    def _names(self, kind: str, rows: int) -> list[str]:
        if kind in (PLAIN, OUTPUT):
            return super()._names(STORE if kind == PLAIN else FINISH, rows)
        if kind == UNPACK:
            return ["k", self.size, "index0", "seen", "kbt", "vb", "keys", "values"]
        if kind == EXPANDED:
            return ["keys", "values", "seen", "q", "mask", "o"]
        return super()._names(kind, rows)

    def expands(self) -> None:
        """Hold each head's key matrix with the latent as its inner dimension, as the expanded form
        multiplies the cached latents by it: the file's is the other way round, for the absorbed
        form. As stored where that is float32, else in float16 (a copy: no quantized type's blocks
        can be turned)."""
        if self.k_b_t is not None:
            return
        H, L, N = self.heads, self.latent, self.nope
        weight = dense_weight(self._key_matrix).detach().to(torch.float32).view(H, L, N).transpose(1, 2)
        m = self.k_b[0]
        exact = m is None or m.qtype == ggml.GGML_TYPE_F32
        self.k_b_t = weight.contiguous() if exact else weight.to(torch.float16).contiguous()
        self.k_b_t_type = ggml.GGML_TYPE_F32 if exact else ggml.GGML_TYPE_F16

    def widened(self) -> tuple[tuple, tuple, list[torch.Tensor]]:
        """Each head's key and value matrices (as _per_head holds them) as Q8_0 where they are
        stored Q4_0 or Q5_0 (the same values, codecs.widened_to_q8_0), and the copies they read."""
        held, copies = [], []
        for (m, heads, dense), module in zip((self.k_b, self.v_b), self._per_head_modules):
            stored = None if m is None else GGMLQuantizationType(m.qtype).name
            if stored in WIDENS:
                copies.append(widened_to_q8_0(module.raw.view(m.N, -1), stored))
                m = _Matrix(ggml.GGML_TYPE_Q8_0, m.K, m.N, copies[-1].data_ptr(), m.bias)
            held.append((m, heads, dense))
        return held[0], held[1], copies

    def widen(self, widened: tuple | None = None) -> None:
        """Hold each head's key and value matrices widened (choose_widening found it faster;
        `widened`: what widened() gave, where made already)."""
        if not self._widened:
            self.k_b, self.v_b, self._widened = widened or self.widened()
            self._built.clear()

    @property
    def v_b_type(self) -> int:
        m = self.v_b[0]
        return ggml.GGML_TYPE_F32 if m is None else m.qtype

    def _head_matrices(self, h: int) -> tuple[int, int]:
        """Where head h's key matrix (latent inner) and value matrix lie (the next heads' follow)."""
        keys = self.k_b_t.data_ptr() + h * self.k_b_t[h].nbytes
        m, _, dense = self.v_b
        if m is None:
            return keys, dense.data_ptr() + h * self.v_dim * self.latent * 4
        return keys, m.data + h * self.v_dim * ggml.ggml_row_size(m.qtype, self.latent)

    def __call__(self, x: torch.Tensor, cache, layer: int, ctx, last_only: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        if last_only or self.crossover is None or self.k_b_t is None or not self._expands(T, ctx):
            return super().__call__(x, cache, layer, ctx, last_only)
        return self.expanded(x, ctx, layer_pools(cache, layer), pool_type(cache))

    def _expands(self, rows: int, ctx) -> bool:
        """Whether a chunk of `rows` rows of each sequence runs expanded: where the crossover says
        so for the sequence that sees the most positions."""
        return self.crossover.expands(rows, max(counts[-1] for counts in ctx.key_counts))

    def expanded(self, x: torch.Tensor, ctx, pools: list[int], kind: int) -> torch.Tensor:
        """The block on a prompt chunk x [B, T, dim] in expanded form."""
        B, T, _ = x.shape
        queries, _ = self.store(x.reshape(B * T, self.dim).contiguous(), ctx, pools, kind, PLAIN)
        return self.finish(x, self.attend_expanded(queries, pools, ctx, kind, B, T), None, OUTPUT)

    def attend_expanded(self, queries, pools: list[int], ctx, kind: int, B: int, T: int) -> torch.Tensor:
        """The attention of the rows of B sequences of T (their plain queries, PLAIN's) -> [B * T,
        heads * v]: for each sequence, the keys and values of a group of heads decompressed at once
        from the positions its last row sees (as many heads as fit in UNPACKED bytes), then each
        head's rows over them a group of rows at a time (as many as keep a head's scores in SCORES
        bytes)."""
        H, D, V = self.heads, self.nope + self.rope_dim, self.v_dim
        attn = scratch("attention", B * T, H * V)
        index_at, index_row = ctx.at.read_at
        for s, counts in enumerate(ctx.key_counts):
            seen = counts[-1]
            heads = heads_at_once(H, seen * (D + V) * 4)
            keys, values = scratch("expanded keys", heads * seen, D), scratch("expanded values", heads * V, seen)
            unpack = self._graph(UNPACK, heads, seen, kind)
            step = rows_at_once(T, seen)
            groups = []
            for a in range(0, T, step):
                rows = counts[a : a + step]
                mask = torch.full((len(rows), seen), float("-inf"))
                mask.masked_fill_(torch.arange(seen) < torch.tensor(rows)[:, None], 0.0)
                groups.append((a, mask, self._graph(EXPANDED, len(rows), seen, kind)))
            first = s * T
            for group in range(0, H, heads):
                at = [pools[0], pools[-1], index_at + s * index_row, seen, *self._head_matrices(group)]
                unpack(at + [keys.data_ptr(), values.data_ptr()])
                for h in range(group, group + heads):
                    k, v = (t.data_ptr() + (h - group) * width * seen * 4 for t, width in ((keys, D), (values, V)))
                    for a, mask, graph in groups:
                        q = queries.data_ptr() + ((first + a) * H + h) * D * 4
                        o = attn.data_ptr() + ((first + a) * H + h) * V * 4
                        graph([k, v, seen, q, mask.data_ptr(), o])
        return attn

    def time_forms(self, rows: int, prefix: int) -> tuple[float, float]:
        """Seconds a prompt chunk of `rows` rows after `prefix` cached positions takes in absorbed
        form and in expanded form, the least of REPEATS, on random values over a float16 cache:
        the queries' projections, the keys cached and attention. The rest of the block is the same
        in both (the output projection, the feed-forward) but for the absorbed form's value
        matrices, which are left out: a choice by these times leans to the absorbed form."""
        seen = prefix + rows
        kind = ggml.GGML_TYPE_F16
        pool = torch.randn(1, 1, seen, self.head_dim).to(torch.float16)
        x = torch.randn(rows, self.dim)
        positions, write, read = (
            array("i", range(prefix, seen)),
            array("q", range(prefix, seen)),
            array("i", range(seen)),
        )
        at = SimpleNamespace(write_at=write.buffer_info()[0], read_at=(read.buffer_info()[0], 0))
        ctx = SimpleNamespace(
            positions_at=positions.buffer_info()[0], at=at, key_counts=[list(range(prefix + 1, seen + 1))]
        )
        pools = [pool.data_ptr(), pool.data_ptr(), seen]

        def absorbed():
            self.attend(self.store(x, ctx, pools, kind)[0], pools, ctx, kind, 1, rows)

        def expanded():
            self.attend_expanded(self.store(x, ctx, pools, kind, PLAIN)[0], pools, ctx, kind, 1, rows)

        times: dict = {absorbed: [], expanded: []}
        for _ in range(REPEATS):
            for form in times:
                start = time.perf_counter()
                form()
                times[form].append(time.perf_counter() - start)
        return min(times[absorbed]), min(times[expanded])


# a prompt in expanded form holds, at most: the keys and values of a group of heads decompressed
# at once, and one head's scores for a group of rows
UNPACKED, SCORES = 64 << 20, 16 << 20


def _strided(t, row_bytes: int) -> None:
    """t [width, rows] as lying a row every `row_bytes` (one head's part of rows of every head's)."""
    t.contents.nb[1] = row_bytes
    t.contents.nb[2] = t.contents.nb[3] = row_bytes * t.contents.ne[1]


def _per_head(module: nn.Module, heads: int) -> tuple:
    """A matrix of every head's rows as the graphs multiply it a head at a time: its stored blocks
    where ggml reads them (not a repacked layout), else a dense float32 copy; (matrix or None,
    heads, copy or None)."""
    found = _matrices(module)
    if found is not None and found[0].repacked is None:
        return found[0], heads, None
    weight = dense_weight(module)
    return None, heads, weight.detach().to(torch.float32).contiguous()


def turned_key_bytes(cfg, stored: str | None) -> int:
    """What a latent block holds beside its weights where it runs prompts in expanded form: each
    head's key matrix turned (LatentGraphs.expands), from a key matrix stored as `stored` (None: a
    folder's kv_b, split into float32 matrices)."""
    size = 4 if stored in (None, "F32") else 2
    return cfg.n_heads * (cfg.head_dim - cfg.rope_dim) * cfg.kv_lora_rank * size


def expanded_workspace(cfg, chunk: int, seen: int) -> int:
    """Bytes a prompt chunk of `chunk` rows over `seen` positions in expanded form holds at most
    beside what the absorbed form holds: the keys and values of a group of heads (in scratch, and
    the graph's own of them before their copy), the gathered latents and their copy, and one head's
    scores and weights for a group of rows (attend_expanded)."""
    seen = max(seen, 1)
    per_head = seen * (cfg.head_dim + cfg.v_head_dim) * 4
    latents = seen * (2 * cfg.kv_lora_rank + cfg.rope_dim) * 4
    return 2 * heads_at_once(cfg.n_heads, per_head) * per_head + latents + 2 * rows_at_once(chunk, seen) * seen * 4


def heads_at_once(heads: int, per_head: int) -> int:
    """Of `heads`, how many a prompt decompresses at once where each takes `per_head` bytes: a
    divisor of them, within UNPACKED bytes (one at least)."""
    return max(n for n in range(1, heads + 1) if heads % n == 0 and (n == 1 or n * per_head <= UNPACKED))


def rows_at_once(rows: int, seen: int) -> int:
    """Of a sequence's `rows` in a prompt chunk over `seen` positions, how many attend at once:
    a head's scores within SCORES bytes, MAX_ROWS at least."""
    return min(rows, max(MAX_ROWS, SCORES // (4 * seen) // MAX_ROWS * MAX_ROWS))


def choose_form(graphs: list[LatentGraphs]) -> tuple[str, str]:
    """Time the two forms on the first of a stage's latent blocks (all have its shapes) at ROWS
    after each of PREFIXES, and fit where the expanded form is the faster (Crossover); every block
    runs a prompt chunk's rows expanded there (holding each head's key matrix turned, expands),
    none where it never is. -> what was chosen, and the times it was chosen by."""
    first = graphs[0]
    first.expands()
    times = {(rows, prefix + rows): first.time_forms(rows, prefix) for prefix in PREFIXES for rows in ROWS}
    crossover = Crossover.fit(times)
    contexts = [PREFIXES[0], 4 * PREFIXES[-1], 64 * PREFIXES[-1]]
    rows_from = [crossover.rows_from(seen) for seen in contexts]
    if any(rows_from):
        for g in graphs:
            g.expands()
            g.crossover = crossover
        (rows, seen), *more = [(rows, seen) for rows, seen in zip(rows_from, contexts) if rows]
        chosen = f"latent attention: prompt chunks expanded from {rows} rows at {seen} positions seen"
        chosen += "".join(f", {rows} at {seen}" for rows, seen in more)
    else:
        first.k_b_t = None
        chosen = "latent attention: absorbed (every row)"
    measured = ", ".join(f"{r} rows over {s} {a * 1e3:.1f}/{e * 1e3:.1f} ms" for (r, s), (a, e) in times.items())
    return chosen, f"absorbed/expanded: {measured}"


class _PerHead(ggml_cpu._Built):
    """One row for each head through a per-head matrix as held (_per_head): what a decode row's
    query (the key matrices) or latent (the value matrices) goes through."""

    def __init__(self, held: tuple, threads: int):
        super().__init__(4, 4)
        heads = held[1]
        self.w = LatentGraphs._tensor_3d(self.ctx, held)
        K, N = self.w.contents.ne[0], self.w.contents.ne[1]
        self.x, self.y = torch.randn(heads, K), torch.empty(heads, N)
        x = ggml.ggml_new_tensor_3d(self.ctx, ggml.GGML_TYPE_F32, K, 1, heads)
        x.contents.data = self.x.data_ptr()
        y = ggml.ggml_mul_mat(self.ctx, self.w, x)
        y.contents.data = self.y.data_ptr()
        self._finish(y, threads)

    def run(self) -> None:
        self._compute()


CALLS = 50  # a timing of a decode row's per-head products: the least of REPEATS runs of CALLS each


def _per_head_seconds(variants: dict[str, tuple]) -> dict[str, float]:
    """Seconds of a decode row through each variant's key and value matrices, the variants timed
    in turn, the least of REPEATS runs of CALLS each."""
    graphs = {name: [_PerHead(held, torch.get_num_threads()) for held in pair] for name, pair in variants.items()}
    best = dict.fromkeys(graphs, float("inf"))
    for _ in range(REPEATS):
        for name, pair in graphs.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                for g in pair:
                    g.run()
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS)
    return best


def choose_widening(graphs: list[LatentGraphs]) -> tuple[str, str] | None:
    """Where each head's key and value matrices are stored Q4_0 or Q5_0: time a decode row's
    products through the first block's as stored and widened to Q8_0, and widen every block's
    where that is the faster (ggml's product of such short rows costs mostly its calls, and Q8_0's
    calls are the cheaper on some CPUs). -> what was chosen and the times, or None where nothing
    widens."""
    first = graphs[0]
    widened = first.widened()
    if not widened[2]:
        return None
    named = (GGMLQuantizationType(m.qtype).name for m, _, _ in (first.k_b, first.v_b) if m is not None)
    stored = sorted({name for name in named if name in WIDENS})
    seconds = _per_head_seconds({"stored": (first.k_b, first.v_b), "widened": widened[:2]})
    faster = seconds["widened"] < seconds["stored"]
    if faster:
        first.widen(widened)
        for g in graphs[1:]:
            g.widen()
    what = f"each head's key and value matrices: {'/'.join(stored)} " + ("widened to Q8_0" if faster else "as stored")
    return (
        what,
        f"a decode row through them as stored/widened: {seconds['stored'] * 1e6:.0f}/{seconds['widened'] * 1e6:.0f} us",
    )


def widened_bytes(cfg, key_stored: str | None, value_stored: str | None) -> int:
    """What a latent block holds beside its weights where each head's key and value matrices,
    stored as given, are widened (choose_widening): the Q8_0 copies (34 bytes a 32 values) of those
    stored Q4_0 or Q5_0."""
    nope, rank = cfg.head_dim - cfg.rope_dim, cfg.kv_lora_rank
    values = (nope * rank if key_stored in WIDENS else 0) + (cfg.v_head_dim * rank if value_stored in WIDENS else 0)
    return cfg.n_heads * values // 32 * 34
