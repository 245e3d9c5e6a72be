"""Tokenizers: GGUF-embedded vocabularies, token-for-token as llama.cpp, and Hugging Face tokenizer.json.

A GGUF vocabulary of type "llama" (SentencePiece) or "gpt2" (byte-level BPE) is tokenized by a Python
port of llama.cpp's algorithms (src/llama-vocab.cpp, src/unicode.cpp): same special-token partition, same
pre-tokenizer splits, same merge order, same byte fallback, same detokenizer clean-up. Anything carrying
a whole tokenizer.json (a Hugging Face folder, or GGUF metadata with `tokenizer.huggingface.json`) goes
through the `tokenizers` library instead.
"""
from __future__ import annotations

import codecs
import heapq
import json
import re
from pathlib import Path

import regex

from .chat import render_chat

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError", "load_tokenizer"]


class TokenizerError(ValueError):
    pass


# llama.cpp's token attributes; GGUF's tokenizer.ggml.token_type maps onto the first six.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE, LSTRIP, RSTRIP = (1 << i for i in range(8))
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}  # else: undefined (0)

# Token texts llama.cpp treats as end of generation, and the FIM tokens it detects by text
# (llama_vocab::impl::load). Every EOG token is also forced to CONTROL.
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>", "<file_sep>", "<file-sep>"),
}
_ID_KEYS = {name: f"tokenizer.ggml.{name}_token_id" for name in
            ("bos", "eos", "eot", "eom", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")}
_ID_KEYS["unk"] = "tokenizer.ggml.unknown_token_id"

# --- byte-level BPE pre-tokenizers, as llama.cpp picks them by tokenizer.ggml.pre ---------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's hand-written splitter for this one also covers `\s+`, which the regex itself lacks.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _stage(pattern: str, hand_written: bool):
    """One split pass. llama.cpp's hand-written splitters (gpt2, llama3, qwen2, qwen35) cut an unmatched
    character off on its own; its std::regex fallback keeps each unmatched run as one piece."""
    if hand_written:
        pattern += r"|(?s:.)"
    return regex.compile(pattern)


_PRE_STAGES = {
    "llama3": [_stage(_LLAMA3, True)],
    "qwen2": [_stage(_QWEN2, True)],
    "qwen35": [_stage(_QWEN35, True)],
    "gpt2": [_stage(_GPT2, True)],
    "tekken": [_stage(_TEKKEN, False)],
    "starcoder": [_stage(r"\p{N}", False), _stage(_GPT2, True)],
    "default": [_stage(r"[\p{P}\$\+<=>\^~\|]+", False), _stage(_GPT2, True),
                _stage(r"\p{N}+", False), _stage(r"[0-9][0-9][0-9]", False)],
}
# tokenizer.ggml.pre -> (stages, ignore_merges, clean_spaces, default add_bos)
_PRE_TYPES = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"], ("llama3", True, True, True)),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False, True, False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"],
                    ("qwen2", False, False, False)),
    **dict.fromkeys(["stablelm2", "megrez"], ("qwen2", False, True, False)),
    "qwen35": ("qwen35", False, False, False),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"],
                    ("gpt2", False, True, False)),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"],
                    ("starcoder", False, True, False)),
    **dict.fromkeys(["smollm", "command-r"], ("starcoder", False, False, False)),
    "tekken": ("tekken", True, False, True),
    "default": ("default", False, True, False),
}


def _split(text: str, stages) -> list[str]:
    probe = _NEWER_UNICODE.sub("\u0378", text)  # same length; classified as llama.cpp classifies
    spans = [(0, len(text))]
    for pattern in stages:
        out = []
        for start, end in spans:
            pos = start
            for m in pattern.finditer(probe, start, end):
                if m.start() > pos:
                    out.append((pos, m.start()))
                out.append(m.span())
                pos = m.end()
            if pos < end:
                out.append((pos, end))
        spans = out
    return [text[a:b] for a, b in spans]


