"""OpenAI tool calls: a request's `tools`, `tool_choice` and `parallel_tool_calls` checked, the
tools handed to the model's own chat template, and the calls the model writes read back out of its
text, one `tool_calls` entry (with its own id) per call.

Three families of call syntax are read, the family told by the chat template or else by the
tokenizer's special tokens (call_syntax):

- Hermes, as Qwen2.5/Qwen3 templates ask for: one <tool_call> block per call, text around them
  being content,

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- Llama 3.x: bare JSON, {"name": ..., "parameters": {...}} (after <|python_tag|> or not), several
  calls separated by ";" or newlines;
- Mistral: [TOOL_CALLS] and a JSON list of {"name", "arguments"}, or (newer tokenizers)
  [TOOL_CALLS]name[ARGS]{...} once per call. Both markers are control tokens that decoding
  usually drops, so the forms are read without them too;
- GLM-4.5: a <tool_call> block per call holding the name, then each argument as a key and a value
  (a string as it is, any other value as JSON, as its template writes them):

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

- DeepSeek-V3/R1/V3.1: one section of calls, each its name and its JSON arguments (V3 and R1 wrote
  `function<｜tool▁sep｜>name` and the arguments in a json code fence):

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
      <｜tool▁call▁end｜><｜tool▁calls▁end｜>           (on one line)

- Kimi K2: one section of calls, each under an id of its name and index (which becomes the call's id):

      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
      <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>   (on one line)

- gpt-oss: harmony messages addressed to a function (harmony.py hands them over as one form):

      <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

Text that is not entirely well-formed calls of known functions stays content. tool_choice
"required" or a named function constrains the output to one such JSON object, or with
parallel_tool_calls to a JSON list of one or more of them, so the model must write valid calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .harmony import CALL, CALL_OPEN, CHANNEL

__all__ = [
    "DEEPSEEK",
    "GLM",
    "HARMONY",
    "KIMI",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "ToolCall",
    "ToolSpec",
    "ToolStream",
    "call_marks",
    "call_syntax",
    "history_message",
    "parse_tool_calls",
    "parse_tools",
    "single_tokens",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"
ARG_KEY = "<arg_key>"
DEEPSEEK_CALLS, KIMI_CALLS = "<｜tool▁calls▁begin｜>", "<|tool_calls_section_begin|>"
HERMES, LLAMA3, MISTRAL, GLM, DEEPSEEK, KIMI = "hermes", "llama3", "mistral", "glm", "deepseek", "kimi"
HARMONY = "harmony"
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(.*?)(?:<｜tool▁sep｜>|\n)"
    r"\s*(?:```(?:json)?\s*)?(.*?)\s*(?:```\s*)?<｜tool▁call▁end｜>",
    re.DOTALL,
)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.DOTALL,
)
_SECTIONS = {  # syntax: (where its calls begin, the pattern of one call, where they end)
    DEEPSEEK: (DEEPSEEK_CALLS, _DEEPSEEK_CALL, "<｜tool▁calls▁end｜>"),
    KIMI: (KIMI_CALLS, _KIMI_CALL, "<|tool_calls_section_end|>"),
}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_LIST_START = re.compile(r"\[\s*(?:\{|$)")
_SEPARATORS = (PYTHON_TAG, MISTRAL_TAG, ";", " ", "\t", "\r", "\n")  # what may stand between calls


class ToolError(ValueError):
    """A bad tools or tool_choice field; the message says what, `param` which."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# the marks of each syntax's calls, which the reply's text must show for its calls to be read out
_MARKS = {
    HERMES: (OPEN, CLOSE),
    LLAMA3: (PYTHON_TAG,),
    MISTRAL: (MISTRAL_TAG, ARGS_TAG),
    GLM: (OPEN, CLOSE, ARG_KEY, "</arg_key>", "<arg_value>", "</arg_value>"),
    DEEPSEEK: (
        DEEPSEEK_CALLS,
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
    ),
    KIMI: (
        KIMI_CALLS,
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    ),
    HARMONY: (),  # its marks are read as text already (tokenizer/llamacpp.py)
}


