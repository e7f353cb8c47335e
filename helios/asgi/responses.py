"""Plain and JSON responses, and the SSE writer.

JSON is compact UTF-8 (``ensure_ascii=False``) and strict: NaN and infinities are refused
(``allow_nan=False``) because they are not JSON and break every client parser; encoders map such
values (e.g. a ``-inf`` logprob) before they get here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from helios.asgi.types import RawHeaders, Send

Header = tuple[bytes, bytes]

JSON_CONTENT_TYPE = b"application/json"
TEXT_CONTENT_TYPE = b"text/plain; charset=utf-8"
SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(obj: Any) -> str:
    """Compact, strict JSON text (the one serializer every response and SSE event uses): what
    `json.dumps` writes with these options, through one encoder built once (json.dumps builds one
    per call when given options)."""
    return _ENCODER.encode(obj)


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes, headers: Iterable[Header] = ()
) -> None:
    """A complete response in one body message, with Content-Length."""
    raw: RawHeaders = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: Any, headers: Iterable[Header] = ()) -> None:
    await send_bytes(send, status, dumps(obj).encode("utf-8"), JSON_CONTENT_TYPE, headers)


async def send_text(
    send: Send,
    status: int,
    text: str,
    headers: Iterable[Header] = (),
    content_type: bytes = TEXT_CONTENT_TYPE,
) -> None:
    await send_bytes(send, status, text.encode("utf-8"), content_type, headers)


class SSEWriter:
    """Server-sent events over one ASGI response: ``start`` → ``event``/``comment``... → ``close``.

    Each message (event, comment, ``[DONE]``) is exactly one ``http.response.body`` send with
    ``more_body=True``, so the server flushes it promptly. ``close`` ends the body and is
    idempotent; writing after ``close`` or before ``start`` is a programming error.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self._started = False
        self._closed = False

    @property
    def started(self) -> bool:
        return self._started

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self, headers: Iterable[Header] = (), status: int = 200) -> None:
        if self._started:
            raise RuntimeError("SSE response already started")
        raw: RawHeaders = [
            (b"content-type", SSE_CONTENT_TYPE),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        raw.extend(headers)
        self._started = True
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def event(self, data: str | dict[str, Any] | list[Any], event: str | None = None) -> None:
        """One event; a dict or list is serialized as compact JSON, a string may span lines."""
        text = data if isinstance(data, str) else dumps(data)
        await self._write(format_event(text, event))

    async def comment(self, text: str = "") -> None:
        """A comment line (keepalive); clients ignore it."""
        lines = _split_lines(text)
        await self._write("".join(f": {line}\n" if line else ":\n" for line in lines) + "\n")

    async def close(self) -> None:
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _write(self, message: str) -> None:
        if not self._started:
            raise RuntimeError("SSE response not started")
        if self._closed:
            raise RuntimeError("SSE response already closed")
        await self._send({"type": "http.response.body", "body": message.encode("utf-8"), "more_body": True})


def format_event(data: str, event: str | None = None) -> str:
    """The wire text of one SSE message (pure; the writer's encoder, exposed for tests)."""
    parts: list[str] = []
    if event is not None:
        if "\n" in event or "\r" in event:
            raise ValueError("SSE event names cannot contain line breaks")
        parts.append(f"event: {event}\n")
    parts.extend(f"data: {line}\n" for line in _split_lines(data))
    parts.append("\n")
    return "".join(parts)


def _split_lines(text: str) -> list[str]:
    """Split on the SSE line terminators (CRLF, CR, LF) only; an empty text is one empty line."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
