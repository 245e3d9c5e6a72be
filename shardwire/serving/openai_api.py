"""OpenAI's request and response shapes: parse a JSON body into engine Requests, and build the
JSON answers (whole or as stream chunks) from what the engine produced.

Pure functions over dicts; the HTTP side lives in app.py.

One module of this length: both directions of the OpenAI bodies (chat, completions, embeddings,
their streamed chunks) follow one specification and share its checks.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace

from .. import __version__
from ..constrain import ConstraintError, Grammar, vocabulary_of
from ..engine import Event, Request
from ..engine.drafting import KINDS, MIN_NGRAM, Speculation
from ..sampling import MAX_LOGIT_BIAS, SamplingParams
from .harmony import splitter
from .reasoning import close_thinking, opens_thinking, tags_of
from .tools import ToolError, ToolSpec, ToolStream, call_marks, history_message, parse_tools, single_tokens

MAX_CHOICES = 128  # prompts x n in one request
MAX_STOPS = 64  # OpenAI allows 4; llama-server any number, and its clients send more
SYSTEM_FINGERPRINT = f"b{__version__}-shardwire"  # llama-server's is "b<build>-<commit>"


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}, plus
    `extra` fields where llama-server adds some."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.extra = extra or {}

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, **self.extra}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str = "unavailable") -> APIError:
    # llama-server's type for "not ready / cannot serve now"
    return APIError(503, message, type="unavailable_error", code=code)


# -- reading fields ----------------------------------------------------------------------------


def _number(body: dict, name: str, default, lo=None, hi=None, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {bounds}, got {value}", name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


def _reject_unsupported(body: dict, kind: str) -> None:
    for name in ("functions", "suffix") if kind == "chat" else ("tools", "functions", "suffix"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by this server", name)


def _grammar(body: dict, tokenizer, tools: ToolSpec | None = None) -> Grammar | None:
    """The output's constraint: OpenAI's response_format (json_object, json_schema), or
    llama-server's json_schema (a schema) or grammar (GBNF) fields, or the one tool call that
    tool_choice "required" or a named function demands; at most one of them."""
    asked = []
    if tools is not None and tools.forced:
        asked.append(("tool_choice", "json_schema", tools.schema()))
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
        if kind == "json_object":  # llama-server lets a schema ride along
            asked.append(("response_format", "json_schema", fmt.get("schema") or {"type": "object"}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, an object", "response_format")
            asked.append(("response_format", "json_schema", schema))
        elif kind != "text":
            raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")
    if body.get("json_schema") is not None:
        if not isinstance(body["json_schema"], dict):
            raise bad_request("'json_schema' must be a JSON schema object", "json_schema")
        asked.append(("json_schema", "json_schema", body["json_schema"]))
    if body.get("grammar") is not None and body.get("grammar") != "":
        if not isinstance(body["grammar"], str):
            raise bad_request("'grammar' must be a GBNF grammar in a string", "grammar")
        asked.append(("grammar", "gbnf", body["grammar"]))
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"only one of {', '.join(a[0] for a in asked)} may constrain the output", asked[1][0])
    param, kind, source = asked[0]
    if tokenizer is None:
        raise bad_request("this server cannot constrain output without the model's tokenizer", param)
    try:
        return Grammar.compile(kind, source, vocabulary_of(tokenizer))
    except ConstraintError as e:
        raise bad_request(str(e), param, "invalid_grammar") from None


_TOKEN_ID = re.compile(r"-?[0-9]+")


def _logit_bias(body: dict, tokenizer) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; llama-server also takes [[id or text, bias], ...], text keys
    (every token of the text gets the bias) and false for a bias that bans the token. With
    `ignore_eos` the end-of-generation tokens are banned, as llama-server does, so that a reply
    runs on without one in its text."""
    value = body.get("logit_bias")
    out = _logit_bias_given(value, tokenizer) if value is not None else {}
    if _bool(body, "ignore_eos") and tokenizer is not None:
        out.update((i, -math.inf) for i in tokenizer.stop_ids)  # over any bias given for them
    if len(out) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    return tuple(sorted(out.items()))


