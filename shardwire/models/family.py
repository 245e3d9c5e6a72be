"""What a model family declares: how its configs read, which tensors its blocks hold in which
shapes, how a transformers checkpoint's values become the converter's, and the variant of every
block: what each block computes, which a backend must implement exactly or refuse."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Mapping

import torch

from ..config import ConfigError, ModelConfig

Shapes = dict[str, tuple[int, ...]]
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def block_of(name: str) -> int | None:
    """The block a tensor name (GGUF's, shardwire's) belongs to; None for the model's own."""
    m = _BLOCK.match(name)
    return int(m[1]) if m else None


@dataclass(frozen=True)
class BlockVariant:
    """What one block computes. Two blocks of one variant run the same arithmetic on weights of
    their own shapes; a backend that runs a block implements its variant, or refuses it."""

    mixer: str = "attention"  # attention | gated_attention (Qwen3.5's output gate) | gated_delta_net
    qk_norm: bool = False  # an RMS norm on each query and key head before RoPE
    ffn: str = "dense"  # dense | experts
    activation: str = "silu"  # the gated feed-forward's: silu | gelu_tanh | clamped_swiglu (gpt-oss's)
    routing: str = ""  # experts: softmax_top_k, or softmax_top_k_normalized (chosen weights sum to 1)
    shared_expert: str = ""  # experts: one more every token runs: "sigmoid_gated" (its output behind a gate) or "plain"
    post_norms: bool = False  # an RMS norm on the mixer's and on the feed-forward's output (Gemma)
    window: int = 0  # sliding-window attention: the keys a query sees, its own included; 0: all
    local_rope: bool = False  # RoPE of the model's local base (ModelConfig.local_rope_theta), unscaled
    query_scale: float = 0.0  # attention scores' scale; 0: 1 / sqrt(head_dim)
    sinks: bool = False  # a learned logit per head in each query's softmax, reading no value (gpt-oss)

    def __str__(self) -> str:
        words = [self.mixer + (" with q/k norms" if self.qk_norm else "") + (" with sinks" if self.sinks else "")]
        if self.window:
            words.append(f"a {self.window}-key window" + (" with local RoPE" if self.local_rope else ""))
        if self.query_scale:
            words.append(f"scores scaled by {self.query_scale:.4g}")
        ffn = f"{self.activation} {self.ffn}"
        if self.ffn == "experts":
            ffn += f" ({self.routing}{f', {self.shared_expert} shared expert' if self.shared_expert else ''})"
        words.append(ffn)
        if self.post_norms:
            words.append("post-norms")
        return ", ".join(words)


def require(source: Mapping, key: str, where: str):
    if key not in source:
        raise ConfigError(f"{where}: missing required key '{key}'")
    return source[key]


class GGUFKeys:
    """A GGUF's metadata under its architecture's prefix: `keys("embedding_length")` reads
    `<arch>.embedding_length`, required unless given a default."""

    def __init__(self, meta: Mapping, arch: str, where: str, tensors: frozenset[str] = frozenset()):
        self.meta, self.arch, self.where = meta, arch, where
        self.tensors = tensors  # the file's tensor names, for what its metadata leaves unsaid

    def __call__(self, name: str, default=None):
        full = f"{self.arch}.{name}"
        if default is None:
            return require(self.meta, full, self.where)
        return self.meta.get(full, default)

    def sliding_blocks(self, n_layers: int, period: int) -> tuple[int, ...]:
        """The blocks on a sliding window, as llama.cpp reads them: a per-block list of flags
        (attention.sliding_window_pattern), else a period (the key's, or the family's `period`)
        of which every block but the last slides (0: all do)."""
        pattern = self("attention.sliding_window_pattern", period)
        if isinstance(pattern, list):
            return tuple(i for i, on in enumerate(pattern[:n_layers]) if on)
        period = int(pattern)
        return tuple(i for i in range(n_layers) if period == 0 or i % period < period - 1)

    def count(self, name: str, default=None) -> int:
        """A count that hybrids may list per block (0 for blocks without it): the largest."""
        value = self(name, default)
        return int(max(value)) if isinstance(value, list) and value else int(value)


