"""ModelConfig: the shape of a Llama-family model (dense or mixture-of-experts, or a Qwen3.5 hybrid
of gated delta-net and attention blocks), read from GGUF metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "mixtral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
# Hybrids: gated delta-net (linear attention) blocks with a few gated full-attention blocks
HYBRID_ARCHS = ("qwen35", "qwen35moe")
# Hugging Face model_type -> our architecture name (GGUF's, where llama.cpp has one); Qwen3.5's
# multimodal configs hold the language model's under text_config
_HF_ARCHS = {a: a for a in SUPPORTED_ARCHS if not a.endswith("moe") and a not in HYBRID_ARCHS} | {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "qwen3_5": "qwen35",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_5_moe_text": "qwen35moe",
}
# whether llama.cpp renormalizes the chosen experts' weights, where GGUF does not say
_GGUF_EXPERT_NORM = {"qwen2moe": False}


class ConfigError(ValueError):
    """A model whose configuration is missing, malformed or not supported."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    context_length: int
    tied_embeddings: bool
    rope_scaling: dict[str, Any] | None = field(default=None)
    # Mixture of experts (n_experts 0: every block has a dense FFN). Routing: softmax over all
    # experts, the top n_experts_used, their weights renormalized to sum to 1 when expert_norm.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    expert_norm: bool = True
    dense_blocks: tuple[int, ...] = ()  # blocks with a dense FFN in a mixture-of-experts model
    shared_expert_ffn_dim: int = 0  # an expert every token runs, its output gated by a sigmoid (Qwen2-MoE)
    rope_dim: int = 0  # dimensions of each head RoPE rotates (the first ones); 0: all of head_dim
    # Gated delta-net blocks (Qwen3.5): a causal convolution of ssm_conv_kernel taps over q, k, v,
    # then the delta rule over ssm_k_heads query/key heads of ssm_k_dim and ssm_v_heads value heads
    # of ssm_v_dim; the other blocks are gated full attention.
    linear_blocks: tuple[int, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_k_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_heads: int = 0
    ssm_v_dim: int = 0
    # Tensors hold transformers' values, not those llama.cpp's converter writes: zero-centred norm
    # gains (the norm scales by 1 + w), A_log rather than -exp(A_log), and value heads grouped by
    # key head rather than tiled. Loading turns them into the converter's form.
    hf_layout: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        object.__setattr__(self, "linear_blocks", tuple(self.linear_blocks))
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(
                f"model config: unsupported architecture '{self.arch}' (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config: {self.n_heads} attention heads are not a multiple of {self.n_kv_heads} key/value heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim {self.head_dim} must be even for RoPE")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn_dim > 0):
            raise ConfigError(
                f"model config: {self.n_experts} experts need 1 to {self.n_experts} used per token and an expert "
                f"FFN size, got {self.n_experts_used} used and size {self.expert_ffn_dim}"
            )
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ConfigError(
                f"model config: rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}"
            )
        if self.linear_blocks:
            self._check_linear()
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ("linear", "llama3"):
            raise ConfigError(
                f"model config: unsupported rope scaling {self.rope_scaling!r} (supported: linear, llama3)"
            )

    def _check_linear(self) -> None:
        if self.arch not in HYBRID_ARCHS:
            raise ConfigError(f"model config: {self.arch} has no linear-attention blocks")
        if any(not 0 <= b < self.n_layers for b in self.linear_blocks):
            raise ConfigError(f"model config: linear blocks {list(self.linear_blocks)} outside 0..{self.n_layers - 1}")
        sizes = ("ssm_conv_kernel", "ssm_k_heads", "ssm_k_dim", "ssm_v_heads", "ssm_v_dim")
        for name in sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: linear-attention blocks need {name} > 0, got {value!r}")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise ConfigError(
                f"model config: {self.ssm_v_heads} value heads are not a multiple of {self.ssm_k_heads} key heads"
            )

    def linear(self, block: int) -> bool:
        """Whether `block` is a gated delta-net block (else it is attention)."""
        return block in self.linear_blocks

    @property
    def gated_attention(self) -> bool:
        """Attention whose query projection also carries a sigmoid gate on its output (Qwen3.5)."""
        return self.arch in HYBRID_ARCHS

    @property
    def conv_channels(self) -> int:
        """Channels of a delta-net block's convolution: queries, keys and values."""
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim

    def sparse(self, block: int) -> bool:
        """Whether `block`'s feed-forward is a mixture of experts."""
        return self.n_experts > 0 and block not in self.dense_blocks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"model config: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"model config: {e}") from None


