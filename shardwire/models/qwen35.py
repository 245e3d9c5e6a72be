"""Qwen3.5 and Qwen3.5-MoE: hybrids of gated delta-net blocks (linear attention, deltanet.py) and
a few gated full-attention blocks (each head's output behind a sigmoid gate its query projection
carries, q/k norms, RoPE on a part of each head), dense or with a shared expert beside the routed."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigError, ModelConfig
from . import blocks
from .family import BlockVariant, GGUFKeys, Shapes, require

ARCHS = ("qwen35", "qwen35moe")
HF_TYPES = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe"}
HF_CLASSES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
PARTIAL_ROPE = True
HF_BLOCK_NAMES = {  # the gated delta-net's
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
HF_BLOCK_PARAMS = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}


DELTANET = (
    "attn_norm.weight",
    "attn_qkv.weight",
    "attn_gate.weight",
    "ssm_beta.weight",
    "ssm_alpha.weight",
    "ssm_conv1d.weight",
    "ssm_a",
    "ssm_dt.bias",
    "ssm_norm.weight",
    "ssm_out.weight",
)
_LAYER_TYPES = ("linear_attention", "full_attention")


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    sparse = cfg.sparse(block)
    return BlockVariant(
        mixer="gated_delta_net" if cfg.linear(block) else "gated_attention",
        qk_norm=not cfg.linear(block),
        ffn="experts" if sparse else "dense",
        routing=blocks.routing(cfg) if sparse else "",
        shared_expert="sigmoid_gated" if sparse and cfg.shared_expert_ffn_dim else "",
    )


def block_shapes(cfg: ModelConfig, block: int) -> Shapes:
    if not cfg.linear(block):  # each head's queries, then its output gate
        return blocks.attention_shapes(cfg, 2 * cfg.n_heads * cfg.head_dim) | blocks.ffn_shapes(cfg, block)
    v, hv = cfg.ssm_v_heads * cfg.ssm_v_dim, cfg.ssm_v_heads
    return blocks.ffn_shapes(cfg, block) | {
        "attn_norm.weight": (cfg.dim,),
        "attn_qkv.weight": (cfg.conv_channels, cfg.dim),
        "attn_gate.weight": (v, cfg.dim),
        "ssm_beta.weight": (hv, cfg.dim),
        "ssm_alpha.weight": (hv, cfg.dim),
        "ssm_conv1d.weight": (cfg.conv_channels, cfg.ssm_conv_kernel),
        "ssm_a": (hv,),
        "ssm_dt.bias": (hv,),
        "ssm_norm.weight": (cfg.ssm_v_dim,),
        "ssm_out.weight": (cfg.dim, v),
    }


def required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    mixer = DELTANET if cfg.linear(block) else (*blocks.ATTENTION, *blocks.QK_NORMS)
    return (*mixer, *blocks.ffn_required(cfg, block))


def gguf_fields(keys: GGUFKeys, n_layers: int) -> dict[str, Any]:
    """The delta-net fields as llama.cpp's converter writes them. Its rope.dimension_sections
    (M-RoPE) need nothing: text gives every section the same position, which makes M-RoPE plain
    RoPE."""
    v_heads, inner = int(keys("ssm.time_step_rank")), int(keys("ssm.inner_size"))
    if v_heads <= 0 or inner % v_heads:
        raise ConfigError(
            f"{keys.where}: ssm.inner_size {inner} and ssm.time_step_rank {v_heads} do not describe a Qwen3.5 model"
        )
    return dict(
        linear_blocks=_recurrent_blocks(keys, n_layers),
        ssm_conv_kernel=int(keys("ssm.conv_kernel")),
        ssm_k_heads=int(keys("ssm.group_count")),
        ssm_k_dim=int(keys("ssm.state_size")),
        ssm_v_heads=v_heads,
        ssm_v_dim=inner // v_heads,
    )


_ABSENT = object()


def _recurrent_blocks(keys: GGUFKeys, n_layers: int) -> tuple[int, ...]:
    """The delta-net blocks, as llama.cpp reads them: attention.recurrent_layers (a flag per block,
    or one for all) where the file has it, as today's converter writes it, else every block but
    each full_attention_interval-th."""
    flags = keys("attention.recurrent_layers", _ABSENT)
    if flags is not _ABSENT:
        flags = flags if isinstance(flags, list) else [flags] * n_layers
        if len(flags) != n_layers:
            raise ConfigError(f"{keys.where}: attention.recurrent_layers lists {len(flags)} blocks, not {n_layers}")
        return tuple(i for i, recurrent in enumerate(flags) if recurrent)
    interval = int(keys("full_attention_interval", 4))
    if interval <= 0:
        raise ConfigError(f"{keys.where}: full_attention_interval {interval} does not describe a Qwen3.5 model")
    return tuple(i for i in range(n_layers) if (i + 1) % interval)


def hf_text_config(cfg: dict) -> dict:
    """The language model's part of a multimodal config.json, which nests it under text_config."""
    text = cfg.get("text_config")
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe") and isinstance(text, dict):
        return {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **text, "model_type": cfg["model_type"]}
    return cfg


