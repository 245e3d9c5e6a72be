"""A gated delta-net block (Qwen3.5) as ggml graphs, as llama.cpp's CPU backend computes it: the
norm and input projections, the causal convolution over the slot's last inputs (ggml's
ssm_conv), the queries' and keys' L2 norms, the decay and learning rate, the delta rule on the
slot's state one token after another (ggml's gated_delta_net), the gated norm, the output
projection and residual, then the feed-forward half. The slots' convolution inputs and states are
read from the stage's RecurrentState and written back in the same graph: a decode step of several
sequences, or a piece of one sequence's prompt (the pieces in turn, each from the state the last
left; the delta rule's recurrent form costs a few state-sized products a token, far less than the
block's matrices).

Several sequences' prompts in one step go through the modules (deltanet.py's chunked form) with
the feed-forward half in ggml (FeedForwardGraphs); so does every row of a block whose query/key
and value heads differ in width, which ggml's operation does not take.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import nn

from ...deltanet import L2_EPS, GatedDeltaNet
from ...weights import ggml_cpu
from ...weights.ggml_cpu import ggml, least_recently_used
from .block import (
    KEPT,
    FeedForwardGraphs,
    _f32,
    _input,
    _linear,
    _matrices,
    _Matrix,
    _norm,
    _projections,
    _vector,
    recurrent_addresses,
    slot_ids,
)
from .graph import MAX_ROWS, PROMPT, Graph


class DeltaNetGraphs:
    """A delta-net block's decode step, built per row count, slot count and thread on first use;
    `feed` is its feed-forward half, which prompts run in ggml after the modules' mixer."""

    def __init__(self, block: nn.Module, projections: list[_Matrix], out: _Matrix, feed: FeedForwardGraphs):
        net = block.attn
        self.feed = feed
        self.attn_norm, self.eps_attn = _f32(block.attn_norm.weight), block.attn_norm.eps
        self.projections, self.out = projections, out  # queries|keys|values, z, beta, alpha; output
        for m in [*projections, out]:
            m.bias = _f32(m.bias)
        self.conv = _f32(net.conv)  # [channels, taps]: ggml's [taps, channels]
        self.a, self.dt_bias, self.norm = _f32(net.a), _f32(net.dt_bias), _f32(net.norm)
        self.eps, self.l2_eps = net.eps, L2_EPS
        self.k_heads, self.k_dim, self.v_heads, self.v_dim = net.k_heads, net.k_dim, net.v_heads, net.v_dim
        self.channels, self.taps = self.conv.shape
        self.dim = feed.dim
        self.layer = block.layer  # its state's layer in the stage's RecurrentState
        self._built: OrderedDict = OrderedDict()

    @classmethod
    def of(cls, block: nn.Module, feed: FeedForwardGraphs | None) -> "DeltaNetGraphs | None":
        """The step graph of a delta-net block whose matrices ggml can run as held and whose
        feed-forward half runs in ggml (`feed`)."""
        net = block.attn
        if feed is None or not ggml_cpu.available() or not isinstance(net, GatedDeltaNet) or net.k_dim != net.v_dim:
            return None
        projections = _projections(net.w_in, net.sizes, lambda: (net.w_qkv, net.w_z, net.w_beta, net.w_alpha))
        out = _matrices(net.w_out)
        return None if projections is None or out is None else cls(block, projections, out[0], feed)

    def takes(self, x: torch.Tensor) -> bool:
        """A decode step (one new position for each of at most MAX_ROWS sequences) or one
        sequence's prompt rows, float32 on the CPU."""
        return (
            x.dim() == 3
            and (x.shape[1] == 1 and x.shape[0] <= MAX_ROWS or x.shape[0] == 1)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
        )

    def nodes(self, rows: int) -> int:
        """Graph nodes its part of a stage's decode graph takes, at most."""
        return 128 + self.feed.ffn.nodes

    def _build(self, g: Graph, seqs: int, tokens: int, slots: int):
        x = _input(g, "x", self.dim, seqs * tokens)
        ids = _input(g, "slots", seqs, kind=ggml.GGML_TYPE_I32)
        return g.fields.data(self._step(g, x, seqs, tokens, ids, slots, "conv", "state"), "out")

    def decode(self, g: Graph, x, rows: int, built: int, kind: int, positions, write):
        """This block's part of a stage's decode graph (StageGraph), whose "slots" are g.slots,
        each sequence's g.per_sequence rows in turn."""
        seqs = rows // g.per_sequence
        return self._step(g, x, seqs, g.per_sequence, g.slots, g.n_slots, f"conv{self.layer}", f"state{self.layer}")

    def _step(self, g: Graph, x, seqs: int, tokens: int, ids, slots: int, conv_name: str, state_name: str):
        """x [dim, seqs * tokens] (each sequence's tokens in turn) -> the block's output; the
        sequences' slots' (`ids`, of `slots` in the pools, which the call gives as `conv_name` and
        `state_name`) convolution inputs and states moved on by `tokens`."""
        ctx = g.ctx
        C, taps, Hk, D, Hv = self.channels, self.taps, self.k_heads, self.k_dim, self.v_heads
        rows = seqs * tokens
        conv_pool = _input(g, conv_name, C * (taps - 1), slots)
        state_pool = _input(g, state_name, Hv * D * D, slots)
        h = _norm(ctx, x, self.attn_norm, self.eps_attn)
        qkv, z, b, a = (_linear(ctx, m, h) for m in self.projections)

        # each channel's window: the slot's last taps - 1 inputs, then the new ones
        last = ggml.ggml_reshape_3d(ctx, ggml.ggml_get_rows(ctx, conv_pool, ids), taps - 1, C, seqs)
        new = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, ggml.ggml_reshape_3d(ctx, qkv, C, tokens, seqs), 1, 0, 2, 3))
        window = ggml.ggml_concat(ctx, last, new, 0)  # [taps - 1 + tokens, C, seqs]
        nb1, nb2 = window.contents.nb[1], window.contents.nb[2]
        kept = ggml.ggml_cont(ctx, ggml.ggml_view_3d(ctx, window, taps - 1, C, seqs, nb1, nb2, tokens * 4))
        kept = ggml.ggml_reshape_2d(ctx, kept, C * (taps - 1), seqs)
        g.then(g.fields.data(ggml.ggml_set_rows(ctx, conv_pool, kept, ids), conv_name))  # a view of the pool
        conv = ggml.ggml_ssm_conv(ctx, window, _f32_matrix(ctx, self.conv))
        mixed = ggml.ggml_silu(ctx, conv)  # [C, tokens, seqs]

        nb = mixed.contents.nb[1]  # a token's
        qk = ggml.ggml_l2_norm(ctx, ggml.ggml_view_3d(ctx, mixed, D, 2 * Hk, rows, D * 4, nb, 0), self.l2_eps)
        at = qk.contents.nb[2]
        q = ggml.ggml_view_4d(ctx, qk, D, Hk, tokens, seqs, D * 4, at, at * tokens, 0)
        k = ggml.ggml_view_4d(ctx, qk, D, Hk, tokens, seqs, D * 4, at, at * tokens, Hk * D * 4)
        v = ggml.ggml_view_4d(ctx, mixed, D, Hv, tokens, seqs, D * 4, nb, nb * tokens, 2 * Hk * D * 4)
        beta = ggml.ggml_reshape_4d(ctx, ggml.ggml_sigmoid(ctx, b), 1, Hv, tokens, seqs)
        decay = ggml.ggml_mul(
            ctx, ggml.ggml_softplus(ctx, ggml.ggml_add(ctx, a, _vector(ctx, self.dt_bias))), _vector(ctx, self.a)
        )
        decay = ggml.ggml_reshape_4d(ctx, decay, 1, Hv, tokens, seqs)
        state = ggml.ggml_reshape_4d(ctx, ggml.ggml_get_rows(ctx, state_pool, ids), D, D, Hv, seqs)

        stepped = ggml.ggml_gated_delta_net(ctx, q, k, v, decay, beta, state, 1)  # outputs, then the new states
        states = ggml.ggml_view_2d(ctx, stepped, Hv * D * D, seqs, Hv * D * D * 4, Hv * D * rows * 4)
        g.then(g.fields.data(ggml.ggml_set_rows(ctx, state_pool, states, ids), state_name))
        out = ggml.ggml_view_3d(ctx, stepped, D, Hv, rows, D * 4, Hv * D * 4, 0)

        normed = ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, out, self.eps), _vector(ctx, self.norm))
        gated = ggml.ggml_mul(ctx, normed, ggml.ggml_silu(ctx, ggml.ggml_reshape_3d(ctx, z, D, Hv, rows)))
        mid = ggml.ggml_add(ctx, x, _linear(ctx, self.out, ggml.ggml_reshape_2d(ctx, gated, Hv * D, rows)))
        return self.feed.residual_ffn(ctx, mid)

    def _graph(self, seqs: int, tokens: int, slots: int) -> Graph:
        def make() -> Graph:
            return Graph(
                lambda g: self._build(g, seqs, tokens, slots),
                ["x", "slots", "conv", "state", "out"],
                PROMPT if tokens > 1 else seqs,
                self.nodes(seqs * tokens),
                torch.get_num_threads(),
            )

        key = (threading.get_ident(), seqs, tokens, slots)
        return least_recently_used(self._built, key, KEPT, make)

    def __call__(self, x, cache, layer: int, ctx, last_only: bool = False) -> torch.Tensor:
        """The block on x [B, T, dim]: a decode step (T = 1), or one sequence's prompt rows a
        piece at a time (B = 1). Every row's output comes out (the last position's alone read
        where `last_only`)."""
        B, T, _ = x.shape
        flat = x.reshape(B * T, self.dim).contiguous()
        out = torch.empty_like(flat)
        recurrent, ids = cache.recurrent, slot_ids(ctx.rows)
        pools, slots, row = recurrent_addresses(recurrent, [layer]), recurrent.conv.shape[1], self.dim * 4
        step = T if T == 1 else self.feed.piece or T
        for a in range(0, T, step):
            n = min(step, T - a)
            at = [flat.data_ptr() + a * row, ids.buffer_info()[0], *pools, out.data_ptr() + a * row]
            self._graph(B, n, slots)(at)
        out = out.view(x.shape)
        return out[:, -1:] if last_only else out


def _f32_matrix(ctx, t: torch.Tensor):
    """A float32 [rows, columns] tensor as a ggml matrix [columns, rows] on its memory."""
    m = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, t.shape[1], t.shape[0])
    m.contents.data = t.data_ptr()
    return m
