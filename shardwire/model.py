"""The reference path: decoder blocks of every variant a family declares (models.BlockVariant:
attention, gated or on a sliding window, or Qwen3.5's gated delta-net in deltanet.py; a dense or
mixture-of-experts feed-forward; norms before or also after each half) as PyTorch operations, and
the Stage: blocks [start, end) of one model on one device, whose blocks a backend may run instead.

One forward pass runs B sequences with T new tokens each; every sequence owns a cache slot
and brings its own start position, so a batch mixes sequences at different lengths.

One module of this length: it is the reference for every backend, each block variant's arithmetic
beside the others, so that who adds a variant or a backend reads it in one place.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, yarn_mscale
from .deltanet import GatedDeltaNet
from .devices import attention_without_cudnn
from .enums import pages_for
from .formats.names import EXPERT_MATRICES, GROUPED_EXPERTS
from .kvcache import Addresses, KVCache, RecurrentState, WindowCache, kv_dtype, pool_pages, window_blocks, window_ring
from .linear import Linear, Weight, fused, linear
from .models import BlockVariant, variant
from .models.blocks import CHOICE_BIAS


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # as Hugging Face does: normalize in float32, round, then scale
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Elsewhere(nn.Module):
    """A weight module kept on another device than its stage's (-ot): its inputs go there, in the
    dtype that device computes in, and its output comes back. Moving the stage leaves it be."""

    def __init__(self, inner: nn.Module, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.inner, self.where, self.where_dtype = inner, torch.device(device), dtype

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        y = self.inner(x.to(self.where, self.where_dtype), *(r.to(self.where) for r in rest))
        return y.to(x.device, x.dtype)

    def _apply(self, fn, recurse=True):
        return self

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    def prefers_whole(self, rows: int) -> bool:
        return True


class Embedding(nn.Module):
    """Token ids -> rows of a table: a dense tensor, or any module with rows(ids) (a packed
    table, or the tied output head itself)."""

    def __init__(self, table: Weight):
        super().__init__()
        self.table = Linear(table) if isinstance(table, torch.Tensor) else table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


def plain_inv_freq(cfg: ModelConfig, theta: float) -> torch.Tensor:
    """Per-pair rotation frequencies of RoPE with base `theta`, unscaled."""
    dim = cfg.rope_dim or cfg.head_dim
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama 3.1 or linear scaling applied."""
    inv_freq = plain_inv_freq(cfg, cfg.rope_theta)
    scaling = cfg.rope_scaling or {}
    if freq_factors is not None:
        return inv_freq / freq_factors.float()
    if scaling.get("type") == "linear":
        return inv_freq / scaling["factor"]
    if scaling.get("type") == "yarn":
        return yarn_inv_freq(inv_freq, cfg, scaling)
    if scaling.get("type") == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv_freq


