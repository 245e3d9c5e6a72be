"""Thinking models write their reasoning between tags before the answer (<think>...</think> in
Qwen3, QwQ and DeepSeek-R1). llama-server returns it apart, as message.reasoning_content (and
delta.reasoning_content when streamed); so does shardwire, for models whose chat template uses
the tags. A template may open the block itself (DeepSeek-R1's ends the prompt with <think>), so
the reply can start inside it. gpt-oss writes its reasoning in harmony's analysis channel instead
(harmony.py), read apart the same way."""

from __future__ import annotations

HARMONY = ("<|channel|>", "<|message|>")  # not tags around reasoning: the marks of harmony's messages
TAGS = (("<think>", "</think>"), HARMONY)


def tags_of(template: str | None) -> tuple[str, str] | None:
    """The reasoning tags a chat template writes (or HARMONY), if any."""
    return next((tags for tags in TAGS if template and tags[0] in template), None)


def opens_thinking(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether the template left the prompt inside an open block (the reply starts in it)."""
    return tags != HARMONY and prompt.rstrip().endswith(tags[0])


def close_thinking(prompt: str, tags: tuple[str, str]) -> str:
    """With thinking off: a block the template opened is closed, so the reply is the answer (what
    llama-server does with --reasoning off)."""
    return prompt + tags[1] if opens_thinking(prompt, tags) else prompt


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class ReasoningSplit:
    """Streamed text into (reasoning, answer) pieces; a piece that may be part of a tag is held
    until the next one says. The reasoning comes without the blank space around it (as the whole
    reply's reasoning_content, and llama-server's): blank space at its end is held until more of
    it follows."""

    def __init__(self, tags: tuple[str, str], inside: bool):
        self.open, self.close = tags
        self.state = "reasoning" if inside else "start"
        self.held = ""
        self.reasoned = False  # some reasoning came out: blank space before more of it is kept

    def _reasoning(self, text: str) -> str:
        if not self.reasoned:
            text = text.lstrip()
            self.reasoned = bool(text)
        return text

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        reasoning = answer = ""
        while buf or self.state == "start":
            if self.state == "start":  # the reply may open a block (after blank space)
                lead = buf.lstrip()
                if lead.startswith(self.open):
                    buf, self.state = lead[len(self.open) :], "reasoning"
                    continue
                if self.open.startswith(lead):  # blank, or the tag's start: wait for more
                    self.held = buf
                    return reasoning, answer
                self.state = "answer"
            elif self.state == "reasoning":
                end = buf.find(self.close)
                if end >= 0:
                    reasoning += self._reasoning(buf[:end].rstrip())
                    buf, self.state = buf[end + len(self.close) :], "after"
                    continue
                said = buf[: len(buf) - held_back(buf, self.close)].rstrip()
                reasoning += self._reasoning(said)
                self.held = buf[len(said) :]
                return reasoning, answer
            elif self.state == "after":  # blank space between the reasoning and the answer
                buf = buf.lstrip()
                if buf:
                    self.state = "answer"
            else:
                answer += buf
                buf = ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The end of the reply: what is held is what it looked like (an unclosed block stays
        reasoning)."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return self._reasoning(held.rstrip()), ""
        return "", held if self.state in ("start", "answer") and held.strip() else ""
