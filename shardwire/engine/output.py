"""What a sequence's generated tokens show: its detokenizer's text, held back where it may be the
start of a stop string, and where it ends (a stop token, a stop string)."""

from __future__ import annotations


class Output:
    def __init__(self, tokenizer, prompt: list[int], stops: list[str], ignore_eos: bool, kept=frozenset()):
        self.detok = tokenizer.stream_decoder(after=prompt, kept=kept) if tokenizer is not None else None
        self.stop_ids = frozenset() if ignore_eos or tokenizer is None else tokenizer.stop_ids
        self.stops = [s for s in stops or () if s]
        self.pending = ""  # text held back: it may be the start of a stop string

    def token(self, token: int) -> tuple[str, bool]:
        """The text to show now that `token` came, and whether the sequence stops here."""
        if token in self.stop_ids:
            return "", True
        text = self.detok.feed(token) if self.detok is not None else ""
        if not self.stops:
            return text, False
        pending = self.pending + text
        hits = [pending.find(s) for s in self.stops if s in pending]
        if hits:
            self.pending, self.detok = "", None  # what follows the stop string is not shown
            return pending[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(pending)), 0, -1):
                if pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def tail(self) -> str:
        """What is left to show when the sequence ends by a stop or its length."""
        return self.pending + (self.detok.flush() if self.detok is not None else "")
