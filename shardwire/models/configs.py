"""A model's ModelConfig from GGUF metadata or a config.json: the keys every family shares here,
each family's own through its hooks."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig, yarn_mscale
from .family import GGUFKeys, require
from .registry import checked, family_of, hf_family

EXPERT_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func


def from_gguf_metadata(meta: dict, tensor_names: set[str], where: str) -> ModelConfig:
    arch = require(meta, "general.architecture", where)
    family = family_of(arch, where)
    key = GGUFKeys(meta, arch, where, frozenset(tensor_names))
    dim = int(key("embedding_length"))
    n_heads = key.count("attention.head_count")
    n_kv = key.count("attention.head_count_kv", n_heads)
    head_dim = int(key("attention.key_length", dim // n_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim and (not family.partial_rope or rope_dim > head_dim):
        raise ConfigError(
            f"{where}: partial rotary embeddings ('{arch}.rope.dimension_count' "
            f"{key('rope.dimension_count')} < head size {head_dim}) are not supported"
        )
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ConfigError(
                f"{where}: missing required key '{arch}.vocab_size' (and no 'tokenizer.ggml.tokens' to count)"
            )
        vocab = len(tokens)
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        factor = float(key("rope.scaling.factor"))
        # DeepSeek's converter writes its mscale_all_dim as 0.1 times it
        mscale_all_dim = float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        # the gain on RoPE's cos and sin, as llama.cpp derives it (transformers' attention_factor):
        # DeepSeek-V2 Lite's mscale is its mscale_all_dim, every other file's 1
        mscale = mscale_all_dim if arch == "deepseek2" and mscale_all_dim not in (0.0, 1.0) else 1.0
        gain = yarn_mscale(factor)
        if mscale_all_dim:
            gain = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        scaling = {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale_all_dim": mscale_all_dim,
            "attention_factor": gain * float(key("rope.scaling.attn_factor", 1.0)),
        }
    elif scaling_type not in ("none", ""):
        raise ConfigError(
            f"{where}: unsupported rope scaling '{scaling_type}' (supported: linear, yarn, llama3 through "
            "rope_freqs.weight)"
        )
    n_experts = int(key("expert_count", 0))
    expert_ffn = int(key("expert_feed_forward_length", key("feed_forward_length", 0))) if n_experts else 0
    gating = int(key("expert_gating_func", 1))
    if n_experts and gating not in EXPERT_GATING:
        raise ConfigError(f"{where}: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # MTP layers are not run
    fields = dict(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        # Mixtral's converter writes the experts' size as the feed-forward length; Qwen3.5-MoE's
        # writes none
        ffn_dim=int(key("feed_forward_length", expert_ffn or None)),
        vocab_size=int(vocab),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        context_length=int(key("context_length")),
        tied_embeddings="output.weight" not in tensor_names,
        # Llama 3.1-style scaling arrives as per-frequency factors in the tensor rope_freqs.weight
        rope_scaling=scaling,
        n_experts=n_experts,
        n_experts_used=int(key("expert_used_count", 0)) if n_experts else 0,
        expert_ffn_dim=expert_ffn,
        expert_norm=bool(key("expert_weights_norm", True)),
        expert_gating=EXPERT_GATING.get(gating, "softmax"),
        expert_groups=int(key("expert_group_count", 1)) if n_experts else 1,
        expert_groups_used=int(key("expert_group_used_count", 1)) if n_experts else 1,
        expert_weights_scale=float(key("expert_weights_scale", 1.0)),
        # Qwen2-MoE's converter writes the shared expert's width, DeepSeek's and GLM's a count of experts'
        shared_expert_ffn_dim=int(
            key("expert_shared_feed_forward_length", expert_ffn * int(key("expert_shared_count", 0)))
        )
        if n_experts
        else 0,
        dense_blocks=tuple(range(int(key("leading_dense_block_count", 0)))) if n_experts else (),
        rope_dim=0 if rope_dim == head_dim else rope_dim,
    )
    return checked(ModelConfig(**fields | family.gguf_fields(key, n_layers)))


def _hf_rope(cfg: dict, where: str) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(require(scaling, "factor", where))}
    if kind == "yarn":
        factor = float(require(scaling, "factor", where))
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = scaling.get("attention_factor")
        if attention is None and mscale and mscale_all_dim:  # as transformers infers it
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        elif attention is None:
            attention = yarn_mscale(factor)
        return float(theta), {
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(require(scaling, "original_max_position_embeddings", where)),
            "beta_fast": float(scaling.get("beta_fast") or 32.0),
            "beta_slow": float(scaling.get("beta_slow") or 1.0),
            "mscale_all_dim": float(mscale_all_dim or 0.0),
            "attention_factor": float(attention),
            "truncate": bool(scaling.get("truncate", True)),
        }
    if kind == "llama3":
        return float(theta), {
            "type": "llama3",
            "factor": float(require(scaling, "factor", where)),
            "low_freq_factor": float(require(scaling, "low_freq_factor", where)),
            "high_freq_factor": float(require(scaling, "high_freq_factor", where)),
            "original_max_position_embeddings": int(require(scaling, "original_max_position_embeddings", where)),
        }
    raise ConfigError(f"{where}: unsupported rope scaling '{kind}' (supported: linear, llama3, yarn)")


def _aliased(cfg: dict, aliases: tuple[tuple[str, ...], ...], where: str) -> dict:
    """cfg with every name of each alias group set, from whichever of them it gives."""
    out = dict(cfg)
    for names in aliases:
        given = {name: cfg[name] for name in names if name in cfg}
        if len({repr(v) for v in given.values()}) > 1:
            raise ConfigError(f"{where}: {' and '.join(f'{k}={v!r}' for k, v in given.items())} name one value")
        if given:
            out.update(dict.fromkeys(names, next(iter(given.values()))))
    return out


def from_hf_config(cfg: dict, where: str) -> ModelConfig:
    family = hf_family(require(cfg, "model_type", where), where)
    cfg = _aliased(family.hf_text_config(cfg), family.hf_aliases, where)
    arch = family.hf_types[cfg["model_type"]]
    dim = int(require(cfg, "hidden_size", where))
    n_heads = int(require(cfg, "num_attention_heads", where))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    theta, scaling = _hf_rope(cfg, where)
    own = family.hf_fields(cfg, head_dim, where)
    fields: dict[str, Any] = dict(
        arch=arch,
        n_layers=int(require(cfg, "num_hidden_layers", where)),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(own["ffn_dim"] if "ffn_dim" in own else require(cfg, "intermediate_size", where)),
        vocab_size=int(require(cfg, "vocab_size", where)),
        norm_eps=float(require(cfg, "rms_norm_eps", where)),
        rope_theta=theta,
        context_length=int(require(cfg, "max_position_embeddings", where)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
    )
    return checked(ModelConfig(**fields | own))
