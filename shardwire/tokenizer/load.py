"""A model's tokenizer: its GGUF's vocabulary (llama.cpp's algorithms, or the tokenizer.json it
carries), or its Hugging Face folder's tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from .base import Tokenizer, TokenizerError
from .hf import HFTokenizer
from .llamacpp import LlamaCppTokenizer


def tokenizer_from_gguf(metadata: dict) -> Tokenizer:
    if "tokenizer.huggingface.json" in metadata:
        return HFTokenizer.from_gguf_metadata(metadata)
    return LlamaCppTokenizer(metadata)


def tokenizer_from_hf_folder(folder) -> Tokenizer:
    return HFTokenizer.from_folder(Path(folder))


def load_tokenizer(model) -> Tokenizer:
    """The tokenizer of a shardwire.formats.ModelFile."""
    if model.format == "gguf":
        return tokenizer_from_gguf(model.metadata)
    if model.format == "hf":
        return tokenizer_from_hf_folder(model.path)
    raise TokenizerError(f"{model.path}: no tokenizer for model format {model.format!r}")
