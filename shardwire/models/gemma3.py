"""Gemma 3: attention with q/k norms, every fifth of six blocks on a sliding window of positions
with RoPE of a local base, a GELU-tanh gated feed-forward, a norm before and after each half of
a block, token embeddings scaled by sqrt(dim), and logits soft-capped where the config says so."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("gemma3",)
HF_TYPES = {"gemma3": "gemma3", "gemma3_text": "gemma3"}
HF_CLASSES = {"gemma3": "Gemma3ForCausalLM"}
HF_BLOCK_NAMES = {  # its norms after each half of a block, and the one before the feed-forward
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}

POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")
SLIDING_PATTERN = 6  # llama.cpp's default for a GGUF that lists no pattern: the sixth block of six is global
_LAYER_TYPES = ("sliding_attention", "full_attention")


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    sliding = cfg.sliding(block)
    return BlockVariant(
        mixer="attention",
        qk_norm=True,
        activation="gelu_tanh",
        post_norms=True,
        window=cfg.sliding_window if sliding else 0,
        local_rope=sliding,
        query_scale=cfg.query_scale,
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    return blocks.attention_shapes(cfg) | blocks.ffn_shapes(cfg, block) | {n: (cfg.dim,) for n in POST_NORMS}


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    return (*blocks.ATTENTION, *blocks.QK_NORMS, *POST_NORMS, *blocks.ffn_required(cfg, block))


def _sqrt32(x: int) -> float:
    """sqrt(x) rounded to float32, as llama.cpp's sqrtf and transformers' float32 buffer have it."""
    return float(np.float32(math.sqrt(x)))


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    dim, n_heads = int(keys("embedding_length")), keys.count("attention.head_count")
    window = int(keys("attention.sliding_window", 0))
    sliding = keys.sliding_blocks(n_layers, SLIDING_PATTERN)
    # llama.cpp scales the 27B's queries by its width per head (gemma_pytorch's query_pre_attn_scalar),
    # which its GGUF does not record, and every other size's by 1 / sqrt(head_dim)
    query_scale = 1 / math.sqrt(dim // n_heads) if n_layers == 62 else 0.0
    return dict(
        sliding_window=window,
        sliding_blocks=sliding if window else (),
        local_rope_theta=float(keys("rope.freq_base_swa", 10000.0)) if window else 0.0,
        query_scale=query_scale,
        embedding_scale=_sqrt32(dim),
        logit_softcap=float(keys("final_logit_softcapping", 0.0)),
    )


def hf_text_config(cfg: dict) -> dict:
    """The text model's config (Gemma3ForConditionalGeneration nests it), its RoPE parameters per
    kind of layer (transformers 5) or local base at the top (transformers 4) brought to the top as
    the full-attention layers' and a local base."""
    text = cfg.get("text_config")
    if cfg.get("model_type") == "gemma3" and isinstance(text, dict):
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", True), **text, "model_type": "gemma3"}
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        local = params.get("sliding_attention", {}).get("rope_theta", 10000.0)
        cfg = {**cfg, "rope_parameters": params["full_attention"], "rope_local_base_freq": local}
    return cfg


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: Gemma 3 with hidden_activation '{act}' is not supported (gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping"):
        raise ConfigError(f"{where}: attention logit soft-capping is not supported (Gemma 3 has none)")
    n_layers = int(require(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", SLIDING_PATTERN))
        types = [_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{where}: layer_types must list one of {', '.join(_LAYER_TYPES)} per layer")
    window = int(cfg.get("sliding_window") or 0)
    scalar = cfg.get("query_pre_attn_scalar", head_dim)
    return dict(
        sliding_window=window,
        sliding_blocks=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
        local_rope_theta=float(cfg.get("rope_local_base_freq", 10000.0)) if window else 0.0,
        query_scale=0.0 if scalar == head_dim else float(scalar) ** -0.5,
        embedding_scale=_sqrt32(int(require(cfg, "hidden_size", where))),
        logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        hf_layout=True,
    )


def check(cfg: ModelConfig) -> None:
    if cfg.n_experts or cfg.linear_blocks:
        raise ConfigError("model config: Gemma 3 has neither experts nor linear-attention blocks")
    if any(not 0 <= b < cfg.n_layers for b in cfg.sliding_blocks):
        raise ConfigError(f"model config: sliding blocks {list(cfg.sliding_blocks)} outside 0..{cfg.n_layers - 1}")


def needs_float32(cfg: ModelConfig, name: str) -> bool:
    return name.endswith("norm.weight")


def from_transformers(cfg: ModelConfig, name: str, t: torch.Tensor, itemsize: int = 0) -> torch.Tensor:
    """Norm gains as the converter writes them: 1 + w (Gemma3RMSNorm scales by 1 + w)."""
    return t + 1 if name.endswith("norm.weight") else t
