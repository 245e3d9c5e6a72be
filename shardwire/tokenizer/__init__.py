"""Tokenizers: GGUF-embedded vocabularies, token-for-token as llama.cpp, and Hugging Face tokenizer.json.

A GGUF vocabulary of type "llama" (SentencePiece) or "gpt2" (byte-level BPE) is tokenized by a Python
port of llama.cpp's algorithms (src/llama-vocab.cpp, src/unicode.cpp): same special-token partition, same
pre-tokenizer splits, same merge order, same byte fallback, same detokenizer clean-up. Anything carrying
a whole tokenizer.json (a Hugging Face folder, or GGUF metadata with `tokenizer.huggingface.json`) goes
through the `tokenizers` library instead.
"""

from .base import StreamDecoder, Tokenizer, TokenizerError
from .load import load_tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "tokenizer_from_hf_folder",
]
