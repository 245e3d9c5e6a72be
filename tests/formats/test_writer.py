"""shardwire_kit.writer: GGUF files and Hugging Face folders as llama.cpp's converter and transformers
write them, read back by shardwire, by the gguf package and by transformers."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from shardwire.enums import CODEBOOK_TYPES
from shardwire.formats import TensorReader, open_model
from shardwire.formats.gguf import read_gguf
from shardwire.formats.safetensors import hf_name
from shardwire.pipeline.loading import undo_qk_interleave
from shardwire.weights import ggml_cpu
from shardwire_kit.synthetic import LLAMA3_SCALING, load_vocab, random_model
from shardwire_kit.writer import (
    GGUF_ARCH,
    PERMUTED_ARCHS,
    WEIGHT_TYPES,
    gguf_config,
    llama3_rope_factors,
    quantize,
    write_gguf,
    write_hf,
)

from paths import shared_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Relative RMS error (rms(error) / rms(weights)) each type stays under on Gaussian weights.
REL_TOLERANCE = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 8e-3,
    "Q8_0": 0.01,
    "Q6_K": 0.03,
    "Q5_K": 0.06,
    "Q5_1": 0.06,
    "Q5_0": 0.06,
    "Q4_K": 0.1,
    "Q4_1": 0.11,
    "Q4_0": 0.12,
    "Q3_K": 0.2,
    "Q2_K": 0.4,
}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LEGACY_QUANTS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# Width 256 so every matrix holds whole K-quant blocks; the tiny vocabulary keeps files small.
SMALL = {
    "llama": dict(arch="llama"),
    "llama3.1": dict(arch="llama", tied=True, rope_scaling=LLAMA3_SCALING),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2", tied=True),
    "qwen3": dict(arch="qwen3", head_dim=128, tied=True),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine run 40x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@lru_cache(maxsize=None)
def small(name: str):
    vocab = load_vocab("tiny")
    cfg, tensors = random_model(
        **SMALL[name],
        n_layers=2,
        dim=256,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=512,
        vocab_size=vocab.size,
        context_length=256,
    )
    return cfg, tensors, vocab


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory):
    """gguf_file(name, weight_type) -> path, each written once per session."""
    folder = tmp_path_factory.mktemp("gguf")
    written: dict[tuple[str, str], Path] = {}

    def get(name: str, weight_type: str) -> Path:
        if (name, weight_type) not in written:
            cfg, tensors, vocab = small(name)
            written[name, weight_type] = write_gguf(
                folder / f"{name}-{weight_type}.gguf", cfg, tensors, vocab.gguf_metadata, weight_type=weight_type
            )[0]
        return written[name, weight_type]

    return get


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            cfg, tensors, vocab = small(name)
            written[name] = write_hf(
                folder / name,
                cfg,
                tensors,
                tokenizer_json=vocab.tokenizer_json,
                tokenizer_config=vocab.tokenizer_config,
            )
        return written[name]

    return get


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want**2)))


def hf_order(name: str, w: np.ndarray, cfg) -> np.ndarray:
    """A GGUF tensor back in Hugging Face row order (undoing the converter's Q/K permutation)."""
    if cfg.arch in PERMUTED_ARCHS and ".attn_q." in name:
        return undo_qk_interleave(w, cfg.n_heads)
    if cfg.arch in PERMUTED_ARCHS and ".attn_k." in name:
        return undo_qk_interleave(w, cfg.n_kv_heads)
    return w


def stored_type(name: str, shape: tuple, weight_type: str) -> str:
    if len(shape) == 1:
        return "F32"
    block = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]][0]
    return weight_type if shape[-1] % block == 0 else "F16"


# --------------------------------------------------------------------------------------------
# Quantizers


