"""The chat page: GET /ui and its two static files (helios/http/static, package data, no build step).

The files are public, like / and /health: they hold no data and no key. The page itself calls
/v1/models and /v1/chat/completions with the key typed into its key field (a bearer token), so a
server with `[server] api_key` answers its requests only with that key (docs/operations.md, "Chat
page")."""

from __future__ import annotations

import functools
from importlib import resources

from helios.asgi.responses import send_bytes
from helios.http.context import RequestContext
from helios.http.dispatch import Route

# What each URL serves: (file in helios/http/static, content type).
FILES: dict[str, tuple[str, bytes]] = {
    "/ui": ("index.html", b"text/html; charset=utf-8"),
    "/ui/": ("index.html", b"text/html; charset=utf-8"),
    "/ui/chat.js": ("chat.js", b"text/javascript; charset=utf-8"),
    "/ui/chat.css": ("chat.css", b"text/css; charset=utf-8"),
}

# No third-party origin at all: scripts, styles and requests come from the server itself.
_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
     b"frame-ancestors 'none'"),
]


@functools.cache
def _read(name: str) -> bytes:
    return resources.files("helios.http").joinpath("static", name).read_bytes()


async def static_file(ctx: RequestContext) -> None:
    name, content_type = FILES[ctx.req.path]
    ctx.responded = True
    await send_bytes(ctx.send, 200, _read(name), content_type, _HEADERS)


ROUTES: list[Route] = [("GET", path, static_file) for path in FILES]
