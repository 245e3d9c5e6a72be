"""The real HTTP app in process, over one stage: a test's requests meet everything `serve` runs
but the cluster."""

from __future__ import annotations

from contextlib import asynccontextmanager

from aiohttp import web

from shardwire.engine import Engine
from shardwire.pipeline import LocalPipeline
from shardwire.serving.app import Backend, create_app


@asynccontextmanager
async def served(stage, tokenizer, n_slots: int = 1, ctx: int = 512, name: str = "m", settings=None):
    """The app's base URL while the block runs; the engine and the pipeline close after it.
    `settings`: the server's (serving.state.ServerSettings), where not the defaults."""
    backend = Backend(name, tokenizer, set(), {}, settings)
    pipeline = LocalPipeline([stage], n_slots=n_slots, ctx=ctx)
    backend.attach(pipeline, None, Engine(pipeline, tokenizer))
    runner = web.AppRunner(create_app(backend), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield "http://%s:%d" % runner.addresses[0][:2]
    finally:
        await runner.cleanup()
        backend.close()
