"""Speculative decoding's proposals: the tokens a sequence will likely go on with, for its next
decode step to check all at once (pipeline/local.py: a row's proposals), and how many of them a
step should carry.

Prompt lookup: the sequence's last n tokens (n from `ngram` down to 2) are looked up earlier in
its own context, prompt and output; the tokens that followed them there are the proposal. It
costs no model and is right where the output repeats its input: editing code, summarising,
answering from a document, repeating structure.

How many to send is decided per step from what was measured: the sequence's acceptance rate
(the chance that a proposal is kept once those before it were) and what a decode step of each
width has cost. k proposals are worth their step when the tokens they are expected to yield,
(1 - a^(k+1)) / (1 - a), per second of a step of width k + 1, beat one token per second of a step
of width 1; a sequence whose proposals are rarely kept stops proposing, and so costs no more
than decoding one token at a time, but for a probe now and then that keeps its rate current
(none where even proposals all kept could not pay for their step).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_NGRAM = 2
PROBE_EVERY = 32  # steps a sequence that stopped proposing waits before it proposes again
PAYS = 1.1  # a step's proposals are worth probing where, all kept, they would give this many tokens per step's time
FORGET = 0.9  # what a step's count of kept and refused proposals weighs, one step later
PRIOR = (1.0, 1.0)  # (kept, refused) before anything was measured: a rate of one half


@dataclass(frozen=True)
class Speculation:
    """How a request's decode steps propose tokens, with llama-server's names: at most `n_max`
    proposals a step, none where fewer than `n_min` would go; prompt lookup matches n-grams of
    up to `ngram` tokens (its --spec-ngram-size-n)."""

    n_max: int = 16
    n_min: int = 0
    ngram: int = 3

    def __post_init__(self):
        if not 0 <= self.n_min <= self.n_max <= 64:
            raise ValueError("speculative n_min and n_max must satisfy 0 <= n_min <= n_max <= 64")
        if not MIN_NGRAM <= self.ngram <= 64:
            raise ValueError(f"speculative ngram size must be in [{MIN_NGRAM}, 64]")


class StepCosts:
    """What a decode step has cost, from its sending to its result, by width (tokens per row): a
    moving average of each width measured, for the engine's thread alone."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self._seconds: dict[int, float] = {}
        self._first: set[int] = set()  # widths whose first step came back

    def add(self, width: int, seconds: float) -> None:
        if width not in self._first:  # a width's first step also builds its graphs: not its cost
            self._first.add(width)
            return
        old = self._seconds.get(width)
        self._seconds[width] = seconds if old is None else old + self.weight * (seconds - old)

    def of(self, width: int) -> float | None:
        """The cost of a step of `width`: measured, else on the line through the nearest widths
        measured on either side of it, or the two widest when it is wider than all (a wider step
        costs no less than a narrower one); with one width measured, that width's cost."""
        measured = self._seconds
        if width in measured:
            return measured[width]
        if not measured:
            return None
        widths = sorted(measured)
        below = [w for w in widths if w < width]
        above = [w for w in widths if w > width]
        if not below:
            return measured[above[0]]
        if above:
            a, b = below[-1], above[0]
        elif len(below) >= 2:
            a, b = below[-2], below[-1]
        else:
            return measured[below[-1]]
        slope = max(0.0, (measured[b] - measured[a]) / (b - a))
        return measured[a] + slope * (width - a)


class Drafter:
    """One sequence's prompt lookup and acceptance rate."""

    def __init__(self, speculation: Speculation):
        self.speculation = speculation
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(speculation.ngram + 1)]
        self._seen = 0  # tokens indexed
        self.kept, self.refused = PRIOR
        self._waited = 0

    def _extend(self, tokens: list[int]) -> None:
        """Index each n-gram of tokens by where the token after its latest occurrence is."""
        for t in range(max(self._seen, 1), len(tokens)):
            for n in range(MIN_NGRAM, min(self.speculation.ngram, t) + 1):
                self._index[n][tuple(tokens[t - n : t])] = t
        self._seen = len(tokens)

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest n-gram
        tokens end with."""
        self._extend(tokens)
        for n in range(min(self.speculation.ngram, len(tokens) - 1), MIN_NGRAM - 1, -1):
            follows = self._index[n].get(tuple(tokens[-n:]))
            if follows is not None:
                return tokens[follows : follows + limit]
        return []

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.refused)

    def checked(self, proposed: int, kept: int) -> None:
        """A step checked `proposed` of this sequence's tokens and kept the first `kept`: the
        rate moves towards what the latest steps showed (a passage copied, then new text)."""
        self.kept = self.kept * FORGET + kept
        self.refused = self.refused * FORGET + (kept < proposed)

    def length(self, found: int, costs: StepCosts, room: int) -> int:
        """How many of `found` proposals the next step should carry (at most `room`)."""
        spec = self.speculation
        most = min(found, spec.n_max, room)
        if most < max(spec.n_min, 1):
            return 0
        base = costs.of(1)
        if base is None:
            return most  # nothing measured yet: this step measures
        a = min(self.rate, 0.999)
        best, best_value, could_pay = 0, 1.0, False
        for k in range(1, most + 1):
            speed = base / costs.of(k + 1)
            could_pay |= (k + 1) * speed > PAYS  # were every proposal kept
            value = (1 - a ** (k + 1)) / (1 - a) * speed
            if value > best_value:
                best, best_value = k, value
        if best < spec.n_min:
            best = 0
        if best == 0 and could_pay:
            self._waited += 1
            if self._waited >= PROBE_EVERY:  # a proposal now and then, to see whether the rate changed
                self._waited = 0
                return max(1, spec.n_min)
        return best
