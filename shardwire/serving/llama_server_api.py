"""llama-server's native endpoints, for clients written against llama.cpp's server:

    POST /completion      prompt (text, token ids, or a list of those) -> content, tokens, stop_type,
                          timings, completion_probabilities (n_probs); stream: one event per token
    POST /tokenize, POST /detokenize, POST /apply-template
    GET  /props, GET /slots, GET /metrics (with --metrics)

Requests run on the same engine and plumbing as the OpenAI endpoints (state.py); the sampling
defaults here are llama.cpp's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) under the
server's flags, as llama-server has them.

One module of this length: llama-server's native routes are short handlers over the same few helpers
(the body's sampling fields, the engine's plumbing); apart they would share all of them.
"""

from __future__ import annotations

import math
import time

import psutil
from aiohttp import web

from .. import __version__
from ..engine import PromptProgress, SlotView
from .chat import CHATML_TEMPLATE
from .metrics import CONTENT_TYPE_LATEST, render
from .openai_api import APIError, Choice, Job, bad_request, chat_messages, chat_text, text_job, unavailable
from .state import BACKEND, Backend, Run, check_model, failure, json_body, open_stream, parse_off_loop, skip_ids
from .tools import ToolError, parse_tools

METRICS = web.AppKey("metrics", object)
SLOTS = web.AppKey("slots", bool)  # GET /slots answers (--no-slots: 501, as llama-server's)

LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
MAX_PROBS = 20  # the sampler reports at most this many alternatives
RANDOM_SEED = 0xFFFFFFFF  # how llama-server shows "a random seed per request" (-1)
# Native fields read here, not by the OpenAI parsing the rest of the body goes through.
_NATIVE_ONLY = set(
    "prompt n_predict max_tokens n_probs logprobs n echo stream_options response_fields timings_per_token".split()
)


# -- POST /completion --------------------------------------------------------------------------


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be an integer {bounds}, got {value!r}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false", name)
    return value


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _one_prompt(p) -> bool:
    """A string, token ids, token ids mixed with strings, or {"prompt_string": ...}: one prompt
    (llama-server's rule)."""
    return isinstance(p, (str, dict)) or (isinstance(p, list) and bool(p) and any(_is_token(t) for t in p))


def _tokenize_prompt(p, tokenizer) -> list[int]:
    """BOS as the model says when the prompt starts with text, as llama-server adds it."""
    if isinstance(p, dict):
        if p.get("multimodal_data"):
            raise bad_request("Multimodal data provided, but model does not support multimodal requests.", "prompt")
        p = p.get("prompt_string")
    if isinstance(p, str):
        p = [p]
    if not isinstance(p, list) or not all(_is_token(t) or isinstance(t, str) for t in p):
        raise bad_request("each prompt must be a string or a list of token ids and strings", "prompt")
    ids: list[int] = []
    for i, part in enumerate(p):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special=i == 0, parse_special=True)
        elif not 0 <= part < tokenizer.vocab_size:
            raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        else:
            ids.append(part)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids


def _response_fields(body: dict) -> list[str]:
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise bad_request("'response_fields' must be a list of field names", "response_fields")
    return fields


def pick_fields(answer: dict, fields: list[str]) -> dict:
    """llama-server's response_fields: only these, "a/b" taken from inside "a" and named "a/b";
    a field the answer lacks is left out."""
    if not fields:
        return answer
    out = {}
    for path in fields:
        value, found = answer, True
        for key in path.split("/"):
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        if found:
            out[path] = value
    return out


def parse_native_completion(body: dict, tokenizer) -> Job:
    """POST /completion's body (defaults already merged in) -> a text Job, one choice per prompt."""
    prompt = body.get("prompt")
    if prompt is None or prompt == [] or prompt == "":
        raise bad_request("'prompt' is required", "prompt")
    prompts = [prompt] if _one_prompt(prompt) else prompt
    if not isinstance(prompts, list):
        raise bad_request("'prompt' must be a string, token ids, or a list of those", "prompt")
    ids = [_tokenize_prompt(p, tokenizer) for p in prompts]
    n_predict = _integer(body, "n_predict", -1)
    if n_predict is None:
        n_predict = _integer(body, "max_tokens", -1)
    n_probs = _integer(body, "n_probs", 0, MAX_PROBS)
    for name in ("cache_prompt", "return_tokens", "post_sampling_probs", "timings_per_token"):
        _flag(body, name)
    _response_fields(body)
    rest = {k: v for k, v in body.items() if k not in _NATIVE_ONLY}
    if rest.get("seed") == -1:
        del rest["seed"]  # -1: a new random seed for this request
    return text_job(rest, ids, n_probs or None, None if n_predict in (None, -1) else n_predict, tokenizer)


