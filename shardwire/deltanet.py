"""Qwen3.5's gated delta-net block: linear attention whose memory of a sequence is a fixed-size
state per slot (kvcache.RecurrentState) instead of a KV cache.

Per token: q, k, v come out of a short causal convolution (its last kernel - 1 inputs are state),
q and k are L2-normalized, and each value head keeps a matrix S [k_dim, v_dim] that decays by
exp(g) and learns v at rate beta (the delta rule):

    S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   out = S^T q / sqrt(k_dim)

then an RMS norm gated by silu(z) and the output projection. A prompt runs the chunked form (the
same result through a few matrix products per 64 tokens); decode runs the recurrent form above,
one step per token, never re-reading the history, and so does a step that checks proposals
(StepContext.as_decoded), whose positions must come out as decoding them one at a time would.

Tensors are in the form llama.cpp's converter writes: A as -exp(A_log), and value heads in tiled
order (value head h reads query/key head h % k_heads); models/qwen35.from_transformers brings a
transformers checkpoint's tensors there.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kvcache import KVCache
from .linear import fused, linear

CHUNK = 64  # tokens per chunk of the prefill form, as transformers' and llama.cpp's


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Mapping[str, torch.Tensor | nn.Module]):
        super().__init__()
        self.k_heads, self.k_dim = cfg.ssm_k_heads, cfg.ssm_k_dim
        self.v_heads, self.v_dim = cfg.ssm_v_heads, cfg.ssm_v_dim
        self.eps = cfg.norm_eps
        names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")
        self.sizes = [cfg.conv_channels, self.v_heads * self.v_dim, self.v_heads, self.v_heads]
        self.w_in = fused([w[f"{n}.weight"] for n in names], [None] * 4)
        if self.w_in is None:
            self.w_qkv, self.w_z, self.w_beta, self.w_alpha = (linear(w[f"{n}.weight"]) for n in names)
        self.conv = nn.Parameter(w["ssm_conv1d.weight"], requires_grad=False)  # [channels, taps]
        self.a = nn.Parameter(w["ssm_a"], requires_grad=False)  # -exp(A_log), per value head
        self.dt_bias = nn.Parameter(w["ssm_dt.bias"], requires_grad=False)
        self.norm = nn.Parameter(w["ssm_norm.weight"], requires_grad=False)
        self.w_out = linear(w["ssm_out.weight"])

    def _project(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.w_in is not None:
            return list(self.w_in(x).split(self.sizes, dim=-1))
        return [self.w_qkv(x), self.w_z(x), self.w_beta(x), self.w_alpha(x)]

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, ctx) -> torch.Tensor:
        B, T, _ = x.shape
        projected = self._project(x)
        if T > 1 and ctx.as_decoded:  # position by position, each as a decode step mixes it, to the bit
            at = [[p[:, t : t + 1].contiguous() for p in projected] for t in range(T)]
            mixed = torch.cat([self._mix(*p, cache.recurrent, layer, ctx.rows) for p in at], dim=1)
        else:
            mixed = self._mix(*projected, cache.recurrent, layer, ctx.rows)
        return self.w_out(mixed.to(x.dtype))

    def _mix(self, qkv, z, b, a, state, layer: int, rows) -> torch.Tensor:
        """The projections of T positions [B, T, ...] through the convolution and the delta rule,
        from and into the slots' (`rows`) state: the gated outputs [B, T, v_heads * v_dim]."""
        B, T, _ = qkv.shape
        Hk, Dk, Hv, Dv = self.k_heads, self.k_dim, self.v_heads, self.v_dim

        # causal convolution over the last taps - 1 inputs (state) and the new ones
        conv_state = state.conv[layer]
        window = torch.cat((conv_state[rows], qkv.transpose(1, 2)), dim=-1)  # [B, channels, taps - 1 + T]
        conv_state[rows] = window[..., -conv_state.shape[-1] :]
        if T == 1:  # one output per channel: a product with the taps, far cheaper than a conv1d call
            mixed = F.silu((window * self.conv).sum(-1, keepdim=True)).transpose(1, 2)
        else:
            mixed = F.silu(F.conv1d(window, self.conv[:, None], groups=window.shape[1])).transpose(1, 2)

        qk = _l2norm(mixed[..., : 2 * Hk * Dk].reshape(B, T, 2 * Hk, Dk).float())  # queries and keys at once
        q, k = qk[:, :, :Hk] * Dk**-0.5, qk[:, :, Hk:]
        v = mixed[..., 2 * Hk * Dk :].reshape(B, T, Hv, Dv).float()
        beta = torch.sigmoid(b).float()
        g = self.a.float() * F.softplus(a.float() + self.dt_bias.float())  # log of each step's decay, <= 0

        delta = state.delta[layer]
        if T == 1:  # value head h reads query/key head h % Hk: a broadcast over groups of Hk heads
            out, final = recurrent_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), delta[rows])
        else:
            if Hv != Hk:  # tiled: value head h reads query/key head h % Hk
                q, k = q.repeat(1, 1, Hv // Hk, 1), k.repeat(1, 1, Hv // Hk, 1)
            out, final = chunked_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), delta[rows])
        delta[rows] = final

        out = out.transpose(1, 2).to(qkv.dtype)  # [B, T, Hv, Dv]
        if out.dtype == torch.float32:
            normed = F.rms_norm(out, (Dv,), self.norm, self.eps)
        else:  # as transformers: normalize in float32, round, then scale
            normed = self.norm * F.rms_norm(out.float(), (Dv,), None, self.eps).to(qkv.dtype)
        gated = normed * F.silu(z.reshape(B, T, Hv, Dv).float())
        return gated.reshape(B, T, Hv * Dv)


