"""Synthetic test models: random weights of the right shapes, with real vocabularies.

Vocabularies come from llama.cpp's vocab-only GGUFs in ../shared/vocab (tokenizer metadata copied
as-is, plus a Hugging Face tokenizer.json rebuilt from it), or, where that folder is absent, from
a small byte-level BPE trained here on a built-in paragraph.

Past 400 lines because the model table and the vocabulary loaders are one recipe: each test model
names its vocabulary, and the two are read together.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from shardwire.config import ModelConfig
from shardwire.formats.names import expert_name

SHARED_VOCAB = Path(os.environ.get("SHARDWIRE_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "vocab"

# ---------------------------------------------------------------------------------------------
# Vocabularies


@dataclass(frozen=True)
class Vocab:
    name: str
    gguf_metadata: dict  # tokenizer.* keys, as a GGUF file holds them
    tokenizer_json: str  # the same vocabulary as a Hugging Face tokenizer.json
    tokenizer_config: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.gguf_metadata["tokenizer.ggml.tokens"])


_CORPUS = """\
Once upon a time, in a small town beside a wide river, there lived a clockmaker who repaired
watches for everyone. Every morning at 7:30 she opened her shop; by noon the counter held 12 or
13 broken clocks. "Time is patient," she liked to say, "but people are not!" Children pressed
their noses to the window and asked questions: Why do gears turn? What makes a spring strong?
She answered each one, then went back to work. In the evening the river was quiet, the lamps
were lit, and the town counted its hours with her clocks - tick, tock, tick - until morning.
def add(a, b):
    return a + b  # 1 + 2 = 3, 10 * 10 = 100
"""
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def tiny_vocab_metadata(size: int = 512) -> dict:
    """A byte-level BPE of `size` tokens (plus ChatML specials) trained on a built-in paragraph,
    as GGUF gpt2-type tokenizer metadata."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + list(_TINY_SPECIALS)
    eot = tokens.index("<|endoftext|>")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in _TINY_SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        "tokenizer.ggml.bos_token_id": eot,
        "tokenizer.ggml.eos_token_id": eot,
        "tokenizer.ggml.padding_token_id": eot,
        "tokenizer.chat_template": _CHATML,
    }


