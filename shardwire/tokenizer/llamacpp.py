"""GGUF vocabularies ("llama" SentencePiece, "gpt2" byte-level BPE) tokenized token-for-token as llama.cpp
(src/llama-vocab.cpp): special-token partition, merges, byte fallback, and the byte-level stream decoder."""

from __future__ import annotations

import codecs

import regex

from .base import StreamDecoder, Tokenizer, TokenizerError
from .pretokenize import PRE_STAGES, PRE_TYPES, byte_decode, byte_encode, merge_symbols, split_words

# llama.cpp's token attributes; GGUF's tokenizer.ggml.token_type maps onto the first six.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE, LSTRIP, RSTRIP = (1 << i for i in range(8))
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}  # else: undefined (0)

# Token texts llama.cpp treats as end of generation, and the FIM tokens it detects by text
# (llama_vocab::impl::load). Every EOG token is also forced to CONTROL.
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    ]
)
HARMONY_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>", "<file_sep>", "<file-sep>"),
}
ID_KEYS = {
    name: f"tokenizer.ggml.{name}_token_id"
    for name in ("bos", "eos", "eot", "eom", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
}
ID_KEYS["unk"] = "tokenizer.ggml.unknown_token_id"


class LlamaCppTokenizer(Tokenizer):
    def __init__(self, md: dict):
        kind = md.get("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
        if kind not in ("llama", "gpt2"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {kind!r} (shardwire reads 'llama' and "
                "'gpt2' vocabularies, or a tokenizer.huggingface.json)"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens (missing vocabulary)")
        n = self.vocab_size = len(tokens)
        self.spm = kind == "llama"
        self._texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._ids = {t: i for i, t in enumerate(self._texts)}
        types = md.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self.attrs = [_TYPE_ATTR.get(t, 0) for t in types[:n]] if types is not None else [NORMAL] * n

        if self.spm:
            scores = md.get("tokenizer.ggml.scores")
            if scores is not None and len(scores) < n:
                raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            self._scores = scores if scores is not None else [0.0] * n
            ids = {"bos": 1, "eos": 2, "unk": 0}
            add_space_prefix, add_bos, self.cleans_spaces = True, True, False
        else:
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges (needed by a gpt2 vocabulary)")
            # Byte-level symbols never contain a raw space, so "left right" is the key; first one wins.
            self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in PRE_TYPES:
                raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} (known: {', '.join(sorted(PRE_TYPES))})")
            stages, self._ignore_merges, self.cleans_spaces, add_bos = PRE_TYPES[pre]
            self._stages = PRE_STAGES[stages]
            self._cache: dict[str, list[int]] = {}
            ids = {"bos": 11, "eos": 11}
            add_space_prefix = False
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template = md.get("tokenizer.chat_template")

        ids = {k: v for k, v in ids.items() if v < n}
        for name, key in ID_KEYS.items():
            value = md.get(key)
            if isinstance(value, int) and 0 <= value < n:
                ids[name] = value
        self.stop_ids = frozenset(self._find_special_tokens(ids))
        self.bos_id, self.eos_id, self.unk_id = ids.get("bos"), ids.get("eos"), ids.get("unk")
        self._prepare_partition(md)
        self._pieces: list[bytes | None] = [None] * n

    def _find_special_tokens(self, ids: dict) -> set[int]:
        """Fill in eot/eom/fim ids from token texts and return the end-of-generation set, marking those
        tokens CONTROL, as llama.cpp does."""

        def mark(i):
            self.attrs[i] |= CONTROL

        for name, texts in (("eot", _EOT_TEXTS), ("eom", ("<|eom_id|>",)), *_FIM_TEXTS.items()):
            if name not in ids:
                found = next((self._ids[t] for t in texts if t in self._ids), None)
                if found is not None:
                    ids[name] = found
                    mark(found)
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in ids}
        for text in EOG_TEXTS:
            if text in self._ids:
                eog.add(self._ids[text])
                mark(self._ids[text])
        eog.update(ids[k] for k in ("eos", "eot", "eom") if k in ids)
        # harmony (gpt-oss): its message marks are written out like text, and a message's <|end|>
        # ends no reply where <|return|> and <|call|> do
        for text in HARMONY_RENDERED:
            if text in self._ids:
                self.attrs[self._ids[text]] = USER_DEFINED
        if all(t in self._ids and self._ids[t] in eog for t in ("<|return|>", "<|call|>", "<|end|>")):
            eog.discard(self._ids["<|end|>"])
            self.attrs[self._ids["<|end|>"]] = USER_DEFINED
        return eog

    def _prepare_partition(self, md: dict):
        specials = [i for i, a in enumerate(self.attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
        specials.sort(key=lambda i: -len(self._texts[i]))
        name = str(md.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp's per-model attributes for Phi-3
            for i in specials:
                self.attrs[i] |= RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._ids:
                    i = self._ids[text]
                    self.attrs[i] = self.attrs[i] | RSTRIP if on else self.attrs[i] & ~RSTRIP
        # (text, id, lstrip, rstrip), longest first; without parse_special only user-defined ones split
        self._specials = [(self._texts[i], i, self.attrs[i] & LSTRIP, self.attrs[i] & RSTRIP) for i in specials]
        self._user_defined = [s for s in self._specials if not self.attrs[s[1]] & (CONTROL | UNKNOWN)]

    # encode

    def _partition(self, text: str, parse_special: bool) -> list:
        """Split out special tokens (llama_vocab::impl::tokenizer_st_partition): a list of str and int."""
        parts = [text]
        for special, id, lstrip, rstrip in self._specials if parse_special else self._user_defined:
            if special not in text:
                continue
            out = []
            for part in parts:
                if isinstance(part, int) or special not in part:
                    out.append(part)
                    continue
                pos = 0
                while (match := part.find(special, pos)) >= 0:
                    left = part[pos:match]
                    if lstrip:
                        left = left.rstrip(" \t\n\v\f\r")
                    if left:
                        out.append(left)
                    out.append(id)
                    pos = match + len(special)
                    if rstrip:
                        while pos < len(part) and part[pos] in " \t\n\v\f\r":
                            pos += 1
                if pos < len(part):
                    out.append(part[pos:])
            parts = out
        return parts

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        out: list[int] = []
        prev_special = True
        for part in self._partition(text, parse_special) if text else []:
            if isinstance(part, int):
                out.append(part)
                prev_special = True
            elif self.spm:
                if self.add_space_prefix and prev_special:
                    part = " " + part
                out += self._spm(part.replace(" ", "\u2581"))
                prev_special = False
            else:
                for word in split_words(part, self._stages):
                    ids = self._cache.get(word)
                    if ids is None:
                        if len(self._cache) > 100_000:
                            self._cache.clear()
                        ids = self._cache[word] = self._bpe(byte_encode(word))
                    out += ids
        return out

    def _spm(self, text: str) -> list[int]:
        vocab, scores = self._ids, self._scores

        def priority(left, right):  # highest score first
            id = vocab.get(left + right)
            return None if id is None else -scores[id]

        out = []
        for piece in merge_symbols(text, priority):
            id = vocab.get(piece)
            if id is not None:
                out.append(id)
            else:  # byte fallback: <0xXX> tokens (or the raw byte as a token)
                out += (self._byte_token(b) for b in piece.encode("utf-8"))
        return out

    def _byte_token(self, b: int) -> int:
        id = self._ids.get(f"<0x{b:02X}>")
        if id is None and b < 0x80:
            id = self._ids.get(chr(b))
        if id is None:  # where llama.cpp would throw
            if self.unk_id is None:
                raise TokenizerError(f"vocabulary has no token for byte 0x{b:02X} and no unknown token")
            id = self.unk_id
        return id

    def _bpe(self, word: str) -> list[int]:
        vocab, ranks = self._ids, self._ranks
        if self._ignore_merges and word in vocab:
            return [vocab[word]]
        out = []
        for piece in merge_symbols(word, lambda left, right: ranks.get(left + " " + right)):
            id = vocab.get(piece)
            if id is not None:
                out.append(id)
            else:  # llama.cpp looks up each UTF-8 byte as a one-byte token; only ASCII can match
                out += (vocab[c] for c in piece if c < "\x80" and c in vocab)
        return out

    # decode

    def piece(self, id: int) -> bytes:
        """llama.cpp's token_to_piece with special=True."""
        piece = self._pieces[id]
        if piece is None:
            text, attr = self._texts[id], self.attrs[id]
            if attr & (UNKNOWN | CONTROL | USER_DEFINED):
                piece = text.encode("utf-8")
            elif attr & NORMAL:
                piece = text.replace("\u2581", " ").encode("utf-8") if self.spm else byte_decode(text)
            elif attr & BYTE and regex.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                piece = bytes([int(text[3:5], 16)])
            else:
                piece = b""
            self._pieces[id] = piece
        return piece

    def decode(self, ids, skip_special: bool = True) -> str:
        """llama.cpp's detokenize (remove_special = skip_special, unparse_special = not skip_special):
        the first piece loses the space SentencePiece prefixed unless the ids start with BOS, and
        clean_spaces vocabularies (llama3, gpt-2) drop spaces before punctuation and some contractions."""
        ids = self.check_ids(ids)
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        stream = self.stream_decoder(skip_special)
        return "".join(stream.feed(i) for i in ids) + stream.flush()

    def token_text(self, id: int) -> str:
        return self.piece(self.check_ids([id])[0]).decode("utf-8", "replace")

    def stream_decoder(
        self, skip_special: bool = True, after: list[int] | None = None, kept: frozenset[int] = frozenset()
    ) -> StreamDecoder:
        return _ByteStreamDecoder(self, skip_special, continues=bool(after), kept=kept)


class _ByteStreamDecoder(StreamDecoder):
    def __init__(self, tokenizer: LlamaCppTokenizer, skip_special: bool, continues: bool, kept: frozenset[int]):
        super().__init__(tokenizer, skip_special, kept)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = not continues
        self._strip_space = tokenizer.add_space_prefix and not continues

    def _text(self, id: int) -> str:
        tok = self._tok
        id = tok.check_ids([id])[0]
        first, self._first = self._first, False
        if first and self._skip_special and tok.add_bos and id == tok.bos_id:
            self._strip_space = False
            return ""
        strip, self._strip_space = self._strip_space, False
        if self._skip_special and tok.attrs[id] & (UNKNOWN | CONTROL) and id not in self._kept:
            return ""
        piece = tok.piece(id)
        if strip and piece.startswith(b" "):
            piece = piece[1:]
        return self._utf8.decode(piece)

    def _text_end(self) -> str:
        return self._utf8.decode(b"", final=True)
