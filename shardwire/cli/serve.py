"""`shardwire serve`: the HTTP app listens at once, the model loads behind it on a thread of
its own, Ctrl-C or SIGTERM stop both (workers release their stages)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from pathlib import Path

from aiohttp import web

from ..coordinator.launch import build_pipeline, load_draft
from ..devices import set_threads
from ..engine import Engine
from ..formats import open_model
from ..serving.app import Backend, create_app
from ..serving.chat_templates import chosen_template
from ..serving.cors import CorsPolicy
from ..serving.state import ServerSettings
from ..tokenizer import load_tokenizer
from .generate import speculation_from_args


def run_serve(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    model = open_model(args.model)
    tokenizer = load_tokenizer(model)
    template = chosen_template(args.chat_template, args.chat_template_file)
    if template is not None:
        tokenizer.chat_template = template
    name = args.alias or Path(args.model).name
    cfg = model.config
    backend = Backend(
        name,
        tokenizer,
        {Path(args.model).name, Path(args.model).stem, str(args.model)},
        {
            "arch": cfg.arch,
            "n_layers": cfg.n_layers,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.context_length,
        },
        settings(args),
    )
    return asyncio.run(_serve(args, model, backend))


_SAMPLING_FLAGS = {
    "temperature": "temp",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "seed": "seed",
}


def settings(args: argparse.Namespace) -> ServerSettings:
    """The flags that set request defaults: only those given (a --seed of -1 is no seed)."""
    sampling = {
        field: getattr(args, flag) for field, flag in _SAMPLING_FLAGS.items() if getattr(args, flag) is not None
    }
    if sampling.get("seed") == -1:
        del sampling["seed"]
    speculation = speculation_from_args(args)  # checked here, where a bad flag stops the start
    if speculation is not None:
        sampling |= {
            "speculative.type": speculation.kind,
            "speculative.n_max": speculation.n_max,
            "speculative.n_min": speculation.n_min,
            "speculative.ngram_size_n": speculation.ngram,
            "speculative.p_min": speculation.p_min,
        }
    return ServerSettings(
        sampling=sampling,
        n_predict=None if args.n_predict < 0 else args.n_predict,
        model_path=str(args.model),
        metrics=args.metrics,
        verbose=args.verbose,
        chat_template_kwargs=template_kwargs(args),
        reasoning_format=args.reasoning_format,
    )


def template_kwargs(args: argparse.Namespace) -> dict:
    """--chat-template-kwargs, with --reasoning as enable_thinking: true unless off, as llama.cpp
    passes it (DeepSeek-R1's template closes its block when enable_thinking is not true)."""
    try:
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    kwargs.setdefault("enable_thinking", args.reasoning != "off")
    return kwargs


def _cors(args: argparse.Namespace) -> CorsPolicy | None:
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    if not origins:
        return None
    return CorsPolicy(origins, args.cors_methods, args.cors_headers, args.cors_credentials)


async def _serve(args: argparse.Namespace, model, backend: Backend) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C raises KeyboardInterrupt instead
            pass
    runner = web.AppRunner(
        create_app(backend, args.api_key, _cors(args), args.slots, args.webui),
        handler_cancellation=True,
        shutdown_timeout=3,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        host, port = runner.addresses[0][:2]
        print(f"shardwire serve: listening on http://{host}:{port} (loading {backend.model_id})", flush=True)
        loaded = _load_in_background(model, args, backend.tokenizer)
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not loaded.done():
            print("\ninterrupted while loading", file=sys.stderr)
            return 130
        backend.attach(*loaded.result())
        print(
            f"shardwire serve: ready: {backend.model_id}, context {backend.ctx} tokens, {args.parallel} "
            f"parallel sequences; OpenAI API at http://{host}:{port}/v1",
            flush=True,
        )
        await stopping
        print("\nshutting down", file=sys.stderr)
        return 0
    finally:
        backend.closing = True
        await loop.run_in_executor(None, backend.close)
        await runner.cleanup()


def _load_in_background(model, args: argparse.Namespace, tokenizer) -> asyncio.Future:
    """Plan, assign and load on a daemon thread (a Ctrl-C while loading must not wait for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value, cleanup=None):
        def apply():
            if not future.done():
                setter(value)
            elif cleanup is not None:
                cleanup()

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the server already stopped
            if cleanup is not None:
                cleanup()

    def load():
        try:
            ctx = min(args.ctx_size, model.config.context_length)
            draft = load_draft(args, tokenizer, args.parallel, ctx)  # before any weight ships
            pipeline, cluster = build_pipeline(model, args, n_slots=args.parallel)
            engine = Engine(pipeline, tokenizer, draft=draft, ahead=args.spec_ahead)
        except Exception as e:  # noqa: BLE001 -- handed to the event loop, which re-raises it
            settle(future.set_exception, e)
            return

        def release():
            engine.close()
            pipeline.close()

        settle(future.set_result, (pipeline, cluster, engine), release)

    threading.Thread(target=load, name="shardwire-load", daemon=True).start()
    return future