def call_marks(syntax: str) -> tuple[str, ...]:
    return _MARKS[syntax]


def _token_of(tokenizer, text: str) -> int | None:
    """The id of the one token `text` is, else None."""
    encode = getattr(tokenizer, "encode", None)
    ids = encode(text, add_special=False, parse_special=True) if encode is not None else []
    return ids[0] if len(ids) == 1 else None


def single_tokens(tokenizer, texts) -> frozenset[int]:
    """The ids of those of `texts` that are one token each (a special token's text decoding would skip)."""
    return frozenset(i for i in (_token_of(tokenizer, t) for t in texts) if i is not None)


def call_syntax(tokenizer) -> str:
    """How the model writes calls: HERMES, LLAMA3, MISTRAL, GLM, DEEPSEEK, KIMI or HARMONY. Its chat template
    names the markers it renders calls with; a model without a template that names any is judged by
    its special tokens."""
    template = getattr(tokenizer, "chat_template", None) or ""
    markers = (
        (MISTRAL_TAG, MISTRAL),
        (PYTHON_TAG, LLAMA3),
        (DEEPSEEK_CALLS, DEEPSEEK),
        (KIMI_CALLS, KIMI),
        (CHANNEL, HARMONY),
        (ARG_KEY, GLM),
        (OPEN, HERMES),
    )
    for marker, syntax in markers:
        if marker in template:
            return syntax
    for marker, syntax in markers:
        if _token_of(tokenizer, marker) is not None:
            return syntax
    return HERMES


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {...}}], as given
    choice: str  # "auto", "required" or "function" (one named function)
    name: str | None = None  # with "function": its name
    syntax: str = HERMES  # how the model writes calls (call_syntax)
    parallel: bool = True  # the request's parallel_tool_calls; false keeps only the first call

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def arguments_key(self) -> str:
        """What the template asks calls to write their arguments under."""
        return "parameters" if self.syntax == LLAMA3 else "arguments"

    def _call_schema(self, fn: dict) -> dict:
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, self.arguments_key: params},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }

    def schema(self) -> dict:
        """With a forced choice: the JSON schema of what the model must write, one call, or with
        parallel calls a list of one or more."""
        fns = [t["function"] for t in self.tools]
        options = [self._call_schema(fn) for fn in fns if self.choice != "function" or fn["name"] == self.name]
        call = options[0] if len(options) == 1 else {"anyOf": options}
        return {"type": "array", "items": call, "minItems": 1} if self.parallel else call

    @property
    def string_arguments(self) -> dict[str, set[str]]:
        """Each function's parameters its schema types as strings: GLM-4.5 writes their values bare."""
        out = {}
        for t in self.tools:
            properties = (t["function"].get("parameters") or {}).get("properties") or {}
            out[t["function"]["name"]] = {
                k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"
            }
        return out

    def read_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, self.names, self.syntax, self.parallel, self.string_arguments)

    def stream(self) -> ToolStream:
        return ToolStream(self.names, self.forced, self.syntax, self.parallel, self.string_arguments)


def _checked_tools(tools) -> list[dict]:
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
    return [{"type": "function", "function": t["function"]} for t in tools]


def _checked_choice(choice, names: set[str]) -> tuple[str, str | None]:
    """tool_choice as (kind, the named function or None)."""
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice")
        return "function", name
    raise ToolError(
        "'tool_choice' must be 'none', 'auto', 'required' or {type: function, function: {name}}", "tool_choice"
    )


def parse_tools(body: dict, tokenizer) -> ToolSpec | None:
    """The request's tools, tool_choice and parallel_tool_calls; None when no tool may be called (no
    tools, or tool_choice "none"). `tokenizer` (its chat template, its special tokens) tells which
    call syntax the model writes."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    tools = _checked_tools(tools)
    choice, name = _checked_choice(choice, {t["function"]["name"] for t in tools})
    if choice == "none":
        return None
    return ToolSpec(tools, choice, name, call_syntax(tokenizer), parallel is not False)


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


def _call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
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


def _calls_in(value, names: set[str], name: str | None) -> list[ToolCall] | None:
    """The calls one JSON value holds: a call object, a list of them, or (after a bare `name`)
    the arguments object of Mistral's name[ARGS]{...}."""
    if name is not None:
        value = {"name": name, "arguments": value}
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