def _logit_bias_given(value, tokenizer) -> dict[int, float]:
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise bad_request("'logit_bias' must map token ids to biases", "logit_bias")
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100] (or false), got {bias!r}", "logit_bias")
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            ids = [int(key)]
        elif isinstance(key, str) and key and tokenizer is not None:
            ids = tokenizer.encode(key, add_special=False)
        else:
            raise bad_request(f"logit_bias keys must be token ids or text, got {key!r}", "logit_bias")
        for i in ids:
            if i < 0 or (vocab is not None and i >= vocab):
                raise bad_request(f"logit_bias token id {i} is not in the vocabulary [0, {vocab})", "logit_bias")
            out[i] = float(bias)
    return out


def _sampling(body: dict, logprobs: int | None, tokenizer=None) -> SamplingParams:
    """OpenAI's defaults, not llama.cpp's: temperature 1.0 and top_p 1.0 with top_k and min_p off,
    so an unchanged OpenAI client samples from the model's whole distribution. top_k, min_p,
    repeat_penalty and repeat_last_n are llama-server's extra fields, accepted for its users.
    `tokenizer` reads logit_bias keys given as text and checks their ids."""
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:  # OpenAI accepts 0: only the most likely token survives
        temperature, top_p = 0.0, 1.0
    seed = _number(body, "seed", None, integer=True)
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=_number(body, "top_k", 0, 0, integer=True),
        min_p=float(_number(body, "min_p", 0.0, 0, 1)),
        repeat_penalty=float(_number(body, "repeat_penalty", 1.0, 0.01, 10)),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2, 2)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2, 2)),
        repeat_last_n=_number(body, "repeat_last_n", 64, 0, integer=True),  # llama-server's penalty window
        seed=None if seed is None else seed % (1 << 63),  # any integer; the wire carries 63 bits
        logprobs=logprobs,
        logit_bias=_logit_bias(body, tokenizer),
    )


SPEC_TYPES = ("none", *KINDS)  # llama-server's names of the kinds shardwire has


def _speculation(body: dict) -> Speculation | None:
    """llama-server's speculative.* fields: how a request's decode steps propose tokens, or None."""
    kind = body.get("speculative.type", "none")
    if kind not in SPEC_TYPES:
        kinds = ", ".join(SPEC_TYPES)
        raise bad_request(f"'speculative.type' must be one of {kinds}, got {kind!r}", "speculative.type")
    if kind == "none":
        return None
    default = Speculation()
    n_max = _number(body, "speculative.n_max", default.n_max, 0, 64, integer=True)
    n_min = _number(body, "speculative.n_min", default.n_min, 0, n_max, integer=True)
    ngram = _number(body, "speculative.ngram_size_n", default.ngram, MIN_NGRAM, 64, integer=True)
    p_min = _number(body, "speculative.p_min", default.p_min, 0, 1)
    return Speculation(kind, n_max, n_min, ngram, float(p_min))


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOPS:
        raise bad_request(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stop if s)


# -- requests ----------------------------------------------------------------------------------