# Pre-tokenizer regexes of the Hugging Face tokenizers llama.cpp's `tokenizer.ggml.pre` names.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_REGEX = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
_CONTROL, _USER_DEFINED, _UNKNOWN, _BYTE = 3, 4, 2, 6


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """BPE merges equivalent to a SentencePiece vocabulary: every split of a piece into two
    pieces, highest-scoring result first (what transformers' SentencePieceExtractor does)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = []
    for piece, i in ids.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        local.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        merges += [(scores[i], left, right) for left, right in local]
    merges.sort(key=lambda m: -m[0])
    return [[left, right] for _, left, right in merges]


def hf_tokenizer(meta: dict) -> tuple[str, dict]:
    """tokenizer.json and tokenizer_config.json for GGUF tokenizer metadata (gpt2 or llama models)."""
    kind = meta["tokenizer.ggml.model"]
    normalizer = None
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = {_CONTROL, _UNKNOWN}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": types[i] in special,
        }
        for i, t in enumerate(tokens)
        if types[i] in special | {_USER_DEFINED}
    ]
    token_of = lambda key: tokens[meta[key]] if key in meta else None  # noqa: E731
    bos = token_of("tokenizer.ggml.bos_token_id")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2":
        add_bos = meta.get("tokenizer.ggml.add_bos_token", pre in ("llama-bpe", "llama3"))
        regex = _PRE_REGEX.get(pre)
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": regex is None}
        pre_tokenizer = (
            byte_level
            if regex is None
            else {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                    byte_level,
                ],
            }
        )
        merges = [m.split(" ", 1) for m in meta["tokenizer.ggml.merges"]]
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in ("llama-bpe", "llama3"),
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        }
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    elif kind == "llama":
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
        # The normalizer of Llama 2's own tokenizer.json; it reproduces llama.cpp's SPM tokenizer
        # on every test line, where Metaspace (transformers' GGUF conversion) misses 15 of 47.
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        normalizer = {
            "type": "Sequence",
            "normalizers": [
                *([{"type": "Prepend", "prepend": "\u2581"}] if prefix else []),
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        }
        pre_tokenizer = None
        merges = _spm_merges(tokens, meta["tokenizer.ggml.scores"], types)
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": _BYTE in types,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        }
        decoder = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1 if prefix else 0, "stop": 0},
            ],
        }
    else:
        raise ValueError(f"no Hugging Face equivalent for tokenizer model '{kind}'")
    post = None
    if add_bos and bos is not None:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": decoder,
        "model": model,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return json.dumps(spec, ensure_ascii=False), {k: v for k, v in config.items() if v is not None}


@lru_cache(maxsize=None)
def load_vocab(name: str) -> Vocab:
    """A vocabulary by name: 'tiny', or a llama.cpp vocab file ('llama-spm', 'llama-bpe', 'qwen2',
    'gpt-2', 'phi-3' in ../shared/vocab). Falls back to 'tiny' when ../shared is absent."""
    from shardwire.formats.gguf import read_gguf

    path = SHARED_VOCAB / f"ggml-vocab-{name}.gguf"
    if name == "tiny" or not path.is_file():
        name, meta = "tiny", tiny_vocab_metadata()
    else:
        meta = {k: v for k, v in read_gguf(path).metadata.items() if k.startswith("tokenizer.")}
    tokenizer_json, tokenizer_config = hf_tokenizer(meta)
    return Vocab(name, meta, tokenizer_json, tokenizer_config)


# ---------------------------------------------------------------------------------------------
# Random weights

_DEFAULT_THETA = (
    {"llama": 10000.0, "mistral": 1e6, "mixtral": 1e6}
    | dict.fromkeys(("qwen2", "qwen2moe", "qwen3", "qwen3moe"), 1e6)
    | dict.fromkeys(("qwen35", "qwen35moe"), 1e7)
)
_DEFAULT_EPS = {"llama": 1e-5, "mistral": 1e-5, "mixtral": 1e-5} | dict.fromkeys(
    ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "qwen35", "qwen35moe"), 1e-6
)
_HYBRID = ("qwen35", "qwen35moe")


def random_model(
    arch: str,
    *,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    ffn_dim: int | None = None,
    vocab_size: int,
    context_length: int = 512,
    tied: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float | None = None,
    norm_eps: float | None = None,
    n_experts: int = 0,
    n_experts_used: int = 0,
    expert_ffn_dim: int | None = None,
    shared_expert_ffn_dim: int = 0,
    full_attention_interval: int = 4,
    linear_heads: tuple[int, int] = (2, 6),
    linear_head_dims: tuple[int, int] = (16, 16),
    conv_kernel: int = 4,
    partial_rotary: float = 0.25,
    seed: int = 0,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A config and float32 tensors (canonical names, Hugging Face order) with random weights.

    Qwen3.5 hybrids (qwen35, qwen35moe) get a gated delta-net block but every
    `full_attention_interval`-th, with `linear_heads` (query/key, value) heads of
    `linear_head_dims`; their tensors hold transformers' values (ModelConfig.hf_layout).

    Scales keep activations of order one: attention scores and FFN pre-activations near unit
    variance, block outputs on the embedding's scale, and logits with a standard deviation of
    about 3, so greedy decoding is decisive and its continuations depend on the prompt.
    """
    head_dim = head_dim or dim // n_heads
    if rope_theta is None:
        rope_theta = 500000.0 if rope_scaling and rope_scaling.get("type") == "llama3" else _DEFAULT_THETA[arch]
    cfg = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim or 2 * dim,
        vocab_size=vocab_size,
        norm_eps=_DEFAULT_EPS[arch] if norm_eps is None else norm_eps,
        rope_theta=rope_theta,
        context_length=context_length,
        tied_embeddings=tied,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        n_experts=n_experts,
        n_experts_used=n_experts_used,
        expert_ffn_dim=(expert_ffn_dim or dim) if n_experts else 0,
        expert_norm=arch != "qwen2moe",  # as llama.cpp routes each architecture
        shared_expert_ffn_dim=shared_expert_ffn_dim,
        **(
            _hybrid_fields(
                head_dim, n_layers, full_attention_interval, linear_heads, linear_head_dims, conv_kernel, partial_rotary
            )
            if arch in _HYBRID
            else {}
        ),
    )
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def norm(n):
        return 1.0 + normal(n, 0.1)

    q, kv = cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim
    t = {"token_embd.weight": normal((vocab_size, dim), 3.0 / np.sqrt(dim))}
    if arch in _HYBRID:  # norms scale by 1 + w
        norm = lambda n: normal(n, 0.1)  # noqa: E731
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(dim)
        if cfg.linear(i):
            t.update(_deltanet(cfg, p, normal, rng))
            _ffn(cfg, t, i, normal, norm)
            continue
        # gated attention: each head's query rows, then its gate's
        t[p + "attn_q.weight"] = normal((2 * q if arch in _HYBRID else q, dim), 1 / np.sqrt(dim))
        t[p + "attn_k.weight"] = normal((kv, dim), 1 / np.sqrt(dim))
        t[p + "attn_v.weight"] = normal((kv, dim), 1 / np.sqrt(dim))
        t[p + "attn_output.weight"] = normal((dim, q), 1 / np.sqrt(q))
        if arch in ("qwen2", "qwen2moe"):
            t[p + "attn_q.bias"] = normal(q, 0.3)
            t[p + "attn_k.bias"] = normal(kv, 0.3)
            t[p + "attn_v.bias"] = normal(kv, 0.1)
        if arch in ("qwen3", "qwen3moe", *_HYBRID):
            t[p + "attn_q_norm.weight"] = norm(head_dim)
            t[p + "attn_k_norm.weight"] = norm(head_dim)
        _ffn(cfg, t, i, normal, norm)
    # Random signs on the final norm: with all-positive gains a tied model's logits favour the
    # token just read (its own embedding), and greedy decoding gets stuck repeating it.
    gains = norm(dim) + (1 if arch in _HYBRID else 0)
    gains = gains * rng.choice(np.float32([-1, 1]), dim)
    t["output_norm.weight"] = gains - 1 if arch in _HYBRID else gains
    if not tied:
        t["output.weight"] = normal((vocab_size, dim), 3.0 / np.sqrt(dim))
    return cfg, t


