"""The OpenAI-compatible HTTP API over one engine, the counterpart of llama-server's.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, GET /health, GET /v1/cluster     (workers, devices, blocks, memory, latency, slots,
                                                       recoveries)
    llama-server's: /chat/completions, /models, /v1/health, and its native API
    (llama_server_api.py): /completion (and /completions), /tokenize, /detokenize, /apply-template,
    /props, /slots, /metrics; CORS for browsers as llama-server answers it (cors.py)
    GET  /v1/cluster/events                           (the same, pushed as server-sent events: cluster_view.py)
    POST /v1/cluster/workers {"address": "host:port"}  (admit a new worker; stages move onto it)
    GET  /, /webui/...                                (the web page: chat and the cluster view, webui.py)
    POST /v1/chat/completions/input_tokens            (llama-server's: the prompt's length in tokens)

The app answers from the start; serve.py loads the model behind it (/health answers 503 until
every stage is ready). Every request becomes engine Requests (state.py runs them); the engine's
thread batches all running sequences into each decode step and hands their events to the event
loop with call_soon_threadsafe, so no handler blocks it. A client that goes away cancels its
sequences, which frees their KV cache slots on every worker.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from ..coordinator.links import parse_address
from . import llama_server_api as native
from .cluster_view import RATES, Rates, cluster, cluster_events
from .cors import CorsPolicy, allow_cors
from .metrics import registry_for
from .openai_api import (
    APIError,
    Choice,
    bad_request,
    chunk,
    chunk_choice,
    parse_chat,
    parse_completion,
    response,
    tool_stream,
    unavailable,
)
from .state import (
    BACKEND,
    Backend,
    Run,
    check_model,
    error_response,
    failure,
    json_body,
    open_stream,
    parse_off_loop,
    skip_ids,
)
from .webui import add_webui, is_public

__all__ = ["Backend", "create_app"]

log = logging.getLogger("shardwire.serving.app")

API_KEY = web.AppKey("api_key", object)
MAX_BODY = 32 << 20  # a long prompt as JSON; aiohttp's default of 1 MiB is ~250k characters
PUBLIC_PATHS = ("/health", "/v1/health")  # answered without the API key, as llama-server does


# -- handlers ----------------------------------------------------------------------------------


async def _generate(request: web.Request, parse) -> web.StreamResponse:
    backend: Backend = request.app[BACKEND]
    body = await json_body(request)
    check_model(body)
    engine = backend.ready_engine()
    settings = backend.settings
    job = settings.default_length(await parse_off_loop(parse, settings.with_defaults(body), backend.tokenizer))
    with backend.running(engine, job) as run:
        return await (_stream(request, backend, run) if job.stream else _whole(backend, run))


async def _whole(backend: Backend, run: Run) -> web.Response:
    job = run.job
    choices = [Choice(i, backend.tokenizer, skip_ids(backend.tokenizer, job), job) for i in range(len(run.handles))]
    use = await run.gather(choices)
    answer = {**response(job, backend.model_id, choices, use), **_timings(run)}
    if job.verbose:
        answer["__verbose"] = _verbose(backend, job, choices[0], use)
    return web.json_response(answer)


def _verbose(backend: Backend, job, choice: Choice, use: dict) -> dict:
    """llama-server's __verbose: what its native API would answer, the prompt as text first."""
    return {
        "prompt": backend.tokenizer.decode(job.prompts[0], skip_special=False),
        "content": choice.text,
        "tokens_evaluated": len(job.prompts[0]),
        "tokens_predicted": use["completion_tokens"],
        "stop_type": "limit" if choice.finish_reason == "length" else "eos",
        "model": backend.model_id,
    }


def _timings(run: Run) -> dict:
    """llama-server's `timings` beside OpenAI's usage, for a request of one choice."""
    return {"timings": native.timings(run.handles[0].stats)} if len(run.handles) == 1 else {}


