"""A gated delta-net block's decode step (Qwen3.5) as one ggml graph, as llama.cpp's CPU backend
computes it: the norm and input projections, the causal convolution over the slot's last inputs
(ggml's ssm_conv), the queries' and keys' L2 norms, the decay and learning rate, one step of the
delta rule on the slot's state (ggml's gated_delta_net), the gated norm, the output projection and
residual, then the feed-forward half. The slots' convolution inputs and states are read from the
stage's RecurrentState and written back in the same graph.

A prompt's rows keep the modules' chunked form (deltanet.py), the feed-forward half in ggml
(FeedForwardGraphs); so does a block whose query/key and value heads differ in width, which
ggml's operation does not take.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import nn

from . import ggml_cpu
from .ggml_block import (
    KEPT,
    FeedForwardGraphs,
    _f32,
    _input,
    _linear,
    _matrices,
    _Matrix,
    _norm,
    _vector,
    recurrent_addresses,
    slot_ids,
)
from .ggml_cpu import ggml, least_recently_used
from .ggml_graph import MAX_ROWS, Graph


class DeltaNetGraphs:
    """A delta-net block's decode step, built per row count, slot count and thread on first use;
    `feed` is its feed-forward half, which prompts run in ggml after the modules' mixer."""

    def __init__(self, block: nn.Module, projections: list[_Matrix], out: _Matrix, feed: FeedForwardGraphs):
        from ..deltanet import L2_EPS

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
        from ..deltanet import GatedDeltaNet

        net = block.attn
        if feed is None or not ggml_cpu.available() or not isinstance(net, GatedDeltaNet) or net.k_dim != net.v_dim:
            return None
        if net.w_in is not None:
            projections = _matrices(net.w_in, net.sizes)
        else:
            parts = [_matrices(m) for m in (net.w_qkv, net.w_z, net.w_beta, net.w_alpha)]
            projections = None if None in parts else [p[0] for p in parts]
        out = _matrices(net.w_out)
        return None if projections is None or out is None else cls(block, projections, out[0], feed)

    def takes(self, x: torch.Tensor) -> bool:
        """A decode step: one new position for each of at most MAX_ROWS sequences, float32 on the CPU."""
        return (
            (x.dim() == 3 and x.shape[1] == 1 and x.shape[0] <= MAX_ROWS)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
        )

    def nodes(self, rows: int) -> int:
        """Graph nodes its part of a stage's decode graph takes, at most."""
        return 128 + self.feed.ffn.nodes

    def _build(self, g: Graph, rows: int, slots: int):
        x = _input(g, "x", self.dim, rows)
        ids = _input(g, "slots", rows, kind=ggml.GGML_TYPE_I32)
        return g.fields.data(self._step(g, x, rows, ids, slots, "conv", "state"), "out")

    def decode(self, g: Graph, x, rows: int, built: int, kind: int, positions, write):
        """This block's part of a stage's decode graph (StageGraph), whose "slots" are g.slots."""
        return self._step(g, x, rows, g.slots, g.n_slots, f"conv{self.layer}", f"state{self.layer}")

    def _step(self, g: Graph, x, rows: int, ids, slots: int, conv_name: str, state_name: str):
        """x [dim, rows] -> the block's output; the slots' (`ids`, of `slots` in the pools, which
        the call gives as `conv_name` and `state_name`) inputs and states moved on a step."""
        ctx = g.ctx
        C, taps, Hk, D, Hv = self.channels, self.taps, self.k_heads, self.k_dim, self.v_heads
        conv_pool = _input(g, conv_name, C * (taps - 1), slots)
        state_pool = _input(g, state_name, Hv * D * D, slots)
        h = _norm(ctx, x, self.attn_norm, self.eps_attn)
        qkv, z, b, a = (_linear(ctx, m, h) for m in self.projections)

        # the convolution's window: the slot's last taps - 1 inputs, then this step's
        last = ggml.ggml_reshape_3d(ctx, ggml.ggml_get_rows(ctx, conv_pool, ids), taps - 1, C, rows)
        window = ggml.ggml_concat(ctx, last, ggml.ggml_reshape_3d(ctx, qkv, 1, C, rows), 0)  # [taps, C, rows]
        kept = ggml.ggml_view_3d(ctx, window, taps - 1, C, rows, window.contents.nb[1], window.contents.nb[2], 4)
        kept = ggml.ggml_reshape_2d(ctx, ggml.ggml_cont(ctx, kept), C * (taps - 1), rows)
        g.then(g.fields.data(ggml.ggml_set_rows(ctx, conv_pool, kept, ids), conv_name))  # a view of the pool
        mixed = ggml.ggml_silu(ctx, ggml.ggml_ssm_conv(ctx, window, _f32_matrix(ctx, self.conv)))  # [C, 1, rows]

        nb = mixed.contents.nb[2]
        qk = ggml.ggml_l2_norm(ctx, ggml.ggml_view_3d(ctx, mixed, D, 2 * Hk, rows, D * 4, nb, 0), self.l2_eps)
        q = ggml.ggml_view_4d(ctx, qk, D, Hk, 1, rows, D * 4, qk.contents.nb[2], qk.contents.nb[2], 0)
        k = ggml.ggml_view_4d(ctx, qk, D, Hk, 1, rows, D * 4, qk.contents.nb[2], qk.contents.nb[2], Hk * D * 4)
        v = ggml.ggml_view_4d(ctx, mixed, D, Hv, 1, rows, D * 4, nb, nb, 2 * Hk * D * 4)
        beta = ggml.ggml_reshape_4d(ctx, ggml.ggml_sigmoid(ctx, b), 1, Hv, 1, rows)
        decay = ggml.ggml_mul(
            ctx, ggml.ggml_softplus(ctx, ggml.ggml_add(ctx, a, _vector(ctx, self.dt_bias))), _vector(ctx, self.a)
        )
        decay = ggml.ggml_reshape_4d(ctx, decay, 1, Hv, 1, rows)
        state = ggml.ggml_reshape_4d(ctx, ggml.ggml_get_rows(ctx, state_pool, ids), D, D, Hv, rows)

        stepped = ggml.ggml_gated_delta_net(ctx, q, k, v, decay, beta, state, 1)  # outputs, then the new states
        new = ggml.ggml_view_2d(ctx, stepped, Hv * D * D, rows, Hv * D * D * 4, Hv * D * rows * 4)
        g.then(g.fields.data(ggml.ggml_set_rows(ctx, state_pool, new, ids), state_name))
        out = ggml.ggml_view_3d(ctx, stepped, D, Hv, rows, D * 4, Hv * D * 4, 0)

        normed = ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, out, self.eps), _vector(ctx, self.norm))
        gated = ggml.ggml_mul(ctx, normed, ggml.ggml_silu(ctx, ggml.ggml_reshape_3d(ctx, z, D, Hv, rows)))
        mid = ggml.ggml_add(ctx, x, _linear(ctx, self.out, ggml.ggml_reshape_2d(ctx, gated, Hv * D, rows)))
        return self.feed.residual_ffn(ctx, mid)

    def _graph(self, rows: int, slots: int) -> Graph:
        def make() -> Graph:
            size = self.nodes(rows)
            return Graph(
                lambda g: self._build(g, rows, slots),
                ["x", "slots", "conv", "state", "out"],
                rows,
                size,
                torch.get_num_threads(),
            )

        key = (threading.get_ident(), rows, slots)
        return least_recently_used(self._built, key, KEPT, make)

    def __call__(self, x, mixer, cache, layer: int, ctx, last_only: bool = False) -> torch.Tensor:
        """The block's decode step on x [B, 1, dim] (`mixer`, the block's, is not called)."""
        B = x.shape[0]
        flat = x.reshape(B, self.dim).contiguous()
        out = torch.empty_like(flat)
        recurrent, ids = cache.recurrent, slot_ids(ctx.rows)
        at = [flat.data_ptr(), ids.buffer_info()[0], *recurrent_addresses(recurrent, [layer]), out.data_ptr()]
        self._graph(B, recurrent.conv.shape[1])(at)
        return out.view(x.shape)


def _f32_matrix(ctx, t: torch.Tensor):
    """A float32 [rows, columns] tensor as a ggml matrix [columns, rows] on its memory."""
    m = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, t.shape[1], t.shape[0])
    m.contents.data = t.data_ptr()
    return m
