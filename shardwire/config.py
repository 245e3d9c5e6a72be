"""ModelConfig: the shape of a model (dense or mixture-of-experts, or a hybrid of gated delta-net
and attention blocks). models/ reads it from GGUF metadata or a config.json, and its family checks
and interprets the fields that are its own."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 where nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    shared_expert_ffn_dim: int = 0  # an expert every token runs (behind a sigmoid gate where the block has one)
    # Routing by sigmoid scores (GLM-4.5, DeepSeek-V3) rather than a softmax: a learned bias per expert
    # (exp_probs_b) is added where experts are chosen, only among the expert_groups_used best of
    # expert_groups groups (a group scored by its two best), and the chosen ones' unbiased scores
    # (renormalized when expert_norm) times expert_weights_scale weigh their outputs
    # top_k_softmax (gpt-oss): the experts chosen by logit, a softmax over the chosen ones weighs them
    expert_gating: str = "softmax"  # softmax | sigmoid | top_k_softmax
    expert_groups: int = 1
    expert_groups_used: int = 1
    expert_weights_scale: float = 1.0
    # gpt-oss's clamped SwiGLU in its experts, where swiglu_limit > 0: the gate clamped above and the
    # up projection on both sides at the limit, then gate * sigmoid(swiglu_alpha * gate) * (up + 1)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    rope_dim: int = 0  # dimensions of each head RoPE rotates (the first ones); 0: all of head_dim
    qk_norm: bool = False  # an RMS norm on each query and key head, where the family leaves it to the config (GLM)
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), where kv_lora_rank > 0: queries through
    # a q_lora_rank bottleneck (0: one projection), keys and values from a kv_lora_rank latent per
    # position that is all the cache keeps beside the rope_dim part of the key every head shares;
    # head_dim is a query/key head's width (rope_dim of it rotated), v_head_dim a value head's.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0
    # Gated delta-net blocks (Qwen3.5): a causal convolution of ssm_conv_kernel taps over q, k, v,
    # then the delta rule over ssm_k_heads query/key heads of ssm_k_dim and ssm_v_heads value heads
    # of ssm_v_dim; the other blocks are gated full attention.
    linear_blocks: tuple[int, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_k_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_heads: int = 0
    ssm_v_dim: int = 0
    # Tensors hold transformers' values, not those llama.cpp's converter writes (Qwen3.5: zero-centred
    # norm gains (the norm scales by 1 + w), A_log rather than -exp(A_log), value heads grouped by
    # key head rather than tiled). Loading turns them into the converter's form, as the family says.
    hf_layout: bool = False
    # Sliding-window attention (Gemma 3): sliding_blocks see the last sliding_window positions
    # (their own included), with RoPE of base local_rope_theta and no scaling
    sliding_window: int = 0
    sliding_blocks: tuple[int, ...] = ()
    local_rope_theta: float = 0.0
    query_scale: float = 0.0  # what attention scores are scaled by; 0: 1 / sqrt(head_dim)
    embedding_scale: float = 1.0  # token embeddings are multiplied by this
    logit_softcap: float = 0.0  # logits become cap * tanh(logits / cap); 0: none

    def __post_init__(self):
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        object.__setattr__(self, "linear_blocks", tuple(self.linear_blocks))
        object.__setattr__(self, "sliding_blocks", tuple(self.sliding_blocks))
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.arch, str) or not self.arch:
            raise ConfigError(f"model config: arch must name an architecture, got {self.arch!r}")
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
        if self.expert_gating not in ("softmax", "sigmoid", "top_k_softmax"):
            raise ConfigError(
                f"model config: expert_gating must be softmax, sigmoid or top_k_softmax, got {self.expert_gating!r}"
            )
        if not (0 < self.expert_groups_used <= self.expert_groups and self.n_experts % self.expert_groups == 0):
            raise ConfigError(
                f"model config: {self.n_experts} experts in {self.expert_groups} groups, of which "
                f"{self.expert_groups_used} are used, do not divide evenly"
            )
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ConfigError(
                f"model config: rope_dim {self.rope_dim} must be even and at most head_dim {self.head_dim}"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ("linear", "llama3", "yarn"):
            raise ConfigError(
                f"model config: unsupported rope scaling {self.rope_scaling!r} (supported: linear, llama3, yarn)"
            )
        if self.kv_lora_rank and not (self.rope_dim and self.v_head_dim > 0 and self.q_lora_rank >= 0):
            raise ConfigError(
                f"model config: latent attention needs a rotated part and value heads, got rope_dim {self.rope_dim}"
                f" and v_head_dim {self.v_head_dim}"
            )

    @property
    def cache_widths(self) -> tuple[int, int, int]:
        """What the KV cache keeps per position and attention block: (heads, key width, value width).
        Latent attention keeps one latent and the shared rotated key part, and no values (they are
        read out of the latent), as llama.cpp's cache does."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.rope_dim, 0
        return self.n_kv_heads, self.head_dim, self.head_dim

    @property
    def attention_widths(self) -> tuple[int, int]:
        """Values per position of an attention block's queries (a gated block's gates beside them)
        and of its heads' output, as a prompt's rows hold them between a block's graphs on a CPU.
        Latent attention's are each head's latent (its queries with the rotated part): 9x the
        model's width in the DeepSeek-V3 layout."""
        if self.kv_lora_rank:
            return self.n_heads * (self.kv_lora_rank + self.rope_dim), self.n_heads * self.kv_lora_rank
        width = self.n_heads * self.head_dim
        return width * (2 if self.linear_blocks else 1), width

    def sliding(self, block: int) -> bool:
        """Whether `block` attends to a sliding window of positions."""
        return self.sliding_window > 0 and block in self.sliding_blocks

    def linear(self, block: int) -> bool:
        """Whether `block` is a gated delta-net block (else it is attention)."""
        return block in self.linear_blocks

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
