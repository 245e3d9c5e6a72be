"""llama.cpp's byte-level BPE text handling: the pre-tokenizer splits it picks by tokenizer.ggml.pre, GPT-2's
byte <-> printable-character mapping, the pair-merge loop shared by SentencePiece and BPE, and the detokenizer's
clean-spaces rule."""

from __future__ import annotations

import heapq
import re

import regex

# --- byte-level BPE pre-tokenizers, as llama.cpp picks them by tokenizer.ggml.pre ---------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's hand-written splitter for this one also covers `\s+`, which the regex itself lacks.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LATIN = (  # the letters of DeepSeek-V2's tokenizer, as llama.cpp lists them
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-"
    "\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00"
    "-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943"
)
_CONTRACTED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTED
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTED
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # fmt: skip

_NOT_HAN = r"(?!\p{Han})"
_KIMI_K2 = (  # Kimi K2's (tokenization_kimi.py): letters of any script but Han, whose runs split apart
    r"\p{Han}+"
    + r"|[^\r\n\p{L}\p{N}]?(?:" + _NOT_HAN + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*"
    + r"(?:" + _NOT_HAN + r"[\p{Ll}\p{Lm}\p{Lo}\p{M}])+" + _CONTRACTED
    + r"|[^\r\n\p{L}\p{N}]?(?:" + _NOT_HAN + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+"
    + r"(?:" + _NOT_HAN + r"[\p{Ll}\p{Lm}\p{Lo}\p{M}])*" + _CONTRACTED
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # fmt: skip


def _stage(pattern: str, hand_written: bool):
    """One split pass. llama.cpp's hand-written splitters (gpt2, llama3, qwen2, qwen35) cut an unmatched
    character off on its own; its std::regex fallback keeps each unmatched run as one piece."""
    if hand_written:
        pattern += r"|(?s:.)"
    return regex.compile(pattern)


PRE_STAGES = {
    "llama3": [_stage(_LLAMA3, True)],
    "qwen2": [_stage(_QWEN2, True)],
    "qwen35": [_stage(_QWEN35, True)],
    "gpt2": [_stage(_GPT2, True)],
    "tekken": [_stage(_TEKKEN, False)],
    "starcoder": [_stage(r"\p{N}", False), _stage(_GPT2, True)],
    "deepseek-v3": [
        _stage(r"\p{N}{1,3}", False),
        _stage("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", False),
        _stage(_DEEPSEEK3, False),
    ],
    "deepseek-llm": [
        _stage("[\r\n]", False),
        _stage(f"\\s?[{_DEEPSEEK_LATIN}]+", False),
        _stage("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", False),
        _stage(r"\s+\Z", False),  # std::regex's $: the end of the piece searched only
        _stage("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", False),
        _stage(r"\p{N}+", False),
    ],
    "gpt-4o": [_stage(_GPT4O, False)],
    "kimi-k2": [_stage(_KIMI_K2, True)],
    "default": [
        _stage(r"[\p{P}\$\+<=>\^~\|]+", False),
        _stage(_GPT2, True),
        _stage(r"\p{N}+", False),
        _stage(r"[0-9][0-9][0-9]", False),
    ],
}
# tokenizer.ggml.pre -> (stages, ignore_merges, clean_spaces, default add_bos)
PRE_TYPES = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        ("llama3", True, True, True),
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False, True, False)),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open"], ("qwen2", False, False, False)
    ),
    **dict.fromkeys(["stablelm2", "megrez"], ("qwen2", False, True, False)),
    "qwen35": ("qwen35", False, False, False),
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
        ],
        ("gpt2", False, True, False),
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"], ("starcoder", False, True, False)
    ),
    **dict.fromkeys(["smollm", "command-r"], ("starcoder", False, False, False)),
    "tekken": ("tekken", True, False, True),
    # DeepSeek-V3/R1/V3.1 (and llama.cpp's others that split alike), DeepSeek-V2's, GLM-4.5's, gpt-oss's
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm"], ("deepseek-v3", False, False, False)),
    "deepseek-llm": ("deepseek-llm", False, False, False),
    **dict.fromkeys(["glm4", "glm5"], ("llama3", True, True, False)),
    "chatglm-bpe": ("llama3", False, True, False),
    **dict.fromkeys(["gpt-4o", "llama4"], ("gpt-4o", False, False, False)),
    "kimi-k2": ("kimi-k2", False, False, False),
    "default": ("default", False, True, False),
}


def split_words(text: str, stages) -> list[str]:
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
_NEWER_UNICODE = regex.compile(
    "["
    + (
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
    )
    + "]"
)


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable character table."""
    chars = {b: chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return [chars[b] for b in range(256)]


_BYTE_CHAR = _byte_chars()
_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHAR)}
_LATIN1_TO_BYTE_CHAR = {b: c for b, c in enumerate(_BYTE_CHAR)}  # str.translate table


def byte_encode(text: str) -> str:
    return text.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)


def merge_symbols(word: str, priority) -> list[str]:
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
        pieces.append(word[i : end[i]])
        i = end[i]
    return pieces


def byte_decode(text: str) -> bytes:
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


def clean_spaces(text: str) -> str:
    """llama.cpp's clean_spaces passes: " ?" " !" " ." " ," lose the space, " ' " becomes "'",
    and " 's" " 'm" " 're" " 've" lose the space (" 't", " 'd", " 'll" keep theirs)."""
    text = _SPACE_BEFORE_PUNCT.sub("", text)
    text = text.replace(" ' ", "'")
    return _SPACE_BEFORE_CONTRACTION.sub("", text)