# llama.cpp classifies code points with Unicode 15.1 tables, where everything assigned since (Unicode
# 16.0 and 17.0, which the regex module knows) is unassigned. Before splitting, these are replaced by
# U+0378, unassigned in every version, so \p{L}, \p{N}, \s... see them as llama.cpp does.
_NEWER_UNICODE = regex.compile("[" + (
    r"\u0558\u058b-\u058c\u05c8-\u05c9\u088f\u0897\u0b53-\u0b54\u0c5c\u0cdc\u1acf-\u1af0\u1b4e-\u1b4f\u1b7f"
    r"\u1c89-\u1c8a\u208f\u209d-\u209f\u20c1-\u20c4\u2427-\u2429\u2b96\u2e60-\u2e63\u31e4-\u31e5"
    r"\ua7cb-\ua7cf\ua7d2\ua7d4\ua7da-\ua7dd\ua7e2\ua7f1\uab6c-\uab6d\ufbc3-\ufbd2\ufd90-\ufd91\ufdc8-\ufdce"
    r"\U000105c0-\U000105f3\U000107bb-\U000107bf\U00010940-\U00010959\U00010d40-\U00010d65"
    r"\U00010d69-\U00010d85\U00010d8e-\U00010d8f\U00010ec2-\U00010ec7\U00010ec9-\U00010eee"
    r"\U00010ef0-\U00010efc\U00011380-\U00011389\U0001138b\U0001138e\U00011390-\U000113b5"
    r"\U000113b7-\U000113c0\U000113c2\U000113c5\U000113c7-\U000113ca\U000113cc-\U000113d5"
    r"\U000113d7-\U000113d8\U000113e1-\U000113e2\U000116d0-\U000116e3\U00011b0a\U00011b60-\U00011b67"
    r"\U00011bc0-\U00011be1\U00011bf0-\U00011bf9\U00011db0-\U00011ddb\U00011de0-\U00011de9"
    r"\U00011df0-\U00011df1\U00011f5a\U0001246f\U00012475-\U0001247f\U00012550-\U00012686"
    r"\U00013460-\U000143fa\U00016100-\U00016139\U00016d40-\U00016d79\U00016ea0-\U00016eb8"
    r"\U00016ebb-\U00016ed3\U00016ff2-\U00016ff6\U000187f8-\U000187ff\U00018cd6-\U00018cda\U00018cff"
    r"\U00018d09-\U00018d20\U00018d80-\U00018df2\U00018e00-\U00019191\U000191a0-\U000191d2"
    r"\U0001b123-\U0001b128\U0001b168\U0001cc00-\U0001ccfc\U0001cd00-\U0001ceb3\U0001ceba-\U0001ced0"
    r"\U0001ced2-\U0001ced4\U0001cedd-\U0001cefd\U0001d127-\U0001d128\U0001d1eb-\U0001d1ff"
    r"\U0001d250-\U0001d281\U0001d6a6\U0001db00-\U0001db1c\U0001df1f-\U0001df24\U0001df2b-\U0001df81"
    r"\U0001df90-\U0001df96\U0001dfcd-\U0001dfff\U0001e5d0-\U0001e5fa\U0001e5ff\U0001e6c0-\U0001e6de"
    r"\U0001e6e0-\U0001e6f5\U0001e6fe-\U0001e6ff\U0001f1ae\U0001f6d8-\U0001f6d9\U0001f777-\U0001f77a"
    r"\U0001f7da-\U0001f7db\U0001f7f1-\U0001f7ff\U0001f8b2-\U0001f8bb\U0001f8c0-\U0001f8c1"
    r"\U0001f8d0-\U0001f8d8\U0001fa54-\U0001fa57\U0001fa89-\U0001fa8f\U0001fabe\U0001fac6\U0001fac8"
    r"\U0001facc-\U0001facd\U0001fadc-\U0001fadd\U0001fadf\U0001fae9-\U0001faeb\U0001faef"
    r"\U0001faf9-\U0001fafa\U0001fbcb-\U0001fbef\U0001fbfa\U0002b73a-\U0002b73f\U0002b81e"
    r"\U0002cea2-\U0002cead\U000323b0-\U00033479\U0003d000-\U0003fc3f"
) + "]")


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable character table."""
    chars = {b: chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return [chars[b] for b in range(256)]


_BYTE_CHAR = _byte_chars()
_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHAR)}
_LATIN1_TO_BYTE_CHAR = {b: c for b, c in enumerate(_BYTE_CHAR)}  # str.translate table


def _byte_encode(text: str) -> str:
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)


def _merge(word: str, priority) -> list[str]:
    """Merge adjacent symbols of `word`, single characters at first: always the pair with the lowest
    priority(left, right), leftmost on ties; a None priority never merges. This is the order of
    llama.cpp's work queues for both SentencePiece (by score) and BPE (by rank)."""
    n = len(word)
    if n < 2:
        return [word]
    end = list(range(1, n + 1))  # symbol i spans word[i:end[i]]
    prev = list(range(-1, n - 1))
    alive = [True] * n
    heap = []

    def consider(left, right):
        stop = end[right]
        p = priority(word[left:right], word[right:stop])
        if p is not None:
            heapq.heappush(heap, (p, left, right, stop))

    for i in range(1, n):
        consider(i - 1, i)
    while heap:
        _, left, right, stop = heapq.heappop(heap)
        if not (alive[left] and alive[right] and end[right] == stop):
            continue  # one side changed since this pair was queued
        end[left] = stop
        alive[right] = False
        if stop < n:
            prev[stop] = left
            consider(left, stop)
        if prev[left] >= 0:
            consider(prev[left], left)
    pieces, i = [], 0
    while i < n:
        pieces.append(word[i:end[i]])
        i = end[i]
    return pieces


