"""A draft model for speculative decoding (llama-server's -md): a small model of the target's
vocabulary, whole in the coordinator's process, writing greedily what a sequence likely goes on
with. It keeps a cache per sequence slot; each call feeds it the sequence's tokens it has not
seen (after a step, the proposals kept and the token drawn after them), the positions past them
are written over."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..constrain import vocabulary_of
from ..model import Stage

MAX_SIZE_DIFFERENCE = 128  # vocabularies may differ by this many tokens at their end, as llama.cpp allows


def check_vocabularies(target, draft) -> None:
    """A ValueError unless the draft's tokenizer gives every text the target's ids: the same
    tokens under the same ids (where both have them) and the same end-of-sequence tokens."""
    a, b = vocabulary_of(target), vocabulary_of(draft)
    if abs(len(a.tokens) - len(b.tokens)) > MAX_SIZE_DIFFERENCE:
        raise ValueError(
            f"the draft model's vocabulary has {len(b.tokens)} tokens, the model's {len(a.tokens)}: "
            "a draft model must share the model's vocabulary"
        )
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            raise ValueError(
                f"the draft model's token {i} is {y!r} where the model's is {x!r}: "
                "a draft model must share the model's vocabulary"
            )
    if sorted(a.eos) != sorted(b.eos):
        raise ValueError(f"the draft model ends sequences with tokens {b.eos}, the model with {a.eos}")


class DraftModel:
    """The draft model's stage (all its blocks, its cache allocated for `n_slots` sequences of
    up to `ctx` positions), for the engine's thread alone."""

    def __init__(self, stage: Stage, n_slots: int, ctx: int):
        if not (stage.first and stage.last):
            raise ValueError("a draft model runs whole: one stage with its embedding and its head")
        self.stage, self.ctx = stage, ctx
        stage.allocate_cache(n_slots, ctx)
        self._held: dict[int, list[int]] = {}  # slot -> the tokens whose keys and values its cache holds
        self.seconds_per_token = 0.0  # what a proposal has cost to write, a moving average

    def continuation(self, slot: int, tokens: list[int], k: int, p_min: float = 0.0) -> list[int]:
        """Up to k tokens the draft model would write greedily after `tokens`; fewer where its
        most likely next token is less likely than p_min."""
        k = min(k, self.ctx - len(tokens))  # its context may be shorter than the model's
        if k <= 0:
            return []
        held = self._held.get(slot, [])
        same = 0
        for x, y in zip(held, tokens[:-1]):  # the last token is fed again for its logits
            if x != y:
                break
            same += 1
        started = time.perf_counter()
        logits = self.stage([tokens[same:]], [slot], [same])
        if same < len(tokens) - 1:  # a prompt caught up with is not what a proposal costs
            started = time.perf_counter()
        held = list(tokens)
        out: list[int] = []
        while True:
            row = logits[0, -1]
            token = int(np.argmax(row.numpy())) if row.dtype == torch.float32 else int(row.argmax())
            if p_min > 0 and float(torch.softmax(row.float(), -1)[token]) < p_min:
                break
            out.append(token)
            if len(out) == k:
                break
            logits = self.stage([[token]], [slot], [len(held)])
            held.append(token)
        self._held[slot] = held
        if out:
            seconds = (time.perf_counter() - started) / len(out)
            self.seconds_per_token += 0.2 * (seconds - self.seconds_per_token) if self.seconds_per_token else seconds
        return out
