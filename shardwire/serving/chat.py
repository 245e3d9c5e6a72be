"""Chat templates: a model's Jinja template rendered the way transformers' apply_chat_template does."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import SandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "render_chat"]


class ChatTemplateError(ValueError):
    pass


# The fallback for a model without a template. llama.cpp falls back to ChatML too, so a model that
# worked there without a template gets the same prompt here. Content given as a list of parts (the
# OpenAI format) contributes its text parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning comes under; templates (Qwen3, gpt-oss) read the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **extra,
) -> str:
    """The prompt text for `messages` (dicts with "role" and "content"). `template` None means the
    ChatML fallback. Extra keywords reach the template as variables (e.g. enable_thinking=False).
    Today's date is there too, under the names llama.cpp gives it (Llama 3.x and FireFunction
    templates print it), and the tools as JSON text under `functions` ('' without tools), which
    FireFunction's template adds to its system prompt."""
    compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    now = datetime.now()
    extra = {
        "date_string": now.strftime("%d %b %Y"),
        "datetime": now.strftime("%b %d %Y"),
        "functions": json.dumps(tools, indent=2) if tools else "",
        **extra,
    }
    try:
        return compiled.render(
            messages=_normalize(messages),
            tools=copy.deepcopy(tools),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except Exception as e:  # anything a template does wrong is the template's error to the caller
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _normalize(messages: list[dict]) -> list[dict]:
    """As transformers: keys whose value is None are dropped, and reasoning is copied under each name;
    copies, which a template may change."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
        message = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it; renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike Jinja's own filter: no HTML escaping, the json.dumps options templates pass, and what
    # Jinja's map and select give (generators) written as the lists they stand for
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys, default=_listed
    )


def _listed(value):
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # Sandboxed, but lists and dicts the template builds may grow (Kimi K2's collects ids with
    # append), as llama.cpp's template engine allows; each render gets its own copy of the messages
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads  # DeepSeek-V3.2's and V4's templates read arguments with it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e