@dataclass
class Job:
    """One API request: every prompt times n choices, each an engine Request."""

    kind: str  # "chat" or "text"
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    echo: list[str] = field(default_factory=list)  # completions with echo: each prompt's text
    grammar: Grammar | None = None  # what every choice's output must follow
    tools: ToolSpec | None = None  # chat: the functions the model may call; its calls are parsed out
    cache_prompt: bool = True  # llama-server's field: reuse the cached KV pages of a prompt's prefix
    verbose: bool = False  # llama-server's field: the answer carries __verbose (the prompt as text...)
    return_progress: bool = False  # llama-server's field: a stream tells how far the prompt is
    reasoning: tuple[str, str] | None = None  # chat: the tags the reasoning comes between, read apart
    thinking: bool = False  # the prompt leaves the reply inside a reasoning block
    kept_tokens: frozenset[int] = frozenset()  # special tokens shown as text: the marks parsed out
    speculation: Speculation | None = None  # llama-server's speculative.* fields
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = self.created or int(time.time())

    @property
    def logprobs(self) -> int | None:
        return self.sampling.logprobs

    def requests(self, ctx: int) -> list[Request]:
        """Choice i * n + j continues prompt i; with a seed, choice j draws with seed + j, so n=1
        gives what choice 0 of a larger n gives."""
        out = []
        for prompt in self.prompts:
            if len(prompt) >= ctx:
                # OpenAI's message and code, llama-server's type and fields
                raise APIError(
                    400,
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"{'messages' if self.kind == 'chat' else 'prompt'} resulted in {len(prompt)} "
                    f"tokens: the request exceeds the available context size.",
                    "exceed_context_size_error",
                    "messages" if self.kind == "chat" else "prompt",
                    "context_length_exceeded",
                    {"n_prompt_tokens": len(prompt), "n_ctx": ctx},
                )
            for j in range(self.n):
                seed = self.sampling.seed
                sampling = self.sampling if seed is None else replace(self.sampling, seed=(seed + j) % (1 << 63))
                # Without max_tokens the engine stops at the end of the context, as llama-server does.
                out.append(
                    Request(
                        prompt,
                        sampling,
                        max_tokens=self.max_tokens if self.max_tokens is not None else ctx,
                        stop=self.stop,
                        ignore_eos=self.ignore_eos,
                        grammar=self.grammar,
                        cache_prompt=self.cache_prompt,
                        report_progress=self.stream and self.return_progress,
                        kept_tokens=self.kept_tokens,
                        speculation=self.speculation,
                    )
                )
        return out


def _common(
    body: dict,
    kind: str,
    prompts: list[list[int]],
    logprobs: int | None,
    max_tokens: int | None,
    echo: list[str] = (),
    tokenizer=None,
    tools: ToolSpec | None = None,
) -> Job:
    """The fields every kind of request shares. `tokenizer` checks logit_bias and compiles a
    grammar (response_format, json_schema, grammar); without it those fields are refused."""
    _reject_unsupported(body, kind)
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = stream and _bool(options or {}, "include_usage")
    return Job(
        kind,
        prompts,
        n,
        _sampling(body, logprobs, tokenizer),
        max_tokens,
        _stop(body),
        stream,
        include_usage,
        _bool(body, "ignore_eos"),
        list(echo),
        _grammar(body, tokenizer, tools),
        tools,
        _bool(body, "cache_prompt", True),
        _bool(body, "verbose"),
        return_progress=_bool(body, "return_progress"),
        speculation=_speculation(body),
    )


def text_job(body: dict, prompts: list[list[int]], logprobs: int | None, max_tokens: int | None, tokenizer) -> Job:
    """A text completion of prompts already tokenized, its other fields read as /v1/completions
    reads them: llama-server's /completion builds its Job here."""
    return _common(body, "text", prompts, logprobs, max_tokens, tokenizer=tokenizer)


