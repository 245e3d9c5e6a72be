"""The OpenAI-compatible HTTP API over one engine, the counterpart of llama-server's.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, GET /health, GET /v1/cluster     (workers, devices, blocks, memory, latency, slots,
                                                       recoveries)
    llama-server's: /completions, /chat/completions, /models, /v1/health, POST /tokenize, POST /detokenize;
    CORS for browsers (preflight answered without the API key)
    POST /v1/cluster/workers {"address": "host:port"}  (admit a new worker; stages move onto it)

The app answers from the start; serve.py loads the model behind it (/health answers 503 until
every stage is ready). Every request becomes engine Requests; the engine's thread batches all running sequences
into each decode step and hands their events to the event loop with call_soon_threadsafe, so no
handler blocks it. A client that goes away cancels its sequences, which frees their KV cache slots
on every worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import web

from .coordinator import Cluster
from .coordinator.links import parse_address
from .engine import Engine, Event
from .openai_api import (
    APIError,
    Choice,
    Job,
    bad_request,
    chunk,
    chunk_choice,
    parse_chat,
    parse_completion,
    response,
    unavailable,
    usage,
)
from .pipeline import Pipeline

log = logging.getLogger("shardwire.server")

BACKEND = web.AppKey("backend", object)
API_KEY = web.AppKey("api_key", object)
MAX_BODY = 32 << 20  # a long prompt as JSON; aiohttp's default of 1 MiB is ~250k characters


class Backend:
    """What the handlers serve: the model's name and tokenizer from the start, the engine once loaded."""

    def __init__(self, model_id: str, tokenizer, names: set[str], info: dict):
        self.model_id, self.tokenizer, self.names, self.info = model_id, tokenizer, names | {model_id}, info
        self.pipeline: Pipeline | None = None
        self.cluster: Cluster | None = None  # when stages live on workers
        self.engine: Engine | None = None
        self.ctx = 0
        self.closing = False
        self.requests = {"served": 0, "failed": 0, "client_gone": 0}

    def attach(self, pipeline: Pipeline, cluster: Cluster | None, engine: Engine) -> None:
        self.pipeline, self.cluster, self.ctx, self.engine = pipeline, cluster, pipeline.ctx, engine

    def ready_engine(self) -> Engine:
        if self.closing:
            raise unavailable("the server is shutting down", "shutting_down")
        if self.engine is None:
            raise unavailable("Loading model", "model_loading")
        if not self.engine.running:
            raise unavailable("the engine stopped after an internal error; see the server log", "engine_stopped")
        return self.engine

    def pipeline_status(self) -> dict | None:
        if self.pipeline is None:
            return None
        return self.pipeline.status()

    def problem(self) -> str | None:
        """Why the model cannot serve right now, or None when every stage is loaded and reachable."""
        if self.closing:
            return "the server is shutting down"
        if self.engine is None:
            return "Loading model"
        if not self.engine.running:
            return "the engine stopped after an internal error; see the server log"
        status = self.pipeline_status()
        if status.get("broken"):
            return status["broken"]
        gone = [w["name"] for w in status["workers"] if w["stages"] and not w["alive"]]
        if gone or not status.get("ready", True):
            return f"worker {', '.join(gone)} is gone" if gone else "the stages are not loaded"
        return None

    def close(self) -> None:
        self.closing = True
        if self.engine is not None:
            self.engine.close()  # fails every open sequence, so streaming handlers finish
        if self.pipeline is not None:
            self.pipeline.close()  # the cluster tells each worker to release its stages


# -- from engine thread to event loop ----------------------------------------------------------