def _require(source: dict, key: str, where: str):
    if key not in source:
        raise ConfigError(f"{where}: missing required key '{key}'")
    return source[key]


def _architecture(source: dict, key: str, where: str) -> str:
    arch = _require(source, key, where)
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"{where}: unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def from_gguf_metadata(meta: dict, tensor_names: set[str], where: str) -> ModelConfig:
    arch = _architecture(meta, "general.architecture", where)

    def key(name: str, default=None):
        full = f"{arch}.{name}"
        if default is None:
            return _require(meta, full, where)
        return meta.get(full, default)

    def count(name: str, default=None) -> int:
        value = key(name, default)
        # hybrids may list a count per block (0 for blocks without attention)
        return int(max(value)) if isinstance(value, list) and value else int(value)

    dim = int(key("embedding_length"))
    n_heads = count("attention.head_count")
    n_kv = count("attention.head_count_kv", n_heads)
    head_dim = int(key("attention.key_length", dim // n_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim and (arch not in HYBRID_ARCHS or rope_dim > head_dim):
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
    elif scaling_type not in ("none", ""):
        raise ConfigError(
            f"{where}: unsupported rope scaling '{scaling_type}' (supported: linear, llama3 through rope_freqs.weight)"
        )
    n_experts = int(key("expert_count", 0))
    expert_ffn = int(key("expert_feed_forward_length", key("feed_forward_length", 0))) if n_experts else 0
    n_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # MTP layers are not run
    # Llama 3.1-style scaling arrives as per-frequency factors in the tensor rope_freqs.weight.
    return ModelConfig(
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
        rope_scaling=scaling,
        n_experts=n_experts,
        n_experts_used=int(key("expert_used_count", 0)) if n_experts else 0,
        expert_ffn_dim=expert_ffn,
        expert_norm=bool(key("expert_weights_norm", _GGUF_EXPERT_NORM.get(arch, True))),
        shared_expert_ffn_dim=int(key("expert_shared_feed_forward_length", 0)) if n_experts else 0,
        dense_blocks=tuple(range(int(key("leading_dense_block_count", 0)))) if n_experts else (),
        rope_dim=0 if rope_dim == head_dim else rope_dim,
        **(_gguf_hybrid(key, n_layers, where) if arch in HYBRID_ARCHS else {}),
    )


def _gguf_hybrid(key, n_layers: int, where: str) -> dict[str, Any]:
    """The delta-net fields of a qwen35 / qwen35moe GGUF, as llama.cpp's converter writes them.
    Its rope.dimension_sections (M-RoPE) need nothing: text gives every section the same
    position, which makes M-RoPE plain RoPE."""
    interval = int(key("full_attention_interval", 4))
    v_heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    if interval <= 0 or v_heads <= 0 or inner % v_heads:
        raise ConfigError(
            f"{where}: full_attention_interval {interval}, ssm.inner_size {inner} and ssm.time_step_rank "
            f"{v_heads} do not describe a Qwen3.5 model"
        )
    return dict(
        linear_blocks=tuple(i for i in range(n_layers) if (i + 1) % interval),
        ssm_conv_kernel=int(key("ssm.conv_kernel")),
        ssm_k_heads=int(key("ssm.group_count")),
        ssm_k_dim=int(key("ssm.state_size")),
        ssm_v_heads=v_heads,
        ssm_v_dim=inner // v_heads,
    )


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
        return float(theta), {"type": "linear", "factor": float(_require(scaling, "factor", where))}
    if kind == "llama3":
        return float(theta), {
            "type": "llama3",
            "factor": float(_require(scaling, "factor", where)),
            "low_freq_factor": float(_require(scaling, "low_freq_factor", where)),
            "high_freq_factor": float(_require(scaling, "high_freq_factor", where)),
            "original_max_position_embeddings": int(_require(scaling, "original_max_position_embeddings", where)),
        }
    raise ConfigError(f"{where}: unsupported rope scaling '{kind}' (supported: linear, llama3)")


def _hf_experts(cfg: dict, arch: str, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2/3-MoE or Qwen3.5-MoE config.json."""
    if arch == "mixtral":
        n = int(_require(cfg, "num_local_experts", where))
        ffn = int(_require(cfg, "intermediate_size", where))
        return dict(n_experts=n, n_experts_used=int(_require(cfg, "num_experts_per_tok", where)), expert_ffn_dim=ffn)
    if arch == "qwen35moe":  # every block sparse, with a shared expert; the router renormalizes
        return dict(
            n_experts=int(_require(cfg, "num_experts", where)),
            n_experts_used=int(_require(cfg, "num_experts_per_tok", where)),
            expert_ffn_dim=int(_require(cfg, "moe_intermediate_size", where)),
            shared_expert_ffn_dim=int(_require(cfg, "shared_expert_intermediate_size", where)),
        )
    if arch in ("qwen2moe", "qwen3moe"):
        n_layers, step = int(_require(cfg, "num_hidden_layers", where)), int(cfg.get("decoder_sparse_step", 1))
        only_mlp = set(cfg.get("mlp_only_layers") or ())
        shared = int(_require(cfg, "shared_expert_intermediate_size", where)) if arch == "qwen2moe" else 0
        return dict(
            n_experts=int(_require(cfg, "num_experts", where)),
            n_experts_used=int(_require(cfg, "num_experts_per_tok", where)),
            expert_ffn_dim=int(_require(cfg, "moe_intermediate_size", where)),
            expert_norm=bool(cfg.get("norm_topk_prob", False)),
            dense_blocks=tuple(i for i in range(n_layers) if i in only_mlp or step <= 0 or (i + 1) % step),
            shared_expert_ffn_dim=shared,
        )
    return {}


_LAYER_TYPES = ("linear_attention", "full_attention")


def _hf_hybrid(cfg: dict, head_dim: int, where: str) -> dict[str, Any]:
    """The delta-net fields of a Qwen3.5 text config (defaults as transformers has them)."""
    n_layers = int(_require(cfg, "num_hidden_layers", where))
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
    return dict(
        linear_blocks=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        ssm_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ssm_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        ssm_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        ssm_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        ssm_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        rope_dim=0 if rope_dim == head_dim else rope_dim,
        hf_layout=True,
    )


def _hf_text_config(cfg: dict, where: str) -> dict:
    """The language model's part of a config.json (Qwen3.5's multimodal ones nest it)."""
    text = cfg.get("text_config")
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe") and isinstance(text, dict):
        merged = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **text}
        merged["model_type"] = cfg["model_type"]
        return merged
    return cfg


def from_hf_config(cfg: dict, where: str) -> ModelConfig:
    cfg = _hf_text_config(cfg, where)
    model_type = _require(cfg, "model_type", where)
    if model_type not in _HF_ARCHS:
        raise ConfigError(
            f"{where}: unsupported architecture '{model_type}' (supported: {', '.join(sorted(_HF_ARCHS))})"
        )
    arch = _HF_ARCHS[model_type]
    dim = int(_require(cfg, "hidden_size", where))
    n_heads = int(_require(cfg, "num_attention_heads", where))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    theta, scaling = _hf_rope(cfg, where)
    experts = _hf_experts(cfg, arch, where)
    ffn = cfg.get("intermediate_size") if arch == "qwen35moe" else _require(cfg, "intermediate_size", where)
    return ModelConfig(
        arch=arch,
        n_layers=int(_require(cfg, "num_hidden_layers", where)),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(ffn or experts.get("expert_ffn_dim", 0)),
        vocab_size=int(_require(cfg, "vocab_size", where)),
        norm_eps=float(_require(cfg, "rms_norm_eps", where)),
        rope_theta=theta,
        context_length=int(_require(cfg, "max_position_embeddings", where)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        **experts,
        **(_hf_hybrid(cfg, head_dim, where) if arch in HYBRID_ARCHS else {}),
    )
