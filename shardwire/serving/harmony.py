"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.                  (then <|return|>)
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

(the last one a tool call, then <|call|>). llama-server returns the analysis channel as
reasoning_content, the final channel as content, and each message addressed to=functions.NAME as a
tool call; so does shardwire. HarmonySplit reads the stream as ReasoningSplit reads <think> tags;
a call message reaches the answer in one form, CALL_OPEN NAME <|message|> ARGUMENTS <|end|>, which
tools.py reads."""

from __future__ import annotations

import re

from .reasoning import HARMONY, ReasoningSplit, held_back

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
CALL_OPEN = "<|channel|>commentary to=functions."
CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(MESSAGE) + r"(.*?)" + re.escape(END), re.DOTALL)
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonySplit:
    """Streamed harmony text into (reasoning, answer) pieces. Text before any header (a model that
    does not write harmony) is answer as it is."""

    def __init__(self):
        self.state = "start"  # start | header | body | plain (not harmony)
        self.kind = ""  # the body's: reasoning | answer
        self.calling = False  # whether the body is a call's arguments
        self.held = ""

    def _header(self, header: str) -> tuple[str, str]:
        """Where a message with this header goes, and what the answer gets before its body."""
        recipient = _RECIPIENT.search(header)
        if recipient:
            return "answer", CALL_OPEN + recipient[1] + MESSAGE
        channel = _CHANNEL.search(header)
        return ("reasoning" if channel and channel[1] == "analysis" else "answer"), ""

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        out = {"reasoning": "", "answer": ""}
        while buf:
            if self.state == "start":  # a reply opens with a header, or is not harmony
                lead = buf.lstrip()
                if lead.startswith((CHANNEL, START)):
                    buf, self.state = lead, "header"
                elif CHANNEL.startswith(lead) or START.startswith(lead):
                    self.held = buf
                    break
                else:
                    out["answer"] += buf
                    buf, self.state = "", "plain"
            elif self.state == "plain":
                out["answer"] += buf
                buf = ""
            elif self.state == "header":
                at = buf.find(MESSAGE)
                if at < 0:
                    self.held = buf
                    break
                self.kind, opening = self._header(buf[:at])
                out["answer"] += opening
                self.calling = bool(opening)
                buf, self.state = buf[at + len(MESSAGE) :], "body"
            else:  # body: to the end of the message, or the next one's start
                ends = [i for i in (buf.find(END), buf.find(START)) if i >= 0]
                if ends:
                    at = min(ends)
                    out[self.kind] += buf[:at] + (END if self.calling else "")
                    buf = buf[at:]
                    buf = buf[len(END) :] if buf.startswith(END) else buf
                    self.state = "header"
                    buf = buf.lstrip()
                    continue
                keep = max(held_back(buf, END), held_back(buf, START))
                out[self.kind] += buf[: len(buf) - keep]
                self.held = buf[len(buf) - keep :]
                break
        return out["reasoning"], out["answer"]

    def flush(self) -> tuple[str, str]:
        """The end of the reply (<|return|> or <|call|>, which are not rendered): a body ends there."""
        held, self.held = self.held, ""
        if self.state == "body":
            closing = END if self.calling else ""
            return (held, "") if self.kind == "reasoning" else ("", held + closing)
        return "", held if self.state in ("start", "plain") else ""


def splitter(tags: tuple[str, str], inside: bool) -> HarmonySplit | ReasoningSplit:
    """What reads a reply's reasoning apart from its answer (reasoning.tags_of's `tags`): feed(text)
    -> (reasoning, answer), flush() at its end."""
    return HarmonySplit() if tags == HARMONY else ReasoningSplit(tags, inside)