class _Sink:
    """Where one choice's engine events go: put() runs on the engine thread and only schedules."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        self.loop, self.queue, self.index = loop, queue, index

    def put(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, event))
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


class _Run:
    """The engine handles of one API request, their events merged into one asyncio queue."""

    def __init__(self, engine: Engine, job: Job, ctx: int):
        self.job = job
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.handles = [engine.submit(r, _Sink(loop, self.queue, i)) for i, r in enumerate(job.requests(ctx))]
        self.open = set(range(len(self.handles)))
        self.outcome = "client_gone"  # until the answer is complete or has failed

    async def next(self) -> tuple[int, Event]:
        index, event = await self.queue.get()
        if event.finish_reason is not None:
            self.open.discard(index)
        return index, event

    def cancel_open(self) -> int:
        for index in self.open:
            self.handles[index].cancel()
        n, self.open = len(self.open), set()
        return n

    def usage(self) -> dict:
        # The prompt counts once per prompt, not once per choice, as OpenAI counts it.
        return usage(sum(len(p) for p in self.job.prompts), sum(h.stats.completion_tokens for h in self.handles))


def _failure(event: Event) -> APIError:
    if event.finish_reason == "cancelled":
        return unavailable("the server is shutting down", "shutting_down")
    return unavailable(f"generation failed: {event.error}", "worker_unavailable")


# -- handlers ----------------------------------------------------------------------------------


def _error(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


MAX_JSON_DEPTH = 64  # far beyond any real request; deeper bodies would reach recursive code


def _depth_within(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    too_deep = bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request ({e})") from None
    if not _depth_within(body, MAX_JSON_DEPTH):
        raise too_deep
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _check_model(backend: Backend, body: dict) -> None:
    """Any model name is answered by the one model served, as llama-server does: clients come with
    their own default names ("gpt-3.5-turbo") and aliases."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")


async def _generate(request: web.Request, parse) -> web.StreamResponse:
    backend: Backend = request.app[BACKEND]
    body = await _json_body(request)
    _check_model(backend, body)
    engine = backend.ready_engine()
    try:  # tokenizing a long prompt takes a while: off the event loop
        job = await asyncio.get_running_loop().run_in_executor(None, parse, body, backend.tokenizer)
    except ValueError as e:
        raise bad_request(str(e)) from None
    run = _Run(engine, job, backend.ctx)
    try:
        if job.stream:
            return await _stream(request, backend, run)
        return await _whole(backend, run)
    finally:
        if run.cancel_open() and run.outcome == "client_gone":
            log.info("%s: client gone; its sequences are cancelled", job.id)
        backend.requests[run.outcome] += 1


async def _whole(backend: Backend, run: _Run) -> web.Response:
    job = run.job
    choices = [Choice(i, backend.tokenizer, _skip_ids(backend, job)) for i in range(len(run.handles))]
    while run.open:
        index, event = await run.next()
        choices[index].add(event)
        if event.finish_reason in ("error", "cancelled"):
            run.outcome = "failed"
            raise _failure(event)
    use = run.usage()
    _log_done(job, run, use)
    run.outcome = "served"
    return web.json_response(response(job, backend.model_id, choices, use))