def _byte_decode(text: str) -> bytes:
    try:
        return bytes(_CHAR_BYTE[c] for c in text)
    except KeyError:  # not a byte-level token after all; llama.cpp marks each such character
        out = b""
        for c in text:
            if c in _CHAR_BYTE:
                out += bytes([_CHAR_BYTE[c]])
            else:
                out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return out


# --- detokenizer clean-up --------------------------------------------------------------------------

_SPACE_BEFORE_PUNCT = re.compile(r" (?=[?!.,])")
_SPACE_BEFORE_CONTRACTION = re.compile(r" (?='(?:[sm]|re|ve))")


def _clean_spaces(text: str) -> str:
    """llama.cpp's clean_spaces passes: " ?" " !" " ." " ," lose the space, " ' " becomes "'",
    and " 's" " 'm" " 're" " 've" lose the space (" 't", " 'd", " 'll" keep theirs)."""
    text = _SPACE_BEFORE_PUNCT.sub("", text)
    text = text.replace(" ' ", "'")
    return _SPACE_BEFORE_CONTRACTION.sub("", text)


class StreamDecoder:
    """Decodes ids one at a time. Each feed() returns only complete UTF-8 text; the concatenation of
    every feed() and the final flush() equals Tokenizer.decode(ids) for the same ids."""

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._pending = ""

    def feed(self, id: int) -> str:
        return self._release(self._text(id))

    def flush(self) -> str:
        text, self._pending = self._pending + self._text_end(), ""
        return self._clean(text)

    # A clean-up pattern starts with a space and is at most 4 characters long, so text is released
    # only up to a point with no space in the 3 characters before it.
    def _release(self, text: str) -> str:
        if not self._tok._cleans_spaces:
            return text
        pending = self._pending + text
        cut = len(pending)
        while (space := pending.rfind(" ", max(0, cut - 3), cut)) >= 0:
            cut = space
        self._pending = pending[cut:]
        return self._clean(pending[:cut])

    def _clean(self, text: str) -> str:
        return _clean_spaces(text) if self._tok._cleans_spaces else text

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
    _cleans_spaces = False

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

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
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
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} out of range for a vocabulary of {self.vocab_size}")
        return ids

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        if "tokenizer.huggingface.json" in metadata:
            return _HFTokenizer.from_gguf_metadata(metadata)
        return _LlamaCppTokenizer(metadata)

    @classmethod
    def from_hf_folder(cls, folder) -> "Tokenizer":
        return _HFTokenizer.from_folder(Path(folder))


def load_tokenizer(model) -> Tokenizer:
    """The tokenizer of a shardwire.formats.ModelFile."""
    if model.format == "gguf":
        return Tokenizer.from_gguf_metadata(model.metadata)
    if model.format == "hf":
        return Tokenizer.from_hf_folder(model.path)
    raise TokenizerError(f"{model.path}: no tokenizer for model format {model.format!r}")


# --- GGUF vocabularies, as llama.cpp ---------------------------------------------------------------

