"""GLM-4.5, GLM-4.6 and GLM-4.5-Air: attention with biases on q, k and v (and q/k norms where the
config says so), RoPE on the first half of each head, the first blocks dense, then experts chosen
by sigmoid scores with a learned bias, their weights scaled, beside a shared expert with no gate.
The multi-token-prediction block the checkpoints carry past the last block is not run."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("glm4moe",)
HF_TYPES = {"glm4_moe": "glm4moe"}
HF_CLASSES = {"glm4moe": "Glm4MoeForCausalLM"}
HF_ALIASES = (("n_routed_experts", "num_local_experts"), ("num_nextn_predict_layers", "num_mtp_layers"))
HF_BLOCK_NAMES = blocks.HF_SHARED_EXPERTS  # its shared expert under DeepSeek's names
HF_BLOCK_PARAMS = blocks.HF_CHOICE_BIAS
PARTIAL_ROPE = True


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    sparse = cfg.sparse(block)
    return BlockVariant(
        mixer="attention",
        qk_norm=cfg.qk_norm,
        ffn="experts" if sparse else "dense",
        routing=blocks.routing(cfg) if sparse else "",
        shared_expert="plain" if sparse and cfg.shared_expert_ffn_dim else "",
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    return blocks.attention_shapes(cfg) | blocks.ffn_shapes(cfg, block)


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    norms = blocks.QK_NORMS if cfg.qk_norm else ()
    biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
    return (*blocks.ATTENTION, *biases, *norms, *blocks.ffn_required(cfg, block, shared_gate=False))


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    """Sigmoid gating (the converter writes expert_gating_func 2); q/k norms where their tensors are."""
    gating = int(keys("expert_gating_func", 2))
    if gating != 2:
        raise ConfigError(f"{keys.where}: GLM-4.5 routes by sigmoid (expert_gating_func 2), this file says {gating}")
    return dict(qk_norm=any(name.endswith("attn_q_norm.weight") for name in keys.tensors), expert_gating="sigmoid")


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"{where}: GLM-4.5 with topk_method {cfg['topk_method']!r} is not supported (noaux_tc)")
    n_layers = int(require(cfg, "num_hidden_layers", where))
    expert_ffn = int(require(cfg, "moe_intermediate_size", where))
    params = cfg.get("rope_parameters") or {}
    rope_dim = int(head_dim * float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
    return dict(
        n_experts=int(require(cfg, "n_routed_experts", where)),
        n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
        expert_ffn_dim=expert_ffn,
        expert_norm=bool(cfg.get("norm_topk_prob", True)),
        dense_blocks=tuple(range(min(int(cfg.get("first_k_dense_replace", 1)), n_layers))),
        shared_expert_ffn_dim=expert_ffn * int(cfg.get("n_shared_experts", 1)),
        expert_gating="sigmoid",
        expert_groups=int(cfg.get("n_group", 1)),
        expert_groups_used=int(cfg.get("topk_group", 1)),
        expert_weights_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rope_dim=0 if rope_dim == head_dim else rope_dim,
    )


def check(cfg: ModelConfig) -> None:
    if not cfg.n_experts or cfg.linear_blocks or cfg.sliding_blocks:
        raise ConfigError("model config: GLM-4.5 has experts, and neither linear-attention nor sliding blocks")


gguf_tensors = blocks.ffn_norm_renamed