async def completion(request: web.Request) -> web.StreamResponse:
    backend = request.app[BACKEND]
    body = await json_body(request)
    check_model(body)
    engine = backend.ready_engine()
    merged = backend.settings.with_defaults(body, LLAMA_DEFAULTS)
    job = backend.settings.default_length(await parse_off_loop(parse_native_completion, merged, backend.tokenizer))
    answer = _Answer(backend, job, merged)
    with backend.running(engine, job) as run:
        return await (_stream(request, run, answer) if job.stream else _whole(run, answer))


class _Answer:
    """Builds llama-server's /completion JSON for each prompt of one request."""

    def __init__(self, backend: Backend, job: Job, body: dict):
        self.backend, self.job, self.tokenizer = backend, job, backend.tokenizer
        self.return_tokens = body.get("return_tokens", False)
        self.timings_per_token = body.get("timings_per_token", False)
        self.post_sampling = body.get("post_sampling_probs", False)
        self.fields = _response_fields(body)
        self.skip = skip_ids(self.tokenizer, job)

    def probs(self, entries) -> list[dict]:
        def item(token: int, logprob: float) -> dict:
            piece = self.tokenizer.decode([token], skip_special=False)
            out = {"id": token, "token": piece, "bytes": list(piece.encode("utf-8"))}
            if self.post_sampling:
                out["prob"] = math.exp(logprob)
            else:
                out["logprob"] = logprob
            return out

        top_name = "top_probs" if self.post_sampling else "top_logprobs"
        return [{**item(t, lp), top_name: [item(a, b) for a, b in top]} for t, lp, top in entries]

    def partial(
        self, index: int, run: Run, text: str, token: int | None, entries, progress: PromptProgress | None = None
    ) -> dict:
        """One streamed event: a token's text, or with `progress` (return_progress) how far the
        prompt is, before any text."""
        out = {
            "index": index,
            "content": text,
            "tokens": [] if token is None or token in self.skip else [token],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": run.handles[index].stats.completion_tokens,
            "tokens_evaluated": len(self.job.prompts[index]),
        }
        if self.job.logprobs is not None and entries:
            out["completion_probabilities"] = self.probs(entries)
        if self.timings_per_token:
            out["timings"] = timings(run.handles[index].stats, progress)
        if progress is not None:
            out["prompt_progress"] = prompt_progress(progress)
        return out

    def final(self, index: int, run: Run, choice: Choice, streamed: bool) -> dict:
        handle, job = run.handles[index], self.job
        prompt = job.prompts[index]
        tokens = [t for t in handle.tokens if t not in self.skip]
        stop_type, word = self._stop(handle, choice)
        stats = handle.stats
        out = {
            "index": index,
            "content": "" if streamed else choice.text,
            "tokens": tokens if self.return_tokens and not streamed else [],
            "id_slot": -1,
            "stop": True,
            "model": self.backend.model_id,
            "tokens_predicted": stats.completion_tokens,
            "tokens_evaluated": len(prompt),
            "generation_settings": self.settings(handle),
            "prompt": self.tokenizer.decode(prompt, skip_special=False),
            "has_new_line": "\n" in choice.text,
            "truncated": len(prompt) + stats.completion_tokens >= self.backend.ctx,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": stats.cached_tokens,
            "timings": timings(stats),
        }
        if job.logprobs is not None and not streamed:
            out["completion_probabilities"] = self.probs(choice.logprobs)
        return pick_fields(out, self.fields)

    def _stop(self, handle, choice: Choice) -> tuple[str, str]:
        if choice.finish_reason == "length":
            return "limit", ""
        if handle.tokens and handle.tokens[-1] in self.skip:
            return "eos", ""
        # The engine cut the text at the first stop string: the one that starts earliest.
        text = self.tokenizer.decode(handle.tokens)
        hits = [(text.find(s), s) for s in self.job.stop if s in text]
        return ("word", min(hits)[1]) if hits else ("none", "")

    def settings(self, handle) -> dict:
        s = handle.request.sampling  # the seed the engine drew when the request had none
        return {
            "n_ctx": self.backend.ctx,
            "model": self.backend.model_id,
            **sampling_params(s.to_dict(), handle.request.max_tokens if self.job.max_tokens is not None else -1),
            "stop": list(self.job.stop),
            "ignore_eos": self.job.ignore_eos,
            "stream": self.job.stream,
            # as llama-server lists them; a ban (-inf) is null in JSON
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias],
            "n_probs": self.job.logprobs or 0,
        }