def hf_fields(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    """The delta-net fields of a Qwen3.5 text config (defaults as transformers has them), and
    Qwen3.5-MoE's experts: every block sparse, with a shared expert; the router renormalizes."""
    n_layers = int(require(cfg, "num_hidden_layers", where))
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [
            "full_attention" if interval > 0 and (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{where}: layer_types must list one of {', '.join(_LAYER_TYPES)} per layer")
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rope_dim = int(head_dim * partial)
    out = dict(
        linear_blocks=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        ssm_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ssm_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        ssm_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        ssm_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        ssm_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        rope_dim=0 if rope_dim == head_dim else rope_dim,
        hf_layout=True,
    )
    if cfg["model_type"] in ("qwen3_5_moe", "qwen3_5_moe_text"):
        expert_ffn = int(require(cfg, "moe_intermediate_size", where))
        out.update(
            n_experts=int(require(cfg, "num_experts", where)),
            n_experts_used=int(require(cfg, "num_experts_per_tok", where)),
            expert_ffn_dim=expert_ffn,
            shared_expert_ffn_dim=int(require(cfg, "shared_expert_intermediate_size", where)),
            ffn_dim=int(cfg.get("intermediate_size") or expert_ffn),
        )
    return out


def check(cfg: ModelConfig) -> None:
    if any(not 0 <= b < cfg.n_layers for b in cfg.linear_blocks):
        raise ConfigError(f"model config: linear blocks {list(cfg.linear_blocks)} outside 0..{cfg.n_layers - 1}")
    if not cfg.linear_blocks:
        return
    for name in ("ssm_conv_kernel", "ssm_k_heads", "ssm_k_dim", "ssm_v_heads", "ssm_v_dim"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model config: linear-attention blocks need {name} > 0, got {value!r}")
    if cfg.ssm_v_heads % cfg.ssm_k_heads:
        raise ConfigError(
            f"model config: {cfg.ssm_v_heads} value heads are not a multiple of {cfg.ssm_k_heads} key heads"
        )


# the pre-feed-forward norm renamed; the blocks of multi-token prediction the converter appends
# past n_layers (nextn_predict_layers) are left out by formats.open_model, as for every family
gguf_tensors = blocks.ffn_norm_renamed


# A transformers checkpoint's tensors in the form llama.cpp's converter writes them


def _tile_v_heads(cfg: ModelConfig, t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """Value heads along `dim` (each `width` wide) from grouped order (those of query/key head 0,
    then of head 1...) to tiled order (the first of every group, then the second...)."""
    r = cfg.ssm_v_heads // cfg.ssm_k_heads
    if r == 1:
        return t
    shape = t.shape
    return t.unflatten(dim, (cfg.ssm_k_heads, r, width)).transpose(dim, dim + 1).reshape(shape)


def _is_offset_norm(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight")


def needs_float32(cfg: ModelConfig, name: str) -> bool:
    return cfg.hf_layout and (_is_offset_norm(name) or name.endswith(".ssm_a"))


def from_transformers(cfg: ModelConfig, name: str, t: torch.Tensor, itemsize: int = 0) -> torch.Tensor:
    """Norm gains 1 + w (but the delta-net's own), A = -exp(A_log), value heads tiled."""
    if _is_offset_norm(name):
        return t + 1
    short = name.split(".", 2)[-1]
    qk = 2 * cfg.ssm_k_heads * cfg.ssm_k_dim
    if short in ("attn_qkv.weight", "ssm_conv1d.weight"):
        return torch.cat((t[:qk], _tile_v_heads(cfg, t[qk:], 0, cfg.ssm_v_dim)))
    if short == "attn_gate.weight":
        return _tile_v_heads(cfg, t, 0, cfg.ssm_v_dim)
    if short in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        return _tile_v_heads(cfg, t, 0, 1)
    if short == "ssm_a":
        return _tile_v_heads(cfg, -t.exp(), 0, 1)
    if short == "ssm_out.weight":
        return _tile_v_heads(cfg, t, 1, cfg.ssm_v_dim * (itemsize or 1))
    return t
