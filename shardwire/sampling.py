"""Token sampling, on the stage that holds the output head.

Randomness is a pure function of (seed, position): a sequence replayed after a failure, or
sampled on a different machine, draws exactly the same tokens.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch


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

    def __post_init__(self):
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
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        return cls(**d)


GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def uniform(seed: int, position: int) -> float:
    """The random number for the token at `position` of a sequence seeded with `seed`."""
    return random.Random(f"{seed}:{position}").random()


def _penalize(logits: torch.Tensor, params: SamplingParams, recent: list[int]) -> torch.Tensor:
    counts = Counter(recent[-params.repeat_last_n:] if params.repeat_last_n else [])
    if not counts:
        return logits
    logits = logits.clone()
    ids = torch.tensor(list(counts), device=logits.device)
    n = torch.tensor(list(counts.values()), device=logits.device, dtype=logits.dtype)
    values = logits[ids]
    values = torch.where(values > 0, values / params.repeat_penalty, values * params.repeat_penalty)
    values = values - n * params.frequency_penalty - params.presence_penalty
    logits[ids] = values
    return logits


def _candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, token ids) that survive top-k, top-p and min-p. Sorted by logit when top-k or
    top-p need an order; otherwise the whole vocabulary in id order, which spares a sort of
    100k+ logits per token under OpenAI's defaults."""
    vocab = logits.numel()
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        values, ids = logits, torch.arange(vocab, device=logits.device)
        probs = torch.softmax(values, dim=-1)
    elif k < vocab:
        values, ids = torch.topk(logits, k)
        probs = torch.softmax(values, dim=-1)
    else:
        # The nucleus of the full distribution: widen a window of the largest logits until it
        # holds top_p of the mass, so the cut never needs the whole sorted vocabulary.
        full = torch.softmax(logits, dim=-1)
        window = 64
        while True:
            values, ids = torch.topk(logits, min(window, vocab))
            if window >= vocab or float(full[ids].sum()) >= params.top_p:
                break
            window *= 4
        probs = full[ids]
    keep = values.numel()
    if params.top_p < 1.0:  # values are sorted here
        keep = min(keep, int(torch.searchsorted(torch.cumsum(probs, 0), torch.tensor(params.top_p))) + 1)
    if params.min_p > 0:
        mask = probs[:keep] >= params.min_p * probs.max()
        if not bool(mask.all()):
            return values[:keep][mask], ids[:keep][mask]
    return values[:keep], ids[:keep]


def sample(logits: torch.Tensor, params: SamplingParams, position: int,
           recent: list[int] | None = None) -> Sampled:
    """Pick the token at `position` from float32 `logits` [vocab].

    Order as llama.cpp's default chain: penalties, top-k, top-p, min-p, temperature, draw.
    """
    raw = logits
    if params.penalized and recent:
        logits = _penalize(logits, params, recent)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        values, ids = _candidates(logits, params)
        probs = torch.softmax(values.double().cpu() / params.temperature, dim=-1)
        cdf = torch.cumsum(probs, 0)
        u = torch.tensor(uniform(params.seed, position) * float(cdf[-1]), dtype=torch.float64)
        pick = int(torch.searchsorted(cdf, u, right=True))
        token = int(ids[min(pick, ids.numel() - 1)])
    if params.logprobs is None:
        return Sampled(token)
    logp = torch.log_softmax(raw.float(), dim=-1)
    top = []
    if params.logprobs:
        values, ids = torch.topk(logp, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
    value = float(logp[token])
    return Sampled(token, value if math.isfinite(value) else -1e30, top)