def sampling_params(fields: dict, n_predict: int) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n")
    out = {name: fields[name] for name in names if name in fields}
    out.update(
        presence_penalty=fields.get("presence_penalty", 0.0),
        frequency_penalty=fields.get("frequency_penalty", 0.0),
        seed=fields.get("seed", RANDOM_SEED),
        n_predict=n_predict,
        max_tokens=n_predict,
    )
    return out


def timings(stats, progress: PromptProgress | None = None) -> dict:
    """As llama-server reports them: the first token comes with the prompt, so predicted_ms and
    the rates cover the decode steps after it (n - 1); mid-stream, the times so far. With
    `progress`, the prompt's so far while it is processed."""
    if progress is not None:
        cached, n_prompt, n_predicted, predicted_ms = progress.cached, progress.processed - progress.cached, 0, 0.0
        prompt_ms = progress.ms if n_prompt else 0.0
    else:
        end = stats.t_end or time.perf_counter()
        prompt_ms = max(0.0, stats.t_first_token - stats.t_submit) * 1000 if stats.t_first_token else 0.0
        predicted_ms = max(0.0, end - stats.t_first_token) * 1000 if stats.t_first_token else 0.0
        cached, n_prompt = stats.cached_tokens, stats.prompt_tokens - stats.cached_tokens
        n_predicted = stats.completion_tokens
    steps = max(0, n_predicted - 1)
    drafted = {}
    if progress is None and stats.draft_n:
        drafted = {"draft_n": stats.draft_n, "draft_n_accepted": stats.draft_n_accepted}
    return {
        "cache_n": cached,
        "prompt_n": n_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
        "prompt_per_second": n_prompt / prompt_ms * 1000 if prompt_ms else 0.0,
        "predicted_n": n_predicted,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps and predicted_ms else 0.0,
        "predicted_per_second": steps / predicted_ms * 1000 if steps and predicted_ms else 0.0,
        **drafted,  # as llama-server: only where its steps proposed tokens
    }


def prompt_progress(progress: PromptProgress) -> dict:
    return {"total": progress.total, "cache": progress.cached, "processed": progress.processed, "time_ms": progress.ms}


async def _whole(run: Run, answer: _Answer) -> web.Response:
    choices = [Choice(i, answer.tokenizer, answer.skip) for i in range(len(run.handles))]
    await run.gather(choices)
    results = [answer.final(i, run, c, streamed=False) for i, c in enumerate(choices)]
    return web.json_response(results[0] if len(results) == 1 else results)


async def _stream(request: web.Request, run: Run, answer: _Answer) -> web.StreamResponse:
    """llama-server's stream: `data: {...}` per token, then one with stop: true and the totals; no
    [DONE] (that is the OpenAI endpoints' end)."""
    resp, send, pending = await open_stream(request, run)

    choices = [Choice(i, answer.tokenizer, answer.skip) for i in range(len(run.handles))]
    try:
        while pending or run.open:
            index, event = pending.pop() if pending else await run.next()
            if event.progress is not None:
                await send(answer.partial(index, run, "", None, (), event.progress))
                continue
            text, entries = choices[index].add(event)
            if event.finish_reason in ("error", "cancelled"):
                await send(failure(event).body())
                run.outcome = "failed"
                break
            if text or (event.token is not None and event.token not in answer.skip):
                await send(answer.partial(index, run, text, event.token, entries))
            if event.finish_reason is not None:
                await send(answer.final(index, run, choices[index], streamed=True))
        await resp.write_eof()
        if run.outcome != "failed":
            run.log_done(run.usage())
            run.outcome = "served"
    except ConnectionError:
        pass  # the client went away mid-stream; the handler cancels what is still running
    return resp


# -- tokens and templates ----------------------------------------------------------------------


