"""A block's rows on a CPU as ggml graphs, as llama.cpp's CPU backend computes them: the norm,
the Q, K and V projections and RoPE; attention over the cached keys and values; the output
projection and residual, the feed-forward norm, the feed-forward and the second residual. The
feed-forward is dense (gate, up, SwiGLU, down) or a mixture of experts (the router, each row's
top experts by ggml's mul_mat_id on the experts as held, a shared expert), as in llama.cpp.

A decode step is a few rows against every weight of the model. Run one PyTorch or ggml call at
a time, its ~20 calls per block cost more than their arithmetic (PyTorch's dispatch, its code
cold after each block's weights went through the caches: 170 us a block at 1B width), and every
matrix starts its stream from a cold prefetcher. So a decode step of a stage whose blocks all
decode in graphs (these, and Qwen3.5's delta-net blocks, deltanet.py) is one graph
(StageGraph), as llama.cpp's is; other stages run a block as two graphs.

A prompt chunk goes through the same kernels in pieces of rows where every matrix multiplies a
piece as it is held (no dequantized GEMM that pieces would repeat). Attention takes each row
alone over exactly the keys it sees (a graph's shapes follow each call's key counts), the values
weighted one key after another, so each row meets the same arithmetic whether it is decoded or
read in a prompt, and the keys and values a reply left in the cache are the ones a prompt
holding it computes. (Latent attention's expanded form, for a prompt's many rows, rounds
otherwise: latent.py.)

A gated block (Qwen3.5) splits each head's queries from its gate rows and scales the attention's
output by sigmoid(gate) before the output projection, in a decode step and in a prompt's pieces
(the gates carried from the projection's graph to the rest's).

One module of this length: a block's graphs (store, attention, finish, feed-forward, the stage's
step) share the graph-building helpers and the rules of the thread's scratch.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

import torch
from gguf import GGMLQuantizationType
from torch import nn

from ...model import (
    Attention,
    FeedForward,
    Linear,
    MixtureOfExperts,
    ffn_piece_rows,
    prefers_whole,
    swiglu,
)
from ...weights import ggml_cpu
from ...weights.ggml_cpu import GGMLExperts, GGMLLinear, RepackedLinear, ggml, least_recently_used, point_at
from ...weights.packed import GGUFLinear
from .graph import MAX_ROWS, PROMPT, Graph, scratch, scratch_beside

KEPT = 8  # graphs a block keeps built per kind: decode's row counts, a prompt's pieces
FIRST_KEYS = 256  # keys a graph's attention is first built for; doubled as its sequences grow

_GGML_TYPES = {torch.float32: "GGML_TYPE_F32", torch.float16: "GGML_TYPE_F16", torch.bfloat16: "GGML_TYPE_BF16"}

# a block's graph kinds: STORE (norm, Q, K, V, RoPE, and the keys and values written into the
# cache); then STEP (a decode step's attention, one row per sequence, and the rest
# of the block), or EACH (that attention alone) or SHARED (rows of one sequence, a prompt's,
# attention alone) followed by FINISH (the rest); FEED: the feed-forward half alone, of a block
# whose token mixer runs in the modules
STORE, FINISH, STEP, EACH, SHARED, FEED = "store", "finish", "step", "each", "shared", "feed"


class _Matrix:
    """One weight as a ggml graph takes it: type, shape, where its bytes are, and for a repacked
    weight the buffer its kernels dispatch on; plus the bias added after it."""

    def __init__(self, qtype: int, K: int, N: int, data: int, bias, repacked=None):
        self.qtype, self.K, self.N, self.data, self.bias, self.repacked = qtype, K, N, data, bias, repacked

    def tensor(self, ctx):
        t = ggml.ggml_new_tensor_2d(ctx, self.qtype, self.K, self.N)
        point_at(t, self.data if self.repacked is None else self.repacked)
        return t


def _matrices(module: nn.Module, rows: list[int] | None = None) -> list[_Matrix] | None:
    """`module` as ggml matrices, split into consecutive row ranges of the given sizes (a fused
    dense projection holds several; None: one of all its rows); None if ggml cannot run it as it
    is held."""
    bias = getattr(module, "bias", None)
    if isinstance(module, RepackedLinear):
        found = [_Matrix(module.qtype, module.in_features, module.out_features, 0, bias, module.layout)]
    elif isinstance(module, GGMLLinear):
        found = [_Matrix(module.qtype, module.in_features, module.out_features, module.raw.data_ptr(), bias)]
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


def _projections(fused: nn.Module | None, sizes: list[int] | None, parts) -> list[_Matrix] | None:
    """Several projections of one input as ggml matrices: `fused` (one module holding them all,
    where the model was loaded so) split into rows of `sizes`, else each of the modules `parts()`
    gives; None if ggml cannot run one as it is held."""
    if fused is not None:
        return _matrices(fused, sizes)
    found = [_matrices(m) for m in parts()]
    return None if None in found else [f[0] for f in found]


def _table(module: nn.Module) -> _Matrix | None:
    """A token embedding's table as ggml reads its rows (stored blocks, in whichever format they
    are multiplied, or a dense matrix); None where its layout is not one ggml reads rows of."""
    if isinstance(module, GGUFLinear):
        return _Matrix(
            int(GGMLQuantizationType[module.stored]),
            module.in_features,
            module.out_features,
            module.raw.data_ptr(),
            None,
        )
    found = None if isinstance(module, RepackedLinear) else _matrices(module)
    return None if found is None else found[0]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float32).contiguous()


def _capacity(n: int) -> int:
    return max(FIRST_KEYS, 1 << (n - 1).bit_length())


def pool_type(cache) -> int | None:
    """The ggml type of a KV cache's pool, None where the graphs cannot read it."""
    name = _GGML_TYPES.get(cache.dtype)
    return None if name is None else getattr(ggml, name)


def pool_addresses(cache, layers: range) -> list[int]:
    """Where each layer's keys and values pools lie in a KV cache, in turn (k, v of the first, ...)."""
    k, v = cache.k, cache.v
    step = k.stride(0) * k.element_size()
    k_at, v_at = k.data_ptr(), v.data_ptr()
    return [at + i * step for i in layers for at in (k_at, v_at)]


def layer_pools(cache, layer: int) -> list[int]:
    """A layer's keys and values pools in a KV cache and the positions each holds."""
    return [*pool_addresses(cache, range(layer, layer + 1)), cache.k.shape[2]]


