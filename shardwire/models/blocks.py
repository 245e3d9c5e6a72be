"""The tensors of the blocks most families share: attention, a dense feed-forward, experts."""

from __future__ import annotations

from ..config import ModelConfig
from .family import Shapes

ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
ROUTER = ("ffn_gate_inp.weight",)
SHARED_EXPERT = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
SHARED_GATE = ("ffn_gate_inp_shexp.weight",)  # the shared expert's sigmoid gate (Qwen2-MoE, Qwen3.5-MoE)
CHOICE_BIAS = "exp_probs_b.bias"  # sigmoid routing's bias on each expert's score where experts are chosen
# DeepSeek's config.json names for its shared experts and its routing bias, which GLM-4.5 keeps
HF_SHARED_EXPERTS = {
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
HF_CHOICE_BIAS = {"mlp.gate.e_score_correction_bias": CHOICE_BIAS}


def attention_shapes(cfg: ModelConfig, query_rows: int | None = None) -> Shapes:
    """Attention's tensors; `query_rows`: attn_q's rows where they are not the heads' queries alone."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {
        "attn_norm.weight": (cfg.dim,),
        "attn_q.weight": (query_rows or q, cfg.dim),
        "attn_q.bias": (q,),
        "attn_k.weight": (kv, cfg.dim),
        "attn_k.bias": (kv,),
        "attn_v.weight": (kv, cfg.dim),
        "attn_v.bias": (kv,),
        "attn_output.weight": (cfg.dim, q),
        "attn_output.bias": (cfg.dim,),
        "attn_q_norm.weight": (cfg.head_dim,),
        "attn_k_norm.weight": (cfg.head_dim,),
    }


def ffn_shapes(cfg: ModelConfig, block: int) -> Shapes:
    """A feed-forward's tensors: dense, or a router and experts (held one matrix per expert, named
    as formats.names.expert_name gives them, whose shapes formats.expected_shape knows) and a
    shared expert."""
    shared = cfg.shared_expert_ffn_dim
    out = {
        "ffn_norm.weight": (cfg.dim,),
        "ffn_gate.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_up.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_down.weight": (cfg.dim, cfg.ffn_dim),
    }
    if cfg.n_experts:
        out["ffn_gate_inp.weight"] = (cfg.n_experts, cfg.dim)
        out[CHOICE_BIAS] = (cfg.n_experts,)
    if cfg.n_experts and shared:
        out.update(
            {
                "ffn_gate_inp_shexp.weight": (1, cfg.dim),
                "ffn_gate_shexp.weight": (shared, cfg.dim),
                "ffn_up_shexp.weight": (shared, cfg.dim),
                "ffn_down_shexp.weight": (cfg.dim, shared),
            }
        )
    return out


def ffn_required(cfg: ModelConfig, block: int, shared_gate: bool = True) -> tuple[str, ...]:
    """The feed-forward tensors a block cannot do without (experts' matrices aside); `shared_gate`:
    whether the family's shared expert sits behind a gate."""
    if not cfg.sparse(block):
        return ("ffn_norm.weight", *DENSE_FFN)
    shared = (*SHARED_EXPERT, *(SHARED_GATE if shared_gate else ())) if cfg.shared_expert_ffn_dim else ()
    return ("ffn_norm.weight", *ROUTER, *shared, *((CHOICE_BIAS,) if cfg.expert_gating == "sigmoid" else ()))


def routing(cfg: ModelConfig) -> str:
    """The router's arithmetic (BlockVariant.routing): softmax_top_k, sigmoid_biased_top_k (the
    choice by score plus bias, in groups where there are several, the weights scaled), or
    top_k_softmax (chosen by logit, a softmax over the chosen); normalized where the chosen weights
    are divided by their sum."""
    if cfg.expert_gating == "top_k_softmax":
        return "top_k_softmax"
    kind = "softmax_top_k" if cfg.expert_gating == "softmax" else "sigmoid_biased_top_k"
    return f"{kind}_normalized" if cfg.expert_norm else kind


def ffn_norm_renamed(cfg: ModelConfig, tensors: dict, path) -> dict:
    """A GGUF's tensors with the norm before the feed-forward under shardwire's name (a family's
    gguf_tensors): the converters of Qwen3.5 and GLM-4.5 write it as post_attention_norm (ffn_norm
    here, as for every family)."""
    out = {}
    for name, info in tensors.items():
        if name.endswith(".post_attention_norm.weight"):
            name = name.replace(".post_attention_norm.", ".ffn_norm.")
            info = info.renamed(name)
        out[name] = info
    return out