def _no_fields(*_args) -> dict[str, Any]:
    return {}


def _no_check(_cfg: ModelConfig) -> None:
    pass


def _as_stored(_cfg: ModelConfig, tensors: dict, _path) -> dict:
    return tensors


def _as_given(cfg: dict) -> dict:
    return cfg


@dataclass(frozen=True)
class Family:
    """One family of architectures that share their block code. The hooks default to a family
    with nothing of its own to say."""

    name: str
    archs: tuple[str, ...]  # GGUF's names for them (llama.cpp's, where it has one)
    # a config.json's model_type -> its architecture here; of those naming one architecture, the
    # last is the one transformers saves a text model under
    hf_types: Mapping[str, str]
    variant: Callable[[ModelConfig, int], BlockVariant]
    block_shapes: Callable[[ModelConfig, int], Shapes]  # every tensor a block may hold, by short name
    required: Callable[[ModelConfig, int], tuple[str, ...]]  # the short names a block cannot do without
    gguf_fields: Callable[[GGUFKeys, int], dict[str, Any]] = _no_fields  # (keys, n_layers): its own config fields
    hf_fields: Callable[[dict, int, str], dict[str, Any]] = _no_fields  # (config.json, head_dim, where)
    check: Callable[[ModelConfig], None] = _no_check  # what its own fields must satisfy
    hf_text_config: Callable[[dict], dict] = _as_given  # the language model's part of a config.json
    gguf_tensors: Callable[[ModelConfig, dict, Any], dict] = _as_stored  # a GGUF's tensors under shardwire's names
    hf_classes: Mapping[str, str] = field(default_factory=dict)  # architecture -> its transformers class
    converter_archs: Mapping[str, str] = field(default_factory=dict)  # where llama.cpp's converter writes another
    qk_interleaved: tuple[str, ...] = ()  # architectures whose GGUF Q/K rows the converter interleaved for RoPE
    partial_rope: bool = False  # whether RoPE may turn only the first dimensions of each head
    # a config.json's per-block tensor names of this family beyond the Llama ones -> short names here
    hf_block_names: Mapping[str, str] = field(default_factory=dict)
    hf_block_params: Mapping[str, str] = field(default_factory=dict)  # the same for tensors with no .weight
    # how a Hugging Face folder holds experts beyond one tensor per expert: "" (transformers 5's
    # fused [experts, 2 ffn, dim], gate rows then up rows), or "openai" (formats/openai_experts.py)
    hf_experts: str = ""
    # config.json keys that name one value, as transformers' attribute_map aliases them (which of
    # them it saves has changed between its releases)
    hf_aliases: tuple[tuple[str, ...], ...] = ()
    # a transformers checkpoint's tensor (cfg.hf_layout) as the converter writes it; itemsize: raw
    # rows of elements of that size, where it only reorders
    from_transformers: Callable[[ModelConfig, str, torch.Tensor, int], torch.Tensor] | None = None
    needs_float32: Callable[[ModelConfig, str], bool] = lambda cfg, name: False  # arithmetic in from_transformers

    @classmethod
    def of(cls, module) -> "Family":
        """The family a module declares: a function for each hook, named as its field, and a
        constant for each value (ARCHS, HF_TYPES, ...); a module leaves out what it has nothing of
        its own to say about."""
        given = {"name": module.__name__.rsplit(".", 1)[-1]}
        for f in fields(cls):
            for attr in (f.name, f.name.upper()):
                if hasattr(module, attr):
                    given[f.name] = getattr(module, attr)
            if f.name not in given and f.default is MISSING and f.default_factory is MISSING:
                raise TypeError(f"{module.__name__} declares no {f.name} (or {f.name.upper()})")
        return cls(**given)