def _hybrid_fields(head_dim, n_layers, interval, heads, head_dims, kernel, partial) -> dict:
    return dict(
        linear_blocks=tuple(i for i in range(n_layers) if (i + 1) % interval),
        ssm_conv_kernel=kernel,
        ssm_k_heads=heads[0],
        ssm_v_heads=heads[1],
        ssm_k_dim=head_dims[0],
        ssm_v_dim=head_dims[1],
        rope_dim=int(head_dim * partial) if partial < 1 else 0,
        hf_layout=True,
    )


def _deltanet(cfg: ModelConfig, p: str, normal, rng) -> dict[str, np.ndarray]:
    """A gated delta-net block's token mixer, as transformers initializes and holds it."""
    dim, v = cfg.dim, cfg.ssm_v_heads * cfg.ssm_v_dim
    return {
        p + "attn_qkv.weight": normal((cfg.conv_channels, dim), 1 / np.sqrt(dim)),
        p + "attn_gate.weight": normal((v, dim), 1 / np.sqrt(dim)),
        p + "ssm_beta.weight": normal((cfg.ssm_v_heads, dim), 1 / np.sqrt(dim)),
        p + "ssm_alpha.weight": normal((cfg.ssm_v_heads, dim), 1 / np.sqrt(dim)),
        p + "ssm_conv1d.weight": normal((cfg.conv_channels, cfg.ssm_conv_kernel), 0.5),
        p + "ssm_a": np.log(rng.uniform(0.01, 16, cfg.ssm_v_heads)).astype(np.float32),  # A_log
        p + "ssm_dt.bias": 1.0 + normal(cfg.ssm_v_heads, 0.3),
        p + "ssm_norm.weight": 1.0 + normal(cfg.ssm_v_dim, 0.1),
        p + "ssm_out.weight": normal((dim, v), 1 / np.sqrt(v)),
    }


