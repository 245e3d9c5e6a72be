"""Reading model files: real llama.cpp output, lazy per-layer reads, and clear errors on bad input."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardwire.config import ConfigError
from shardwire.formats import TensorReader, open_model
from shardwire.formats.gguf import GGUFError
from shardwire.pipeline.loading import load_stage
from shardwire.tokenizer import load_tokenizer
from shardwire_kit.writer import write_gguf

from models import hf_path, model_path, model_source
from paths import shared_path


def test_llama_cpp_written_gguf_loads_tokenizes_and_runs():
    path = shared_path("models", "llama-2-tiny-random.gguf")
    model = open_model(path)
    assert (model.config.arch, model.config.n_layers, model.config.dim) == ("llama", 1, 8)
    tok = load_tokenizer(model)
    ids = tok.encode("Hello world")
    assert ids == [1, 15043, 3186]  # llama.cpp: BOS, "▁Hello", "▁world"
    stage = load_stage(model, 0, 1)
    stage.allocate_cache(1, 16)
    logits = stage(torch.tensor([ids]), [0], [0])
    assert logits.shape == (1, 1, 32000) and torch.isfinite(logits).all()


def test_loading_a_layer_range_reads_only_its_tensors():
    model = open_model(model_path("llama", "Q8_0"))
    reader = TensorReader()
    load_stage(model, 1, 3, reader=reader)
    expected = sum(t.nbytes for n, t in model.tensors.items() if n.startswith(("blk.1.", "blk.2.")))
    assert reader.bytes_read == expected
    everything = sum(t.nbytes for t in model.tensors.values())
    assert reader.bytes_read < everything / 2


def test_sharded_safetensors_folder(tmp_path):
    from shardwire_kit.writer import write_hf

    cfg, tensors, vocab = model_source("qwen2")
    write_hf(tmp_path, cfg, tensors, tokenizer_json=vocab.tokenizer_json, shard_max_tensors=7)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, single = open_model(tmp_path), open_model(hf_path("qwen2"))
    assert sharded.config == single.config and set(sharded.tensors) == set(single.tensors)
    reader = TensorReader()
    for name in single.tensors:
        assert np.array_equal(reader.read(sharded.tensors[name]), reader.read(single.tensors[name]))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "shardwire", *args], capture_output=True, text=True, timeout=120)


def one_line_error(result, *needles):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_truncated_gguf(tmp_path):
    src = model_path("llama", "F16")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(GGUFError, match="truncated GGUF"):
        open_model(bad)
    one_line_error(run_cli("generate", str(bad), "-p", "hi"), "cut.gguf", "truncated", "blk.")
    header_only = tmp_path / "head.gguf"
    header_only.write_bytes(src.read_bytes()[:1000])
    with pytest.raises(GGUFError, match="truncated GGUF"):
        open_model(header_only)


def test_unsupported_architecture(tmp_path):
    cfg, tensors, vocab = model_source("llama")
    path = tmp_path / "gpt.gguf"
    write_gguf(path, cfg, tensors, vocab.gguf_metadata)
    data = path.read_bytes().replace(
        b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
        b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00falcn",
        1,
    )
    path.write_bytes(data)
    with pytest.raises(ConfigError, match="unsupported architecture 'falcn'"):
        open_model(path)
    one_line_error(run_cli("generate", str(path), "-p", "hi"), "gpt.gguf", "unsupported architecture 'falcn'")


def test_folder_without_config(tmp_path):
    shutil.copytree(hf_path("qwen3"), tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        open_model(tmp_path / "m")
    one_line_error(run_cli("generate", str(tmp_path / "m"), "-p", "hi"), "config.json")


def test_config_missing_key_is_named(tmp_path):
    shutil.copytree(hf_path("qwen3"), tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["num_attention_heads"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing required key 'num_attention_heads'"):
        open_model(tmp_path / "m")


def test_tensor_with_wrong_shape(tmp_path):
    cfg, tensors, vocab = model_source("mistral")
    tensors = dict(tensors)
    tensors["blk.2.ffn_up.weight"] = tensors["blk.2.ffn_up.weight"][:-1]
    path = tmp_path / "shape.gguf"
    write_gguf(path, cfg, tensors, vocab.gguf_metadata)
    with pytest.raises(ConfigError, match=r"shape.gguf: tensor 'blk.2.ffn_up.weight' has shape \[\d+, 64\], expected"):
        open_model(path)
    one_line_error(run_cli("generate", str(path), "-p", "hi"), "blk.2.ffn_up.weight", "shape")


def test_missing_file():
    one_line_error(run_cli("generate", "/nonexistent/model.gguf", "-p", "hi"), "/nonexistent/model.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_model(path)
