"""Gemma 3, the family added as one module (shardwire/models/gemma3.py): a tiny random model from
transformers' config class, its folder as transformers saves it and the GGUF llama.cpp's own
converter writes from that folder, against transformers float32; in one process and on 2
workers. ggml's graphs implement none of its block variants (GELU-tanh, post-norms, a sliding
window with local RoPE): they refuse every block, say so, and the modules compute it."""

import logging
from functools import lru_cache
from pathlib import Path

import pytest

from shardwire.backends import ggml as ggml_backend
from shardwire.formats import open_model
from shardwire.models import BlockVariant
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu

from models import converted_checkpoint, transformers_greedy
from parity import BACKENDS, greedy_tokens, our_logits
from runs import assert_same, distributed, single_process

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("shardwire_kit.convert")

PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 632, 373]  # past the 4-key window


def gemma3(form: str, softcap: float = 0.0) -> Path:
    """The tiny Gemma 3's folder ("hf") or the converter's float32 GGUF of it ("gguf"), with the
    full-attention blocks' RoPE scaled (as Gemma 3 4B-27B ship) and logits soft-capped where
    `softcap`."""
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full}

    def make(folder):
        convert.tiny_gemma3(folder, layers=7, rope_parameters=rope, final_logit_softcapping=softcap or None)

    return converted_checkpoint(f"gemma3{'-cap' if softcap else ''}", make, form)


@lru_cache(maxsize=None)
def reference(softcap: float = 0.0):
    return transformers_greedy(gemma3("hf", softcap), PROMPT)


@pytest.mark.parametrize("backend", BACKENDS)  # the parity matrix of test_model.py, Gemma 3's row
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(form, softcap, backend):
    ref_logits, ref_tokens = reference(softcap)
    path = gemma3(form, softcap)
    ours = our_logits(path, PROMPT, backend)
    spread = float(ref_logits.max() - ref_logits.min())
    assert float((ours - ref_logits).abs().max()) <= 1e-4 * spread
    assert greedy_tokens(path, PROMPT, 16, backend) == ref_tokens


def test_the_gguf_and_the_folder_read_as_one_model():
    gguf, hf = open_model(gemma3("gguf")), open_model(gemma3("hf"))
    assert gguf.config.arch == hf.config.arch == "gemma3"
    assert gguf.config.sliding_blocks == hf.config.sliding_blocks == (0, 1, 2, 3, 4, 6)
    assert gguf.config.rope_scaling == hf.config.rope_scaling == {"type": "linear", "factor": 8.0}
    assert {n: t.shape for n, t in gguf.tensors.items()} == {n: t.shape for n, t in hf.tensors.items()}


def test_ggml_refuses_every_block_says_so_and_the_modules_compute_it(caplog):
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    model = open_model(gemma3("gguf"))
    with caplog.at_level(logging.INFO, logger="shardwire.ggml"):
        stage = load_stage(model, 0, model.config.n_layers)
    assert stage.runner is None and all(block.runner is None and block.feed_runner is None for block in stage.blocks)
    said = [r.getMessage() for r in caplog.records]
    assert any("blocks 0-4, 6" in line and "local_rope=True" in line and "gelu_tanh" in line for line in said), said
    assert any(line.startswith("blocks 5 (") and "post_norms=True" in line for line in said), said


def test_a_variant_the_graphs_do_not_implement_is_refused_a_known_one_taken():
    assert ggml_backend.refusal(BlockVariant()) is None
    assert ggml_backend.refusal(BlockVariant(mixer="gated_delta_net", ffn="experts", routing="softmax_top_k")) is None
    assert "activation='gelu_tanh'" in ggml_backend.refusal(BlockVariant(activation="gelu_tanh"))
    assert ggml_backend.refusal(BlockVariant(window=128, sinks=True)) is None  # gpt-oss's sliding blocks
    assert "local_rope=True" in ggml_backend.refusal(BlockVariant(window=128, local_rope=True))
    assert "query_scale=0.1" in ggml_backend.refusal(BlockVariant(query_scale=0.1))


@pytest.mark.slow
def test_two_workers_give_the_single_process_tokens(worker_pool, tmp_path):
    path = gemma3("gguf")
    workers = worker_pool(2)
    got, plan, _ = distributed(
        path, [w.address for w in workers], tmp_path / "coord", tensor_split=[3, 4], prompt=PROMPT
    )
    assert [(s.start, s.end) for s in plan.stages] == [(0, 3), (3, 7)]
    assert_same(single_process(path, prompt=PROMPT), got)