def _ffn(cfg: ModelConfig, t: dict, i: int, normal, norm) -> None:
    p, dim, f = f"blk.{i}.", cfg.dim, cfg.ffn_dim
    n_experts = cfg.n_experts
    t[p + "ffn_norm.weight"] = norm(dim)
    if cfg.sparse(i):
        # router scores spread over a few units, so each token's choice of experts is clear-cut
        t[p + "ffn_gate_inp.weight"] = normal((n_experts, dim), 2 / np.sqrt(dim))
        fe = cfg.expert_ffn_dim
        for e in range(n_experts):
            t[expert_name(i, "ffn_gate_exps", e)] = normal((fe, dim), 1 / np.sqrt(dim))
            t[expert_name(i, "ffn_up_exps", e)] = normal((fe, dim), 1 / np.sqrt(dim))
            t[expert_name(i, "ffn_down_exps", e)] = normal((dim, fe), 1 / np.sqrt(fe))
        if cfg.shared_expert_ffn_dim:
            fs = cfg.shared_expert_ffn_dim
            t[p + "ffn_gate_inp_shexp.weight"] = normal((1, dim), 2 / np.sqrt(dim))
            t[p + "ffn_gate_shexp.weight"] = normal((fs, dim), 1 / np.sqrt(dim))
            t[p + "ffn_up_shexp.weight"] = normal((fs, dim), 1 / np.sqrt(dim))
            t[p + "ffn_down_shexp.weight"] = normal((dim, fs), 1 / np.sqrt(fs))
    else:
        t[p + "ffn_gate.weight"] = normal((f, dim), 1 / np.sqrt(dim))
        t[p + "ffn_up.weight"] = normal((f, dim), 1 / np.sqrt(dim))
        t[p + "ffn_down.weight"] = normal((dim, f), 1 / np.sqrt(f))


# ---------------------------------------------------------------------------------------------
# The test-model set: one per supported family, each with the vocabulary its real models use.

LLAMA3_SCALING = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: str
    params: dict  # random_model arguments besides vocab_size


# Widths stay small because the embedding has a row per token (151936 for Qwen); Llama 2 uses a
# 32000-token vocabulary, so it is the one wide enough (256) for its matrices to hold K-quant
# blocks. Qwen3 keeps its real head_dim of 128, which differs from dim / heads.
TEST_MODELS = {
    m.name: m
    for m in [
        ModelSpec("llama", "llama-spm", dict(arch="llama", n_layers=4, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512)),
        ModelSpec(
            "llama3.1",
            "llama-bpe",
            dict(arch="llama", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, tied=True, rope_scaling=LLAMA3_SCALING),
        ),
        ModelSpec("mistral", "llama-spm", dict(arch="mistral", n_layers=4, dim=64, n_heads=4, n_kv_heads=2)),
        ModelSpec("qwen2", "qwen2", dict(arch="qwen2", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, tied=True)),
        ModelSpec(
            "qwen3", "qwen2", dict(arch="qwen3", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=128, tied=True)
        ),
        # Mixtures of experts: 8 experts, 2 per token, as Mixtral 8x7B routes; Qwen2-MoE adds an
        # expert every token runs
        ModelSpec(
            "mixtral",
            "llama-spm",
            dict(
                arch="mixtral", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=64, n_experts=8, n_experts_used=2
            ),
        ),
        ModelSpec(
            "qwen3moe",
            "qwen2",
            dict(
                arch="qwen3moe",
                n_layers=4,
                dim=64,
                n_heads=4,
                n_kv_heads=2,
                head_dim=32,
                n_experts=16,
                n_experts_used=4,
                expert_ffn_dim=32,
            ),
        ),
        # Qwen3.5 hybrids: gated delta-net blocks with a gated attention block every fourth (as
        # the real ones), 2 query/key heads serving 6 value heads (so their order matters)
        ModelSpec(
            "qwen35",
            "qwen2",
            dict(arch="qwen35", n_layers=5, dim=64, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=128),
        ),
        ModelSpec(
            "qwen35moe",
            "qwen2",
            dict(
                arch="qwen35moe",
                n_layers=4,
                dim=64,
                n_heads=4,
                n_kv_heads=2,
                head_dim=64,
                n_experts=8,
                n_experts_used=2,
                ffn_dim=32,  # transformers' Qwen3.5-MoE config has no dense FFN size
                expert_ffn_dim=32,
                shared_expert_ffn_dim=48,
            ),
        ),
        ModelSpec(
            "qwen2moe",
            "qwen2",
            dict(
                arch="qwen2moe",
                n_layers=4,
                dim=64,
                n_heads=4,
                n_kv_heads=2,
                n_experts=8,
                n_experts_used=2,
                expert_ffn_dim=32,
                shared_expert_ffn_dim=64,
            ),
        ),
    ]
}


