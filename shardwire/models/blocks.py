"""The tensors of the blocks most families share: attention, a dense feed-forward, experts."""

from __future__ import annotations

from ..config import ModelConfig
from .family import Shapes

ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
ROUTER = ("ffn_gate_inp.weight",)
SHARED_EXPERT = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


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


def ffn_required(cfg: ModelConfig, block: int) -> tuple[str, ...]:
    """The feed-forward tensors a block cannot do without (experts' matrices aside)."""
    if not cfg.sparse(block):
        return ("ffn_norm.weight", *DENSE_FFN)
    return ("ffn_norm.weight", *ROUTER, *(SHARED_EXPERT if cfg.shared_expert_ffn_dim else ()))


def routing(cfg: ModelConfig) -> str:
    return "softmax_top_k_normalized" if cfg.expert_norm else "softmax_top_k"
