"""Constrained decoding with llguidance: JSON schemas, Lark and GBNF grammars compiled on the
coordinator, matched token by token next to the sampler on the last stage.

The coordinator checks a request's grammar before any worker sees it (Grammar.compile); the
sampling side keeps one matcher per sequence slot (Matchers). A matcher is (re)built from its
grammar and the sequence's generated tokens by the row that carries the last prompt chunk, so a
replay after recovery rebuilds it exactly from the token history; every sampling row after that
says how many tokens the matcher must already have consumed, and the sampled token is consumed at
once.

Both sides build llguidance's tokenizer from the same Vocabulary: each token's bytes (control
tokens marked with a leading 0xFF, as llguidance expects), shipped to the sampling worker once per
plan. Text the grammar forces is split into tokens greedily there (llguidance's own longest-match
tokenizer): a worker holds no tokenizer, and the coordinator uses the same so both agree.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import llguidance
import numpy as np
import torch

from .wire.messages import MAX_GRAMMAR_BYTES, MAX_VOCAB, RowConstraint

VOCABULARY_WAIT = 30.0  # how long a sampling worker waits for the vocabulary it was promised
# llguidance's fuel and size limits bound the time to compile a grammar and to compute each mask.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as Python's json.dumps writes it: a fixed layout, so a model cannot spend its tokens on whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CONTROL_MARK = b"\xff"


class ConstraintError(ValueError):
    """A grammar or schema that cannot be used; the message is llguidance's where it has one."""


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


# -- the vocabulary both sides match against ---------------------------------------------------


class _GreedyTokenize:
    """The tokenize function llguidance calls for text a grammar forces: its own longest match."""

    def __init__(self, vocab: "Vocabulary"):
        self.tokens, self.eos_token_id, self.bos_token_id = vocab.tokens, vocab.eos[0], None
        self.special_token_ids = [i for i, t in enumerate(vocab.tokens) if t.startswith(CONTROL_MARK)]
        self.lltokenizer: llguidance.LLTokenizer | None = None

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.lltokenizer.greedy_tokenize(text)


@dataclass(eq=False)
class Vocabulary:
    tokens: list[bytes]  # per token id; a control token's starts with 0xFF
    eos: list[int]  # the tokens that end generation, allowed once the grammar is satisfied

    def __post_init__(self):
        if not self.tokens or len(self.tokens) > MAX_VOCAB:
            raise ValueError(f"a vocabulary holds 1 to {MAX_VOCAB} tokens")
        if not self.eos or not all(0 <= i < len(self.tokens) for i in self.eos):
            raise ValueError("the vocabulary's end-of-generation ids must be tokens of it")
        self._lltokenizer = None
        self._lock = threading.Lock()

    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer over these tokens, built once (about 0.4 s for 150k tokens)."""
        with self._lock:
            if self._lltokenizer is None:
                tokenize = _GreedyTokenize(self)
                tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(tokenize), eos_token=list(self.eos))
                tokenize.lltokenizer = tokenizer
                self._lltokenizer = tokenizer
            return self._lltokenizer

    def to_payload(self) -> bytes:
        """Lengths as little-endian uint32, then every token's bytes."""
        lengths = np.array([len(t) for t in self.tokens], dtype="<u4")
        return lengths.tobytes() + b"".join(self.tokens)

    @classmethod
    def from_payload(cls, payload, n: int, eos: list[int]) -> "Vocabulary":
        payload = memoryview(payload)
        if not 0 < n <= MAX_VOCAB or len(payload) < 4 * n:
            raise ValueError(f"a vocabulary payload of {len(payload)} bytes cannot hold {n} tokens")
        lengths = np.frombuffer(payload[: 4 * n], dtype="<u4").astype(np.int64)
        if 4 * n + int(lengths.sum()) != len(payload):
            raise ValueError("the vocabulary's token lengths do not add up to its payload")
        ends = 4 * n + np.cumsum(lengths)
        starts = ends - lengths
        data = bytes(payload)
        return cls([data[a:b] for a, b in zip(starts.tolist(), ends.tolist())], list(eos))


