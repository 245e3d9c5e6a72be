"""What the HTTP handlers serve (the model, its tokenizer, the engine once loaded, the server's
flags) and how one API request runs on the engine: its engine handles, their events merged into
one asyncio queue, and what is counted when it ends. Shared by the OpenAI endpoints (app.py)
and llama-server's native ones (llama_server_api.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from ..coordinator import Cluster
from ..engine import Engine, Event
from ..pipeline import Pipeline
from .metrics import Totals
from .openai_api import APIError, Job, bad_request, unavailable, usage

log = logging.getLogger("shardwire.serving.app")

BACKEND = web.AppKey("backend", object)  # the app's Backend


@dataclass
class ServerSettings:
    """What `shardwire serve`'s flags set for every request, and what /props reports."""

    sampling: dict = field(default_factory=dict)  # request fields set by flags (--temp, --seed...)
    n_predict: int | None = None  # -n: max_tokens / n_predict of requests that give none
    model_path: str = ""
    metrics: bool = False  # GET /metrics answers only with --metrics, as llama-server's
    verbose: bool = False  # --verbose: answers carry __verbose unless a request says "verbose": false
    chat_template_kwargs: dict = field(default_factory=dict)  # --chat-template-kwargs, --reasoning
    reasoning_format: str = "auto"  # --reasoning-format: none leaves the reasoning in content

    def with_defaults(self, body: dict, own: dict | None = None) -> dict:
        """The request's fields over the flags' over the endpoint's own defaults; a field sent as
        null counts as not sent."""
        given = {k: v for k, v in body.items() if v is not None}
        flags = {"verbose": True} if self.verbose else {}
        flags |= {"reasoning_format": self.reasoning_format} if self.reasoning_format != "auto" else {}
        merged = {**(own or {}), **self.sampling, **flags, **given}
        asked = given.get("chat_template_kwargs", {})
        if self.chat_template_kwargs and isinstance(asked, dict):  # the request's add to the flags'
            merged["chat_template_kwargs"] = {**self.chat_template_kwargs, **asked}
        return merged

    def default_length(self, job: Job) -> Job:
        """-n for a request without its own length (a request's own wins, as in llama-server)."""
        if self.n_predict is not None and job.max_tokens is None:
            job.max_tokens = self.n_predict
        return job


class Backend:
    """What the handlers serve: the model's name and tokenizer from the start, the engine once loaded."""

    def __init__(self, model_id: str, tokenizer, names: set[str], info: dict, settings: ServerSettings | None = None):
        self.model_id, self.tokenizer, self.names, self.info = model_id, tokenizer, names | {model_id}, info
        self.settings = settings or ServerSettings()
        self.pipeline: Pipeline | None = None
        self.cluster: Cluster | None = None  # when stages live on workers
        self.engine: Engine | None = None
        self.ctx = 0
        self.closing = False
        self.requests = {"served": 0, "failed": 0, "client_gone": 0}
        self.totals = Totals()

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

    @contextmanager
    def running(self, engine: Engine, job: Job):
        """The Run of a request's job, for as long as its handler answers; then `finished`."""
        run = Run(engine, job, self.ctx)
        try:
            yield run
        finally:
            self.finished(run)

    def finished(self, run: "Run") -> None:
        """Cancel what is still running of a request that ended, and count it."""
        if run.cancel_open() and run.outcome == "client_gone":
            log.info("%s: client gone; its sequences are cancelled", run.job.id)
        self.requests[run.outcome] += 1
        self.totals.add(run.handles)

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


class Run:
    """The engine handles of one API request, their events merged into one asyncio queue."""

    def __init__(self, engine: Engine, job: Job, ctx: int):
        self.job = job
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.handles = [engine.submit(r, _Sink(loop, self.queue, i)) for i, r in enumerate(job.requests(ctx))]
        self.open = set(range(len(self.handles)))
        self.outcome = "client_gone"  # until the answer is complete or has failed

    async def gather(self, choices: list) -> dict:
        """Every event of a request answered whole, into its choices; the request's usage. A
        sequence that fails or is cancelled fails the request."""
        while self.open:
            index, event = await self.next()
            choices[index].add(event)
            if event.finish_reason in ("error", "cancelled"):
                self.outcome = "failed"
                raise failure(event)
        use = self.usage()
        self.log_done(use)
        self.outcome = "served"
        return use

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
        firsts = self.handles[:: self.job.n]
        return usage(
            sum(len(p) for p in self.job.prompts),
            sum(h.stats.completion_tokens for h in self.handles),
            sum(h.stats.cached_tokens for h in firsts),
        )

    def log_done(self, use: dict) -> None:
        if log.isEnabledFor(logging.INFO):
            speeds = [h.stats.decode_tps for h in self.handles]
            log.info(
                "%s: %d prompt + %d completion tokens, %.1f tokens/s per sequence",
                self.job.id,
                use["prompt_tokens"],
                use["completion_tokens"],
                sum(speeds) / len(speeds),
            )


def failure(event: Event) -> APIError:
    if event.finish_reason == "cancelled":
        return unavailable("the server is shutting down", "shutting_down")
    return unavailable(f"generation failed: {event.error}", "worker_unavailable")


async def open_stream(request: web.Request, run: Run):
    """Wait for a run's first event before answering 200, so that a failure before any output (a
    worker gone) is still an HTTP error the client can act on; then an event stream and its
    `send(data)`, plus the first event."""
    pending = [await run.next()]
    if pending[0][1].finish_reason in ("error", "cancelled"):
        run.outcome = "failed"
        raise failure(pending[0][1])
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)

    async def send(data: dict) -> None:
        await resp.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")

    return resp, send, pending


def skip_ids(tokenizer, job: Job) -> frozenset[int]:
    """End-of-generation tokens end a choice; they are not part of its logprobs."""
    return frozenset() if job.ignore_eos else tokenizer.stop_ids


# -- reading requests --------------------------------------------------------------------------


def error_response(e: APIError) -> web.Response:
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


async def json_body(request: web.Request) -> dict:
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


def check_model(body: dict) -> None:
    """Any model name is answered by the one model served, as llama-server does: clients come with
    their own default names ("gpt-3.5-turbo") and aliases."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")


async def parse_off_loop(parse, body: dict, tokenizer) -> Job:
    """Tokenizing a long prompt takes a while: off the event loop. A ValueError is a 400."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, parse, body, tokenizer)
    except ValueError as e:
        raise bad_request(str(e)) from None