def yarn_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN: the fast-turning pairs as trained, the slow ones interpolated by `factor`, a linear ramp
    between the pairs that turn beta_fast and beta_slow times over the original context."""
    dim, base, factor = cfg.rope_dim or cfg.head_dim, cfg.rope_theta, scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def pair_turning(times: float) -> float:  # the pair index whose wave turns `times` over the context
        return dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling.get("beta_fast", 32.0)), pair_turning(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):  # as llama.cpp always does; gpt-oss's config says not to
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_gain(cfg: ModelConfig) -> float:
    """What RoPE's cos and sin are multiplied by: YaRN's attention factor (1 without YaRN)."""
    scaling = cfg.rope_scaling or {}
    return float(scaling.get("attention_factor", 1.0)) if scaling.get("type") == "yarn" else 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [B, T, heads, D] with cos of [B, T, 1, R] and sin of the same shape
    whose first half is negated (so the rotation needs no negation of x); where R < D only the
    first R dimensions of each head turn (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


# Up to this many rows, a step's (a decode step's, a verification step's) mixtures of experts
# compute each row as decoding it alone would, to the bit: its router's product a row at a time,
# its experts' outputs summed in the order it chose them.
AS_DECODED = 64


@dataclass
class StepContext:
    """What every block of a forward pass shares: where the new tokens go and what they see.
    What only PyTorch's attention uses (positions as a tensor, the mask, RoPE's angles) is
    computed on first use: a step that a backend's runner takes whole never needs it."""

    rows: slice | torch.Tensor  # the sequences' slots (recurrent state)
    at: Addresses  # where their keys and values go and are read from
    starts: list[int]  # each row's first position
    T: int  # new positions a row
    n_keys: int
    inv_freq: torch.Tensor  # RoPE's frequencies
    dtype: torch.dtype  # the stage's compute dtype
    local_inv_freq: torch.Tensor | None = None  # those of blocks with local RoPE (Gemma 3's sliding ones)
    gain: float = 1.0  # on the (global) RoPE's cos and sin: rope_gain
    as_decoded: bool = False  # each position computed as a decode step of it alone would (proposals checked)
    window_at: Addresses | None = None  # where the sliding-window cache's keys go, where not `at`

    @cached_property
    def windowed(self) -> "StepContext":
        """The context of the blocks whose keys are in the sliding-window cache."""
        return self if self.window_at is None else replace(self, at=self.window_at, window_at=None)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[B, T]"""
        device = self.inv_freq.device
        return torch.tensor(self.starts, device=device)[:, None] + torch.arange(self.T, device=device)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, T, n_keys], True where attention is allowed; None for one sequence's one new
        token, which sees every cached position."""
        if len(self.starts) == 1 and self.T == 1:
            return None
        return (torch.arange(self.n_keys, device=self.positions.device) <= self.positions[:, :, None])[:, None]

    def window_mask(self, window: int) -> torch.Tensor:
        """mask, seeing only the last `window` positions (each row's own included)."""
        keys = torch.arange(self.n_keys, device=self.positions.device)
        p = self.positions[:, :, None]
        return ((keys <= p) & (keys > p - window))[:, None]

    def _angles(self, inv_freq: torch.Tensor, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.positions[..., None].float() * inv_freq  # [B, T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if gain != 1.0:
            cos, sin = cos * gain, sin * gain
        return (
            torch.cat((cos, cos), dim=-1)[:, :, None].to(self.dtype),
            torch.cat((-sin, sin), dim=-1)[:, :, None].to(self.dtype),
        )

    @cached_property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos, and sin with its first half negated (see apply_rope)."""
        return self._angles(self.inv_freq, self.gain)

    @cached_property
    def local_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """rope, of the local frequencies."""
        return self._angles(self.local_inv_freq)

    @cached_property
    def _positions32(self) -> array:
        return array("i", [s + t for s in self.starts for t in range(self.T)])

    @property
    def positions_at(self) -> int:
        """The address of the positions as int32, [B * T] (for a backend's runners)."""
        return self._positions32.buffer_info()[0]

    @cached_property
    def key_counts(self) -> list[list[int]]:
        """How many keys each row sees."""
        return [list(range(s + 1, s + self.T + 1)) for s in self.starts]


class Attention(nn.Module):
    """Grouped-query attention; `gated` (Qwen3.5): attn_q holds each head's queries then as many
    gate rows, and the output is scaled by sigmoid(gate) before the output projection."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight], variant: BlockVariant):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.gated = variant.mixer == "gated_attention"
        self.window, self.local_rope = variant.window, variant.local_rope
        self.scale = variant.query_scale or self.head_dim**-0.5
        names = ("attn_q", "attn_k", "attn_v")
        self.wqkv = fused([w[f"{n}.weight"] for n in names], [w.get(f"{n}.bias") for n in names])
        if self.wqkv is None:
            self.wq, self.wk, self.wv = (linear(w[f"{n}.weight"], w.get(f"{n}.bias")) for n in names)
        self.wo = linear(w["attn_output.weight"], w.get("attn_output.bias"))
        self.q_norm = RMSNorm(w["attn_q_norm.weight"], cfg.norm_eps) if "attn_q_norm.weight" in w else None
        self.k_norm = RMSNorm(w["attn_k_norm.weight"], cfg.norm_eps) if "attn_k_norm.weight" in w else None
        # a learned logit per head beside each query's scores (gpt-oss): it takes its share of the
        # softmax and adds nothing to the output
        self.sinks = _dense(w["attn_sinks.weight"]).float() if variant.sinks else None

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, ctx: StepContext) -> torch.Tensor:
        return self.wo(self.attend(self.project(x), cache, layer, ctx))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> queries (each head's followed by its gate, when gated), keys and values
        side by side, [B, T, (H + 2 KV) * D] (gated: [B, T, (2 H + 2 KV) * D])."""
        if self.wqkv is not None:
            return self.wqkv(x)
        return torch.cat([self.wq(x), self.wk(x), self.wv(x)], dim=-1)

    def attend(self, qkv: torch.Tensor, cache: KVCache, layer: int, ctx: StepContext) -> torch.Tensor:
        """Projected queries, keys and values -> the heads' outputs [B, T, H * D], before the
        output projection; the keys and values are cached."""
        B, T, _ = qkv.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        Q = 2 * H if self.gated else H  # query rows, with the gate's
        qkv = qkv.view(B, T, Q + 2 * KV, D)
        cos, sin = ctx.local_rope if self.local_rope else ctx.rope
        if self.q_norm is None and not self.gated:
            qk = apply_rope(qkv[:, :, : H + KV], cos, sin)  # queries and keys in one go
        else:
            queries, keys = (qkv[:, :, 0:Q:2] if self.gated else qkv[:, :, :H]), qkv[:, :, Q : Q + KV]
            if self.q_norm is not None:
                queries, keys = self.q_norm(queries), self.k_norm(keys)
            qk = apply_rope(torch.cat((queries, keys), dim=2), cos, sin)
        q = qk[:, :, :H].transpose(1, 2)
        k, v = qk[:, :, H:].transpose(1, 2), qkv[:, :, Q + KV :].transpose(1, 2)
        keys, values = cache.update(layer, k, v, ctx.at)
        half = cache.dtype == torch.float16
        out = attention(q, keys, values, ctx, half, self.scale, self.window, self.sinks)
        out = out.transpose(1, 2).reshape(B, T, H * D)
        if self.gated:
            out = out * torch.sigmoid(qkv[:, :, 1:Q:2].reshape(B, T, H * D))
        return out


def _dense(weight: Weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A matrix module's weight as a dense tensor (a packed one's decoded)."""
    return module.weight if isinstance(module, Linear) else module.dequantize()


def _pairs_apart(x: torch.Tensor) -> torch.Tensor:
    """A head's rotated part stored as DeepSeek trains it, (x0, x1) (x2, x3) ... each pair one
    frequency, laid out as rotate-half RoPE (apply_rope) reads it: the pairs' first elements, then
    their second. Queries and keys are reordered alike, so their products do not change."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2). Each position's keys and values come
    out of one latent of kv_lora_rank values (normed) and one rotated key part every head shares,
    and those are all the cache keeps (ModelConfig.cache_widths). Attention runs in absorbed form,
    as llama.cpp's does: each head's query is taken into the latent space through that head's key
    matrix, attends over the cached latents with the shared rotated part (one key head), and the
    latent it reads out goes through the head's value matrix."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight]):
        super().__init__()
        self.n_heads, self.rope_dim, self.latent = cfg.n_heads, cfg.rope_dim, cfg.kv_lora_rank
        self.nope, self.v_dim = cfg.head_dim - cfg.rope_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.wq_a, self.wq_b = linear(w["attn_q_a.weight"]), linear(w["attn_q_b.weight"])
            self.q_a_norm = RMSNorm(w["attn_q_a_norm.weight"], cfg.norm_eps)
        else:
            self.wq = linear(w["attn_q.weight"])
        self.wkv_a = linear(w["attn_kv_a_mqa.weight"])
        self.kv_a_norm = RMSNorm(w["attn_kv_a_norm.weight"], cfg.norm_eps)
        # each head's key matrix [latent, nope] and value matrix [v, latent], every head's rows in
        # one matrix, held as stored where the converter split them (ggml's graphs multiply them so)
        if "attn_k_b.weight" in w:
            self.k_b, self.v_b = linear(w["attn_k_b.weight"]), linear(w["attn_v_b.weight"])
        else:  # transformers' kv_b_proj: each head's key rows, then its value rows
            kv_b = _dense(w["attn_kv_b.weight"]).view(self.n_heads, self.nope + self.v_dim, self.latent)
            self.k_b = linear(kv_b[:, : self.nope].transpose(1, 2).reshape(-1, self.nope).contiguous())
            self.v_b = linear(kv_b[:, self.nope :].reshape(-1, self.latent).contiguous())
        self.wo = linear(w["attn_output.weight"])
        scaling = cfg.rope_scaling or {}
        stretched = scaling.get("type") == "yarn"
        # YaRN's temperature on the scores (mscale_all_dim, squared; its gain on the rotated parts
        # is StepContext's)
        mscale = yarn_mscale(scaling["factor"], scaling.get("mscale_all_dim", 0.0)) if stretched else 1.0
        self.scale = cfg.head_dim**-0.5 * mscale * mscale

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int, ctx: StepContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, R = self.n_heads, self.rope_dim
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rot = q.view(B, T, H, self.nope + R).split([self.nope, R], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.latent, R], dim=-1)
        cos, sin = ctx.rope
        q_rot = apply_rope(_pairs_apart(q_rot), cos, sin)
        k_rot = apply_rope(_pairs_apart(k_rot)[:, :, None], cos, sin)
        new = torch.cat((self.kv_a_norm(latent)[:, :, None], k_rot), dim=-1).transpose(1, 2)  # [B, 1, T, latent + R]
        keys, _ = cache.update(layer, new, new[..., :0], ctx.at)
        k_b = dense_weight(self.k_b).view(H, self.latent, self.nope)
        absorbed = torch.einsum("bthn,hln->bhtl", q_nope, k_b.to(q.dtype))
        query = torch.cat((absorbed, q_rot.transpose(1, 2)), dim=-1)
        half = cache.dtype == torch.float16
        read = attention(query, keys, keys[..., : self.latent], ctx, half, self.scale)  # [B, H, T, latent]
        v_b = dense_weight(self.v_b).view(H, self.v_dim, self.latent)
        out = torch.einsum("bhtl,hvl->bthv", read, v_b.to(read.dtype))
        return self.wo(out.reshape(B, T, H * self.v_dim))


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ctx: StepContext,
    half: bool = False,
    scale: float | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of queries [B, H, T, D] over keys [B, KV, n, D] and values
    [B, KV, n, Dv] (Dv: D but for latent attention). In float32 on a
    CPU each query row is computed alone over exactly the keys it sees, as two small matrix
    products: no row's result depends on the other rows of its step, so a prompt leaves the same
    keys and values however it was cut into chunks and whatever part of it was cached, and a
    sequence decodes the same beside others as alone. `half` (keys and values cached in float16):
    the queries and the weights of the values rounded to float16 first, as llama.cpp's kernels
    round what they multiply with its float16 cache (and as the CPU's ggml graphs do). Scores are
    scaled by `scale` (default 1 / sqrt(D)); `window`: each query sees only the last that many
    positions; `sinks` [H]: a logit per head that joins each query's scores in the softmax and
    reads no value."""
    B, H, T, D = q.shape
    KV, Dv = keys.shape[1], values.shape[-1]
    scale = scale or D**-0.5
    if q.dtype == torch.float32 and q.device.type == "cpu":
        if B == 1 and T == 1:  # one sequence's decode step sees every key it was given (its window's)
            seen = slice(-window, None) if window else slice(None)
            one = _one_query(q[0, :, 0], keys[0, :, seen], values[0, :, seen], half, scale, sinks)
            return one.view(1, H, 1, Dv)
        out = q.new_empty(B, H, T, Dv)
        for b, positions in enumerate(ctx.positions.tolist()):
            for t, p in enumerate(positions):
                seen = slice(max(0, p + 1 - window) if window else 0, p + 1)
                out[b, :, t] = _one_query(q[b, :, t], keys[b, :, seen], values[b, :, seen], half, scale, sinks)
        return out
    mask = ctx.window_mask(window) if window else ctx.mask
    if sinks is not None:
        return _attention_with_sinks(q, keys, values, mask, scale, sinks)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=H != KV, scale=scale)


def _attention_with_sinks(q, keys, values, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """attention() with sinks where PyTorch's fused attention has none: scores, softmax, values."""
    B, H, T, D = q.shape
    KV = keys.shape[1]
    scores = torch.matmul(q.view(B, KV, H // KV, T, D), keys[:, :, None].transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.to(scores.dtype).view(1, KV, H // KV, 1, 1).expand(B, KV, H // KV, T, 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(weights, values[:, :, None]).view(B, H, T, -1)


def _one_query(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, half: bool, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """One query row's heads [H, D] over the keys [KV, n, D] and values [KV, n, Dv] it sees."""
    H, D = q.shape
    KV = keys.shape[0]
    if half:
        q = q.half().float()
    scores = torch.matmul(q.reshape(KV, H // KV, D), keys.transpose(-1, -2)).mul_(scale)
    if sinks is None:
        weights = scores.softmax(-1)
    else:
        weights = torch.cat((scores, sinks.view(KV, H // KV, 1)), dim=-1).softmax(-1)[..., :-1]
    if half:
        weights = weights.half().float()
    return torch.matmul(weights, values).view(H, values.shape[-1])


# On a CPU a prompt chunk goes through a block's feed-forward (a backend's runner, backends/ggml,
# or the modules) in pieces of rows, where a matrix does not prefer whole chunks (it is dequantized
# for each product, or elsewhere). Each piece unpacks every weight block once, so larger pieces read
# prompts faster (1B Q4_K_M, a 512-token prompt: 256-row pieces 1.17x the 64-row ones); the piece's gate, up and
# SwiGLU, the largest activations of a step, are held to FFN_PIECE_ELEMENTS values each (16 MiB).
MIN_PIECE_ROWS, MAX_PIECE_ROWS = 64, 256
FFN_PIECE_ELEMENTS = 1 << 22


def ffn_piece_rows(hidden: int) -> int:
    return max(MIN_PIECE_ROWS, min(MAX_PIECE_ROWS, FFN_PIECE_ELEMENTS // hidden))


def prefers_whole(module: nn.Module, rows: int) -> bool:
    """Whether a product of `rows` rows costs `module` more per row than a whole chunk's (it
    decodes its whole matrix again for each, or each is a round trip to another device)."""
    return getattr(module, "prefers_whole", lambda rows: False)(rows)


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    return gate.mul_(torch.sigmoid(gate * alpha)).mul_(up.clamp_(-limit, limit).add_(1))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate, inplace=True).mul_(up)


def _geglu_tanh(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh").mul_(up)


def glu(activation: str, cfg: ModelConfig) -> Glu:
    """A gated feed-forward's (gate, up) -> hidden as BlockVariant.activation names it (silu,
    gelu_tanh: act(gate) * up; clamped_swiglu: gpt-oss's, ModelConfig.swiglu_limit), computed in
    place where it can be (the intermediates held twice, not 4x)."""
    if activation == "clamped_swiglu":
        return partial(_clamped_swiglu, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
    return {"silu": swiglu, "gelu_tanh": _geglu_tanh}[activation]


class FeedForward(nn.Module):
    """down(glu(gate(x), up(x))), the SwiGLU unless given another (glu()); each product with its
    bias where `biases` (gate's, up's, down's) gives one."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, act: Glu = swiglu, biases: tuple = (None,) * 3):
        super().__init__()
        self.act = act
        self.gate_up = fused([gate, up], list(biases[:2]))
        if self.gate_up is None:
            self.gate, self.up = linear(gate, biases[0]), linear(up, biases[1])
        self.down = linear(down, biases[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        piece = ffn_piece_rows(self.down.in_features)
        if x.device.type != "cpu" or rows <= piece or any(prefers_whole(m, piece) for m in self.children()):
            return self._rows(x)
        flat = x.reshape(rows, x.shape[-1])
        return torch.cat([self._rows(flat[a : a + piece]) for a in range(0, rows, piece)]).view(*x.shape[:-1], -1)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(self.act(gate, up))


def _as_decoded(product: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A small dense product of a step's rows x [rows, dim] a row at a time where they are few (a
    verification step's), as decoding each alone computes it: PyTorch's product of several rows
    rounds otherwise than of one, enough to change which experts a row chooses."""
    if 1 < x.shape[0] <= AS_DECODED:
        return torch.cat([product(row) for row in x.split(1)])
    return product(x)


class MixtureOfExperts(nn.Module):
    """A sparse feed-forward: the router scores every expert for each token (softmax, or sigmoid
    with a bias where they are chosen: ModelConfig.expert_gating), the top n_experts_used run on it,
    and their outputs are summed with those scores as weights (renormalized to sum to 1 where the
    model says so, then scaled). Experts no token chose never run."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight], activation: str = "silu"):
        super().__init__()
        self.router = linear(w["ffn_gate_inp.weight"], w.get("ffn_gate_inp.bias"))
        # each expert's biases, where the block has them (gpt-oss): [experts, rows] a matrix
        biases = [w.get(f"{m}.bias") for m in EXPERT_MATRICES]
        # all experts in one module that runs each row's chosen ones (weights/ggml_cpu.GGMLExperts),
        # or one FeedForward per expert
        self.grouped = w.get(GROUPED_EXPERTS)
        if self.grouped is not None:
            getattr(self.grouped, "inner", self.grouped).set_activation(activation, biases, cfg)  # (-ot: Elsewhere)
        else:
            act = glu(activation, cfg)
            matrices = [[w[f"{m}.{e}.weight"] for m in EXPERT_MATRICES] for e in range(cfg.n_experts)]
            self.experts = nn.ModuleList(
                FeedForward(*matrices[e], act, tuple(b if b is None else b[e] for b in biases))
                for e in range(cfg.n_experts)
            )
        self.k, self.renormalize = cfg.n_experts_used, cfg.expert_norm
        self.sigmoid, self.scale = cfg.expert_gating == "sigmoid", cfg.expert_weights_scale
        self.softmax_of_chosen = cfg.expert_gating == "top_k_softmax"
        self.groups, self.groups_used = cfg.expert_groups, cfg.expert_groups_used
        self.choice_bias = w[CHOICE_BIAS].float() if self.sigmoid else None
        # an expert every token runs beside the chosen ones, its output scaled by a sigmoid gate
        # where the block has one
        self.shared = self.shared_gate = None
        if "ffn_gate_shexp.weight" in w:
            self.shared = FeedForward(w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"])
            if "ffn_gate_inp_shexp.weight" in w:
                self.shared_gate = linear(w["ffn_gate_inp_shexp.weight"])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [rows, k] and their weights [rows, k] in x's dtype."""
        logits = _as_decoded(self.router, x).float()
        if self.softmax_of_chosen:
            top, chosen = logits.topk(self.k, dim=-1)
            weights = F.softmax(top, dim=-1)
        elif not self.sigmoid:
            weights, chosen = F.softmax(logits, dim=-1).topk(self.k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            choice = scores + self.choice_bias
            if self.groups > 1:  # only experts of the groups_used groups whose two best score highest
                grouped = choice.view(-1, self.groups, choice.shape[-1] // self.groups)
                best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.groups_used, dim=-1).indices
                kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = grouped.masked_fill(~kept[..., None], float("-inf")).view_as(choice)
            chosen = choice.topk(self.k, dim=-1).indices
            weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out = self.routed(x)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (
                shared if self.shared_gate is None else torch.sigmoid(_as_decoded(self.shared_gate, x)) * shared
            )
        return out.view(shape)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum for rows x [rows, dim]."""
        chosen, weights = self.route(x)
        if self.grouped is not None:
            return self.grouped(x, chosen, weights)
        if x.shape[0] == 1:  # decode of one sequence: k small products, no gathering
            out = None
            for e, w in zip(chosen[0].tolist(), weights[0]):
                y = self.experts[e](x) * w
                out = y if out is None else out + y
            return out
        # Several rows: group them by expert, one product per expert that has rows.
        if x.shape[0] <= AS_DECODED:  # each row's sum in its choices' order, as decoding it alone
            return self._summed_in_order(x, chosen, weights)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows_of = order // self.k
        row_weights = weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = rows_of[start : start + n]
                out.index_add_(0, rows, self.experts[e](x[rows]) * row_weights[start : start + n])
                start += n
        return out

    def _summed_in_order(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The rows' expert outputs each in its place of [rows, k, dim], then summed over k in turn."""
        parts = x.new_empty(x.shape[0], self.k, x.shape[1])
        flat = chosen.flatten()
        for e in flat.unique().tolist():
            at = (flat == e).nonzero().squeeze(1)  # (row, rank) pairs, flattened
            rows = at // self.k
            parts.view(-1, x.shape[1])[at] = self.experts[e](x[rows]) * weights.flatten()[at, None]
        out = parts[:, 0]
        for rank in range(1, self.k):
            out = out + parts[:, rank]
        return out


class Block(nn.Module):
    """A token mixer (attention, or a gated delta-net) and a feed-forward, each behind a norm and a
    residual, as its `variant` (models.BlockVariant) says; `layer` is the block's index among the
    stage's blocks of its kind, which is where its cache (KV, sliding-window KV, or recurrent
    state) lives."""

    def __init__(
        self, cfg: ModelConfig, w: Mapping[str, Weight], variant: BlockVariant, layer: int = 0, windowed: bool = False
    ):
        super().__init__()
        self.layer, self.variant = layer, variant
        self.windowed = windowed  # its keys and values are in the stage's sliding-window cache (KVCache.window)
        self.attn_norm = RMSNorm(w["attn_norm.weight"], cfg.norm_eps)
        if variant.mixer == "gated_delta_net":
            self.attn = GatedDeltaNet(cfg, w)
        elif variant.mixer == "latent_attention":
            self.attn = LatentAttention(cfg, w)
        else:
            self.attn = Attention(cfg, w, variant)
        self.ffn_norm = RMSNorm(w["ffn_norm.weight"], cfg.norm_eps)
        if variant.ffn == "experts":
            self.ffn = MixtureOfExperts(cfg, w, variant.activation)
        else:
            gate_up_down = (w["ffn_gate.weight"], w["ffn_up.weight"], w["ffn_down.weight"])
            self.ffn = FeedForward(*gate_up_down, glu(variant.activation, cfg))
        # norms of the token mixer's and the feed-forward's outputs, before their residuals (Gemma)
        self.post_attn_norm = self.post_ffn_norm = None
        if variant.post_norms:
            self.post_attn_norm = RMSNorm(w["post_attention_norm.weight"], cfg.norm_eps)
            self.post_ffn_norm = RMSNorm(w["post_ffw_norm.weight"], cfg.norm_eps)
        # where a backend runs this block's rows (backends.BlockRunner), or its feed-forward half
        # alone after the modules' token mixer (backends.FeedRunner)
        self.runner = None
        self.feed_runner = None

    def forward(
        self, x: torch.Tensor, cache: KVCache, layer: int, ctx: StepContext, last_only: bool = False
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim], or only each sequence's last position [B, 1, dim] where
        nothing reads the others (the model's last block, logits of the last position): every
        row's keys and values still go into the cache."""
        if self.runner is not None and self.runner.takes(x):
            return self.runner(x, cache, layer, ctx, last_only)
        mixed = self.attn(self.attn_norm(x), cache, layer, ctx)
        x = x + (mixed if self.post_attn_norm is None else self.post_attn_norm(mixed))
        if last_only:
            x = x[:, -1:]
        if self.feed_runner is not None and self.feed_runner.takes(x):
            return self.feed_runner.feed(x)
        fed = self.ffn(self.ffn_norm(x))
        return x + (fed if self.post_ffn_norm is None else self.post_ffn_norm(fed))


def _one_position_rows(x, slots: list[int], starts: list[int], pages: list[list[int]] | None) -> tuple:
    """Rows of T positions as T rows of one position each: (x, slots, starts, pages). Every row's
    keys and values go into the cache before any row attends (StageGraph), so each position
    sees those before it as it would decoding one at a time."""
    T = len(x[0])
    if isinstance(x, torch.Tensor):
        flat = x.reshape(x.shape[0] * T, 1, *x.shape[2:])
    else:
        flat = [[token] for row in x for token in row]
    return (
        flat,
        [slot for slot in slots for _ in range(T)],
        [start + j for start in starts for j in range(T)],
        None if pages is None else [table for table in pages for _ in range(T)],
    )


class Stage(nn.Module):
    """Blocks [start, end), plus the token embedding if first and the norm + head if last.

    Weights are dense tensors or packed modules (weights/packed.py); `embedding` is the token table when
    it is held apart from the head (a packed head of a tied model may serve as both)."""

    def __init__(
        self,
        cfg: ModelConfig,
        start: int,
        end: int,
        weights: Mapping[str, Weight],
        first: bool,
        last: bool,
        embedding: Weight | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 0 <= start <= end <= cfg.n_layers or (start == end and not (first or last)):
            raise ValueError(f"stage blocks [{start}, {end}) are not a valid range of {cfg.n_layers}")
        self.cfg, self.start, self.end, self.first, self.last = cfg, start, end, first, last
        mixing, windowed = [cfg.linear(i) for i in range(start, end)], window_blocks(cfg, start, end)
        kinds = list(zip(mixing, windowed))  # each kind's blocks keep their caches apart
        self.n_linear, self.n_windowed = sum(mixing), sum(windowed)
        self.blocks = nn.ModuleList(
            Block(
                cfg,
                {k.split(".", 2)[2]: t for k, t in weights.items() if k.startswith(f"blk.{i}.")},
                variant(cfg, i),
                layer=kinds[: i - start].count(kind),
                windowed=kind[1],
            )
            for i, kind in zip(range(start, end), kinds)
        )
        if last:
            self.norm = RMSNorm(weights["output_norm.weight"], cfg.norm_eps)
            self.head = linear(weights["token_embd.weight" if cfg.tied_embeddings else "output.weight"])
        tied = last and cfg.tied_embeddings and embedding is None
        self.embed = (
            Embedding(self.head if tied else embedding if embedding is not None else weights["token_embd.weight"])
            if first
            else None
        )
        if dtype is None:
            dtype = next(
                t.dtype for n, t in weights.items() if isinstance(t, torch.Tensor) and n != "rope_freqs.weight"
            )
        self.register_buffer("inv_freq", rope_inv_freq(cfg, weights.get("rope_freqs.weight")), persistent=False)
        local = cfg.local_rope_theta or None
        self.register_buffer("local_inv_freq", local and plain_inv_freq(cfg, local), persistent=False)
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype), persistent=False)
        self.runner = None  # backends.StageRunner, where a backend runs a decode step of all the blocks
        self.backend = None  # the backend whose runners it has (backends.attach)
        self.choices: list[str] = []  # what the backend's start measured and chose beyond the weights' formats
        self.cache: KVCache | None = None
        self.ctx = 0  # positions a sequence may reach, set with the cache
        self.kv_dtype: torch.dtype | None = None  # keys and values: kvcache.kv_dtype(dtype) unless set

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations and norms (packed weights keep their own; the KV cache
        is in kvcache.kv_dtype of it unless `kv_dtype` says otherwise)."""
        return self._dtype.dtype

    def allocate_cache(self, n_slots: int, ctx: int, n_pages: int | None = None, window_step: int = 0) -> None:
        """Caches for `n_slots` sequences of up to `ctx` positions, their keys and values in a
        pool of `n_pages` (default: every slot's whole context); those of the blocks on a sliding
        window apart, in a ring per slot for steps of up to `window_step` positions where that is
        less than the pool holds (kvcache.window_ring; 0: every position, in a pool as the others')."""
        cfg = self.cfg
        if self.device.type == "cuda":
            attention_without_cudnn()
        self.cache = None
        recurrent = RecurrentState(cfg, self.n_linear, n_slots, self.dtype, self.device) if self.n_linear else None
        n_attention = self.end - self.start - self.n_linear
        keys_in = self.kv_dtype or kv_dtype(self.dtype)
        n_pages = pool_pages(n_slots, ctx) if n_pages is None else n_pages
        heads, k_dim, v_dim = cfg.cache_widths
        n_full = n_attention - self.n_windowed
        self.cache = KVCache(n_full, heads, k_dim, n_pages, keys_in, self.device, recurrent, v_dim)
        step = window_ring(cfg, self.start, self.end, window_step, n_slots, n_pages)
        if self.n_windowed and step:
            window = (self.n_windowed, heads, k_dim, n_slots, cfg.sliding_window, step, keys_in, self.device, v_dim)
            self.cache.window = WindowCache(*window)
        elif self.n_windowed:
            self.cache.window = KVCache(self.n_windowed, heads, k_dim, n_pages, keys_in, self.device, None, v_dim)
        self.ctx = ctx

    def own_pages(self, slot: int, n_positions: int) -> list[int]:
        """The page table of a slot's sequence when nobody hands pages out (a stage used on its
        own): each slot owns whole contexts' worth of consecutive pages."""
        first = slot * pages_for(self.ctx)
        return list(range(first, first + pages_for(n_positions)))

    def _context(self, slots: list[int], starts: list[int], T: int, pages: list[list[int]] | None) -> StepContext:
        device = self.device
        n_keys = max(starts) + T
        if n_keys > self.ctx:
            raise ValueError(f"position {n_keys - 1} is past the context size {self.ctx}")
        if pages is None:
            pages = [self.own_pages(slot, start + T) for slot, start in zip(slots, starts)]
        used = 1 + max(max(t) for t in pages)
        self.cache.reserve(used)
        window, window_at = self.cache.window, None
        if isinstance(window, WindowCache):
            window_at = window.addresses(slots, starts, T, n_keys, device)
        elif window is not None:
            window.reserve(used)
        return StepContext(
            KVCache.rows_for(slots, device),
            Addresses.of(pages, starts, T, n_keys, device),
            starts,
            T,
            n_keys,
            self.inv_freq,
            self.dtype,
            self.local_inv_freq,
            rope_gain(self.cfg),
            window_at=window_at,
        )

    @property
    def ring_step(self) -> int:
        """The most positions a step may bring at once to the sliding-window cache's rings, or 0
        where it keeps none."""
        window = self.cache.window
        return window.step if isinstance(window, WindowCache) else 0

    def _prompt_piece(self, x: torch.Tensor) -> int | None:
        """Where the blocks' runners take every block's rows a piece at a time: the rows of a prompt
        chunk that go through all the blocks before the next ones do (so that the activations
        held at once are a piece's, not a chunk's)."""
        runners = [block.runner for block in self.blocks]
        piece = None
        if self.cache.recurrent is None and runners and all(r is not None and r.takes(x) for r in runners):
            pieces = {r.piece for r in runners}
            piece = pieces.pop() if len(pieces) == 1 else None
        limit = self.ring_step  # a step of more positions would overwrite keys its first rows see
        if limit:
            piece = limit if piece is None else min(piece, limit)
        return piece if piece is not None and x.shape[1] > piece else None

    def _through_blocks(self, x: torch.Tensor, ctx: StepContext, last_only: bool) -> torch.Tensor:
        """x through every block; only the last positions out of the last block where `last_only`."""
        for i, block in enumerate(self.blocks):
            cache, seen = (self.cache.window, ctx.windowed) if block.windowed else (self.cache, ctx)
            x = block(x, cache, block.layer, seen, last_only and i == len(self.blocks) - 1)
        return x

    def _in_pieces(
        self,
        x,
        slots: list[int],
        starts: list[int],
        pages,
        piece: int,
        out: torch.Tensor,
        last_only: bool,
        as_decoded: bool = False,
    ) -> torch.Tensor:
        """A prompt chunk's positions a piece at a time through every block, into `out` (which may
        be x: a piece's rows are read before its results are written): a piece's keys and values
        are in the cache before the next piece's rows attend to them. Where `last_only`, each
        piece's last position is the only one written (the chunk's last is the one read)."""
        for a in range(0, x.shape[1], piece):
            b = min(a + piece, x.shape[1])
            ctx = self._context(slots, [s + a for s in starts], b - a, pages)
            ctx.as_decoded = as_decoded
            y = self._through_blocks(x[:, a:b], ctx, last_only)
            out[:, b - y.shape[1] : b] = y
        return out

    def forward(
        self,
        x: torch.Tensor | list[list[int]],
        slots: list[int],
        starts: list[int],
        all_logits: bool = False,
        pages: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """x: token ids [B, T] on the first stage (a tensor or lists), else hidden states [B, T,
        dim]; `pages`: each row's page table (default: own_pages()).
        Returns hidden states, or float32 logits on the last stage (last position only unless
        all_logits)."""
        if self.cache is None:
            raise RuntimeError("allocate_cache() before forward()")
        recurrent = self.cache.recurrent
        if recurrent is not None:
            self._take_back(slots, starts, pages)
            if all_logits and len(x[0]) > 1:  # proposals it may refuse: keep the state from before them
                for i, (slot, start) in enumerate(zip(slots, starts)):
                    recurrent.keep(slot, start, torch.as_tensor(x[i]).clone())
        if self._runs_whole and (all_logits or len(x[0]) == 1):
            out = self._as_decode_step(x, slots, starts, pages)
            if out is not None:
                return out
        with torch.inference_mode():
            return self._forward(x, slots, starts, all_logits, pages)

    @property
    def _runs_whole(self) -> bool:
        """Whether the backend runs a decode step of the whole stage (the head included, on the last)."""
        return self.runner is not None and (self.runner.logits or not self.last)

    def _as_decode_step(self, x, slots: list[int], starts: list[int], pages) -> torch.Tensor | None:
        """A step that the backend runs whole, with no PyTorch call on the way: a decode step, or
        a few positions per sequence (a verification step's) as a row for each: every row's keys
        and values go into the cache before any row attends, so each position sees those before
        it as it would decoding one at a time, and a delta-net block takes a sequence's positions
        in turn. None where the runner does not take the rows."""
        T = len(x[0])
        flat, f_slots, f_starts, f_pages = _one_position_rows(x, slots, starts, pages)
        if not self.runner.takes(flat, self.cache) or T > (self.ring_step or T):
            return None
        ctx, recurrent = self._context(f_slots, f_starts, 1, f_pages), self.cache.recurrent
        if recurrent is not None:
            recurrent.begin(slots, starts, T)
        out = self.runner(flat, self.cache, ctx, T)
        if recurrent is not None:
            recurrent.end()
        return out.view(len(slots), T, out.shape[-1])

    def _take_back(self, slots: list[int], starts: list[int], pages: list[list[int]] | None) -> None:
        """Rows that start inside their slot's last kept step (some of its proposals refused):
        the recurrent state goes back to before that step and takes again the inputs of the
        positions kept, the rows with as many of them together."""
        recurrent = self.cache.recurrent
        again: dict[int, list[tuple[int, int, int, torch.Tensor]]] = {}
        for i, (slot, start) in enumerate(zip(slots, starts)):
            back = recurrent.rewind(slot, start)
            if back is not None and len(back[1]):
                again.setdefault(len(back[1]), []).append((i, slot, *back))
        for n, rows in again.items():
            inputs, slots_again, at = torch.stack([r[3] for r in rows]), [r[1] for r in rows], [r[2] for r in rows]
            tables = None if pages is None else [pages[r[0]] for r in rows]
            if self._runs_whole and self._as_decode_step(inputs, slots_again, at, tables) is not None:
                continue  # as the step first computed them
            with torch.inference_mode():
                ctx = self._context(slots_again, at, n, tables)
                ctx.as_decoded = True
                recurrent.begin(slots_again, at, n)
                self._through_blocks(self._inputs(inputs), ctx, last_only=True)
                recurrent.end()

    def _inputs(self, x) -> torch.Tensor:
        """A step's rows as the blocks take them: token ids embedded on the first stage."""
        if not self.first:
            return x.to(self.device, self.dtype)
        x = self.embed(torch.as_tensor(x).to(self.device))
        if self.cfg.embedding_scale != 1.0:
            x = x * torch.tensor(self.cfg.embedding_scale, dtype=x.dtype)
        return x

    def _forward(self, x, slots: list[int], starts: list[int], all_logits: bool, pages) -> torch.Tensor:
        given = x
        x = self._inputs(x)
        whole = self.runner is not None and self.runner.takes(x, self.cache)
        piece = None if whole else self._prompt_piece(x)
        ctx = None if piece is not None else self._context(slots, starts, x.shape[1], pages)
        recurrent = self.cache.recurrent
        if recurrent is not None:
            recurrent.begin(slots, starts, x.shape[1])
        last_only = self.last and not all_logits  # the head reads the last position alone
        if ctx is None:
            out = x if x is not given else torch.empty_like(x)
            x = self._in_pieces(x, slots, starts, pages, piece, out, last_only, all_logits)
        else:
            ctx.as_decoded = all_logits
            if whole:
                x = self.runner(x, self.cache, ctx)
                if self.runner.logits:
                    return x
            else:
                x = self._through_blocks(x, ctx, last_only)
        if self.backend is not None and self.backend.borrowed(x):  # what the next block to run overwrites
            x = x.clone()
        if recurrent is not None:
            recurrent.end()
        if not self.last:
            return x
        if not all_logits:
            x = x[:, -1:]
        logits = self.head(self.norm(x)).float()
        cap = self.cfg.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
