"""Synthetic test models, built on first use and reused for the rest of the test session.

    from models import model_path, hf_path, model_source   # tests/support/ is on sys.path (pyproject)

    model_path("qwen2", "Q8_0")   # GGUF file
    hf_path("qwen3")              # Hugging Face folder (safetensors, config.json, tokenizer.json)
    model_source("llama")         # (ModelConfig, float32 tensors in HF order, Vocab)

Names: llama, llama3.1, mistral, qwen2, qwen3 (shardwire_kit.synthetic.TEST_MODELS); each uses the
vocabulary its real models use, from ../shared/vocab (a small built-in BPE where that is absent).
Files go to a temporary folder removed at exit, or to $SHARDWIRE_TEST_MODELS when set, where
they are kept and reused across sessions (in a subfolder named after the generating code).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from shardwire_kit import synthetic, writer
from shardwire_kit.synthetic import TEST_MODELS, build_test_model

NAMES = tuple(TEST_MODELS)
# Token ids valid in every test vocabulary (each has at least 512 tokens).
PROMPT = [5, 17, 300, 42, 7, 100, 3, 99, 123, 456, 8, 250, 11, 19, 204, 77]
_lock = threading.RLock()


@lru_cache(maxsize=None)
def models_dir() -> Path:
    persistent = os.environ.get("SHARDWIRE_TEST_MODELS")
    if persistent:
        code = b"".join(Path(m.__file__).read_bytes() for m in (synthetic, writer))
        folder = Path(persistent) / hashlib.sha256(code).hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    folder = Path(tempfile.mkdtemp(prefix="shardwire-test-models-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@lru_cache(maxsize=None)
def model_source(name: str):
    """(config, tensors, vocab) the files of `name` are written from."""
    return build_test_model(name)


def model_path(name: str, weight_type: str = "F32") -> Path:
    path = models_dir() / f"{name}-{weight_type}.gguf"
    with _lock:
        if not path.exists():
            cfg, tensors, vocab = model_source(name)
            writer.write_gguf(
                path, cfg, tensors, vocab.gguf_metadata, weight_type=weight_type, name=f"shardwire-test-{name}"
            )
    return path


def hf_path(name: str) -> Path:
    folder = models_dir() / f"{name}-hf"
    with _lock:
        if not (folder / "config.json").exists():
            cfg, tensors, vocab = model_source(name)
            writer.write_hf(
                folder, cfg, tensors, tokenizer_json=vocab.tokenizer_json, tokenizer_config=vocab.tokenizer_config
            )
    return folder


def llama_cpp_logits(path: Path, prompt: list[int]):
    """llama.cpp's logits at every position of `prompt` for the file at `path` ([len, vocab]
    float32), where benchmarks/build_llama_cpp.sh built it; else the calling test is skipped."""

    import pytest
    import torch

    numerics = pytest.importorskip("benchmarks.numerics_llamacpp")
    if reason := numerics.unavailable():
        pytest.skip(reason)
    with numerics.LlamaCpp(path, n_ctx=128, threads=1) as llama:
        return torch.tensor(llama.prompt_logits(prompt))


def converted_checkpoint(name: str, make, form: str) -> Path:
    """A tiny transformers checkpoint, `make(folder)` saving it, as its folder ("hf") or the float32
    GGUF llama.cpp's own converter writes from that folder ("gguf"); made once per session."""
    from shardwire_kit.convert import convert

    folder = models_dir() / f"{name}-hf"
    with _lock:
        if not (folder / "config.json").is_file():
            make(folder)
        if form == "hf":
            return folder
        path = folder.with_suffix(".gguf")
        if not path.is_file():
            convert(folder, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
    return path


def transformers_greedy(folder: Path, prompt: list[int], steps: int = 16):
    """transformers' float32 logits at every position of `prompt` and its next `steps` greedy tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
        generated = list(prompt)
        for _ in range(steps):
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
    return logits, generated[len(prompt) :]