def slot_ids(rows) -> array:
    """A step's slots (a StepContext's rows: a slice or a tensor) as int32 ids ggml reads."""
    return array("i", range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist())


def recurrent_addresses(recurrent, layers: list[int]) -> list[int]:
    """Where each delta-net layer's convolution inputs and delta-rule states lie, in turn."""
    conv, delta = recurrent.conv, recurrent.delta
    step_conv, step_delta = conv.stride(0) * conv.element_size(), delta.stride(0) * delta.element_size()
    return [at for i in layers for at in (conv.data_ptr() + i * step_conv, delta.data_ptr() + i * step_delta)]


def _vector(ctx, t: torch.Tensor):
    v = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, t.shape[0])
    v.contents.data = t.data_ptr()
    return v


def _matrix_2d(ctx, t: torch.Tensor):
    """A float32 [rows, columns] tensor as ggml's [columns, rows]."""
    m = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, t.shape[1], t.shape[0])
    m.contents.data = t.data_ptr()
    return m


def _linear(ctx, m: _Matrix, h):
    y = ggml.ggml_mul_mat(ctx, m.tensor(ctx), h)
    return y if m.bias is None else ggml.ggml_add(ctx, y, _vector(ctx, m.bias))


def _norm(ctx, x, weight: torch.Tensor, eps: float):
    return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, eps), _vector(ctx, weight))


def _input(g: Graph, name: str, *shape: int, kind=None):
    make = getattr(ggml, f"ggml_new_tensor_{len(shape)}d")
    return g.fields.data(make(g.ctx, ggml.GGML_TYPE_F32 if kind is None else kind, *shape), name)


