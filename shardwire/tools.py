"""OpenAI tool calls: a request's `tools` and `tool_choice` checked, handed to the model's own chat
template, and the calls the model writes read back out of its text.

Two ways models write a call are read: Hermes style, as Qwen2.5/Qwen3 templates ask for,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and Llama 3.x's bare JSON, {"name": ..., "parameters": {...}} (after <|python_tag|> or not; several
calls separated by ";"). tool_choice "required" or a named function constrains the output to one
such JSON object, so the model must write a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

__all__ = ["ToolCall", "ToolSpec", "ToolStream", "parse_tool_calls", "parse_tools", "history_message"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolError(ValueError):
    """A bad tools or tool_choice field; the message says what, `param` which."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}], as given
    choice: str  # "auto", "required" or "function" (one named function)
    name: str | None = None  # with "function": its name
    arguments_key: str = "arguments"  # what the template asks calls to write: arguments or parameters

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def schema(self) -> dict:
        """With a forced choice: the JSON schema of the one call the model must write."""
        options = []
        for tool in self.tools:
            fn = tool["function"]
            if self.choice == "function" and fn["name"] != self.name:
                continue
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.arguments_key: params},
                    "required": ["name", self.arguments_key],
                    "additionalProperties": False,
                }
            )
        return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tools(body: dict, template: str | None) -> ToolSpec | None:
    """The request's tools and tool_choice; None when no tool may be called (no tools, or
    tool_choice "none"). `template` (the chat template's text) tells which call form to force."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {type: function, function: {name, parameters}}", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{param} must be an object of type 'function'", param)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"{param}.function must be an object with a non-empty 'name'", f"{param}.function")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"{param}.function.parameters must be a JSON schema object", f"{param}.function")
        if fn["name"] in seen:
            raise ToolError(f"{param}: the function name {fn['name']!r} is given twice", param)
        seen.add(fn["name"])
    tools = [{"type": "function", "function": t["function"]} for t in tools]
    key = "parameters" if template and PYTHON_TAG in template else "arguments"
    if choice is None or choice == "auto":
        return ToolSpec(tools, "auto", arguments_key=key)
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(tools, "required", arguments_key=key)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in seen:
            raise ToolError(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return ToolSpec(tools, "function", name, arguments_key=key)
    raise ToolError(
        "'tool_choice' must be 'none', 'auto', 'required' or {type: function, function: {name}}", "tool_choice"
    )


def history_message(m: dict, param: str) -> dict:
    """An assistant message's tool_calls made ready for a template: templates write
    `arguments | tojson`, so arguments given as JSON text (as OpenAI sends them) become objects."""
    calls = m.get("tool_calls")
    if calls is None:
        return m
    if not isinstance(calls, list):
        raise ToolError(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{param}.tool_calls[{j}] must have function.name", f"{param}.tool_calls")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # the template gets the text as it came
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return {**m, "tool_calls": out}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self, index: int | None = None) -> dict:
        out = {} if index is None else {"index": index}
        return {**out, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, names: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _bare_json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """Llama 3.x's form: the whole text is one call or several separated by ";"."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].strip()
    if not text.startswith("{"):
        return None
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call(obj, names)
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return calls or None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a model's output. Text that is not a well-formed call of a known
    function stays content; content is None when the text held only calls."""
    if OPEN in text:
        calls, content, last = [], [], 0
        for m in _HERMES.finditer(text):
            try:
                call = _call(json.loads(m[1]), names)
            except ValueError:
                call = None
            if call is None:
                continue
            calls.append(call)
            content.append(text[last : m.start()])
            last = m.end()
        if calls:
            rest = ("".join(content) + text[last:]).strip()
            return rest or None, calls
        return text, []
    calls = _bare_json_calls(text, names)
    if calls:
        return None, calls
    return text, []


class ToolStream:
    """One streamed choice's text, held back from where a tool call may begin: feed() returns
    the text safe to send as content now, finish() what remains as (content, calls)."""

    def __init__(self, names: set[str], forced: bool = False):
        self.names, self.forced = names, forced
        self.text, self.sent = "", 0

    def _safe_end(self) -> int:
        text = self.text
        if self.forced:
            return 0
        head = text.lstrip()
        if self.sent == 0 and (not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)])):
            return 0  # may be a bare JSON call: hold it all
        at = text.find(OPEN)
        if at >= 0:
            return at
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a tag cut in the middle
            if OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def feed(self, text: str) -> str:
        self.text += text
        end = max(self._safe_end(), self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        tail = self.text[self.sent :]
        self.sent = len(self.text)
        content, calls = parse_tool_calls(tail, self.names)
        return content or "", calls
