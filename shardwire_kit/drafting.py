"""A drafter whose acceptance rate is set, for tests and benchmarks of what checking proposals
costs (not of how good a drafter is): it proposes the tokens plain decoding wrote."""

from __future__ import annotations

from shardwire.engine.drafting import Drafter, Speculation, StepCosts


class Scripted(Drafter):
    """Proposes `n` of what plain decoding wrote (`written`, the tokens after the prompt). Where
    `refusing`, one token of the proposals of one step in `every` is wrong, a place further on
    each time (the first, the second ..., then none, again): such a step keeps 0, 1 ... n of its
    proposals in turn."""

    def __init__(
        self, written: list[int], n_prompt: int, vocab_size: int, n: int = 4, refusing: bool = True, every: int = 1
    ):
        super().__init__(Speculation(n_max=n))
        self.written, self.n_prompt, self.vocab_size = written, n_prompt, vocab_size
        self.n, self.refusing, self.every = n, refusing, every
        self.steps = 0

    def propose(
        self, tokens: list[int], costs: StepCosts, room: int, known: int | None = None, guess: int = 0
    ) -> list[int]:
        at = len(tokens) - self.n_prompt
        proposal = self.written[at : at + min(self.n, room) + guess]
        step, self.steps = self.steps, self.steps + 1
        wrong = guess + step // self.every % (self.n + 1)
        if self.refusing and step % self.every == 0 and wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % self.vocab_size
        return proposal
