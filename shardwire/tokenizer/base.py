"""The tokenizer interface: Tokenizer (encode, decode, chat template), StreamDecoder, TokenizerError, and
load_tokenizer, which picks the implementation for a model file."""

from __future__ import annotations

from ..serving.chat import render_chat
from .pretokenize import clean_spaces


class TokenizerError(ValueError):
    pass


class StreamDecoder:
    """Decodes ids one at a time. Each feed() returns only complete UTF-8 text; the concatenation of
    every feed() and the final flush() equals Tokenizer.decode(ids) for the same ids. Special tokens
    in `kept` show their text even where special tokens are skipped (llama-server's preserved
    tokens: the marks a reply's reasoning and tool calls are read apart by)."""

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = True, kept: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._kept = kept
        self._pending = ""

    def feed(self, id: int) -> str:
        return self._release(self._text(id))

    def flush(self) -> str:
        text, self._pending = self._pending + self._text_end(), ""
        return self._clean(text)

    # A clean-up pattern starts with a space and is at most 4 characters long, so text is released
    # only up to a point with no space in the 3 characters before it.
    def _release(self, text: str) -> str:
        if not self._tok.cleans_spaces:
            return text
        pending = self._pending + text
        cut = len(pending)
        while (space := pending.rfind(" ", max(0, cut - 3), cut)) >= 0:
            cut = space
        self._pending = pending[cut:]
        return self._clean(pending[:cut])

    def _clean(self, text: str) -> str:
        return clean_spaces(text) if self._tok.cleans_spaces else text

    def _text(self, id: int) -> str:
        raise NotImplementedError

    def _text_end(self) -> str:
        return ""


class Tokenizer:
    """Text <-> token ids for one model. Build with from_gguf_metadata / from_hf_folder / load_tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    stop_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    cleans_spaces = False

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """add_special: add BOS/EOS as add_bos/add_eos say. parse_special: text like "<|im_start|>"
        becomes that control token (needed for a rendered chat template) instead of plain text."""
        ids = self._encode(text, parse_special)
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        raise NotImplementedError

    def token_text(self, id: int) -> str:
        """The piece as it would print (control tokens included)."""
        raise NotImplementedError

    def stream_decoder(
        self, skip_special: bool = True, after: list[int] | None = None, kept: frozenset[int] = frozenset()
    ) -> StreamDecoder:
        """A decoder for ids that continue `after` (a prompt; default: none, the ids start the
        text): what they add to it, so a continuation's first piece keeps the space SentencePiece
        puts before a word, as llama-server prints generated tokens; the special tokens in `kept`
        show as text."""
        raise NotImplementedError

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        raise NotImplementedError

    @property
    def bos_token(self) -> str:
        return "" if self.bos_id is None else self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        return "" if self.eos_id is None else self.token_text(self.eos_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render messages with the model's template (ChatML when it has none); encode the result
        with add_special=False, parse_special=True."""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} out of range for a vocabulary of {self.vocab_size}")
        return ids