async def _stream(request: web.Request, backend: Backend, run: _Run) -> web.StreamResponse:
    job, model = run.job, backend.model_id
    # Wait for the first event before answering 200, so that a failure before any output (a worker
    # gone) is still an HTTP error the client can act on.
    pending = [await run.next()]
    if pending[0][1].finish_reason in ("error", "cancelled"):
        run.outcome = "failed"
        raise _failure(pending[0][1])
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)

    async def send(data: dict) -> None:
        await resp.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")

    choices = [Choice(i, backend.tokenizer, _skip_ids(backend, job)) for i in range(len(run.handles))]
    try:
        for c in choices:
            if job.kind == "chat":
                await send(chunk(job, model, [chunk_choice(job, c, role=True)]))
            elif job.echo:
                await send(chunk(job, model, [chunk_choice(job, c, text=job.echo[c.index // job.n])]))
        while pending or run.open:
            index, event = pending.pop() if pending else await run.next()
            c = choices[index]
            offset = len(c.text) + (len(job.echo[index // job.n]) if job.echo else 0)
            text, entries = c.add(event)
            if event.finish_reason in ("error", "cancelled"):
                await send(_failure(event).body())  # the openai client raises APIError on this
                run.outcome = "failed"
                break
            if text or entries:
                await send(chunk(job, model, [chunk_choice(job, c, text=text, entries=entries, offset=offset)]))
            if event.finish_reason is not None:
                await send(chunk(job, model, [chunk_choice(job, c, finish_reason=event.finish_reason)]))
        if run.outcome != "failed":
            use = run.usage()
            _log_done(job, run, use)
            if job.include_usage:
                await send(chunk(job, model, [], use))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if run.outcome != "failed":
            run.outcome = "served"
    except ConnectionError:
        pass  # the client went away mid-stream; _generate cancels what is still running
    return resp


def _skip_ids(backend: Backend, job: Job) -> frozenset[int]:
    """End-of-generation tokens end a choice; they are not part of its logprobs."""
    return frozenset() if job.ignore_eos else backend.tokenizer.stop_ids


def _log_done(job: Job, run: _Run, use: dict) -> None:
    if log.isEnabledFor(logging.INFO):
        speeds = [h.stats.decode_tps for h in run.handles]
        log.info(
            "%s: %d prompt + %d completion tokens, %.1f tokens/s per sequence",
            job.id,
            use["prompt_tokens"],
            use["completion_tokens"],
            sum(speeds) / len(speeds),
        )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


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


async def tokenize(request: web.Request) -> web.Response:
    """llama-server's POST /tokenize: {"content", "add_special", "with_pieces"} -> {"tokens"}."""
    body = await _json_body(request)
    content, add_special = body.get("content", ""), body.get("add_special", False)
    if not isinstance(content, str) or not isinstance(add_special, bool):
        raise bad_request("'content' must be a string and 'add_special' a boolean")
    tokenizer = request.app[BACKEND].tokenizer
    ids = tokenizer.encode(content, add_special=add_special, parse_special=True)
    if body.get("with_pieces"):
        return web.json_response({"tokens": [{"id": i, "piece": tokenizer.token_text(i)} for i in ids]})
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """llama-server's POST /detokenize: {"tokens"} -> {"content"}."""
    body = await _json_body(request)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    tokenizer = request.app[BACKEND].tokenizer
    try:
        ids = tokenizer.check_ids(tokens)
    except ValueError as e:
        raise bad_request(str(e), "tokens") from None
    return web.json_response({"content": tokenizer.decode(ids, skip_special=False)})


async def health(request: web.Request) -> web.Response:
    problem = request.app[BACKEND].problem()
    if problem is not None:
        return _error(unavailable(problem))
    return web.json_response({"status": "ok"})


async def cluster(request: web.Request) -> web.Response:
    backend: Backend = request.app[BACKEND]
    problem = backend.problem()
    return web.json_response(
        {
            "model": backend.model_id,
            "ready": problem is None,
            "problem": problem,
            "ctx": backend.ctx or None,
            "slots": backend.engine.slots() if backend.engine is not None else None,
            "requests": backend.requests,
            "cluster": backend.pipeline_status(),
        }
    )


async def add_worker(request: web.Request) -> web.Response:
    """Admit a worker that was not in --rpc: the next rebalance may place stages on it."""
    backend: Backend = request.app[BACKEND]
    body = await _json_body(request)
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
        return _error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
        return _error(APIError(e.status, e.text or e.reason, kind.get(e.status, "invalid_request_error")))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(APIError(500, "internal error in shardwire; the server log has the details", "server_error"))


@web.middleware
async def _preflight(request: web.Request, handler):
    """A browser's CORS preflight is answered before the API key is asked for (it never carries
    one); the key still guards every request that follows."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": "86400",
            },
        )
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Any page may call the API from a browser, as llama-server allows by default."""
    response.headers["Access-Control-Allow-Origin"] = "*"


@web.middleware
async def _api_key(request: web.Request, handler):
    key = request.app[API_KEY]
    if key and request.path not in ("/health", "/v1/health"):
        given = request.headers.get("Authorization", "")
        given = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            return _error(
                APIError(401, "Incorrect or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")
            )
    return await handler(request)


def create_app(backend: Backend, api_key: str | None = None) -> web.Application:
    app = web.Application(middlewares=[_openai_errors, _preflight, _api_key], client_max_size=MAX_BODY)
    app.on_response_prepare.append(_cors_headers)
    app[BACKEND], app[API_KEY] = backend, api_key
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/completions", completions)  # llama-server answers these too
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_post("/v1/cluster/workers", add_worker)
    return app
