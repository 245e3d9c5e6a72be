"""Llama and the families that run its blocks: Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3 and
Qwen3-MoE. Attention (with q/k norms in Qwen3), a SwiGLU feed-forward or softmax-routed experts
(with a sigmoid-gated shared expert in Qwen2-MoE), every norm before its half of the block."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("llama", "mistral", "mixtral", "qwen2", "qwen2moe", "qwen3", "qwen3moe")
HF_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2moe",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
CONVERTER_ARCHS = {"mistral": "llama", "mixtral": "llama"}  # as every LlamaForCausalLM look-alike
HF_ALIASES = (("num_experts", "num_local_experts"),)  # transformers 5 saves Qwen3-MoE's as num_local_experts
QK_INTERLEAVED = ("llama", "mistral")  # llama.cpp's converter interleaves their Q/K rows for its RoPE

_QK_NORMED = ("qwen3", "qwen3moe")


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    sparse = cfg.sparse(block)
    return BlockVariant(
        mixer="attention",
        qk_norm=cfg.arch in _QK_NORMED,
        ffn="experts" if sparse else "dense",
        routing=blocks.routing(cfg) if sparse else "",
        shared_expert="sigmoid_gated" if sparse and cfg.shared_expert_ffn_dim else "",
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    return blocks.attention_shapes(cfg) | blocks.ffn_shapes(cfg, block)


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    norms = blocks.QK_NORMS if cfg.arch in _QK_NORMED else ()
    return (*blocks.ATTENTION, *norms, *blocks.ffn_required(cfg, block))


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    # llama.cpp does not renormalize Qwen2-MoE's chosen experts' weights, where its GGUF does not say
    return {"expert_norm": bool(keys("expert_weights_norm", keys.arch != "qwen2moe"))}


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen2/3-MoE config.json."""
    model_type = cfg["model_type"]
    if model_type == "mixtral":
        return dict(
            n_experts=int(require(cfg, "num_local_experts", where)),
            n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
            expert_ffn_dim=int(require(cfg, "intermediate_size", where)),
        )
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    n_layers, step = int(require(cfg, "num_hidden_layers", where)), int(cfg.get("decoder_sparse_step", 1))
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    shared = int(require(cfg, "shared_expert_intermediate_size", where)) if model_type == "qwen2_moe" else 0
    return dict(
        n_experts=int(require(cfg, "num_experts", where)),
        n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
        expert_ffn_dim=int(require(cfg, "moe_intermediate_size", where)),
        expert_norm=bool(cfg.get("norm_topk_prob", False)),
        dense_blocks=tuple(i for i in range(n_layers) if i in only_mlp or step <= 0 or (i + 1) % step),
        shared_expert_ffn_dim=shared,
    )


def check(cfg: ModelConfig) -> None:
    if cfg.linear_blocks:
        raise ConfigError(f"model config: {cfg.arch} has no linear-attention blocks")