L2_EPS = 1e-6  # queries' and keys' L2 norm, as transformers' and llama.cpp's


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def recurrent_delta_rule(q, k, v, g, beta, state):
    """One token at a time: q, k [B, Hk, T, Dk], v [B, H, T, Dv], g and beta [B, H, T], state
    [B, H, Dv, Dk] (float32; each head's S held transposed, S^T, as ggml's gated_delta_net holds
    it), value head h reading query/key head h % Hk (Hk divides H). Returns the outputs
    [B, H, T, Dv] and the new state."""
    B, H, T, Dv = v.shape
    Hk, Dk = k.shape[1], k.shape[-1]
    r = H // Hk  # heads grouped [r, Hk]: query/key head i serves heads i, Hk + i, ...
    state = state.view(B, r, Hk, Dv, Dk)
    q, k = q[:, None], k[:, None]
    v, g, beta = v.view(B, r, Hk, T, Dv), g.view(B, r, Hk, T), beta.view(B, r, Hk, T)
    outs = []
    for t in range(T):
        state = state * g[..., t, None, None].exp()
        kt = k[..., t, :]
        recalled = (state @ kt[..., :, None]).squeeze(-1)  # what the state holds for this key
        correction = (v[..., t, :] - recalled) * beta[..., t, None]
        state = state + correction[..., :, None] * kt[..., None, :]
        outs.append((state @ q[..., t, :, None]).squeeze(-1))
    return torch.stack(outs, dim=-2).view(B, H, T, Dv), state.view(B, H, Dv, Dk)


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same as recurrent_delta_rule, CHUNK tokens at a time.

    Within a chunk, with c_i the cumulative log decay up to token i, the updates u_i written to
    the state solve a unit lower-triangular system, (I + A) u = beta (v - e^c k S0) with
    A_ij = beta_i (k_i . k_j) e^(c_i - c_j) for j < i; each output is what the chunk's starting
    state S0 gives its query plus the chunk's earlier (and own) updates, and the state moves on
    to e^(c_last) S0 + sum_j e^(c_last - c_j) k_j u_j^T. Only the walk from chunk to chunk is
    sequential. The state comes and goes as recurrent_delta_rule's, S^T [B, H, Dv, Dk]."""
    B, H, T, Dk = k.shape
    state = state.transpose(-1, -2)
    pad = -T % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))  # no decay, no update
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))
    cum = g.reshape(B, H, n, chunk).cumsum(-1)
    beta = beta.reshape(B, H, n, chunk, 1)

    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # e^(c_i - c_j), j <= i
    system = ((k * beta) @ k.transpose(-1, -2)) * decay  # its diagonal and above are ignored
    updates = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    recall = torch.linalg.solve_triangular(system, k * beta * cum[..., None].exp(), upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay
    q_from_start = q * cum[..., None].exp()
    k_to_end = k * (cum[..., -1:] - cum)[..., None].exp()
    chunk_decay = cum[..., -1, None, None].exp()

    out = torch.empty_like(v)
    for c in range(n):
        u = updates[:, :, c] - recall[:, :, c] @ state
        out[:, :, c] = q_from_start[:, :, c] @ state + within[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state.transpose(-1, -2)