def llama_cpp_total_error(weight_type: str) -> float:
    """test-quantize-fns.cpp's measure: data 0.1 + 2 cos(i), sqrt(sum of squared errors) / n."""
    data = (0.1 + 2 * np.cos(np.arange(32 * 128, dtype=np.float32)))[None]
    encoded, qtype = quantize(data, weight_type)
    return float(np.sqrt(np.sum((dequantize(encoded, qtype) - data) ** 2)) / data.size)


@pytest.mark.parametrize("weight_type", K_QUANTS + LEGACY_QUANTS)
def test_quantizers_meet_llama_cpp_error_limits(weight_type):
    # MAX_QUANTIZATION_TOTAL_ERROR{,_3BITS,_2BITS} of llama.cpp's tests/test-quantize-fns.cpp
    limit = {"Q2_K": 0.0075, "Q3_K": 0.0040}.get(weight_type, 0.002)
    assert llama_cpp_total_error(weight_type) < limit


@pytest.mark.parametrize("weight_type", K_QUANTS + LEGACY_QUANTS + ("F16", "BF16"))
def test_quantizers_round_trip_gaussian_weights(weight_type):
    w = np.random.default_rng(1).normal(0, 0.02, (64, 1024)).astype(np.float32)
    encoded, qtype = quantize(w, weight_type)
    assert qtype.name == weight_type
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert encoded.nbytes == w.size // block * type_size
    back = dequantize(encoded, qtype).reshape(w.shape)
    assert rel_error(back, w) < REL_TOLERANCE[weight_type]


@pytest.mark.parametrize("weight_type", K_QUANTS)
def test_k_quants_handle_awkward_blocks(weight_type):
    rows = np.zeros((6, 256), dtype=np.float32)
    rows[1] = 0.5  # constant
    rows[2] = -np.linspace(0.01, 3, 256)  # all negative
    rows[3, 17] = 40.0  # one outlier among zeros
    rows[4] = np.random.default_rng(2).normal(0, 1e-3, 256)  # small: sub-block scales are f16 subnormals
    rows[5] = np.random.default_rng(3).normal(0, 1, 256) * (np.arange(256) < 16)  # one busy sub-block
    back = dequantize(*quantize(rows, weight_type))
    tiny = np.random.default_rng(4).normal(0, 1e-7, (1, 256)).astype(np.float32)  # below f16's reach
    assert np.all(np.isfinite(dequantize(*quantize(tiny, weight_type))))
    assert np.all(np.isfinite(back))
    assert np.array_equal(back[0], rows[0])
    scale = np.abs(rows).max(axis=1, keepdims=True) + 1e-30
    worst = {"Q2_K": 0.4, "Q3_K": 0.3}.get(weight_type, 0.15)
    assert np.all(np.abs(back - rows) / scale < worst)
    assert abs(back[3, 17] - 40.0) < 40 * 0.05


