"""The web page at /: chat with the model and watch the cluster (the files in webui/).

Served from memory, read once at start. The page itself is revalidated on every load (ETag), and
names each of its files with a hash of its content (/webui/app.js?v=HASH), so a browser keeps
those for a year and fetches them again only when they change. Nothing comes from elsewhere: a
cluster's machines often have no internet. The page and its files need no API key, as
llama-server's do not; the page asks for the key and sends it with every API call.
"""

from __future__ import annotations

import gzip
import hashlib
import mimetypes
import re
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

__all__ = ["add_webui", "is_public"]

FOLDER = Path(__file__).with_name("webui")
PREFIX = "/webui/"
FOREVER = "public, max-age=31536000, immutable"
# scripts and styles from this server only, nothing inline; images may be data: URLs in markdown
POLICY = (
    "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes
    content_type: str
    etag: str

    @classmethod
    def of(cls, body: bytes, name: str) -> "Asset":
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if content_type.startswith("text/") or content_type.endswith(("javascript", "json")):
            content_type += "; charset=utf-8"
        return cls(body, gzip.compress(body, 9, mtime=0), content_type, hashlib.sha256(body).hexdigest()[:16])

    def response(self, request: web.Request, cache_control: str) -> web.Response:
        headers = {"ETag": f'"{self.etag}"', "Cache-Control": cache_control, "Vary": "Accept-Encoding", **PAGE_HEADERS}
        if f'"{self.etag}"' in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers=headers)
        body = self.body
        if "gzip" in request.headers.get("Accept-Encoding", "") and len(self.gzipped) < len(body):
            body, headers["Content-Encoding"] = self.gzipped, "gzip"
        return web.Response(body=body, headers={**headers, "Content-Type": self.content_type})


class WebUI:
    def __init__(self, folder: Path = FOLDER):
        self.assets = {
            p.relative_to(folder).as_posix(): Asset.of(p.read_bytes(), p.name)
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "index.html"
        }
        # each of the page's own files named with its content's hash
        page = re.sub(r'(src|href)="/webui/([^"?]+)"', self._versioned, (folder / "index.html").read_text())
        self.page = Asset.of(page.encode(), "index.html")

    def _versioned(self, m: re.Match) -> str:
        asset = self.assets.get(m[2])
        if asset is None:
            raise FileNotFoundError(f"webui/index.html names {m[2]}, which is not in {FOLDER}")
        return f'{m[1]}="{PREFIX}{m[2]}?v={asset.etag}"'

    async def index(self, request: web.Request) -> web.Response:
        return self.page.response(request, "no-cache")

    async def asset(self, request: web.Request) -> web.Response:
        asset = self.assets.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound(text=f"no such file: {request.path}")
        versioned = request.query.get("v") == asset.etag
        return asset.response(request, FOREVER if versioned else "no-cache")


def is_public(path: str) -> bool:
    """The page and its files: answered without the API key."""
    return path == "/" or path.startswith(PREFIX)


def add_webui(app: web.Application) -> None:
    ui = WebUI()
    app.router.add_get("/", ui.index)
    app.router.add_get(PREFIX + "{name:.+}", ui.asset)
