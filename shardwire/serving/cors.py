"""CORS as llama-server answers it, so that a browser front end written for llama-server works
unchanged: a preflight (any OPTIONS) is answered 200 before the API key is asked for, with the
configured methods, headers and credentials; every response names the allowed origin.

Origins: "*" (the default) allows any page, reflecting its Origin when credentials are allowed
(browsers refuse "*" with credentials); "localhost" allows pages served from this machine only
(localhost, 127.0.0.1, ::1, any port), as llama-server's special value; other entries are exact
origins. A page not allowed gets no Access-Control-Allow-Origin, so its browser refuses the
answer. Headers "*" (the default) answers a preflight with the headers it asks for, where
llama-server answers "*": browsers never let "*" cover Authorization (nor anything, for
requests with credentials), and a page sending the API key needs it named. aiohttp-cors
cannot express the localhost rule or llama-server's preflight answer, hence this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # the CLI reads the defaults without loading aiohttp
    from aiohttp import web

ANY = "*"
LOCALHOST = "localhost"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = (ANY,)
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = ANY
    credentials: bool = True

    def allowed_origin(self, origin: str | None) -> str | None:
        """What Access-Control-Allow-Origin says to a page at `origin` (None: leave it out)."""
        if ANY in self.origins:
            return origin if origin and self.credentials else ANY
        if not origin:
            return None
        if origin in self.origins or (LOCALHOST in self.origins and _is_loopback(origin)):
            return origin
        return None


def _is_loopback(origin: str) -> bool:
    try:
        return urlsplit(origin).hostname in LOOPBACK_HOSTS
    except ValueError:
        return False


def allow_cors(app: web.Application, policy: CorsPolicy) -> None:
    """Answer preflights (put this middleware before the API key's) and name the allowed origin on
    every response, streamed ones included (headers are added as a response is prepared)."""
    from aiohttp import web

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS":
            return web.Response(status=200)
        return await handler(request)

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = policy.allowed_origin(request.headers.get("Origin"))
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != ANY:
                response.headers.add("Vary", "Origin")
        if request.method == "OPTIONS":
            response.headers["Access-Control-Allow-Credentials"] = "true" if policy.credentials else "false"
            response.headers["Access-Control-Allow-Methods"] = policy.methods
            asked = request.headers.get("Access-Control-Request-Headers", "")
            response.headers["Access-Control-Allow-Headers"] = (
                asked if policy.headers == ANY and asked else policy.headers
            )
            response.headers["Access-Control-Max-Age"] = "86400"
        elif origin is not None and policy.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(add_headers)
