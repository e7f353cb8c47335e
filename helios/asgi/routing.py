"""A tiny router: method + path pattern → handler, with path parameters.

Patterns are literal paths with ``{name}`` (one non-empty segment) or ``{name:path}`` (the rest
of the path, slashes included, non-empty) placeholders, e.g. ``/v1/models/{model:path}`` matches
``/v1/models/Qwen/Qwen3-8B`` with ``model="Qwen/Qwen3-8B"``. Routes are tried in the order they
were added, so add literal routes before overlapping parameterised ones. Matching runs on the
decoded ASGI ``path``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from helios.errors import MethodNotAllowed, NotFound

H = TypeVar("H")

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(path))?\}")


@attrs.frozen
class Route(Generic[H]):
    method: str
    pattern: str
    handler: H
    regex: re.Pattern[str]


class Router(Generic[H]):
    """Routes of one app; ``match`` raises NotFound (no route has the path) or MethodNotAllowed."""

    def __init__(self) -> None:
        self._routes: list[Route[H]] = []

    @property
    def routes(self) -> tuple[Route[H], ...]:
        return tuple(self._routes)

    def add(self, method: str, pattern: str, handler: H) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {pattern!r}")
        self._routes.append(Route(method.upper(), pattern, handler, compile_pattern(pattern)))

    def route(self, method: str, pattern: str) -> Callable[[H], H]:
        """Decorator form of :meth:`add`."""

        def register(handler: H) -> H:
            self.add(method, pattern, handler)
            return handler

        return register

    def match(self, method: str, path: str) -> tuple[H, dict[str, str]]:
        method = method.upper()
        allowed: list[str] = []
        for route in self._routes:
            found = route.regex.fullmatch(path)
            if found is None:
                continue
            if route.method == method:
                return route.handler, found.groupdict()
            if route.method not in allowed:
                allowed.append(route.method)
        if allowed:
            raise MethodNotAllowed(f"Method {method} not allowed for {path}", allowed=tuple(allowed))
        raise NotFound(f"Invalid URL ({method} {path})")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    parts: list[str] = []
    names: set[str] = set()
    pos = 0
    for placeholder in _PLACEHOLDER.finditer(pattern):
        literal = pattern[pos : placeholder.start()]
        if "{" in literal or "}" in literal:
            raise ValueError(f"malformed route pattern: {pattern!r}")
        parts.append(re.escape(literal))
        name, kind = placeholder.group(1), placeholder.group(2)
        if name in names:
            raise ValueError(f"duplicate parameter {name!r} in route pattern {pattern!r}")
        names.add(name)
        parts.append(f"(?P<{name}>.+)" if kind == "path" else f"(?P<{name}>[^/]+)")
        pos = placeholder.end()
    tail = pattern[pos:]
    if "{" in tail or "}" in tail:
        raise ValueError(f"malformed route pattern: {pattern!r}")
    parts.append(re.escape(tail))
    return re.compile("".join(parts), re.DOTALL)
