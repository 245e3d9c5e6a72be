"""Token sampling, on the stage that holds the output head.

Randomness is a pure function of (seed, position): a sequence replayed after a failure, or
sampled on a different machine, draws exactly the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np
import torch

from .wire.messages import Sampled

MAX_LOGIT_BIAS = 1024  # entries; they travel with every step


def _bias_pairs(pairs) -> tuple[tuple[int, float], ...]:
    """Checked (id, bias) pairs, by id; from a wire dict they arrive as lists."""
    if not isinstance(pairs, (tuple, list)) or len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError("logit_bias entries are (token id, bias) pairs")
        token, bias = pair
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 1 << 31:
            raise ValueError("logit_bias token ids must be non-negative ints")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not number or not (-100 <= bias <= 100 or bias == -math.inf):
            raise ValueError("a logit_bias value must be in [-100, 100], or -inf to ban the token")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int = 0
    logprobs: int | None = None  # how many top alternatives to report; None: no logprobs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf bans it

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first: one argmax over a batch can serve it."""
        return self.greedy and self.logprobs is None and not self.logit_bias

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_dict(self) -> dict:
        return dict(self._fields)

    @cached_property
    def _fields(self) -> dict:
        """Made once: a request's parameters go out with each of its steps."""
        out = asdict(self)
        if not self.logit_bias:
            del out["logit_bias"]  # the common case stays off the wire
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        return cls(**d)


GREEDY = SamplingParams(temperature=0.0)


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) for the token at `position` of a sequence seeded with `seed`."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, position), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def _penalize(logits: torch.Tensor, params: SamplingParams, recent: list[int]) -> torch.Tensor:
    counts = Counter(recent[-params.repeat_last_n :] if params.repeat_last_n else [])
    if not counts:
        return logits
    logits = logits.clone()
    ids = torch.tensor(list(counts))
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    values = logits[ids]
    values = torch.where(values > 0, values / params.repeat_penalty, values * params.repeat_penalty)
    logits[ids] = values - n * params.frequency_penalty - params.presence_penalty
    return logits


# PyTorch's CPU argmax and top-k are ~20x slower than numpy's on one vector, and numpy's exp is
# ~10x slower than PyTorch's: selection runs on numpy views, arithmetic on tensors.


def _largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits, largest first."""
    x = logits.numpy()
    ids = np.argpartition(x, -k)[-k:] if k < x.size else np.arange(x.size)
    return torch.from_numpy(ids[np.argsort(-x[ids], kind="stable")])


def _candidates(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """Ids of the tokens that survive top-k, top-p and min-p, or None for all of them. Sorted
    by logit when top-k or top-p need an order; None spares any sort of 100k+ logits per token
    under OpenAI's defaults."""
    vocab = logits.numel()
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        if params.min_p <= 0:
            return None
        return torch.nonzero(logits >= logits.max() + math.log(params.min_p)).flatten()
    if k < vocab:
        ids = _largest(logits, k)
        probs = torch.softmax(logits[ids], dim=-1)
    else:
        # The nucleus of the full distribution: widen a window of the largest logits until it
        # holds top_p of the mass, so the cut never needs the whole sorted vocabulary.
        full = torch.softmax(logits, dim=-1)
        window = 64
        while True:
            ids = _largest(logits, min(window, vocab))
            if window >= vocab or float(full[ids].sum()) >= params.top_p:
                break
            window *= 4
        probs = full[ids]
    keep = ids.numel()
    if params.top_p < 1.0:  # ids are sorted here
        keep = min(keep, int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(params.top_p))) + 1)
    ids, probs = ids[:keep], probs[:keep]
    if params.min_p > 0:
        ids = ids[probs >= params.min_p * probs.max()]
    return ids


def _bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    ids = [i for i, _ in params.logit_bias if i < logits.numel()]
    if not ids:
        return logits
    logits = logits.clone()
    logits[ids] += torch.tensor([b for i, b in params.logit_bias if i < logits.numel()], dtype=logits.dtype)
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    recent: list[int] | None = None,
    allowed: torch.Tensor | None = None,
) -> Sampled:
    """Pick the token at `position` from the logits [vocab] of one sequence; `allowed`, a bool
    mask over them, is what a grammar permits.

    Order as llama.cpp's default chain: logit bias, grammar, penalties, top-k, top-p, min-p,
    temperature, draw. Logprobs are the model's own, before any of these.
    """
    logits = logits.detach().float().cpu().contiguous()
    raw = logits
    if params.logit_bias:
        logits = _bias(logits, params)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    if params.penalized and recent:
        logits = _penalize(logits, params, recent)
    if params.greedy:
        token = int(np.argmax(logits.numpy()))
    else:
        ids = _candidates(logits, params)
        values = logits if ids is None else logits[ids]
        cdf = torch.cumsum(torch.exp((values - values.max()) / params.temperature), 0, dtype=torch.float64)
        u = torch.tensor(uniform(params.seed, position) * float(cdf[-1]), dtype=torch.float64)
        pick = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
        token = pick if ids is None else int(ids[pick])
    if params.logprobs is None:
        return Sampled(token)
    logp = torch.log_softmax(raw.double(), dim=-1)
    top = []
    if params.logprobs:
        top = [(int(i), float(logp[i])) for i in _largest(logp, params.logprobs)]
    value = float(logp[token])
    return Sampled(token, value if math.isfinite(value) else -1e30, top)