def _skip_separators(text: str, i: int) -> int:
    while True:
        sep = next((s for s in _SEPARATORS if text.startswith(s, i)), None)
        if sep is None:
            return i
        i += len(sep)


def _name_at(text: str, i: int, names: set[str]) -> str | None:
    """The known function name Mistral's name[ARGS]{...} form writes at i, if it does."""
    found = [n for n in names if text.startswith(n, i) and text.startswith(("{", ARGS_TAG), i + len(n))]
    return max(found, key=len, default=None)


def _call_sequence(text: str, names: set[str], named: bool = False) -> list[ToolCall] | None:
    """The calls `text` holds when it is nothing but calls one after another: JSON call objects or
    lists of them, and with `named` also Mistral's name[ARGS]{...}; else None."""
    decoder, calls = json.JSONDecoder(), []
    i = _skip_separators(text, 0)
    while i < len(text):
        name = _name_at(text, i, names) if named else None
        if name is not None:
            i += len(name) + (len(ARGS_TAG) if text.startswith(ARGS_TAG, i + len(name)) else 0)
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        found = _calls_in(value, names, name)
        if found is None:
            return None
        calls += found
        i = _skip_separators(text, i)
    return calls or None


def _glm_value(raw: str, is_string: bool):
    if is_string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # a value whose schema says nothing, written bare: text


def _glm_call(block: str, names: set[str], strings: dict[str, set[str]]) -> ToolCall | None:
    """GLM-4.5's name-then-arguments body of a <tool_call> block, or None where it is not one."""
    at = block.find(ARG_KEY)
    at = len(block) if at < 0 else at  # a call without arguments is its name alone
    name, args = block[:at].strip(), {}
    if name not in names:
        return None
    for m in _GLM_ARGUMENT.finditer(block, at):
        if m.start() != at:
            return None
        args[m[1].strip()] = _glm_value(m[2], m[1].strip() in strings.get(name, ()))
        at = m.end()
    if block[at:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _hermes_calls(text: str, names: set[str], strings: dict[str, set[str]]) -> tuple[str | None, list[ToolCall]]:
    """Every well-formed <tool_call> block (JSON calls, or GLM-4.5's name and arguments); the text
    around them, and any malformed block, is content."""
    calls, content, last = [], [], 0
    for m in _HERMES.finditer(text):
        found = _call_sequence(m[1], names)
        if found is None and (glm := _glm_call(m[1], names, strings)) is not None:
            found = [glm]
        if found is None:
            continue
        calls += found
        content.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    rest = ("".join(content) + text[last:]).strip()
    return rest or None, calls


def _calls_from(text: str, at: int, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Content up to `at`, then nothing but calls; (text, []) where the rest is not all calls."""
    calls = _call_sequence(text[at:], names, named=True)
    if calls is None:
        return text, []
    return text[:at].strip() or None, calls


def _bare_name_pattern(names: set[str]) -> re.Pattern:
    """Where Mistral's name[ARGS]{...} may begin once its control tokens are decoded away: a known
    name, not the end of a longer word, right before "{" or [ARGS]."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{alternatives})(?=\{{|{re.escape(ARGS_TAG)})")


def _section_calls(text: str, names: set[str], syntax: str) -> tuple[str | None, list[ToolCall]]:
    """DeepSeek's and Kimi K2's calls: content, then a section of nothing but well-formed calls of
    known functions (else it all stays content). Kimi's calls keep the ids it writes them under."""
    begin, pattern, end = _SECTIONS[syntax]
    at = text.index(begin)
    section, calls, last = text[at + len(begin) :], [], 0
    for m in pattern.finditer(section):
        call = _call({"name": m[1].strip(), "arguments": m[2]}, names)
        if call is None or section[last : m.start()].strip():
            return text, []
        if syntax == KIMI:
            call.id = f"functions.{call.name}:{len(calls)}"
        calls.append(call)
        last = m.end()
    if not calls or section[last:].strip() not in ("", end):
        return text, []
    return text[:at].strip() or None, calls


def _harmony_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """gpt-oss's calls as harmony.HarmonySplit hands them over; the text around them is content."""
    calls = []
    for m in CALL.finditer(text):
        call = _call({"name": m[1].strip(), "arguments": m[2].strip()}, names)
        if call is None:
            return text, []
        calls.append(call)
    return CALL.sub("", text).strip() or None, calls


def _read_calls(
    text: str, names: set[str], syntax: str, strings: dict[str, set[str]]
) -> tuple[str | None, list[ToolCall]]:
    for section, (begin, _, _) in _SECTIONS.items():
        if begin in text:
            return _section_calls(text, names, section)
    if CALL_OPEN in text:
        return _harmony_calls(text, names)
    if OPEN in text:
        return _hermes_calls(text, names, strings)
    if MISTRAL_TAG in text:
        return _calls_from(text, text.index(MISTRAL_TAG), names)
    calls = _call_sequence(text, names, named=syntax == MISTRAL)
    if calls:
        return None, calls
    if syntax == MISTRAL and names:
        for m in _bare_name_pattern(names).finditer(text):
            content, calls = _calls_from(text, m.start(), names)
            if calls:
                return content, calls
    return text, []


def _mistral_call_id() -> str:
    # Mistral's templates refuse a history whose call ids are not 9 letters or digits.
    return uuid.uuid4().hex[:9]


def parse_tool_calls(
    text: str, names: set[str], syntax: str = HERMES, parallel: bool = True, strings: dict | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a model's output. Text that is not a well-formed call of a known
    function stays content; content is None when the text held only calls. Without `parallel`
    only the first call is kept. `strings`: each function's string parameters (ToolSpec.string_arguments)."""
    content, calls = _read_calls(text, names, syntax, strings or {})
    if not parallel:
        calls = calls[:1]
    if syntax == MISTRAL:
        for call in calls:
            call.id = _mistral_call_id()
    return content, calls


def _may_open_with_json(head: str) -> bool:
    """Whether text that begins so may still be calls written as bare JSON."""
    return (
        not head
        or head.startswith("{")
        or _LIST_START.match(head) is not None
        or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)])
    )