@lru_cache(maxsize=4)
def vocabulary_of(tokenizer) -> Vocabulary:
    """The Vocabulary of a shardwire tokenizer (cached: the coordinator builds it once)."""
    from .tokenizer.hf import HFTokenizer
    from .tokenizer.llamacpp import CONTROL, USER_DEFINED

    if isinstance(tokenizer, HFTokenizer):
        tokens = _hf_tokens(tokenizer)
    else:
        tokens = []
        for i in range(tokenizer.vocab_size):
            piece, attr = tokenizer.piece(i), tokenizer.attrs[i]
            # llama.cpp's rule: control tokens, and user-defined ones that look like <...>
            special = attr & CONTROL or (attr & USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"))
            tokens.append(CONTROL_MARK + piece if special else piece)
    eos = sorted(tokenizer.stop_ids) or [tokenizer.eos_id or 0]
    return Vocabulary(tokens, eos)


def _hf_tokens(tokenizer) -> list[bytes]:
    """llguidance reads a tokenizer.json's pieces (byte-level or metaspace, byte fallback) itself.
    A decoder it does not know (a character vocabulary whose decoder is a list of replacements,
    like the demo model's) gives each token's own decoded text instead, a token that decodes to
    nothing (<pad>, <bos>) being a control token. Tokens that end generation are control tokens,
    as llama.cpp marks them, whatever the file says."""
    n = tokenizer.vocab_size
    try:
        hf = llguidance.LLTokenizer(tokenizer.tokenizer_json, n_vocab=n, eos_token=0)
    except ValueError:
        texts = [tokenizer.token_text(i).encode() for i in range(n)]
        return [
            CONTROL_MARK + tokenizer.token_name(i).encode() if not t or i in tokenizer.stop_ids else t
            for i, t in enumerate(texts)
        ]
    control = [hf.is_special_token(i) or i in tokenizer.stop_ids for i in range(n)]
    return [CONTROL_MARK + hf.decode_bytes([i]) if c else hf.decode_bytes([i]) for i, c in enumerate(control)]


# -- grammars, on the coordinator ---------------------------------------------------------------


@dataclass(frozen=True)
class Grammar:
    text: str  # llguidance's grammar: JSON naming a schema or a Lark grammar
    key: str  # its sha256: which grammar a slot's matcher follows

    @classmethod
    def of(cls, text: str) -> "Grammar":
        return cls(text, hashlib.sha256(text.encode("utf-8")).hexdigest())

    @classmethod
    def compile(cls, kind: str, source, vocabulary: Vocabulary) -> "Grammar":
        """kind: "json_schema" (a dict or its JSON text), "lark" or "gbnf" (text). Raises
        ConstraintError with llguidance's message when the grammar cannot be used."""
        text = json.dumps(source) if kind == "json_schema" and not isinstance(source, str) else source
        if not isinstance(text, str):
            raise ConstraintError(f"a {kind} grammar must be text")
        if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
            raise ConstraintError(f"the {kind} is larger than {MAX_GRAMMAR_BYTES // 1024} KiB")
        try:
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            elif kind == "gbnf":
                grammar = llguidance.grammar_from("gbnf", text)
            elif kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(text)
            else:
                raise ConstraintError(f"unknown grammar kind {kind!r}")
        except ValueError as e:  # not JSON, or GBNF that does not convert
            raise ConstraintError(f"invalid {kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, vocabulary.lltokenizer(), limits=_limits())
        if error:
            raise ConstraintError(f"invalid {kind}: {error.strip()}")
        return cls.of(grammar)


class ProposalCheck:
    """A speculating sequence's grammar as the coordinator follows it (its own matcher, moved on
    by the tokens kept): how much of a proposal the grammar allows, so that a step never carries
    a proposal the sampler would have to refuse."""

    def __init__(self, vocabulary: Vocabulary, grammar: Grammar):
        self.matcher = llguidance.LLMatcher(vocabulary.lltokenizer(), grammar.text, log_level=0, limits=_limits())

    def allowed(self, proposal: list[int]) -> list[int]:
        """The longest start of `proposal` the grammar allows after the tokens kept so far."""
        return proposal[: self.matcher.validate_tokens(proposal)] if proposal else proposal

    def kept(self, token: int) -> None:
        self.matcher.consume_token(token)  # a failure leaves it in its error state: no proposal passes


# -- what a row tells the sampler ---------------------------------------------------------------


# -- matchers, next to the sampler ---------------------------------------------------------------


class _SlotMatcher:
    def __init__(self, key: str, matcher: llguidance.LLMatcher, consumed: int):
        self.key, self.matcher, self.consumed = key, matcher, consumed
        self.next_mask: Future | None = None  # computed while the next step goes round the ring


def _mask(matcher: llguidance.LLMatcher) -> np.ndarray:
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)


class Matchers:
    """The matcher of every constrained sequence slot on the sampling stage. Used by one thread
    at a time (a stage's); the vocabulary may arrive from another. A slot's next mask is computed
    in the background as soon as its token is consumed (llguidance lets go of the GIL), so the
    step that needs it rarely waits."""

    def __init__(self):
        self._vocabulary: Vocabulary | None = None
        self._arrived = threading.Event()
        self._slots: dict[int, _SlotMatcher] = {}
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def use_vocabulary(self, vocabulary: Vocabulary) -> None:
        self._vocabulary = vocabulary
        self._arrived.set()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if not self._arrived.wait(VOCABULARY_WAIT):
            raise ValueError("constrained decoding: the sampling stage never received the vocabulary")
        return self._vocabulary.lltokenizer()

    def prepare(self, slot: int, constraint: RowConstraint) -> None:
        """Rebuild the slot's matcher when the row carries its grammar, else check it is in step."""
        if constraint.grammar is not None:
            matcher = llguidance.LLMatcher(self._lltokenizer(), constraint.grammar, log_level=0, limits=_limits())
            if constraint.tokens and not matcher.consume_tokens(constraint.tokens):
                raise ValueError(f"constrained decoding: the token history breaks the grammar: {matcher.get_error()}")
            if matcher.is_error():
                raise ValueError(f"constrained decoding: {matcher.get_error()}")
            self._slots[slot] = _SlotMatcher(constraint.key, matcher, constraint.consumed)
            return
        state = self._slots.get(slot)
        if state is None or state.key != constraint.key or state.consumed != constraint.consumed:
            raise ValueError(f"constrained decoding: slot {slot}'s matcher is not at the row's token")

    def allowed(self, slot: int, vocab: int) -> torch.Tensor:
        """The tokens the slot's grammar allows next: a bool mask over `vocab` logits."""
        state = self._slots[slot]
        mask = state.next_mask.result() if state.next_mask is not None else _mask(state.matcher)
        state.next_mask = None
        if mask.size < vocab:
            mask = np.concatenate([mask, np.zeros(vocab - mask.size, dtype=bool)])
        mask = mask[:vocab]
        if not mask.any():  # the matcher failed (a limit hit): end the sequence rather than babble
            mask[self._vocabulary.eos[0]] = True
        return torch.from_numpy(mask)

    def consume(self, slot: int, token: int) -> None:
        state = self._slots[slot]
        state.matcher.consume_token(token)  # a failure leaves it in its error state: only EOS from then on
        state.consumed += 1
        state.next_mask = self._ahead.submit(_mask, state.matcher)

    def close(self) -> None:
        self._slots.clear()
        self._ahead.shutdown(wait=False, cancel_futures=True)