def _piece(tokenizer, token: int) -> str | list[int]:
    """A token's text as llama-server shows it: a string, or its bytes where they are not UTF-8
    on their own (SentencePiece's byte tokens, a part of a character)."""
    piece = getattr(tokenizer, "piece", None)
    if piece is None:
        return tokenizer.token_text(token)
    data = piece(token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def tokenize(request: web.Request) -> web.Response:
    """{"content", "add_special", "with_pieces"} -> {"tokens"}."""
    body = await json_body(request)
    content, add_special = body.get("content", ""), body.get("add_special", False)
    if not isinstance(content, str) or not isinstance(add_special, bool):
        raise bad_request("'content' must be a string and 'add_special' a boolean")
    tokenizer = request.app[BACKEND].tokenizer
    ids = tokenizer.encode(content, add_special=add_special, parse_special=True)
    if body.get("with_pieces"):
        return web.json_response({"tokens": [{"id": i, "piece": _piece(tokenizer, i)} for i in ids]})
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens"} -> {"content"}."""
    body = await json_body(request)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    tokenizer = request.app[BACKEND].tokenizer
    try:
        ids = tokenizer.check_ids(tokens)
    except ValueError as e:
        raise bad_request(str(e), "tokens") from None
    return web.json_response({"content": tokenizer.decode(ids, skip_special=False)})


async def apply_template(request: web.Request) -> web.Response:
    """{"messages", "add_generation_prompt"} -> {"prompt"}: the text /v1/chat/completions would continue."""
    backend = request.app[BACKEND]
    body = backend.settings.with_defaults(await json_body(request))  # --chat-template-kwargs, --reasoning
    messages, tokenizer = chat_messages(body.get("messages")), backend.tokenizer
    try:
        tools = parse_tools(body, tokenizer)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    return web.json_response({"prompt": chat_text(tokenizer, messages, body, tools.tools if tools else None)})


# -- server state ------------------------------------------------------------------------------


def _default_params(backend: Backend) -> dict:
    fields = {**LLAMA_DEFAULTS, "repeat_penalty": 1.0, "repeat_last_n": 64, **backend.settings.sampling}
    n_predict = backend.settings.n_predict
    return {
        **sampling_params(fields, -1 if n_predict is None else n_predict),
        "stop": [],
        "ignore_eos": False,
        "stream": False,
        "n_probs": 0,
    }


def _slot(backend: Backend, slot: int, view: SlotView | None) -> dict:
    """llama-server's shape: a slot's request (params, next_token as a list of one) only while it
    has one."""
    out = {"id": slot, "n_ctx": backend.ctx, "speculative": False, "is_processing": view is not None}
    if view is None:
        return out
    request = view.request
    n_decoded = view.stats.completion_tokens
    return {
        **out,
        "id_task": -1,
        "n_prompt_tokens": len(request.prompt),
        "params": sampling_params(request.sampling.to_dict(), request.max_tokens),
        "next_token": [
            {
                "has_next_token": True,
                "has_new_line": False,
                "n_remain": request.max_tokens - n_decoded,
                "n_decoded": n_decoded,
            }
        ],
    }


async def props(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    engine = backend.engine
    return web.json_response(
        {
            "default_generation_settings": {
                "id": 0,
                "id_task": -1,
                "n_ctx": backend.ctx,
                "speculative": False,
                "is_processing": False,
                "params": _default_params(backend),
                "prompt": "",
            },
            "total_slots": engine.pipeline.n_slots if engine is not None else 0,
            "model_alias": backend.model_id,
            "model_path": backend.settings.model_path,
            "n_ctx": backend.ctx,
            "chat_template": backend.tokenizer.chat_template or CHATML_TEMPLATE,
            "bos_token": backend.tokenizer.bos_token,
            "eos_token": backend.tokenizer.eos_token,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"shardwire {__version__}",
            "is_sleeping": False,
        }
    )


async def slots(request: web.Request) -> web.Response:
    if not request.app[SLOTS]:
        raise APIError(
            501, "This server does not support slots endpoint. Start it with `--slots`", "not_supported_error"
        )
    backend = request.app[BACKEND]
    engine = backend.ready_engine()
    in_use = engine.slots_in_use
    states = [_slot(backend, i, in_use.get(i)) for i in range(engine.pipeline.n_slots)]
    if request.query.get("fail_on_no_slot") and all(s["is_processing"] for s in states):
        raise unavailable("no slot available", "no_slot_available")
    return web.json_response(states)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[METRICS]
    if registry is None:
        raise APIError(
            501,
            "This server does not support metrics endpoint. Start it with `--metrics`",
            type="not_supported_error",
        )
    started = int(psutil.Process().create_time())  # lets a scraper see that the server restarted
    return web.Response(
        body=render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST, "Process-Start-Time-Unix": str(started)}
    )
