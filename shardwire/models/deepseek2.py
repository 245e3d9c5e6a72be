"""DeepSeek-V2, V3, R1 and V3.1, and Kimi K2 (llama.cpp's `deepseek2`): multi-head latent
attention (model.LatentAttention; the cache keeps a latent and a shared rotated key part per
position), queries through a low-rank bottleneck, YaRN with DeepSeek's temperature, dense leading
blocks, then experts beside shared ones: V3's chosen by sigmoid scores plus a learned bias within
the best groups, weights scaled; V2's by a softmax."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("deepseek2",)
HF_TYPES = {"deepseek_v2": "deepseek2", "kimi_k2": "deepseek2", "deepseek_v3": "deepseek2"}
HF_CLASSES = {"deepseek2": "DeepseekV3ForCausalLM"}
HF_ALIASES = (("n_routed_experts", "num_local_experts"), ("num_nextn_predict_layers", "num_mtp_layers"))
HF_BLOCK_NAMES = {
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.q_proj": "attn_q",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    **blocks.HF_SHARED_EXPERTS,
}
HF_BLOCK_PARAMS = blocks.HF_CHOICE_BIAS
PARTIAL_ROPE = True  # the rotated part of a query/key head is its last rope_dim of head_dim


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    sparse = cfg.sparse(block)
    return BlockVariant(
        mixer="latent_attention",
        ffn="experts" if sparse else "dense",
        routing=blocks.routing(cfg) if sparse else "",
        shared_expert="plain" if sparse and cfg.shared_expert_ffn_dim else "",
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    H, latent, rope = cfg.n_heads, cfg.kv_lora_rank, cfg.rope_dim
    nope = cfg.head_dim - rope
    q = H * cfg.head_dim
    return {
        "attn_norm.weight": (cfg.dim,),
        "attn_q_a.weight": (cfg.q_lora_rank, cfg.dim),
        "attn_q_a_norm.weight": (cfg.q_lora_rank,),
        "attn_q_b.weight": (q, cfg.q_lora_rank),
        "attn_q.weight": (q, cfg.dim),
        "attn_kv_a_mqa.weight": (latent + rope, cfg.dim),
        "attn_kv_a_norm.weight": (latent,),
        "attn_kv_b.weight": (H * (nope + cfg.v_head_dim), latent),
        # each head's key and value matrices, GGUF's [heads, rows, columns] held as one matrix of
        # every head's rows (multiplied per head: model.LatentAttention)
        "attn_k_b.weight": (H * latent, nope),
        "attn_v_b.weight": (H * cfg.v_head_dim, latent),
        "attn_output.weight": (cfg.dim, H * cfg.v_head_dim),
    } | blocks.ffn_shapes(cfg, block)


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    query = ("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight") if cfg.q_lora_rank else ("attn_q.weight",)
    # transformers' checkpoints hold kv_b whole; today's converter splits it into k_b and v_b
    kv_b = ("attn_kv_b.weight",) if cfg.hf_layout else ("attn_k_b.weight", "attn_v_b.weight")
    attention = ("attn_norm.weight", *query, "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", *kv_b)
    return (*attention, "attn_output.weight", *blocks.ffn_required(cfg, block, shared_gate=False))


def gguf_tensors(cfg: ModelConfig, tensors: dict, path) -> dict:
    """The converter's per-head key and value matrices [heads, rows, columns] as one matrix of
    every head's rows: the same bytes, which a matrix's formats hold as stored."""
    out = {}
    for name, info in tensors.items():
        if name.endswith((".attn_k_b.weight", ".attn_v_b.weight")) and len(info.shape) == 3:
            info = replace(info, shape=(info.shape[0] * info.shape[1], info.shape[2]))
        out[name] = info
    return out


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    """The converter writes MLA as one key head of latent + rotated width (what the cache holds);
    the query/key and value heads' own widths are the *_mla keys. V2-era files name no gating
    (softmax, configs.from_gguf_metadata) and leave the weights unnormalized."""
    return dict(
        n_kv_heads=keys.count("attention.head_count"),
        head_dim=int(keys("attention.key_length_mla")),
        v_head_dim=int(keys("attention.value_length_mla")),
        kv_lora_rank=int(keys("attention.kv_lora_rank")),
        q_lora_rank=int(keys("attention.q_lora_rank", 0)),
        expert_norm=bool(keys("expert_weights_norm", False)),
    )


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    method = cfg.get("topk_method", "noaux_tc" if cfg["model_type"] != "deepseek_v2" else "greedy")
    scoring = cfg.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
    if (method, scoring) not in (("noaux_tc", "sigmoid"), ("greedy", "softmax")):
        raise ConfigError(f"{where}: topk_method {method!r} with scoring_func {scoring!r} is not supported")
    if not cfg.get("rope_interleave", True):
        raise ConfigError(f"{where}: rope_interleave false is not supported (DeepSeek's checkpoints interleave)")
    n_layers = int(require(cfg, "num_hidden_layers", where))
    n_heads = int(require(cfg, "num_attention_heads", where))
    rope = int(require(cfg, "qk_rope_head_dim", where))
    expert_ffn = int(require(cfg, "moe_intermediate_size", where))
    return dict(
        n_kv_heads=n_heads,
        head_dim=int(require(cfg, "qk_nope_head_dim", where)) + rope,
        rope_dim=rope,
        v_head_dim=int(require(cfg, "v_head_dim", where)),
        kv_lora_rank=int(require(cfg, "kv_lora_rank", where)),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        n_experts=int(require(cfg, "n_routed_experts", where)),
        n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
        expert_ffn_dim=expert_ffn,
        expert_norm=bool(cfg.get("norm_topk_prob", False)),
        dense_blocks=tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), n_layers))),
        shared_expert_ffn_dim=expert_ffn * int(cfg.get("n_shared_experts") or 0),
        expert_gating=scoring,
        expert_groups=int(cfg.get("n_group") or 1) if method == "noaux_tc" else 1,
        expert_groups_used=int(cfg.get("topk_group") or 1) if method == "noaux_tc" else 1,
        expert_weights_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        hf_layout=True,
    )


def check(cfg: ModelConfig) -> None:
    if not cfg.kv_lora_rank or cfg.linear_blocks or cfg.sliding_blocks:
        raise ConfigError("model config: DeepSeek-V2/V3 blocks are latent attention, neither linear nor sliding")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError(f"model config: latent attention has as many key heads as heads, not {cfg.n_kv_heads}")
