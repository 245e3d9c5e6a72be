"""Tokenizers that carry a whole tokenizer.json (a Hugging Face folder, or GGUF metadata with
tokenizer.huggingface.json), run through the `tokenizers` library, and their windowed stream decoder."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .base import StreamDecoder, Tokenizer, TokenizerError
from .llamacpp import EOG_TEXTS, ID_KEYS


class HFTokenizer(Tokenizer):
    def __init__(self, hf, *, bos_id, eos_id, add_bos, add_eos, chat_template, stop_ids=()):
        self._hf = hf
        self._hf_plain = None
        self.vocab_size = n = hf.get_vocab_size(with_added_tokens=True)
        bos_id, eos_id = (i if isinstance(i, int) and 0 <= i < n else None for i in (bos_id, eos_id))
        bos_pre, eos_post = _post_processor_tokens(hf)
        self.bos_id = bos_id if bos_id is not None else bos_pre
        self.eos_id = eos_id if eos_id is not None else eos_post
        self.add_bos = add_bos if add_bos is not None else bos_pre is not None and bos_pre == self.bos_id
        self.add_eos = add_eos if add_eos is not None else eos_post is not None and eos_post == self.eos_id
        self.chat_template = chat_template
        eog = {hf.token_to_id(t) for t in EOG_TEXTS} | set(stop_ids) | {self.eos_id}
        self.stop_ids = frozenset(i for i in eog if isinstance(i, int) and 0 <= i < n)

    @classmethod
    def from_folder(cls, folder: Path) -> "HFTokenizer":
        import tokenizers

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: cannot load ({e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif template is None:
            template = _read_json(folder / "chat_template.json").get("chat_template")

        def token_id(key):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return hf.token_to_id(value) if isinstance(value, str) else None

        stop_ids = set()
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(folder / name).get("eos_token_id")
            stop_ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        return cls(
            hf,
            bos_id=token_id("bos_token"),
            eos_id=token_id("eos_token"),
            add_bos=config.get("add_bos_token"),
            add_eos=config.get("add_eos_token"),
            chat_template=template,
            stop_ids=stop_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "HFTokenizer":
        import tokenizers

        try:
            hf = tokenizers.Tokenizer.from_str(md["tokenizer.huggingface.json"])
        except Exception as e:
            raise TokenizerError(f"tokenizer.huggingface.json cannot be loaded ({e})") from None
        ids = {name: md.get(key) for name, key in ID_KEYS.items()}
        return cls(
            hf,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            add_bos=md.get("tokenizer.ggml.add_bos_token"),
            add_eos=md.get("tokenizer.ggml.add_eos_token"),
            chat_template=md.get("tokenizer.chat_template"),
            stop_ids=[ids[k] for k in ("eot", "eom") if ids[k] is not None],
        )

    @property
    def tokenizer_json(self) -> str:
        return self._hf.to_str()

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        hf = self._hf if parse_special else self._plain()
        return hf.encode(text, add_special_tokens=False).ids

    def _plain(self):
        """A twin that reads special-token texts as plain text (non-special added tokens still split,
        like llama.cpp's user-defined tokens)."""
        if self._hf_plain is None:
            import tokenizers

            plain = tokenizers.Tokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._hf_plain = plain
        return self._hf_plain

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._hf.decode(self.check_ids(ids), skip_special_tokens=skip_special)

    def token_text(self, id: int) -> str:
        return self._hf.decode(self.check_ids([id]), skip_special_tokens=False)

    def token_name(self, id: int) -> str:
        """The token as the vocabulary spells it ("<pad>", "▁the"), not as it decodes."""
        return self._hf.id_to_token(self.check_ids([id])[0])

    def stream_decoder(
        self, skip_special: bool = True, after: list[int] | None = None, kept: frozenset[int] = frozenset()
    ) -> StreamDecoder:
        return _WindowStreamDecoder(self, skip_special, after or [], kept)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids decoding skips with skip_special_tokens."""
        return frozenset(i for i, t in self._hf.get_added_tokens_decoder().items() if t.special)


class _WindowStreamDecoder(StreamDecoder):
    """Decodes a short window of recent ids and emits what the newest id added, once it no longer ends
    in an incomplete character (the approach of text-generation-inference)."""

    def __init__(self, tokenizer: HFTokenizer, skip_special: bool, after: list[int], kept: frozenset[int]):
        super().__init__(tokenizer, skip_special, kept)
        self._ids: list[int] = list(after[-4:])  # what a first piece's text depends on
        self._prefix, self._read = 0, len(self._ids)

    def _delta(self) -> tuple[str, str]:
        return self._decode(self._ids[self._prefix : self._read]), self._decode(self._ids[self._prefix :])

    def _decode(self, ids: list[int]) -> str:
        if not (self._skip_special and self._kept):
            return self._tok.decode(ids, self._skip_special)
        dropped = self._tok.special_ids - self._kept
        return self._tok.decode([i for i in ids if i not in dropped], skip_special=False)

    def _text(self, id: int) -> str:
        self._ids += self._tok.check_ids([id])
        before, now = self._delta()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before) :]
        return ""

    def _text_end(self) -> str:
        before, now = self._delta()
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]


def _post_processor_tokens(hf) -> tuple[int | None, int | None]:
    """The ids the post-processor puts before and after a text (BOS/EOS), if any."""
    try:
        plain = hf.encode("a", add_special_tokens=False).ids
        full = hf.encode("a", add_special_tokens=True).ids
    except Exception:
        return None, None
    if not plain or len(full) <= len(plain):
        return None, None
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if at is None:
        return None, None
    bos = full[at - 1] if at > 0 else None
    eos = full[at + len(plain)] if at + len(plain) < len(full) else None
    return bos, eos


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}