class _Dense:
    """A feed-forward as the graphs run it: down(silu(gate(h)) * up(h))."""

    nodes = 0  # graph nodes it adds to a block's

    def __init__(self, gate: _Matrix, up: _Matrix, down: _Matrix):
        self.gate, self.up, self.down = gate, up, down
        self.matrices = [gate, up, down]
        self.hidden = down.K

    @classmethod
    def of(cls, ffn: nn.Module) -> "_Dense | None":
        """model.FeedForward `ffn` (a SwiGLU), None where ggml cannot run its matrices as held."""
        if ffn.act is not swiglu:
            return None
        sizes = None if ffn.gate_up is None else [ffn.gate_up.weight.shape[0] // 2] * 2
        gate_up = _projections(ffn.gate_up, sizes, lambda: (ffn.gate, ffn.up))
        down = _matrices(ffn.down)
        return None if gate_up is None or down is None else cls(*gate_up, down[0])

    def __call__(self, ctx, h):
        swiglu = ggml.ggml_swiglu_split(ctx, _linear(ctx, self.gate, h), _linear(ctx, self.up, h))
        return _linear(ctx, self.down, swiglu)


class _Sparse:
    """model.MixtureOfExperts as the graphs run it, as llama.cpp's CPU graph does: the router's
    scores (a softmax, or sigmoids with a bias where experts are chosen, only among the best
    groups), each row's top k experts and their weights (a softmax over the chosen ones' logits,
    renormalized, scaled, as the model says), the chosen experts' gate, up and down by ggml's
    mul_mat_id on the experts as held, their weighted sum; plus the shared expert (behind its
    sigmoid gate where the model has one)."""

    def __init__(self, router: _Matrix, moe: nn.Module, shared, shared_gate):
        self.router, self.experts, self.k, self.renormalize = router, moe.grouped, moe.k, moe.renormalize
        self.shared, self.shared_gate = shared, shared_gate
        self.of_chosen = moe.softmax_of_chosen  # chosen by logit, weighed by a softmax over the chosen (gpt-oss)
        self.choice_bias = _f32(moe.choice_bias) if moe.sigmoid else None  # sigmoid scores, biased where chosen
        self.groups, self.groups_used, self.scale = moe.groups, moe.groups_used, moe.scale
        self.matrices = [router, *([] if shared is None else shared.matrices), *([shared_gate] if shared_gate else [])]
        self.hidden = self.experts.ffn_dim
        self.nodes = 3 * self.k + 72

    @classmethod
    def of(cls, moe: nn.Module) -> "_Sparse | None":
        """model.MixtureOfExperts `moe`, None unless its experts are one GGMLExperts and ggml can
        run its router and shared expert as held."""
        router = _matrices(moe.router)
        if not isinstance(moe.grouped, GGMLExperts) or router is None:
            return None
        shared = shared_gate = None
        if moe.shared is not None:
            shared = _Dense.of(moe.shared)
            if shared is None:
                return None
            if moe.shared_gate is not None:
                shared_gate = _matrices(moe.shared_gate)
                if shared_gate is None:
                    return None
                shared_gate = shared_gate[0]
        return cls(router[0], moe, shared, shared_gate)

    def _best_groups_only(self, ctx, choice, rows: int):
        """choice [E, rows] with every expert outside each row's groups_used best groups (a group
        scored by its two best) at -inf."""
        E, G = self.experts.n_experts, self.groups
        groups = ggml.ggml_reshape_3d(ctx, choice, E // G, G, rows)
        two = ggml.ggml_argsort_top_k(ctx, groups, 2)  # [2, G, rows]
        best = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_4d(ctx, groups, 1, E // G, G, rows), two)  # [1, 2, G, rows]
        score = ggml.ggml_sum_rows(ctx, ggml.ggml_reshape_3d(ctx, best, 2, G, rows))  # [1, G, rows]
        kept = ggml.ggml_argsort_top_k(ctx, ggml.ggml_reshape_2d(ctx, score, G, rows), self.groups_used)
        others = ggml.ggml_fill(ctx, groups, float("-inf"))
        masked = ggml.ggml_set_rows(ctx, others, ggml.ggml_get_rows(ctx, groups, kept), kept)  # [E / G, G, rows]
        return ggml.ggml_reshape_2d(ctx, masked, E, rows)

    def __call__(self, ctx, h):
        D, rows, E, k = h.contents.ne[0], h.contents.ne[1], self.experts.n_experts, self.k
        logits = _linear(ctx, self.router, h)  # [E, rows]
        if self.choice_bias is not None:
            probs = ggml.ggml_sigmoid(ctx, logits)
            choice = ggml.ggml_add(ctx, probs, _vector(ctx, self.choice_bias))
            if self.groups > 1:
                choice = self._best_groups_only(ctx, choice, rows)
        else:
            probs = choice = logits if self.of_chosen else ggml.ggml_soft_max(ctx, logits)
        chosen = ggml.ggml_argsort_top_k(ctx, choice, k)  # [k, rows]
        weights = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, probs, 1, E, rows), chosen)  # [1, k, rows]
        if self.of_chosen:
            flat = ggml.ggml_soft_max(ctx, ggml.ggml_reshape_2d(ctx, weights, k, rows))
            weights = ggml.ggml_reshape_3d(ctx, flat, 1, k, rows)
        if self.renormalize:
            flat = ggml.ggml_reshape_2d(ctx, weights, k, rows)
            weights = ggml.ggml_reshape_3d(ctx, ggml.ggml_div(ctx, flat, ggml.ggml_sum_rows(ctx, flat)), 1, k, rows)
        if self.scale != 1.0:
            weights = ggml.ggml_scale(ctx, weights, self.scale)
        gate, up, down = self.experts.tensors(ctx)
        biases = [_matrix_2d(ctx, b) for b in self.experts.biases]

        def product(i, w, x):  # the chosen experts' products, each plus its expert's bias where they have them
            out = ggml.ggml_mul_mat_id(ctx, w, x, chosen)
            return ggml.ggml_add_id(ctx, out, biases[i], chosen) if biases else out

        x = ggml.ggml_reshape_3d(ctx, h, D, 1, rows)
        g, u = product(0, gate, x), product(1, up, x)  # [F, k, rows]
        clamped = self.experts.clamped  # (limit, alpha) of gpt-oss's clamped SwiGLU
        if clamped is None:
            act = ggml.ggml_swiglu_split(ctx, g, u)
        else:
            act = ggml.ggml_swiglu_oai(ctx, g, u, clamped[1], clamped[0])
        each = ggml.ggml_mul(ctx, product(2, down, act), weights)  # [D, k, rows]
        nb1, nb2 = each.contents.nb[1], each.contents.nb[2]
        out = None
        for i in range(k):
            part = ggml.ggml_view_2d(ctx, each, D, rows, nb2, i * nb1)
            out = part if out is None else ggml.ggml_add(ctx, out, part)
        if self.shared is not None:
            shared = self.shared(ctx, h)
            if self.shared_gate is not None:
                shared = ggml.ggml_mul(ctx, shared, ggml.ggml_sigmoid(ctx, _linear(ctx, self.shared_gate, h)))
            out = ggml.ggml_add(ctx, out, shared)
        return out


def _feed_forward(ffn: nn.Module) -> "_Dense | _Sparse | None":
    if isinstance(ffn, FeedForward):
        return _Dense.of(ffn)
    return _Sparse.of(ffn) if isinstance(ffn, MixtureOfExperts) else None


def _piece(ffn, modules: list[nn.Module]) -> int | None:
    """Rows of a prompt chunk a graph takes at once: as many as model.ffn_piece_rows gives the
    feed-forward's width, and fewer than those from which one of `modules` measured faster
    dequantized into a GEMM (which the modules would do with a whole chunk); None where even the
    fewest rows would rather go whole (to another device)."""
    piece = ffn_piece_rows(ffn.hidden) // MAX_ROWS * MAX_ROWS
    while piece > MAX_ROWS and any(prefers_whole(m, piece) for m in modules):
        piece -= MAX_ROWS
    return None if any(prefers_whole(m, piece) for m in modules) else piece


class FeedForwardGraphs:
    """The feed-forward half of a block, x + ffn(ffn_norm(x)), as graphs built per row count and
    thread on first use; a prompt's rows a piece at a time. A block whose token mixer runs in the
    modules (Qwen3.5's delta-net blocks) runs this half alone in ggml (FEED); BlockGraphs, the
    whole block, builds on it."""

    def __init__(self, block: nn.Module, ffn, piece: int | None):
        # no reference to the block, which holds this: its weights are freed with it, not by the
        # cycle collector some time later
        self.ffn_norm, self.eps_ffn = _f32(block.ffn_norm.weight), block.ffn_norm.eps
        self.ffn = ffn  # _Dense or _Sparse
        for m in ffn.matrices:
            m.bias = _f32(m.bias)
        self.dim = self.ffn_norm.shape[0]
        self.piece = piece  # rows of a prompt chunk a graph takes at once; None: prompts go through the modules
        self._built: dict[str, OrderedDict] = {}

    @classmethod
    def of(cls, block: nn.Module) -> "FeedForwardGraphs | None":
        """The feed-forward half of `block` where ggml can run it as held."""
        ffn = _feed_forward(block.ffn) if ggml_cpu.available() else None
        piece = None if ffn is None else _piece(ffn, [block.ffn_norm, *block.ffn.modules()])
        return None if piece is None else cls(block, ffn, piece)

    def takes(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.dim
        return x.dtype == torch.float32 and x.device.type == "cpu" and (rows <= MAX_ROWS or self.piece is not None)

    def residual_ffn(self, ctx, x):
        """x + ffn(ffn_norm(x)) in a graph being built."""
        return ggml.ggml_add(ctx, x, self.ffn(ctx, _norm(ctx, x, self.ffn_norm, self.eps_ffn)))

    def _build_feed(self, g: Graph, rows: int):
        return g.fields.data(self.residual_ffn(g.ctx, _input(g, "x", self.dim, rows)), "out")

    _BUILD = {FEED: _build_feed}
    PROMPT_ONLY = (SHARED,)  # kinds whose intermediates go in the prompt's arena whatever their rows

    def _names(self, kind: str, rows: int) -> list[str]:
        """The values a graph of `kind` takes on each call, in order."""
        return ["x", "out"]

    def _graph(self, kind: str, rows: int, keys: int = 0, pool: int = 0) -> Graph:
        """The graph of `kind` for `rows` rows on this thread, built for at least `keys` keys a row."""

        def make() -> Graph:
            built = _capacity(keys) if keys else 0
            build = self._BUILD[kind]
            graph = Graph(
                (lambda g: build(self, g, rows, built, pool)) if built else (lambda g: build(self, g, rows)),
                self._names(kind, rows),
                PROMPT if kind in self.PROMPT_ONLY or rows > MAX_ROWS else rows,
                64 + 20 * rows * (built > 0) + self.ffn.nodes,
                torch.get_num_threads(),
            )
            graph.keys = built
            return graph

        kept = self._built.setdefault(kind, OrderedDict())
        key = (threading.get_ident(), rows, pool)
        return least_recently_used(kept, key, KEPT, make, lambda graph: graph.keys >= keys)

    def _pieces(self, rows: int) -> list[tuple[int, int]]:
        """A decode step's few rows at once, a prompt chunk's a piece at a time."""
        step = rows if rows <= MAX_ROWS else self.piece
        return [(a, min(a + step, rows)) for a in range(0, rows, step)]

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        """x + ffn(ffn_norm(x)) for x [..., dim]."""
        rows = x.numel() // self.dim
        flat = x.reshape(rows, self.dim).contiguous()
        out = torch.empty_like(flat)
        x_at, out_at, row = flat.data_ptr(), out.data_ptr(), self.dim * 4
        for a, b in self._pieces(rows):
            self._graph(FEED, b - a)([x_at + a * row, out_at + a * row])
        return out.view(x.shape)


class BlockGraphs(FeedForwardGraphs):
    """A block's graphs (see the kinds above), built per kind, row count and thread on first use,
    and its part of a stage's decode graph."""

    def __init__(self, block: nn.Module, qkv: list[_Matrix], out: _Matrix, ffn, piece: int | None):
        super().__init__(block, ffn, piece)
        attn = block.attn
        self.attn_norm, self.eps_attn = _f32(block.attn_norm.weight), block.attn_norm.eps
        self.qkv, self.out = qkv, out
        for m in [*qkv, out]:
            m.bias = _f32(m.bias)
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.gated = attn.gated  # each head's queries followed by as many gate rows (Qwen3.5)
        self._place(block)
        self.head_norms = None
        if attn.q_norm is not None:
            eps = attn.q_norm.eps
            self.head_norms = ((_f32(attn.q_norm.weight), eps), (_f32(attn.k_norm.weight), eps))
        self.sinks = _f32(attn.sinks)  # a logit per head in each row's softmax (gpt-oss), or None
        self.window = attn.window  # the keys a row sees, its own included (0: all)
        self.scale = attn.scale  # of the scores
        self.attn_width = out.K  # a row's attention output, before the output projection
        self.rope: tuple | None = None  # (rotated dims, base, frequency factors or None, gain on cos and sin)

    def _place(self, block: nn.Module) -> None:
        """Where the block's keys and values are: their layer in the stage's cache (its sliding-window
        one where the block is windowed), and a stage graph's names of its pools and of their size."""
        self.layer = block.layer
        self.cached = f"w{self.layer}" if block.windowed else str(self.layer)
        self.size = "pool_w" if block.windowed else "pool"

    def _set_rope(self, inv_freq: torch.Tensor, base: float, gain: float) -> None:
        """The stage's RoPE frequencies, as ggml computes them: base^(-2i/dims), each divided by a
        factor (Llama 3.1's, linear or YaRN's scaling; none where every factor is 1), and YaRN's
        gain on cos and sin (model.rope_gain)."""
        dims = 2 * inv_freq.shape[0]
        plain = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        factors = (plain / inv_freq.double()).float()
        unscaled = torch.allclose(factors, torch.ones_like(factors))
        self.rope = (dims, base, None if unscaled else factors.contiguous(), gain)

    def seen(self, count: int) -> tuple[int, int]:
        """Of the first `count` keys of a row's sequence, how many it attends to and the first of them."""
        n = min(count, self.window) if self.window else count
        return n, count - n

    @classmethod
    def of(cls, block: nn.Module, inv_freq: torch.Tensor, rope_base: float, gain: float = 1.0) -> "BlockGraphs | None":
        """The graphs for a block with attention and a feed-forward ggml can run as held (dense,
        or experts held as one GGMLExperts); its stage's RoPE frequencies, base and gain."""
        attn = block.attn
        if not ggml_cpu.available() or not isinstance(attn, Attention):
            return None
        ffn = _feed_forward(block.ffn)
        H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        Q = 2 * H if attn.gated else H
        qkv = _projections(attn.wqkv, [Q * D, KV * D, KV * D], lambda: (attn.wq, attn.wk, attn.wv))
        out = _matrices(attn.wo)
        if qkv is None or out is None or ffn is None:
            return None
        graphs = cls(block, qkv, out[0], ffn, _piece(ffn, list(block.modules())))
        graphs._set_rope(inv_freq, rope_base, gain)
        return graphs

    # -- the arithmetic -----------------------------------------------------------------------------

    def _rotate(self, ctx, t, heads: int, rows: int, positions, norm: tuple | None):
        """RoPE (after a per-head norm, where the model has one) on [heads * D, rows]."""
        t = ggml.ggml_reshape_3d(ctx, t, self.head_dim, heads, rows)
        if norm is not None:
            t = _norm(ctx, t, *norm)
        dims, base, factors, gain = self.rope
        factors = None if factors is None else _vector(ctx, factors)
        mode = ggml.GGML_ROPE_TYPE_NEOX
        t = ggml.ggml_rope_ext(ctx, t, positions, factors, dims, mode, 0, base, 1.0, 0.0, gain, 32.0, 1.0)
        return ggml.ggml_reshape_2d(ctx, t, self.head_dim * heads, rows)

    def _project(self, ctx, x, rows: int, positions, plain: bool = False) -> list:
        """Queries, keys and values of x [dim, rows], each [heads * D, rows], the first two turned
        by RoPE; a gated block's queries come with their gates after them, [q, k, v, gate].
        (`plain`: latent attention's other form of queries; these blocks have one.)"""
        h = _norm(ctx, x, self.attn_norm, self.eps_attn)
        q, k, v = (_linear(ctx, m, h) for m in self.qkv)
        gate = None
        if self.gated:  # [D queries, D gates] a head
            D, H = self.head_dim, self.heads
            q, gate = (
                ggml.ggml_cont(ctx, ggml.ggml_view_3d(ctx, q, D, H, rows, 2 * D * 4, 2 * H * D * 4, at))
                for at in (0, D * 4)
            )
            q, gate = (ggml.ggml_reshape_2d(ctx, t, H * D, rows) for t in (q, gate))
        q_norm, k_norm = self.head_norms or (None, None)
        q = self._rotate(ctx, q, self.heads, rows, positions, q_norm)
        k = self._rotate(ctx, k, self.kv_heads, rows, positions, k_norm)
        return [q, k, v] if gate is None else [q, k, v, gate]

    def _rest(self, ctx, x, attn, gate=None):
        """x + o(attn) (attn scaled by sigmoid(gate) where given), then that plus the feed-forward
        of its norm."""
        if gate is not None:
            attn = ggml.ggml_mul(ctx, attn, ggml.ggml_sigmoid(ctx, gate))
        return self.residual_ffn(ctx, ggml.ggml_add(ctx, x, self._output(ctx, attn)))

    def _output(self, ctx, attn):
        """The output projection of the heads' outputs [attn_width, rows]."""
        return _linear(ctx, self.out, attn)

    POOLS = ("k", "v")  # the cache pools of a layer the graphs write and read

    def _pools(self, g: Graph, built: int, kind: int) -> list:
        return [self._pool(g, name, built, kind) for name in self.POOLS]

    def _pair(self, g: Graph, gathered: list, n: str, built: int) -> tuple:
        """The keys and the values a row attends to, out of what it gathered from the pools."""
        return gathered[0], gathered[1]

    def _pool(self, g: Graph, name: str, built: int, kind: int):
        """A layer's keys or values pool, head-major [KV, positions, D]: as ggml sees it [D, positions, KV]."""
        pool = ggml.ggml_new_tensor_3d(g.ctx, kind, self.head_dim, built, self.kv_heads)
        return self._follow_pool(g, pool, name, built)

    def _follow_pool(self, g: Graph, t, name: str, built: int):
        g.fields.data(t, name)
        return g.fields.follow(t, self.size, built, ne=(1,), nb=(2, 3))

    def _index(self, g: Graph, name: str, n: str, built: int):
        """A sequence's first n cache positions, int32; every kv head reads the same list."""
        t = ggml.ggml_new_tensor_2d(g.ctx, ggml.GGML_TYPE_I32, built, self.kv_heads)
        t.contents.nb[1] = 0
        g.fields.data(t, name)
        return g.fields.follow(t, n, built, ne=(0,))

    @staticmethod
    def _gather(g: Graph, pool, index, n: str, built: int):
        """The pool's rows at the index's positions: [D, n, KV] in float32."""
        return g.fields.follow(ggml.ggml_get_rows(g.ctx, pool, index), n, built, ne=(1,), nb=(2, 3))

    def _query(self, g: Graph, r: int):
        """Row r's queries from the "qkv" input [rows, q] (STORE's output), as [D, H / KV, KV]."""
        t = ggml.ggml_new_tensor_3d(
            g.ctx, ggml.GGML_TYPE_F32, self.head_dim, self.heads // self.kv_heads, self.kv_heads
        )
        return g.fields.data(t, "qkv", r * self.heads * self.head_dim * 4)

    @staticmethod
    def _half(g: Graph, t, n: str | None = None, built: int = 0):
        """t rounded to float16 and back, as llama.cpp's kernels round what they multiply with a
        float16 cache (the queries, and the attention weights that multiply the values)."""
        for kind in (ggml.GGML_TYPE_F16, ggml.GGML_TYPE_F32):
            t = ggml.ggml_cast(g.ctx, t, kind)
            if n is not None:
                g.fields.follow(t, n, built, ne=(0,), nb=(1, 2, 3))
        return t

    def _attend_row(self, g: Graph, query, keys, values, n: str, built: int, kind: int):
        """One row's heads [D, H / KV, KV] over `keys` and `values` [D, n, KV]: each kv head's
        group of query heads in one product, the values weighted one key after another (an outer
        product), so a row's sums never depend on how many keys follow. -> [D, H / KV, KV].
        Where the cache (of type `kind`) holds float16, the queries and weights are rounded as
        llama.cpp's are."""
        ctx, half = g.ctx, kind == ggml.GGML_TYPE_F16
        if half:
            query = self._half(g, query)
        scores = ggml.ggml_mul_mat(ctx, keys, query)
        g.fields.follow(scores, n, built, ne=(0,), nb=(1, 2, 3))
        sinks = self.sinks is not None
        if sinks:  # ggml's softmax reads a row's sink by its index in dimension 2: one head each
            flat = ggml.ggml_reshape_3d(ctx, scores, built, 1, self.heads)
            scores = g.fields.follow(flat, n, built, ne=(0,), nb=(1, 2, 3))
        probs = ggml.ggml_soft_max_ext(ctx, scores, None, self.scale, 0.0)
        if sinks:
            ggml.ggml_soft_max_add_sinks(probs, _vector(ctx, self.sinks))
        g.fields.follow(probs, n, built, ne=(0,), nb=(1, 2, 3))
        if sinks:
            grouped = ggml.ggml_reshape_3d(ctx, probs, built, self.heads // self.kv_heads, self.kv_heads)
            probs = g.fields.follow(grouped, n, built, ne=(0,), nb=(1, 2, 3))
        if half:
            probs = self._half(g, probs, n, built)
        turned = g.fields.follow(ggml.ggml_transpose(ctx, probs), n, built, ne=(1,), nb=(0, 2, 3))
        return g.then(ggml.ggml_out_prod(ctx, values, turned))

    def _attend_each(
        self, g: Graph, rows: int, built: int, kind: int, pools: list, query, place, named: str = ""
    ) -> None:
        """Attention of `rows` rows (row r's queries query(r)), each over its own keys (at
        "index<r>", "n<r>" of them, with `named` after the names) in pools of type `kind`;
        place(r, out) says where a row's result goes."""
        for r in range(rows):
            n = f"n{r}{named}"
            index = self._index(g, f"index{r}{named}", n, built)
            keys, values = self._pair(g, [self._gather(g, p, index, n, built) for p in pools], n, built)
            place(r, self._attend_row(g, query(r), keys, values, n, built, kind))

    # -- a block's graphs -----------------------------------------------------------------------------

    def _build_store(self, g: Graph, rows: int, built: int, kind: int, plain: bool = False):
        """STORE, into pools `built` for (of type `kind`): the keys and values go to the pools,
        which attention reads; the queries alone out (and a gated block's gates)."""
        x = _input(g, "x", self.dim, rows)
        positions = _input(g, "positions", rows, kind=ggml.GGML_TYPE_I32)
        q, k, v, *gate = self._project(g.ctx, x, rows, positions, plain)
        write = _input(g, "write", rows, kind=ggml.GGML_TYPE_I64)
        for name, t in zip(self.POOLS, (k, v)):
            self._store(g, t, name, rows, built, kind, write)
        if gate:  # the gates, for the rest of the block (FINISH or STEP)
            g.fields.data(g.then(gate[0]).contents.view_src, "gate")
        return g.fields.data(q.contents.view_src, "out")  # RoPE's result, of which q is the [Q, rows] view

    def _store(self, g: Graph, t, name: str, rows: int, built: int, kind: int, write):
        """t [KV * D, rows] into the pool `name` at the positions `write`: the pool as written."""
        ctx = g.ctx
        rows_first = ggml.ggml_permute(
            ctx, ggml.ggml_reshape_3d(ctx, t, self.head_dim, self.kv_heads, rows), 0, 2, 1, 3
        )
        written = ggml.ggml_set_rows(ctx, self._pool(g, name, built, kind), rows_first, write)
        return g.then(self._follow_pool(g, written, name, built))

    def _gates(self, g: Graph, rows: int) -> list:
        """A gated block's "gate" input (what STORE gave) for the rest of the block, else none."""
        return [_input(g, "gate", self.out.K, rows)] if self.gated else []

    def _build_finish(self, g: Graph, rows: int):
        x, attn = _input(g, "x", self.dim, rows), _input(g, "attn", self.attn_width, rows)
        return g.fields.data(self._rest(g.ctx, x, attn, *self._gates(g, rows)), "out")

    def _build_step(self, g: Graph, rows: int, built: int, kind: int):
        x = _input(g, "x", self.dim, rows)
        attn = ggml.ggml_new_tensor_2d(g.ctx, ggml.GGML_TYPE_F32, self.attn_width, rows)
        pools = self._pools(g, built, kind)
        width = self.attn_width * 4
        self._attend_each(
            g, rows, built, kind, pools, lambda r: self._query(g, r), lambda r, t: g.inside(t, attn, r * width)
        )
        return g.fields.data(self._rest(g.ctx, x, attn, *self._gates(g, rows)), "out")

    def _build_each(self, g: Graph, rows: int, built: int, kind: int):
        pools = self._pools(g, built, kind)
        width, done = self.attn_width * 4, []
        self._attend_each(
            g,
            rows,
            built,
            kind,
            pools,
            lambda r: self._query(g, r),
            lambda r, t: done.append(g.fields.data(t, "out", r * width)),
        )
        return done[-1]

    def _build_shared(self, g: Graph, rows: int, built: int, kind: int):
        """Attention alone for `rows` consecutive rows of one sequence: their keys are gathered
        once (as many as the last row sees, "seen") and each row takes the first it sees."""
        ctx, D, KV = g.ctx, self.head_dim, self.kv_heads
        index = self._index(g, "index0", "seen", built)
        gathered = [self._gather(g, pool, index, "seen", built) for pool in self._pools(g, built, kind)]
        for r in range(rows):
            n, firsts = f"n{r}", []
            for t in gathered:
                view = ggml.ggml_view_3d(ctx, t, D, built, KV, t.contents.nb[1], t.contents.nb[2], 0)
                g.fields.follow(view, n, built, ne=(1,))
                firsts.append(g.fields.follow(view, "seen", built, nb=(2, 3)))
            row = self._attend_row(g, self._query(g, r), *self._pair(g, firsts, n, built), n, built, kind)
            out = g.fields.data(row, "out", r * self.attn_width * 4)
        return out

    def nodes(self, rows: int) -> int:
        """Graph nodes its part of a stage's decode graph takes, at most."""
        return 96 + 20 * rows + self.ffn.nodes

    def decode(self, g: Graph, x, rows: int, built: int, kind: int, positions, write):
        """This block's part of a stage's decode graph: x [dim, rows] -> the block's output, the
        new keys and values written into the pools at the "write" positions."""
        ctx, D, KV = g.ctx, self.head_dim, self.kv_heads
        q, k, v, *gate = self._project(ctx, x, rows, positions)
        pools = [
            self._store(g, t, f"{name}{self.cached}", rows, built, kind, write) for name, t in zip(self.POOLS, (k, v))
        ]
        attn = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, self.attn_width, rows)
        group, width = self.heads // KV, self.attn_width * 4

        def query(r):
            return ggml.ggml_view_3d(ctx, q, D, group, KV, D * 4, group * D * 4, r * self.heads * D * 4)

        def place(r, t):
            g.inside(t, attn, r * width)

        self._attend_each(g, rows, built, kind, pools, query, place, window_names(self.window))
        return self._rest(ctx, x, attn, *gate)

    # -- running ------------------------------------------------------------------------------------

    _BUILD = {
        **FeedForwardGraphs._BUILD,
        STORE: _build_store,
        FINISH: _build_finish,
        STEP: _build_step,
        EACH: _build_each,
        SHARED: _build_shared,
    }

    def _names(self, kind: str, rows: int) -> list[str]:
        """The values a graph of `kind` takes on each call, in order."""
        gate = ["gate"] if self.gated else []
        if kind == FEED:
            return super()._names(kind, rows)
        if kind == STORE:
            return ["x", "positions", "write", "out", "k", "v", self.size, *gate]
        if kind == FINISH:
            return ["x", "attn", "out", *gate]
        counts = [f"n{r}" for r in range(rows)]
        indexes = [f"index{r}" for r in range(rows)]
        return {
            STEP: ["x", "qkv", "out", "k", "v", self.size, *counts, *indexes, *gate],
            EACH: ["qkv", "out", "k", "v", self.size, *counts, *indexes],
            SHARED: ["qkv", "out", "k", "v", self.size, "seen", "index0", *counts],
        }[kind]

    def store(
        self, x: torch.Tensor, ctx, pools: list[int], kind: int, form: str = STORE
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """attn_norm(x) through Q, K and V, queries and keys turned by RoPE, the keys and values
        into a layer's `pools` (its keys', its values', the positions they hold) of type `kind`:
        [B * T, dim] -> the queries [B * T, q] and a gated block's gates (else None). `form`: the
        graph kind (STORE; latent.py's blocks have another)."""
        rows = x.shape[0]
        width = self.query_width(form)
        out = scratch("queries", rows, width)
        gate = scratch("gates", rows, width) if self.gated else None
        x_at, out_at, positions = x.data_ptr(), out.data_ptr(), ctx.positions_at
        for a, b in self._pieces(rows):
            at = [x_at + a * self.dim * 4, positions + 4 * a, ctx.at.write_at + 8 * a, out_at + a * width * 4, *pools]
            if gate is not None:
                at.append(gate.data_ptr() + a * width * 4)
            self._graph(form, b - a, 1, kind)(at)
        return out, gate

    def query_width(self, form: str = STORE) -> int:
        """Values of a row's queries (a gated block's gates apart) that STORE gives."""
        return self.heads * self.head_dim

    def finish(
        self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None = None, form: str = FINISH
    ) -> torch.Tensor:
        """x + o(attn) (attn scaled by sigmoid(gate) where given), then that plus the feed-forward
        of its norm. `form`: the graph kind (FINISH; latent.py's blocks have another)."""
        rows = x.numel() // self.dim
        flat = x.reshape(rows, self.dim).contiguous()
        attn = attn.reshape(rows, -1).contiguous()
        out = scratch_beside(flat, "outputs", rows, self.dim)
        x_at, attn_at, out_at, width = flat.data_ptr(), attn.data_ptr(), out.data_ptr(), attn.shape[1] * 4
        if gate is not None:
            gate = gate.reshape(rows, -1).contiguous()
        for a, b in self._pieces(rows):
            at = [x_at + a * self.dim * 4, attn_at + a * width, out_at + a * self.dim * 4]
            if gate is not None:
                at.append(gate.data_ptr() + a * width)
            self._graph(form, b - a)(at)
        return out.view(x.shape)

    def __call__(self, x: torch.Tensor, cache, layer: int, ctx, last_only: bool = False) -> torch.Tensor:
        """The block on x [B, T, dim] (only each sequence's last position out where `last_only`),
        attention over the cache, whose every type (kvcache.kv_dtype) ggml reads."""
        kind, pools = pool_type(cache), layer_pools(cache, layer)
        B, T, _ = x.shape
        flat = x.reshape(B * T, self.dim).contiguous()
        queries, gate = self.store(flat, ctx, pools, kind)
        return self._attend_finish(x, flat, queries, gate, pools, ctx, kind, last_only)

    def _attend_finish(self, x, flat, qkv, gate, pools: list[int], ctx, kind: int, last_only: bool) -> torch.Tensor:
        B, T, _ = x.shape
        if T == 1 and B <= MAX_ROWS:  # a decode step: one graph for the rest of the block
            seen, indexes = zip(*(self._keys(ctx, s, 0) for s in range(B)))
            out = torch.empty_like(flat)
            at = [flat.data_ptr(), qkv.data_ptr(), out.data_ptr(), *pools, *seen, *indexes]
            self._graph(STEP, B, max(seen), kind)(at + ([gate.data_ptr()] if gate is not None else []))
            return out.view(x.shape)
        attn = self.attend(qkv, pools, ctx, kind, B, T, last_only)
        if last_only:
            last = None if gate is None else gate.view(B, T, -1)[:, -1:]
            return self.finish(x[:, -1:], attn.view(B, T, -1)[:, -1:], last)
        return self.finish(x, attn, gate)

    def _keys(self, ctx, s: int, t: int) -> tuple[int, int]:
        """The keys row t of sequence s sees: how many, and where their list starts."""
        index_at, index_row = ctx.at.read_at
        n, first = self.seen(ctx.key_counts[s][t])
        return n, index_at + s * index_row + 4 * first

    def attend(self, qkv, pools: list[int], ctx, kind: int, B: int, T: int, last_only: bool = False) -> torch.Tensor:
        """The attention of the rows of B sequences of T (their queries `qkv`, STORE's) over the
        keys each sees -> [B * T, attn_width] (only each sequence's last row where `last_only`): a
        few rows at a time (graphs of a few sizes, whatever the number of rows)."""
        qkv_at, qkv_row = qkv.data_ptr(), qkv.shape[-1] * 4
        index_at, index_row = ctx.at.read_at
        counts = ctx.key_counts
        attn = scratch("attention", B * T, self.attn_width)
        attn_at, attn_row = attn.data_ptr(), attn.shape[1] * 4
        if T == 1 or self.window:
            if T == 1:  # many sequences' decode step
                groups = [[(s, 0) for s in range(a, min(a + MAX_ROWS, B))] for a in range(0, B, MAX_ROWS)]
            else:  # a prompt's rows, each over its own window of keys
                starts = range(T - 1, T) if last_only else range(0, T, MAX_ROWS)
                groups = [[(s, t) for t in range(a, min(a + MAX_ROWS, T))] for s in range(B) for a in starts]
            for rows in groups:
                seen, indexes = zip(*(self._keys(ctx, s, t) for s, t in rows))
                first = rows[0][0] * T + rows[0][1]
                at = [qkv_at + first * qkv_row, attn_at + first * attn_row, *pools, *seen, *indexes]
                self._graph(EACH, len(rows), max(seen), kind)(at)
        else:  # prompts: rows of one sequence share their keys
            for s in range(B):
                for a in range(T - 1, T) if last_only else range(0, T, MAX_ROWS):
                    seen, first = counts[s][a : a + MAX_ROWS], s * T + a
                    at = [qkv_at + first * qkv_row, attn_at + first * attn_row, *pools, max(seen)]
                    self._graph(SHARED, len(seen), max(seen), kind)(at + [index_at + s * index_row, *seen])
        return attn


def window_names(window: int) -> str:
    """What a stage graph's names of a row's keys (count and index) end with for blocks of `window`."""
    return f"w{window}" if window else ""


class StageGraph:
    """A decode step of a stage whose blocks all decode in graphs (attention, gated or not, and
    Qwen3.5's delta-net blocks), as one ggml graph (per row count, slot count and thread): no
    Python between the blocks, as in llama.cpp; on the
    first stage the token embedding too, where ggml reads the table as it is held (`table`), and
    on the last the final norm and the head, where ggml runs the head as it is held (`logits`).

    A call makes no PyTorch call but the one allocating its output: once a step's weights have
    gone through the caches, each PyTorch call costs tens of microseconds (its dispatcher's code
    and data fetched from memory again), as much as the arithmetic of a small model's block."""

    def __init__(self, blocks: list, head: tuple | None, table: _Matrix | None = None):
        self.blocks = blocks  # BlockGraphs, and DeltaNetGraphs (deltanet.py)
        self.attending = [b for b in blocks if isinstance(b, BlockGraphs)]
        self.mixing = [b for b in blocks if not isinstance(b, BlockGraphs)]
        self.windows = sorted({b.window for b in self.attending if b.window})  # the sliding windows' sizes
        self.windowed = [b for b in self.attending if b.size != "pool"]  # those in the sliding-window cache
        self.dim = blocks[0].dim
        self.head = head  # (norm weight, eps, the head's matrix)
        self.table = table  # the token embedding: a call takes token ids
        self._built: OrderedDict = OrderedDict()

    @property
    def logits(self) -> bool:
        """Whether a call gives the logits (the head is in the graph)."""
        return self.head is not None

    @classmethod
    def of(
        cls, graphs: list, norm: nn.Module | None = None, head: nn.Module | None = None, embed: nn.Module | None = None
    ) -> "StageGraph | None":
        """The graph of a stage's blocks' graphs (None unless all decode in graphs), and of its
        final `norm` and `head`, and its token embedding `embed`, where given."""
        if not graphs or any(g is None or not hasattr(g, "decode") for g in graphs):
            return None
        matrix = None if head is None else _matrices(head)
        head = None if matrix is None else (_f32(norm.weight), norm.eps, matrix[0])
        return cls(graphs, head, None if embed is None else _table(embed.table))

    def takes(self, x, cache) -> bool:
        """Whether a call runs x whole: a decode step of at most MAX_ROWS rows, of token ids (a
        tensor or lists) where the graph starts with the embedding, else of float32 hidden states
        on the CPU, over a cache the graphs read."""
        if isinstance(x, torch.Tensor):
            if self.table is not None:
                fits = x.dim() == 2 and not x.dtype.is_floating_point
            else:
                fits = x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu"
            fits = fits and x.shape[1] == 1 and x.shape[0] <= MAX_ROWS
        else:
            fits = self.table is not None and len(x) <= MAX_ROWS and all(len(row) == 1 for row in x)
        recurrent = cache.recurrent
        held = recurrent is None or (recurrent.conv.dtype == torch.float32 and recurrent.conv.device.type == "cpu")
        return fits and held and pool_type(cache) is not None

    def _build(self, g: Graph, rows: int, built: int, kind: int, slots: int, per_sequence: int):
        if self.table is not None:
            ids = _input(g, "x", rows, kind=ggml.GGML_TYPE_I32)
            x = ggml.ggml_get_rows(g.ctx, self.table.tensor(g.ctx), ids)
        else:
            x = _input(g, "x", self.dim, rows)
        positions = _input(g, "positions", rows, kind=ggml.GGML_TYPE_I32)
        write = _input(g, "write", rows, kind=ggml.GGML_TYPE_I64)
        write_w = _input(g, "write_w", rows, kind=ggml.GGML_TYPE_I64) if self.windowed else None
        if self.mixing:  # the sequences' slots, where their recurrent state lies
            g.slots, g.n_slots = _input(g, "slots", rows // per_sequence, kind=ggml.GGML_TYPE_I32), slots
            g.per_sequence = per_sequence
        for block in self.blocks:
            x = block.decode(g, x, rows, built, kind, positions, write_w if block in self.windowed else write)
        if self.head is not None:
            weight, eps, matrix = self.head
            x = _linear(g.ctx, matrix, _norm(g.ctx, x, weight, eps))
        return g.fields.data(x, "out")

    def _graph(self, rows: int, keys: int, kind: int, slots: int, per_sequence: int) -> Graph:
        def make() -> Graph:
            built = _capacity(keys)
            named = ["", *(window_names(w) for w in self.windows)]
            counts = [f"n{r}{w}" for w in named for r in range(rows)]
            indexes = [f"index{r}{w}" for w in named for r in range(rows)]
            pools = [f"{name}{b.cached}" for b in self.attending for name in ("k", "v")]
            names = ["x", "positions", "write", "out", "pool", *counts, *indexes, *pools]
            if self.windowed:
                names += ["write_w", "pool_w"]
            if self.mixing:
                names += ["slots", *(f"{name}{b.layer}" for b in self.mixing for name in ("conv", "state"))]
            size = sum(b.nodes(rows) for b in self.blocks) + 16
            graph = Graph(
                lambda g: self._build(g, rows, built, kind, slots, per_sequence),
                names,
                rows,
                size,
                torch.get_num_threads(),
            )
            graph.keys = built
            return graph

        key = (threading.get_ident(), rows, kind, slots, per_sequence if self.mixing else 1)
        return least_recently_used(self._built, key, KEPT, make, lambda graph: graph.keys >= keys)

    def _input(self, x) -> tuple[int, object]:
        """The address of a call's input and what holds it there."""
        if self.table is None:
            x = x if x.is_contiguous() else x.contiguous()
            return x.data_ptr(), x
        ids = array("i", [row[0] for row in (x.tolist() if isinstance(x, torch.Tensor) else x)])
        if min(ids) < 0 or max(ids) >= self.table.N:
            raise ValueError(f"token ids must be in [0, {self.table.N}), the vocabulary of this model")
        return ids.buffer_info()[0], ids

    def __call__(self, x, cache, ctx, per_sequence: int = 1) -> torch.Tensor:
        """The blocks on a decode step's x (token ids [B, 1] where the graph starts with the
        embedding, else hidden states [B, 1, dim]) -> [B, 1, dim], or the logits [B, 1, vocab]
        in float32 where the head is in the graph. `per_sequence`: rows per sequence, each its own
        position, in order (ctx's slots repeat for each); the delta-net blocks take each
        sequence's in turn from its slot's state."""
        B = len(x)
        x_at, held = self._input(x)
        out = torch.empty(B, 1, self.head[2].N if self.head is not None else self.dim, dtype=torch.float32)
        seen = [c[0] for c in ctx.key_counts]
        index_at, index_row = ctx.at.read_at
        at = [x_at, ctx.positions_at, ctx.at.write_at, out.data_ptr(), cache.k.shape[2], *seen]
        windowed = [[min(n, w) for n in seen] for w in self.windows]  # the keys each window's blocks see
        at += [n for counts in windowed for n in counts]
        at += [index_at + s * index_row for s in range(B)]
        if self.windows:  # the windows' keys are listed where the sliding-window cache's are
            index_at, index_row = ctx.windowed.at.read_at
        for counts in windowed:  # each row's window starts that many keys into its list
            at += [index_at + s * index_row + 4 * (n - w) for s, (n, w) in enumerate(zip(seen, counts))]
        for b in self.attending:
            at += pool_addresses(cache.window if b in self.windowed else cache, range(b.layer, b.layer + 1))
        if self.windowed:
            at += [ctx.windowed.at.write_at, cache.window.k.shape[2]]
        slots = 0
        if self.mixing:
            recurrent = cache.recurrent
            ids = slot_ids(ctx.rows)[::per_sequence]
            at += [ids.buffer_info()[0], *recurrent_addresses(recurrent, [b.layer for b in self.mixing])]
            slots = recurrent.conv.shape[1]
        self._graph(B, max(seen), pool_type(cache), slots, per_sequence)(at)
        del held
        return out
