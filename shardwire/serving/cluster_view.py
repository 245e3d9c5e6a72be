"""GET /v1/cluster, and GET /v1/cluster/events: the same snapshot pushed as server-sent events
(`event: cluster`) when it changes, for the web page's cluster view.

A snapshot: the model, whether it serves (and why not), the slots and KV pages, requests by
outcome, `live` (tokens/s generated and prompt positions/s over the last seconds, the decode
step's moving average, requests running and waiting) and the cluster's workers, each with its
state, devices, stages and link. The feed looks every PUSH_S and sends only what changed, so an
idle server sends nothing but a comment every KEEPALIVE_S.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

from aiohttp import web

from .state import BACKEND, Backend

__all__ = ["RATES", "Rates", "cluster", "cluster_events", "snapshot"]

PUSH_S = 0.5
KEEPALIVE_S = 15.0
WINDOW_S = 2.0


class Rates:
    """Tokens generated and prompt positions computed per second, over the last WINDOW_S,
    from the engine's counters sampled at each snapshot."""

    def __init__(self):
        self._samples: deque[tuple[float, int, int]] = deque()

    def sample(self, generated: int, prompt: int) -> tuple[float, float]:
        now = time.monotonic()
        samples = self._samples
        samples.append((now, generated, prompt))
        while len(samples) > 2 and now - samples[1][0] >= WINDOW_S:
            samples.popleft()
        t0, generated0, prompt0 = samples[0]
        seconds = now - t0
        if seconds <= 0:
            return 0.0, 0.0
        return (generated - generated0) / seconds, (prompt - prompt0) / seconds


RATES = web.AppKey("rates", Rates)


def _live(engine, slots: dict, rates: Rates) -> dict:
    counters = engine.counters
    generated, prompt = rates.sample(counters.generated, counters.prompt_positions)
    return {
        "tokens_per_s": round(generated, 1),
        "prompt_tokens_per_s": round(prompt, 1),
        "step_ms": None if counters.step_ms is None else round(counters.step_ms, 2),
        "running": slots["busy"],
        "waiting": slots["waiting"],
    }


def snapshot(backend: Backend, rates: Rates) -> dict:
    problem, engine = backend.problem(), backend.engine
    slots = engine.slots() if engine is not None else None
    return {
        "model": backend.model_id,
        "ready": problem is None,
        "problem": problem,
        "ctx": backend.ctx or None,
        "slots": slots,
        "requests": dict(backend.requests),
        "live": _live(engine, slots, rates) if engine is not None else None,
        "cluster": backend.pipeline_status(),
    }


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(snapshot(request.app[BACKEND], request.app[RATES]))


async def cluster_events(request: web.Request) -> web.StreamResponse:
    backend: Backend = request.app[BACKEND]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    last, sent_at = None, 0.0
    try:
        while not backend.closing:
            body = json.dumps(snapshot(backend, request.app[RATES]), separators=(",", ":"))
            now = time.monotonic()
            if body != last:
                await resp.write(f"event: cluster\ndata: {body}\n\n".encode())
                last, sent_at = body, now
            elif now - sent_at >= KEEPALIVE_S:
                await resp.write(b": keep-alive\n\n")
                sent_at = now
            await asyncio.sleep(PUSH_S)
    except ConnectionError:
        pass  # the page went away
    return resp
