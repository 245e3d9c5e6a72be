"""ModelConfig: the shape of a Llama-family model (dense or mixture-of-experts), read from GGUF
metadata or an HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "mixtral", "qwen2", "qwen2moe", "qwen3", "qwen3moe")
# Hugging Face model_type -> our architecture name (GGUF's, where llama.cpp has one)
_HF_ARCHS = {a: a for a in SUPPORTED_ARCHS if not a.endswith("moe")} | {
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
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

    def __post_init__(self):
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
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
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ("linear", "llama3"):
            raise ConfigError(
                f"model config: unsupported rope scaling {self.rope_scaling!r} (supported: linear, llama3)"
            )

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

    dim = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_heads)
    head_dim = int(key("attention.key_length", dim // n_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
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
    # Llama 3.1-style scaling arrives as per-frequency factors in the tensor rope_freqs.weight.
    return ModelConfig(
        arch=arch,
        n_layers=int(key("block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
        head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        context_length=int(key("context_length")),
        tied_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        n_experts=n_experts,
        n_experts_used=int(key("expert_used_count", 0)) if n_experts else 0,
        # Mixtral's converter writes the experts' size as the feed-forward length
        expert_ffn_dim=int(key("expert_feed_forward_length", key("feed_forward_length"))) if n_experts else 0,
        expert_norm=bool(key("expert_weights_norm", _GGUF_EXPERT_NORM.get(arch, True))),
        shared_expert_ffn_dim=int(key("expert_shared_feed_forward_length", 0)) if n_experts else 0,
        dense_blocks=tuple(range(int(key("leading_dense_block_count", 0)))) if n_experts else (),
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
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json."""
    if arch == "mixtral":
        n = int(_require(cfg, "num_local_experts", where))
        ffn = int(_require(cfg, "intermediate_size", where))
        return dict(n_experts=n, n_experts_used=int(_require(cfg, "num_experts_per_tok", where)), expert_ffn_dim=ffn)
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


def from_hf_config(cfg: dict, where: str) -> ModelConfig:
    model_type = _require(cfg, "model_type", where)
    if model_type not in _HF_ARCHS:
        raise ConfigError(
            f"{where}: unsupported architecture '{model_type}' (supported: {', '.join(sorted(_HF_ARCHS))})"
        )
    arch = _HF_ARCHS[model_type]
    dim = int(_require(cfg, "hidden_size", where))
    n_heads = int(_require(cfg, "num_attention_heads", where))
    theta, scaling = _hf_rope(cfg, where)
    return ModelConfig(
        arch=arch,
        n_layers=int(_require(cfg, "num_hidden_layers", where)),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        ffn_dim=int(_require(cfg, "intermediate_size", where)),
        vocab_size=int(_require(cfg, "vocab_size", where)),
        norm_eps=float(_require(cfg, "rms_norm_eps", where)),
        rope_theta=theta,
        context_length=int(_require(cfg, "max_position_embeddings", where)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        **_hf_experts(cfg, arch, where),
    )