def parse_completion(body: dict, tokenizer) -> Job:
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids or a list
    of such lists. Text is tokenized as llama-server does: BOS as the model says, special-token
    text like <|im_start|> read as that token."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenizer.encode(p, add_special=True, parse_special=True)
            texts.append(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if any(not 0 <= t < tokenizer.vocab_size for t in p):
                raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            ids = list(p)
            texts.append(tokenizer.decode(ids, skip_special=False))
        else:
            raise bad_request("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        prompts.append(ids)
    logprobs = _number(body, "logprobs", None, 0, 20, integer=True)
    max_tokens = _number(body, "max_tokens", None, 0, integer=True)
    return _common(body, "text", prompts, logprobs, max_tokens, texts if _bool(body, "echo") else (), tokenizer)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _message(m, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in _ROLES:
        raise bad_request(f"{param} must be an object with a role of {', '.join(sorted(_ROLES))}", param)
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}: only text content parts are supported", f"{param}.content")
            parts.append(part["text"])
        content = "\n\n".join(parts)  # as llama-server flattens them
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    try:
        m = history_message(m, param)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    # Templates know system, not OpenAI's newer developer role.
    return {**m, "role": "system" if m["role"] == "developer" else m["role"], "content": content or ""}


def chat_messages(messages) -> list[dict]:
    """Validated messages, ready for the chat template (llama-server's /apply-template too)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


_TEMPLATE_OWN = {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}


def chat_text(tokenizer, messages: list[dict], body: dict, tools=None) -> str:
    """The chat prompt's text, as llama-server renders it. A last assistant message is a prefill
    the reply continues (vLLM's and transformers' `continue_final_message`): the prompt ends
    where its content does, with no generation prompt after it."""
    add = body.get("add_generation_prompt", True)
    go_on = body.get("continue_final_message", False)
    for name, value in (("add_generation_prompt", add), ("continue_final_message", go_on)):
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be true or false", name)
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")  # calls: a whole turn
    if prefill and not go_on:
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise bad_request("two assistant messages cannot end the conversation", "messages")
        go_on, add = True, False
    if go_on and add:
        raise bad_request("'add_generation_prompt' and 'continue_final_message' cannot both be true", "messages")
    if go_on and not prefill:
        raise bad_request("'continue_final_message' needs a last assistant message without tool calls", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or kwargs.keys() & _TEMPLATE_OWN:
        raise bad_request(
            f"'chat_template_kwargs' must be an object without {', '.join(sorted(_TEMPLATE_OWN))}",
            "chat_template_kwargs",
        )
    final = messages[-1]["content"].strip() if go_on else ""
    if go_on and not final:  # nothing to continue: the reply starts where a new one would
        messages, add, go_on = messages[:-1], True, False
    try:
        extra = {**kwargs, **({"tools": tools} if tools else {})}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add, **extra)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    if go_on:
        end = text.rfind(final)
        if end < 0:
            raise bad_request("the chat template does not write the final message as it is", "messages")
        text = text[: end + len(final)]
    tags = tags_of(getattr(tokenizer, "chat_template", None))
    if tags is not None and kwargs.get("enable_thinking") is False and not go_on:
        text = close_thinking(text, tags)
    return text


def parse_chat(body: dict, tokenizer) -> Job:
    """POST /v1/chat/completions: the model's own chat template, then its special tokens read as
    tokens (the template already wrote BOS where the model wants one)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        tools = parse_tools(body, tokenizer)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    # the tools reach the template (Qwen's and Llama 3.x's describe them to the model)
    text = chat_text(tokenizer, messages, body, tools.tools if tools else None)
    tags = tags_of(getattr(tokenizer, "chat_template", None)) if body.get("reasoning_format") != "none" else None
    prompt = tokenizer.encode(text, add_special=False, parse_special=True)
    if not prompt:
        raise bad_request("the rendered chat prompt is empty", "messages")
    top = _number(body, "top_logprobs", None, 0, 20, integer=True)
    wants_logprobs = _bool(body, "logprobs")
    if top is not None and not wants_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = _number(body, "max_completion_tokens", None, 0, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", None, 0, integer=True)
    logprobs = (top or 0) if wants_logprobs else None
    job = _common(body, "chat", [prompt], logprobs, max_tokens, tokenizer=tokenizer, tools=tools)
    job.reasoning, job.thinking = tags, tags is not None and opens_thinking(text, tags)
    marks = (*(tags or ()), *(call_marks(tools.syntax) if tools else ()))
    job.kept_tokens = single_tokens(tokenizer, marks)
    return job


# -- responses ---------------------------------------------------------------------------------


class Choice:
    """What one choice has produced so far."""

    def __init__(self, index: int, tokenizer, skip_ids: frozenset[int], job: "Job | None" = None):
        self.index, self.tokenizer, self.skip_ids = index, tokenizer, skip_ids
        tags = job.reasoning if job is not None else None
        self.split = splitter(tags, job.thinking) if tags is not None else None
        self.text = ""  # the answer (without the reasoning, where it is read apart)
        self.reasoning = ""
        self.new_reasoning = ""  # what the last add() added to it
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None

    def add(self, event: Event) -> tuple[str, list]:
        """Record an event; returns the answer's text and the logprob entries it adds."""
        entries = []
        if event.token is not None and event.logprob is not None and event.token not in self.skip_ids:
            entries.append((event.token, event.logprob, event.top_logprobs))
        text = event.text
        if self.split is not None:
            reasoning, text = self.split.feed(text)
            if event.finish_reason is not None:
                more, rest = self.split.flush()
                reasoning, text = reasoning + more, text + rest
            self.reasoning += reasoning
            self.new_reasoning = reasoning
        self.text += text
        self.logprobs += entries
        if event.finish_reason is not None:
            self.finish_reason, self.error = event.finish_reason, event.error
        return text, entries

    def _piece(self, token: int) -> str:
        return self.tokenizer.token_text(token)

    def chat_logprobs(self, entries) -> dict:
        def item(token, logprob):
            piece = self._piece(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        return {
            "content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in entries],
            "refusal": None,
        }

    def text_logprobs(self, entries, offset: int) -> dict:
        tokens = [self._piece(t) for t, _, _ in entries]
        offsets = []
        for piece in tokens:
            offsets.append(offset)
            offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{self._piece(a): b for a, b in top} for _, _, top in entries],
            "text_offset": offsets,
        }


def tool_stream(job: Job) -> ToolStream | None:
    """A streamed chat choice's holder of text that may be a tool call; None without tools."""
    if job.kind != "chat" or job.tools is None:
        return None
    return job.tools.stream()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(job: Job, model: str, choices: list[Choice], use: dict) -> dict:
    """The whole answer, for a request without stream."""
    out = []
    for c in choices:
        if job.kind == "chat":
            message = {"role": "assistant", "content": c.text, "refusal": None}
            if c.reasoning.strip():
                message["reasoning_content"] = c.reasoning.strip()
            finish_reason = c.finish_reason
            if job.tools is not None:
                content, calls = job.tools.read_calls(c.text)
                if calls:
                    message = {**message, "content": content, "tool_calls": [call.to_dict() for call in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": c.chat_logprobs(c.logprobs) if job.logprobs is not None else None,
                    "finish_reason": finish_reason,
                }
            )
        else:
            echo = job.echo[c.index // job.n] if job.echo else ""
            out.append(
                {
                    "index": c.index,
                    "text": echo + c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": c.text_logprobs(c.logprobs, len(echo)) if job.logprobs is not None else None,
                }
            )
    return {
        "id": job.id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": out,
        "usage": use,
    }


def chunk(job: Job, model: str, choices: list[dict], use: dict | None = None) -> dict:
    """One server-sent event's data. With include_usage every chunk carries "usage": null and a
    last one with no choices carries the counts, as OpenAI streams them."""
    out = {
        "id": job.id,
        "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
    }
    if job.include_usage:
        out["usage"] = use
    return out


def chunk_choice(
    job: Job,
    choice: Choice,
    *,
    text: str = "",
    entries=(),
    offset: int = 0,
    role: bool = False,
    finish_reason: str | None = None,
    tool_calls=(),
    reasoning: str = "",
) -> dict:
    if job.kind == "chat":
        delta = {"role": "assistant", "content": None} if role else ({"content": text} if text or entries else {})
        if reasoning:
            delta = {**delta, "reasoning_content": reasoning}
        if tool_calls:
            delta = {**delta, "tool_calls": [call.to_dict(i) for i, call in tool_calls]}
        return {
            "index": choice.index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": choice.chat_logprobs(entries) if entries else None,
        }
    return {
        "index": choice.index,
        "text": text,
        "finish_reason": finish_reason,
        "logprobs": choice.text_logprobs(entries, offset) if entries else None,
    }
