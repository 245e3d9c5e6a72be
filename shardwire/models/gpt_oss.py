"""gpt-oss (llama.cpp's `gpt-oss`): attention with biases and a learned sink logit per head, its
blocks alternating between a 128-position sliding window and full attention, YaRN; then experts
only, chosen by the router's logits (a softmax over the chosen ones' logits weighs them), each with
biases and a SwiGLU whose gate and up projection are clamped."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("gpt-oss",)
HF_TYPES = {"gpt_oss": "gpt-oss"}
HF_CLASSES = {"gpt-oss": "GptOssForCausalLM"}
HF_BLOCK_NAMES = {"mlp.router": "ffn_gate_inp"}
HF_BLOCK_PARAMS = {"self_attn.sinks": "attn_sinks.weight"}
HF_ALIASES = (("num_local_experts", "num_experts"), ("num_experts_per_tok", "experts_per_token"))
HF_EXPERTS = "openai"  # formats/openai_experts.py: transposed, gate and up interleaved, or MXFP4 blocks
SLIDING_PATTERN = 2  # llama.cpp's for a file that lists none: even blocks slide, odd ones see everything
# llama.cpp's clamped SwiGLU (its GGUF records neither): the limit and the sigmoid's gain
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702
SINKS = "attn_sinks.weight"
_LAYER_TYPES = ("sliding_attention", "full_attention")
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate_inp.bias")
EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    return BlockVariant(
        mixer="attention",
        sinks=True,
        window=cfg.sliding_window if cfg.sliding(block) else 0,
        ffn="experts",
        activation="clamped_swiglu",
        routing=blocks.routing(cfg),
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    E, F = cfg.n_experts, cfg.expert_ffn_dim
    own = {
        SINKS: (cfg.n_heads,),
        "ffn_gate_inp.bias": (E,),
        "ffn_gate_exps.bias": (E, F),
        "ffn_up_exps.bias": (E, F),
        "ffn_down_exps.bias": (E, cfg.dim),
    }
    return blocks.attention_shapes(cfg) | blocks.ffn_shapes(cfg, block) | own


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    return (*blocks.ATTENTION, SINKS, *BIASES, *blocks.ffn_required(cfg, block), *EXPERT_BIASES)


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    return dict(
        sliding_window=int(keys("attention.sliding_window")),
        sliding_blocks=keys.sliding_blocks(n_layers, SLIDING_PATTERN),
        expert_gating="top_k_softmax",
        expert_norm=False,
        swiglu_limit=SWIGLU_LIMIT,
        swiglu_alpha=SWIGLU_ALPHA,
    )


gguf_tensors = blocks.ffn_norm_renamed  # its converter writes the norm before the experts as post_attention_norm


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    n_layers = int(require(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types") or [_LAYER_TYPES[i % 2] for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{where}: layer_types must list one of {', '.join(_LAYER_TYPES)} per layer")
    window = int(cfg.get("sliding_window") or 0)
    expert_ffn = int(require(cfg, "intermediate_size", where))
    return dict(
        ffn_dim=expert_ffn,
        n_experts=int(require(cfg, "num_local_experts", where)),
        n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
        expert_ffn_dim=expert_ffn,
        expert_gating="top_k_softmax",
        expert_norm=False,
        sliding_window=window,
        sliding_blocks=tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
        swiglu_limit=float(cfg.get("swiglu_limit", SWIGLU_LIMIT)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", SWIGLU_ALPHA)),
    )


def check(cfg: ModelConfig) -> None:
    if not cfg.n_experts or cfg.dense_blocks or cfg.linear_blocks or cfg.kv_lora_rank:
        raise ConfigError("model config: gpt-oss blocks are attention and experts, every one")
    if cfg.swiglu_limit <= 0:
        raise ConfigError(f"model config: gpt-oss's SwiGLU needs a positive limit, got {cfg.swiglu_limit}")
    if any(not 0 <= b < cfg.n_layers for b in cfg.sliding_blocks):
        raise ConfigError(f"model config: sliding blocks {list(cfg.sliding_blocks)} outside 0..{cfg.n_layers - 1}")