# A random Llama of six blocks that outweigh a small vocabulary, so a memory budget can hold a third of the model
# and not half.
SIX_BLOCKS = dict(n_layers=6, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=384, context_length=512, seed=3)


def write_random_llama(path: str | Path, *, weight_type: str = "F32", near_ties: float = 0.0, **layout) -> Path:
    """A llama GGUF with random weights and the tiny test vocabulary; `layout` as random_model takes it.

    near_ties > 0 pairs the output rows: each odd token's row is the even one's before it, every
    weight scaled by 1 + near_ties * noise. At 1e-6 greedy decoding then chooses at every step
    between two tokens whose logits differ by about float32 rounding, so any change in how the
    logits were computed (the shape of a batch, the order of a sum) shows in the text."""
    from .writer import write_gguf

    vocab = tiny_vocab_metadata()
    cfg, tensors = random_model("llama", vocab_size=len(vocab["tokenizer.ggml.tokens"]), **layout)
    if near_ties:
        head = tensors["output.weight"]
        twins = head[1::2]
        noise = np.random.default_rng(1).standard_normal(twins.shape).astype(np.float32)
        head[1::2] = head[: 2 * len(twins) : 2] * (1 + near_ties * noise)
    write_gguf(path, cfg, tensors, vocab, weight_type=weight_type)
    return Path(path)


def build_test_model(name: str, *, vocab: str | None = None, seed: int = 0):
    """(config, tensors, vocab) of a named test model; `vocab` overrides its vocabulary."""
    spec = TEST_MODELS[name]
    v = load_vocab(vocab or spec.vocab)
    cfg, tensors = random_model(**spec.params, vocab_size=v.size, seed=seed)
    return cfg, tensors, v


def write_test_model(
    out_dir: str | Path, name: str, types=("F32",), *, hf: bool = True, vocab: str | None = None
) -> dict[str, Path]:
    """Write `name-TYPE.gguf` for each type and, with hf, the folder `name-hf`. Returns paths by type
    ('hf' for the folder)."""
    from .writer import write_gguf, write_hf

    out_dir = Path(out_dir)
    cfg, tensors, v = build_test_model(name, vocab=vocab)
    paths = {}
    for t in types:
        paths[t] = write_gguf(
            out_dir / f"{name}-{t}.gguf", cfg, tensors, v.gguf_metadata, weight_type=t, name=f"shardwire-test-{name}"
        )[0]
    if hf:
        paths["hf"] = write_hf(
            out_dir / f"{name}-hf", cfg, tensors, tokenizer_json=v.tokenizer_json, tokenizer_config=v.tokenizer_config
        )
    return paths