def test_rows_that_are_not_whole_blocks_fall_back_to_f16():
    w = np.random.default_rng(0).normal(0, 0.02, (8, 341)).astype(np.float32)
    for weight_type in ("Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        encoded, qtype = quantize(w, weight_type)
        assert qtype == GGMLQuantizationType.F16
        assert np.array_equal(dequantize(encoded, qtype), w.astype(np.float16).astype(np.float32))
    assert quantize(w[:, :320], "Q4_K")[1] == GGMLQuantizationType.F16  # 320 = 10 x 32, not x 256
    assert quantize(w[:, :320], "Q4_0")[1] == GGMLQuantizationType.Q4_0


# --------------------------------------------------------------------------------------------
# GGUF


# the codebook types come from ggml's own quantizer: tests/weights/test_codebook_types.py reads them
ROUND_TRIPS = [("llama", t) for t in WEIGHT_TYPES if t not in CODEBOOK_TYPES] + [
    (name, t) for name in ("llama3.1", "mistral", "qwen2", "qwen3") for t in ("F32", "Q8_0", "Q4_K")
]


@pytest.mark.parametrize("name,weight_type", ROUND_TRIPS)
def test_gguf_round_trip(gguf_file, name, weight_type):
    cfg, tensors, vocab = small(name)
    path = gguf_file(name, weight_type)

    model = open_model(path)
    assert model.config == gguf_config(cfg)
    assert model.qk_interleaved == (cfg.arch in PERMUTED_ARCHS)

    reader = GGUFReader(path)
    meta = read_gguf(path).metadata
    arch = GGUF_ARCH[cfg.arch]
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.vocab_size"] == cfg.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert meta["general.quantization_version"] == 2
    assert (f"{arch}.attention.key_length" in meta) == (cfg.arch == "qwen3")
    assert {k: v for k, v in meta.items() if k.startswith("tokenizer.")} == vocab.gguf_metadata

    expected = {n for n in tensors if not (n == "output.weight" and cfg.tied_embeddings)}
    if cfg.rope_scaling:
        expected.add("rope_freqs.weight")
    stored = {t.name: t for t in reader.tensors}
    assert set(stored) == expected == set(model.tensors)
    for name_, t in stored.items():
        info = model.tensors[name_]
        assert info.dtype == t.tensor_type.name
        values = dequantize(t.data, t.tensor_type)
        if name_ == "rope_freqs.weight":
            assert t.tensor_type.name == "F32"
            assert np.array_equal(values, llama3_rope_factors(cfg))
            continue
        source = tensors[name_]
        assert info.shape == source.shape
        assert t.tensor_type.name == stored_type(name_, source.shape, weight_type)
        got = hf_order(name_, values.reshape(source.shape), cfg)
        assert rel_error(got, source) <= REL_TOLERANCE[t.tensor_type.name] + 1e-7, name_


def test_gguf_qk_rows_are_interleaved_like_the_converter(gguf_file):
    cfg, tensors, _ = small("llama")
    model = open_model(gguf_file("llama", "F32"))
    reader = TensorReader()
    q = reader.read(model.tensors["blk.0.attn_q.weight"]).view(np.float32).reshape(cfg.n_heads * cfg.head_dim, -1)
    source = tensors["blk.0.attn_q.weight"]
    half = cfg.head_dim // 2
    # Row 2i of each head holds HF row i, row 2i+1 holds HF row i + head_dim/2.
    for head in range(cfg.n_heads):
        base = head * cfg.head_dim
        assert np.array_equal(q[base + 0], source[base + 0])
        assert np.array_equal(q[base + 1], source[base + half])
        assert np.array_equal(q[base + 2 * 3 + 1], source[base + half + 3])
    reader.close()


def test_llama3_rope_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, _, _ = small("llama3.1")
    params = {
        "rope_type": "llama3",
        "rope_theta": cfg.rope_theta,
        **{k: v for k, v in LLAMA3_SCALING.items() if k != "type"},
    }
    config = LlamaConfig(
        hidden_size=cfg.dim,
        num_attention_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        rope_parameters=params,
        max_position_embeddings=cfg.context_length,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
    factors = llama3_rope_factors(cfg)
    assert factors.min() == 1.0 and factors.max() == 8.0  # the test model uses all three regimes
    np.testing.assert_allclose(plain / factors, scaled.numpy(), rtol=1e-5)


def test_type_for_chooses_per_tensor(tmp_path):
    cfg, tensors, vocab = small("llama")
    mix = {"output.weight": "Q6_K", "token_embd.weight": "Q8_0"}
    path = write_gguf(
        tmp_path / "mix.gguf",
        cfg,
        tensors,
        vocab.gguf_metadata,
        weight_type="Q4_K",
        type_for=lambda n, shape: mix.get(n, "Q4_K"),
    )[0]
    types = {n: t.dtype for n, t in open_model(path).tensors.items()}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_norm.weight"] == "F32"
    assert read_gguf(path).metadata["general.file_type"] == 14  # MOSTLY_Q4_K_S
    with pytest.raises(ValueError, match="unsupported weight type"):
        write_gguf(tmp_path / "bad.gguf", cfg, tensors, {}, weight_type="Q4_K", type_for=lambda n, shape: "TQ1_0")


def test_narrow_rows_fall_back_to_f16_in_files(tmp_path):
    vocab = load_vocab("tiny")
    cfg, tensors = random_model("llama", dim=128, ffn_dim=341, vocab_size=vocab.size)  # glassllm's shapes
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, vocab.gguf_metadata, weight_type="Q4_K")[0]
    types = {n: t.dtype for n, t in open_model(path).tensors.items()}
    assert {types[n] for n in types if n.endswith(".weight") and tensors[n].ndim == 2} == {"F16"}
    path = write_gguf(tmp_path / "m0.gguf", cfg, tensors, vocab.gguf_metadata, weight_type="Q4_0")[0]
    types = {n: t.dtype for n, t in open_model(path).tensors.items()}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q4_0"
    if ggml_cpu.available():  # the codebook types come from ggml's quantizer; their 256-value rows do not fit
        path = write_gguf(tmp_path / "iq.gguf", cfg, tensors, vocab.gguf_metadata, weight_type="IQ4_XS")[0]
        types = {n: t.dtype for n, t in open_model(path).tensors.items()}
        assert {types[n] for n in types if n.endswith(".weight") and tensors[n].ndim == 2} == {"F16"}


def test_split_gguf_round_trips(tmp_path, gguf_file):
    cfg, tensors, vocab = small("llama")
    parts = write_gguf(
        tmp_path / "split.gguf", cfg, tensors, vocab.gguf_metadata, weight_type="Q8_0", split_max_tensors=8
    )
    n = len(tensors)
    count = -(-n // 8)
    assert [p.name for p in parts] == [f"split-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    assert sorted(os.listdir(tmp_path)) == [p.name for p in parts]  # no scratch left behind

    whole = open_model(gguf_file("llama", "Q8_0"))
    for start in (parts[0], parts[-1]):
        model = open_model(start)
        assert model.config == gguf_config(cfg)
        assert set(model.tensors) == set(whole.tensors)
    reader = TensorReader()
    for name, info in open_model(parts[0]).tensors.items():
        assert np.array_equal(reader.read(info), reader.read(whole.tensors[name])), name
    reader.close()

    for i, part in enumerate(parts):
        meta = read_gguf(part).metadata
        assert (meta["split.no"], meta["split.count"], meta["split.tensors.count"]) == (i, count, n)
        assert ("llama.block_count" in meta) == (i == 0)  # like gguf-split: metadata in the first part
        assert len(GGUFReader(part).tensors) == min(8, n - 8 * i)


# --------------------------------------------------------------------------------------------
# Hugging Face folders and transformers


def load_hf(folder, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("name", list(SMALL))
def test_transformers_loads_hf_folder(hf_folder, name):
    cfg, tensors, vocab = small(name)
    folder = hf_folder(name)
    assert open_model(folder).config == cfg

    model = load_hf(folder)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for canonical, w in tensors.items():
        assert np.array_equal(state[hf_name(canonical, cfg.arch)], w), canonical
    if cfg.tied_embeddings:
        assert np.array_equal(state["lm_head.weight"], tensors["token_embd.weight"])
    c = model.config
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert (c.model_type, c.hidden_size, c.num_key_value_heads, c.intermediate_size) == (
        cfg.arch,
        cfg.dim,
        cfg.n_kv_heads,
        cfg.ffn_dim,
    )
    assert getattr(c, "head_dim", cfg.head_dim) == cfg.head_dim
    assert c.rope_parameters["rope_theta"] == cfg.rope_theta
    assert c.rope_parameters["rope_type"] == ("llama3" if cfg.rope_scaling else "default")
    assert c.bos_token_id == vocab.gguf_metadata["tokenizer.ggml.bos_token_id"]
    out = logits(model, [1, 2, 3, 4])
    assert np.all(np.isfinite(out)) and out.std() > 1  # logits with a real spread


@pytest.mark.parametrize("name,weight_type", [(n, "F32") for n in SMALL] + [("llama", "Q8_0"), ("qwen3", "Q4_K")])
def test_transformers_loads_gguf(gguf_file, hf_folder, name, weight_type):
    cfg, tensors, _ = small(name)
    path = gguf_file(name, weight_type)
    model = load_hf(path.parent, gguf_file=path.name)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = {
        t.name: hf_order(t.name, dequantize(t.data, t.tensor_type).reshape(tensors[t.name].shape), cfg)
        for t in GGUFReader(path).tensors
        if t.name in tensors
    }
    for canonical, w in ours.items():
        assert np.array_equal(state[hf_name(canonical, cfg.arch)], w), canonical
        if weight_type == "F32":
            assert np.array_equal(w, tensors[canonical])
    if weight_type == "F32" and not cfg.rope_scaling:  # transformers ignores rope_freqs.weight
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        np.testing.assert_allclose(logits(model, ids), logits(load_hf(hf_folder(name)), ids), atol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_write_hf_sharded_and_half_precision(tmp_path, dtype):
    import torch

    cfg, tensors, vocab = small("qwen2")
    folder = write_hf(tmp_path / "m", cfg, tensors, dtype=dtype, shard_max_tensors=10)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    count = -(-len(tensors) // 10)
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert set(index["weight_map"]) == {hf_name(n, cfg.arch) for n in tensors}
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype
    assert set(open_model(folder).tensors) == set(tensors)

    state = load_hf(folder).state_dict()
    torch_dtype = getattr(torch, dtype)
    for canonical, w in tensors.items():
        assert torch.equal(state[hf_name(canonical, cfg.arch)], torch.from_numpy(w).to(torch_dtype).float()), canonical


# --------------------------------------------------------------------------------------------
# Vocabularies and the shared test models


@pytest.mark.parametrize("vocab", ["llama-spm", "llama-bpe", "qwen2"])
def test_vocab_tokenizer_json_tokenizes_like_llama_cpp(vocab):
    from tokenizers import Tokenizer

    texts = shared_path("vocab", f"ggml-vocab-{vocab}.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = shared_path("vocab", f"ggml-vocab-{vocab}.gguf.out").read_text().split("\n")
    tok = Tokenizer.from_str(load_vocab(vocab).tokenizer_json)
    for text, line in zip(texts, expected):
        assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in line.split()], repr(text)


def test_tiny_vocab_tokenizer_round_trips_text():
    from tokenizers import Tokenizer

    vocab = load_vocab("tiny")
    tok = Tokenizer.from_str(vocab.tokenizer_json)
    text = "The clockmaker's 12 gears\n\tturn: ¿qué? 時計 🕰️"
    assert tok.decode(tok.encode(text).ids) == text
    tokens = vocab.gguf_metadata["tokenizer.ggml.tokens"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert (ids[0], ids[-1]) == (tokens.index("<|im_start|>"), tokens.index("<|im_end|>"))


def test_shared_test_models_are_readable():
    from tokenizers import Tokenizer

    from models import hf_path, model_path, model_source

    cfg, tensors, vocab = model_source("mistral")
    gguf = open_model(model_path("mistral", "Q4_0"))
    assert gguf.config == gguf_config(cfg) and gguf.config.arch == "llama"
    assert gguf.tensors["blk.0.attn_q.weight"].dtype == "Q4_0"
    assert model_path("mistral", "Q4_0").stat().st_mtime == model_path("mistral", "Q4_0").stat().st_mtime
    folder = hf_path("mistral")
    assert open_model(folder).config == cfg
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if vocab.name == "llama-spm":  # else ../shared is absent and the built-in vocabulary stands in
        assert tok.encode("Hello world").ids == [1, 15043, 3186]  # Llama 2's vocabulary, BOS added
