"""Ollama discovery routes: GET /api/tags and POST /api/show (errors in Ollama's shape)."""

from __future__ import annotations

from helios.frontends.ollama import discovery
from helios.http.context import RequestContext
from helios.http.dispatch import Route


async def tags(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(discovery.tags(ctx.svc.info))


async def show(ctx: RequestContext) -> None:
    ctx.auth()
    body = await ctx.read_json(identity_only=True)
    await ctx.json(discovery.show(ctx.svc.info, body))


ROUTES: list[Route] = [
    ("GET", "/api/tags", tags),
    ("POST", "/api/show", show),
]