async def _stream(request: web.Request, backend: Backend, run: Run) -> web.StreamResponse:
    job, model = run.job, backend.model_id
    resp, send, pending = await open_stream(request, run)

    choices = [Choice(i, backend.tokenizer, skip_ids(backend.tokenizer, job), job) for i in range(len(run.handles))]
    holds = [tool_stream(job) for _ in choices]  # with tools: text that may be a call waits for its end
    try:
        for c in choices:
            if job.kind == "chat":
                await send(chunk(job, model, [chunk_choice(job, c, role=True)]))
            elif job.echo:
                await send(chunk(job, model, [chunk_choice(job, c, text=job.echo[c.index // job.n])]))
        while pending or run.open:
            index, event = pending.pop() if pending else await run.next()
            c = choices[index]
            if event.progress is not None:  # as llama-server: an empty delta, how far the prompt is
                piece = chunk_choice(job, c, role=job.kind == "chat")
                await send({**chunk(job, model, [piece]), "prompt_progress": native.prompt_progress(event.progress)})
                continue
            offset = len(c.text) + (len(job.echo[index // job.n]) if job.echo else 0)
            text, entries = c.add(event)
            if event.finish_reason in ("error", "cancelled"):
                await send(failure(event).body())  # the openai client raises APIError on this
                run.outcome = "failed"
                break
            hold = holds[index]
            if hold is not None:
                text = hold.feed(text)
            if text or entries or c.new_reasoning:
                piece = chunk_choice(job, c, text=text, entries=entries, offset=offset, reasoning=c.new_reasoning)
                await send(chunk(job, model, [piece]))
            if event.finish_reason is not None:
                finish_reason = event.finish_reason
                if hold is not None:
                    rest, calls = hold.finish()
                    if rest:
                        await send(chunk(job, model, [chunk_choice(job, c, text=rest)]))
                    if calls:  # each whole call in one delta, as OpenAI's clients accumulate them
                        await send(chunk(job, model, [chunk_choice(job, c, tool_calls=list(enumerate(calls)))]))
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                await send(chunk(job, model, [chunk_choice(job, c, finish_reason=finish_reason)]))
        if run.outcome != "failed":
            use = run.usage()
            run.log_done(use)
            if job.include_usage:
                await send({**chunk(job, model, [], use), **_timings(run)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if run.outcome != "failed":
            run.outcome = "served"
    except ConnectionError:
        pass  # the client went away mid-stream; _generate cancels what is still running
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def chat_input_tokens(request: web.Request) -> web.Response:
    """llama-server's token count of a chat request: its prompt as /v1/chat/completions renders it."""
    backend: Backend = request.app[BACKEND]
    job = await parse_off_loop(parse_chat, await json_body(request), backend.tokenizer)
    return web.json_response({"input_tokens": len(job.prompts[0])})


def _model_card(backend: Backend) -> dict:
    return {
        "id": backend.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "shardwire",
        "meta": {**backend.info, "ctx": backend.ctx or None},
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[BACKEND])]})


async def model(request: web.Request) -> web.Response:
    backend: Backend = request.app[BACKEND]
    name = request.match_info["model"]
    if name not in backend.names:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{backend.model_id}`.",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_card(backend))


async def health(request: web.Request) -> web.Response:
    problem = request.app[BACKEND].problem()
    if problem is not None:
        return error_response(unavailable(problem))
    return web.json_response({"status": "ok"})


async def add_worker(request: web.Request) -> web.Response:
    """Admit a worker that was not in --rpc: the next rebalance may place stages on it."""
    backend: Backend = request.app[BACKEND]
    body = await json_body(request)
    address = body.get("address")
    if not isinstance(address, str) or not address.strip():
        raise bad_request("'address' must be a worker's host:port", "address")
    cluster = backend.cluster
    if cluster is None:
        raise bad_request("this server runs its model in one process; start it with --rpc to use workers")
    try:
        parse_address(address)
    except ValueError as e:
        raise bad_request(str(e), "address") from None
    cluster.add_worker(address.strip())
    return web.json_response({"added": address.strip(), "workers": [l.name for l in cluster.links]})


# -- the app -----------------------------------------------------------------------------------


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """Every failure answers in OpenAI's error shape; only a bug in shardwire is a 500."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        return error_response(APIError(e.status, e.text or e.reason, kind.get(e.status, "invalid_request_error")))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(
            APIError(500, "internal error in shardwire; the server log has the details", "server_error")
        )


@web.middleware
async def _api_key(request: web.Request, handler):
    """Authorization: Bearer KEY or X-Api-Key: KEY, as llama-server takes either. A browser's CORS
    preflight never carries the key: cors.py answers it first, and the request that follows needs it."""
    key = request.app[API_KEY]
    if key and request.path not in PUBLIC_PATHS and not is_public(request.path):
        bearer = request.headers.get("Authorization", "")
        given = request.headers.get("X-Api-Key") or (bearer[7:] if bearer.lower().startswith("bearer ") else "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            return error_response(
                APIError(
                    401,
                    "Incorrect or missing API key (send Authorization: Bearer KEY or X-Api-Key: KEY)",
                    "authentication_error",  # llama-server's type; OpenAI's clients go by the status
                    code="invalid_api_key",
                )
            )
    return await handler(request)


def create_app(
    backend: Backend,
    api_key: str | None = None,
    cors: CorsPolicy | None = CorsPolicy(),
    slots: bool = True,
    webui: bool = True,
) -> web.Application:
    """`cors`: which browser pages may call the API (None: no CORS answers); `slots`: GET /slots
    answers (llama-server's --slots, its default; --no-slots: 501); `webui`: the web page at /
    (llama-server's --no-webui: 404)."""
    app = web.Application(middlewares=[_openai_errors, _api_key], client_max_size=MAX_BODY)
    app[BACKEND], app[API_KEY], app[native.SLOTS], app[RATES] = backend, api_key, slots, Rates()
    app[native.METRICS] = registry_for(backend) if backend.settings.metrics else None
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)  # llama-server answers these too
    app.router.add_post("/v1/chat/completions/input_tokens", chat_input_tokens)
    app.router.add_post("/chat/completions/input_tokens", chat_input_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_get("/v1/cluster/events", cluster_events)
    app.router.add_post("/v1/cluster/workers", add_worker)
    # llama-server's native API
    app.router.add_post("/completion", native.completion)
    app.router.add_post("/completions", native.completion)  # llama-server's, not /v1/completions
    app.router.add_post("/tokenize", native.tokenize)
    app.router.add_post("/detokenize", native.detokenize)
    app.router.add_post("/apply-template", native.apply_template)
    app.router.add_get("/props", native.props)
    app.router.add_get("/slots", native.slots)
    app.router.add_get("/metrics", native.metrics)
    if webui:
        add_webui(app)
    if cors is not None:
        allow_cors(app, cors)
    return app
