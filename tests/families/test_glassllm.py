"""shardwire_kit.glassllm: the trained glassllm model, converted by our code, must continue text exactly
as glassllm does, and its tokenizer must give glassllm's ids."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("glassllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gguf import GGUFReader  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from shardwire.formats import open_model  # noqa: E402
from shardwire.formats.gguf import read_gguf  # noqa: E402
from shardwire.pipeline.loading import undo_qk_interleave  # noqa: E402
from shardwire.weights.cache import default_cache_dir  # noqa: E402
from shardwire_kit import glassllm as gl  # noqa: E402

PROMPTS = [
    "Alice was beginning to get very tired",
    "“Curiouser and curiouser!” cried Alice (she was so much surprised).\n\nThe",
    "“Who are you?” said the Caterpillar.",
]
PARAGRAPH = (
    "Down, down, down. Would the fall never come to an end? “I wonder how many miles I’ve fallen by "
    "this time?” she said aloud.  Two  spaces,\ttabs,\r\nCRLF, trailing space \n\n"
    "Outside the alphabet: é (NFC), e\u0301 (NFD), ÆSOP, naïve café, 漢字, emoji 🐇, <bos> and <unk> "
    "as plain text, 42 + 7 = 49; [brackets] {braces} & *stars* _under_ — dashes ‘quotes’."
)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine run 40x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def glass():
    return gl.load("en")


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glassllm")
    return gl.convert_glassllm(folder / "hf", "hf"), gl.convert_glassllm(folder / "glassllm-en.gguf", "gguf")


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with full recomputation: independent of any cache and of EOS."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def load_hf(folder, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def glass_greedy(glass, ids, n):
    model, _ = glass
    return [step.token for step in model.generate(ids, n, greedy=True)]


def test_config(converted, glass):
    hf, gguf = converted
    cfg = gl.model_config(glass[0])
    assert (cfg.arch, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (
        "llama",
        4,
        128,
        4,
        2,
        32,
        341,
    )
    assert (cfg.vocab_size, cfg.norm_eps, cfg.rope_theta, cfg.context_length, cfg.tied_embeddings) == (
        1024,
        1e-6,
        10000.0,
        128,
        True,
    )
    assert open_model(hf).config == cfg
    g = open_model(gguf).config
    assert g.to_dict() == {**cfg.to_dict(), "norm_eps": float(np.float32(1e-6))}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_transformers_continues_like_glassllm(converted, glass, prompt):
    hf, _ = converted
    ids = glass[1].encode(prompt)
    n = 48
    assert len(ids) + n <= 128
    expected = glass_greedy(glass, ids, n)
    assert greedy(load_hf(hf), ids, n) == expected


def test_transformers_runs_the_gguf_like_glassllm(converted, glass):
    _, gguf = converted
    ids = glass[1].encode(PROMPTS[0])
    assert greedy(load_hf(gguf.parent, gguf_file=gguf.name), ids, 32) == glass_greedy(glass, ids, 32)


@pytest.mark.parametrize("text", PROMPTS + [PARAGRAPH])
def test_tokenizer_json_encodes_and_decodes_like_glassllm(converted, glass, text):
    from tokenizers import Tokenizer

    _, tok = glass
    hf = Tokenizer.from_file(str(converted[0] / "tokenizer.json"))
    ids = tok.encode(text)
    assert hf.encode(text).ids == ids
    assert hf.decode(ids) == tok.decode(ids)
    assert tok.unk_id in ids or text != PARAGRAPH
    with_specials = [tok.token_to_id["<bos>"], *ids, tok.token_to_id["<eos>"], tok.token_to_id["<pad>"]]
    assert hf.decode(with_specials) == tok.decode(with_specials)


def test_transformers_tokenizer_adds_nothing(converted, glass):
    from transformers import AutoTokenizer

    _, tok = glass
    hf = AutoTokenizer.from_pretrained(converted[0])
    ids = tok.encode(PARAGRAPH)
    assert hf.encode(PARAGRAPH) == ids
    assert hf.decode([2, *ids, 3]) == tok.decode(ids)
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id) == (2, 3, 1, 0)


def test_gguf_holds_the_hf_weights(converted):
    from safetensors.numpy import load_file

    from shardwire.formats.safetensors import hf_name

    hf, gguf = converted
    cfg = open_model(gguf).config
    stored = load_file(hf / "model.safetensors")
    tensors = GGUFReader(gguf).tensors
    assert {t.name for t in tensors} == {n for n in open_model(hf).tensors}
    for t in tensors:
        w = dequantize(t.data, t.tensor_type).reshape(stored[hf_name(t.name, "llama")].shape)
        if ".attn_q." in t.name:
            w = undo_qk_interleave(w, cfg.n_heads)
        elif ".attn_k." in t.name:
            w = undo_qk_interleave(w, cfg.n_kv_heads)
        assert np.array_equal(w, stored[hf_name(t.name, "llama")].astype(np.float32)), t.name
        assert t.tensor_type.name == ("F32" if w.ndim == 1 else "F16")


def test_gguf_tokenizer_metadata(converted, glass):
    _, tok = glass
    meta = read_gguf(converted[1]).metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"] == tok.vocab
    assert meta["tokenizer.ggml.token_type"][:5] == [3, 2, 3, 3, 1]
    scores = meta["tokenizer.ggml.scores"]
    n_plain = len(tok.vocab) - len(tok.merges)
    assert scores[n_plain:] == [-float(r) for r in range(len(tok.merges))]
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (2, 3)
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.huggingface.json"] == (converted[0] / "tokenizer.json").read_text(encoding="utf-8")


def test_cached_gguf_is_converted_once(tmp_path, monkeypatch):
    path = gl.cached_glassllm_gguf(tmp_path)
    assert path.parent == tmp_path and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert gl.cached_glassllm_gguf(tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no scratch left behind

    monkeypatch.delenv("SHARDWIRE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "shardwire"
    monkeypatch.setenv("SHARDWIRE_CACHE", str(tmp_path / "sw"))
    assert default_cache_dir() == tmp_path / "sw"
    assert gl.cached_glassllm_gguf().parent == tmp_path / "sw" / "models"


def shardwire_greedy(path, text: str, n: int) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy continuation through shardwire's own tokenizer, stage and engine."""
    from shardwire.engine import Engine, Request
    from shardwire.pipeline import LocalPipeline
    from shardwire.pipeline.loading import load_stage
    from shardwire.sampling import GREEDY
    from shardwire.tokenizer import load_tokenizer

    model = open_model(path)
    ids = load_tokenizer(model).encode(text)
    engine = Engine(LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=1, ctx=128))
    try:
        handle = engine.submit(Request(ids, GREEDY, max_tokens=n, ignore_eos=True))
        handle.result()
        return ids, handle.tokens
    finally:
        engine.close()


@pytest.mark.parametrize("form", ["gguf", "hf"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_shardwire_continues_like_glassllm(converted, glass, form, prompt):
    path = converted[1] if form == "gguf" else converted[0]
    ids, tokens = shardwire_greedy(path, prompt, 40)
    assert ids == glass[1].encode(prompt)
    assert tokens == glass_greedy(glass, ids, 40)
