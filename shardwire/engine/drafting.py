"""Speculative decoding's proposals: the tokens a sequence will likely go on with, for its next
decode step to check all at once (pipeline/local.py: a row's proposals), and how many of them a
step should carry.

Prompt lookup: the sequence's last n tokens (n from `ngram` down to 2) are looked up earlier in
its own context, prompt and output; the tokens that followed them there are the proposal. It
costs no model and is right where the output repeats its input: editing code, summarising,
answering from a document, repeating structure. A draft model (draft_model.py): a small model of
the same vocabulary writes the proposal, greedily, in this process.

How many to send is decided per step from what was measured: the sequence's acceptance rate
(the chance that a proposal is kept once those before it were) and what a decode step of each
width has cost. k proposals are worth their step when the tokens they are expected to yield,
(1 - a^(k+1)) / (1 - a), per second of a step of width k + 1, beat one token per second of a step
of width 1 (a draft model's time to write them counts with its step); a sequence whose
proposals are rarely kept stops proposing, and so costs no more
than decoding one token at a time, but for a probe now and then that keeps its rate current
(none where even proposals all kept could not pay for their step).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..averages import moved

MIN_NGRAM = 2
# the widths a step may take (tokens per row): a few, so that a stage keeps a decode graph built for
# each (ggml's graphs are built per row count) and the engine has measured each
WIDTHS = (2, 4, 8, 16, 32, 64)
MAX_PROPOSALS = 64  # a step's, at most
PROBE_EVERY = 32  # steps a sequence that stopped proposing waits before it proposes again
PAYS = 1.1  # a step's proposals are worth probing where, all kept, they would give this many tokens per step's time
FORGET = 0.9  # what a step's count of kept and refused proposals weighs, one step later
PRIOR_WEIGHT = 2.0  # steps' worth of counts a new sequence starts from (the engine's rate)


KINDS = ("ngram-simple", "draft-simple")  # llama-server's names: prompt lookup, a draft model


@dataclass(frozen=True)
class Speculation:
    """How a request's decode steps propose tokens, with llama-server's names: `kind` (prompt
    lookup, or the server's draft model), at most `n_max` proposals a step, none where fewer than
    `n_min` would go; prompt lookup matches n-grams of up to `ngram` tokens (its
    --spec-ngram-size-n); a draft model stops proposing where its most likely token is less
    likely than `p_min`."""

    kind: str = "ngram-simple"
    n_max: int = 16
    n_min: int = 0
    ngram: int = 3
    p_min: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"speculative type must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not 0 <= self.n_min <= self.n_max <= MAX_PROPOSALS:
            raise ValueError(f"speculative n_min and n_max must satisfy 0 <= n_min <= n_max <= {MAX_PROPOSALS}")
        if not MIN_NGRAM <= self.ngram <= 64:
            raise ValueError(f"speculative ngram size must be in [{MIN_NGRAM}, 64]")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError("speculative p_min must be in [0, 1]")


class StepCosts:
    """What a decode step has cost, from its sending to its result, by width (tokens per row): a
    moving average of each width measured, for the engine's thread alone."""

    def __init__(self):
        self._seconds: dict[int, float] = {}
        self._widths: list[int] = []  # those measured, in order
        self._first: set[int] = set()  # widths whose first step came back

    def add(self, width: int, seconds: float) -> None:
        if width not in self._first:  # a width's first step also builds its graphs: not its cost
            self._first.add(width)
            return
        old = self._seconds.get(width)
        if old is None:
            bisect.insort(self._widths, width)
        self._seconds[width] = moved(old, seconds)

    def measured(self, width: int) -> bool:
        return width in self._seconds

    def by_width(self) -> dict[int, float]:
        """Each width measured and its cost."""
        return {width: self._seconds[width] for width in self._widths}

    def of(self, width: int) -> float | None:
        """The cost of a step of `width`: measured, else on the line through the nearest widths
        measured on either side of it, or the two widest when it is wider than all (a wider step
        costs no less than a narrower one); with one width measured, that width's cost."""
        measured, widths = self._seconds, self._widths
        if width in measured:
            return measured[width]
        if not widths:
            return None
        i = bisect.bisect(widths, width)  # widths[:i] are narrower
        if i == 0:
            return measured[widths[0]]
        if i < len(widths):
            a, b = widths[i - 1], widths[i]
        elif i >= 2:
            a, b = widths[i - 2], widths[i - 1]
        else:
            return measured[widths[0]]
        slope = max(0.0, (measured[b] - measured[a]) / (b - a))
        return measured[a] + slope * (width - a)


class Acceptance:
    """How often proposals are kept: counts of kept proposals and of refusals (a step that kept
    fewer than it checked), each weighing FORGET less a step later."""

    def __init__(self, kept: float = 0.0, refused: float = 0.0):
        self.kept, self.refused = kept, refused

    @property
    def rate(self) -> float:
        """The chance that a proposal is kept once those before it were; one half before any was checked."""
        seen = self.kept + self.refused
        return self.kept / seen if seen else 0.5

    def checked(self, proposed: int, kept: int) -> None:
        self.kept = self.kept * FORGET + kept
        self.refused = self.refused * FORGET + (kept < proposed)

    def prior(self) -> "Acceptance":
        """A new sequence's start: this rate, weighing as much as a couple of its own steps."""
        return Acceptance(PRIOR_WEIGHT * self.rate, PRIOR_WEIGHT * (1 - self.rate))


class Drafter:
    """One sequence's proposals and acceptance rate (starting from `prior`: the engine's, over
    the sequences before it), and how many proposals its next step should carry."""

    def __init__(self, speculation: Speculation, prior: Acceptance | None = None):
        self.speculation = speculation
        self.acceptance = (prior or Acceptance()).prior()
        self._waited = 0

    def propose(
        self, tokens: list[int], costs: StepCosts, room: int, known: int | None = None, guess: int = 0
    ) -> list[int]:
        """What the sequence's next step proposes after `tokens` (at most `room`). A step sent
        ahead (engine.core: while those before it are in flight) proposes after what they are
        expected to give: only the first `known` of `tokens` are the sequence's, and its first
        `guess` tokens are a guess at the token the step before it samples."""
        raise NotImplementedError

    def filler(self, tokens: list[int], skip: int, n: int) -> list[int]:
        """Up to n more likely tokens after the first `skip` of a proposal, where a step is wider
        than this sequence's proposal."""
        return []

    def checked(self, proposed: int, kept: int) -> None:
        """A step checked `proposed` of this sequence's tokens and kept the first `kept`: the
        rate moves towards what the latest steps showed (a passage copied, then new text)."""
        self.acceptance.checked(proposed, kept)

    def length(self, found: int, costs: StepCosts, room: int, per_proposal: float = 0.0) -> int:
        """How many of `found` proposals the next step should carry (at most `room`), each costing
        `per_proposal` seconds to make."""
        spec = self.speculation
        most = min(found, spec.n_max, room)
        if most < max(spec.n_min, 1):
            return 0
        base = costs.of(1)
        if base is None:  # nothing measured yet
            return 1
        a = min(self.acceptance.rate, 0.999)
        best, best_value, could_pay = 0, 1.0, False
        # a width is tried once the one half as wide has been measured: the widths a stage takes
        # fast are found a step at a time, without paying for one far past them
        for k in (w - 1 for w in WIDTHS if w - 1 <= most and (w == 2 or costs.measured(w // 2))):
            speed = base / (costs.of(k + 1) + k * per_proposal)
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


class Lookup(Drafter):
    """Prompt lookup over the sequence's own tokens."""

    def __init__(self, speculation: Speculation, prior: Acceptance | None = None):
        super().__init__(speculation, prior)
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(speculation.ngram + 1)]
        self._seen = 0  # tokens indexed

    def _extend(self, tokens: list[int], known: int) -> None:
        """Index each n-gram of the first `known` tokens by where the token after its latest
        occurrence is (the sequence's own: tokens past them may yet be taken back)."""
        for t in range(max(self._seen, 1), known):
            for n in range(MIN_NGRAM, min(self.speculation.ngram, t) + 1):
                self._index[n][tuple(tokens[t - n : t])] = t
        self._seen = max(self._seen, known)

    def lookup(self, tokens: list[int], limit: int, known: int | None = None) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest n-gram
        tokens end with (among the first `known`)."""
        self._extend(tokens, len(tokens) if known is None else known)
        for n in range(min(self.speculation.ngram, len(tokens) - 1), MIN_NGRAM - 1, -1):
            follows = self._index[n].get(tuple(tokens[-n:]))
            if follows is not None:
                return tokens[follows : follows + limit]
        return []

    def propose(
        self, tokens: list[int], costs: StepCosts, room: int, known: int | None = None, guess: int = 0
    ) -> list[int]:
        found = self.lookup(tokens, min(self.speculation.n_max, room) + guess, known)
        return found[: guess + self.length(len(found) - guess, costs, room)] if len(found) >= guess else []

    def filler(self, tokens: list[int], skip: int, n: int) -> list[int]:
        return self.lookup(tokens, skip + n)[skip:]


class ByModel(Drafter):
    """A draft model's greedy continuation (draft_model.py), in the sequence's slot of it."""

    def __init__(self, speculation: Speculation, prior: Acceptance | None, model, slot: int):
        super().__init__(speculation, prior)
        self.model, self.slot = model, slot

    def propose(
        self, tokens: list[int], costs: StepCosts, room: int, known: int | None = None, guess: int = 0
    ) -> list[int]:
        k = self.length(min(self.speculation.n_max, room), costs, room, self.model.seconds_per_token)
        if not k + guess:
            return []
        found = self.model.continuation(self.slot, tokens, k + guess, self.speculation.p_min)
        return found if len(found) >= guess else []