class ToolStream:
    """One streamed choice's text, held back from where a tool call may begin: feed() returns
    the text safe to send as content now, finish() what remains as (content, calls)."""

    def __init__(
        self, names: set[str], forced: bool = False, syntax: str = HERMES, parallel: bool = True, strings=None
    ):
        self.names, self.forced, self.syntax, self.parallel = names, forced, syntax, parallel
        self.strings = strings or {}
        self.text, self.sent = "", 0
        self.openers = [OPEN, MISTRAL_TAG, DEEPSEEK_CALLS, KIMI_CALLS, CALL_OPEN]
        self.named_openers = [n + end for n in names for end in ("{", ARGS_TAG)] if syntax == MISTRAL else []
        self.bare_name = _bare_name_pattern(names) if self.named_openers else None

    def _cut_opener_at(self, k: int) -> bool:
        """Whether the text's last k characters may be the beginning of a call's opening."""
        tail = self.text[-k:]
        if any(o.startswith(tail) for o in self.openers):
            return True
        at_word_start = k == len(self.text) or not (self.text[-k - 1].isalnum() or self.text[-k - 1] == "_")
        return at_word_start and any(o.startswith(tail) for o in self.named_openers)

    def _safe_end(self) -> int:
        text = self.text
        if self.forced or (self.sent == 0 and _may_open_with_json(text.lstrip())):
            return 0
        starts = [text.find(o) for o in self.openers]
        if self.bare_name is not None and (m := self.bare_name.search(text)):
            starts.append(m.start())
        if found := [s for s in starts if s >= 0]:
            return min(found)
        longest = max(map(len, self.openers + self.named_openers))
        for k in range(min(longest - 1, len(text)), 0, -1):
            if self._cut_opener_at(k):
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
        content, calls = parse_tool_calls(tail, self.names, self.syntax, self.parallel, self.strings)
        return content or "", calls