class _LlamaCppTokenizer(Tokenizer):
    def __init__(self, md: dict):
        kind = md.get("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
        if kind not in ("llama", "gpt2"):
            raise TokenizerError(f"unsupported tokenizer.ggml.model {kind!r} (shardwire reads 'llama' and "
                                 "'gpt2' vocabularies, or a tokenizer.huggingface.json)")
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
        self._attrs = [_TYPE_ATTR.get(t, 0) for t in types[:n]] if types is not None else [NORMAL] * n

        if self.spm:
            scores = md.get("tokenizer.ggml.scores")
            if scores is not None and len(scores) < n:
                raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            self._scores = scores if scores is not None else [0.0] * n
            ids = {"bos": 1, "eos": 2, "unk": 0}
            add_space_prefix, add_bos, self._cleans_spaces = True, True, False
        else:
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges (needed by a gpt2 vocabulary)")
            # Byte-level symbols never contain a raw space, so "left right" is the key; first one wins.
            self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE_TYPES:
                raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r} (known: {', '.join(sorted(_PRE_TYPES))})")
            stages, self._ignore_merges, self._cleans_spaces, add_bos = _PRE_TYPES[pre]
            self._stages = _PRE_STAGES[stages]
            self._cache: dict[str, list[int]] = {}
            ids = {"bos": 11, "eos": 11}
            add_space_prefix = False
        self._add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template = md.get("tokenizer.chat_template")

        ids = {k: v for k, v in ids.items() if v < n}
        for name, key in _ID_KEYS.items():
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
            self._attrs[i] |= CONTROL

        for name, texts in (("eot", _EOT_TEXTS), ("eom", ("<|eom_id|>",)), *_FIM_TEXTS.items()):
            if name not in ids:
                found = next((self._ids[t] for t in texts if t in self._ids), None)
                if found is not None:
                    ids[name] = found
                    mark(found)
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in ids}
        for text in _EOG_TEXTS:
            if text in self._ids:
                eog.add(self._ids[text])
                mark(self._ids[text])
        eog.update(ids[k] for k in ("eos", "eot", "eom") if k in ids)
        return eog

    def _prepare_partition(self, md: dict):
        specials = [i for i, a in enumerate(self._attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
        specials.sort(key=lambda i: -len(self._texts[i]))
        name = str(md.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp's per-model attributes for Phi-3
            for i in specials:
                self._attrs[i] |= RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._ids:
                    i = self._ids[text]
                    self._attrs[i] = self._attrs[i] | RSTRIP if on else self._attrs[i] & ~RSTRIP
        # (text, id, lstrip, rstrip), longest first; without parse_special only user-defined ones split
        self._specials = [(self._texts[i], i, self._attrs[i] & LSTRIP, self._attrs[i] & RSTRIP) for i in specials]
        self._user_defined = [s for s in self._specials if not self._attrs[s[1]] & (CONTROL | UNKNOWN)]

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
                if self._add_space_prefix and prev_special:
                    part = " " + part
                out += self._spm(part.replace(" ", "\u2581"))
                prev_special = False
            else:
                for word in _split(part, self._stages):
                    ids = self._cache.get(word)
                    if ids is None:
                        if len(self._cache) > 100_000:
                            self._cache.clear()
                        ids = self._cache[word] = self._bpe(_byte_encode(word))
                    out += ids
        return out

    def _spm(self, text: str) -> list[int]:
        vocab, scores = self._ids, self._scores

        def priority(left, right):  # highest score first
            id = vocab.get(left + right)
            return None if id is None else -scores[id]

        out = []
        for piece in _merge(text, priority):
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
        for piece in _merge(word, lambda left, right: ranks.get(left + " " + right)):
            id = vocab.get(piece)
            if id is not None:
                out.append(id)
            else:  # llama.cpp looks up each UTF-8 byte as a one-byte token; only ASCII can match
                out += (vocab[c] for c in piece if c < "\x80" and c in vocab)
        return out

    # decode

    def _piece(self, id: int) -> bytes:
        """llama.cpp's token_to_piece with special=True."""
        piece = self._pieces[id]
        if piece is None:
            text, attr = self._texts[id], self._attrs[id]
            if attr & (UNKNOWN | CONTROL | USER_DEFINED):
                piece = text.encode("utf-8")
            elif attr & NORMAL:
                piece = text.replace("\u2581", " ").encode("utf-8") if self.spm else _byte_decode(text)
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
        ids = self._check_ids(ids)
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        stream = self.stream_decoder(skip_special)
        return "".join(stream.feed(i) for i in ids) + stream.flush()

    def token_text(self, id: int) -> str:
        return self._piece(self._check_ids([id])[0]).decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return _ByteStreamDecoder(self, skip_special)


class _ByteStreamDecoder(StreamDecoder):
    def __init__(self, tokenizer: _LlamaCppTokenizer, skip_special: bool):
        super().__init__(tokenizer, skip_special)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True
        self._strip_space = tokenizer._add_space_prefix

    def _text(self, id: int) -> str:
        tok = self._tok
        id = tok._check_ids([id])[0]
        first, self._first = self._first, False
        if first and self._skip_special and tok.add_bos and id == tok.bos_id:
            self._strip_space = False
            return ""
        strip, self._strip_space = self._strip_space, False
        if self._skip_special and tok._attrs[id] & (UNKNOWN | CONTROL):
            return ""
        piece = tok._piece(id)
        if strip and piece.startswith(b" "):
            piece = piece[1:]
        return self._utf8.decode(piece)

    def _text_end(self) -> str:
        return self._utf8.decode(b"", final=True)


# --- tokenizer.json through the tokenizers library -------------------------------------------------

class _HFTokenizer(Tokenizer):
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
        eog = {hf.token_to_id(t) for t in _EOG_TEXTS} | set(stop_ids) | {self.eos_id}
        self.stop_ids = frozenset(i for i in eog if isinstance(i, int) and 0 <= i < n)

    @classmethod
    def from_folder(cls, folder: Path) -> "_HFTokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(path))
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
        return cls(hf, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
                   add_bos=config.get("add_bos_token"), add_eos=config.get("add_eos_token"),
                   chat_template=template, stop_ids=stop_ids)

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "_HFTokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            hf = HFTokenizer.from_str(md["tokenizer.huggingface.json"])
        except Exception as e:
            raise TokenizerError(f"tokenizer.huggingface.json cannot be loaded ({e})") from None
        ids = {name: md.get(key) for name, key in _ID_KEYS.items()}
        return cls(hf, bos_id=ids["bos"], eos_id=ids["eos"],
                   add_bos=md.get("tokenizer.ggml.add_bos_token"), add_eos=md.get("tokenizer.ggml.add_eos_token"),
                   chat_template=md.get("tokenizer.chat_template"),
                   stop_ids=[ids[k] for k in ("eot", "eom") if ids[k] is not None])

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        hf = self._hf if parse_special else self._plain()
        return hf.encode(text, add_special_tokens=False).ids

    def _plain(self):
        """A twin that reads special-token texts as plain text (non-special added tokens still split,
        like llama.cpp's user-defined tokens)."""
        if self._hf_plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._hf_plain = plain
        return self._hf_plain

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._hf.decode(self._check_ids(ids), skip_special_tokens=skip_special)

    def token_text(self, id: int) -> str:
        return self._hf.decode(self._check_ids([id]), skip_special_tokens=False)

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return _WindowStreamDecoder(self, skip_special)


class _WindowStreamDecoder(StreamDecoder):
    """Decodes a short window of recent ids and emits what the newest id added, once it no longer ends
    in an incomplete character (the approach of text-generation-inference)."""

    def __init__(self, tokenizer: _HFTokenizer, skip_special: bool):
        super().__init__(tokenizer, skip_special)
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def _delta(self) -> tuple[str, str]:
        decode = self._tok.decode
        before = decode(self._ids[self._prefix:self._read], self._skip_special)
        return before, decode(self._ids[self._prefix:], self._skip_special)

    def _text(self, id: int) -> str:
        self._ids += self._tok._check_ids([id])
        before, now = self._delta()
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before):]
        return ""

    def _text_end(self) -> str:
        before, now = self._delta()
        self._prefix = self._read = len(self._ids)
        return now[len(before):]


def _post_processor_tokens(hf) -> tuple[int | None, int | None]:
    """The ids the post-processor puts before and after a text (BOS/EOS), if any."""
    try:
        plain = hf.encode("a", add_special_tokens=False).ids
        full = hf.encode("a", add_special_tokens=True).ids
    except Exception:
        return None, None
    if not plain or len(full) <= len(plain):
        return None, None
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
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
