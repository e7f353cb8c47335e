"""The request view of an ASGI scope, and bounded body reading with content decoding.

Spec (api.md, "Transport and admission"): request bodies support identity, gzip, zlib deflate, br
and zstd content encodings; both the encoded and the decoded body are bounded by max_body_bytes.
Over the bound is 413, an unknown coding is 415, undecodable data is 400.

Decoding never materialises more than the bound: every decompressor runs with an output cap
(zlib ``max_length``, brotli ``output_buffer_limit``, zstd fed in input slices small enough that
one call cannot overshoot by more than a few blocks), so a decompression bomb becomes a 413 after
at most ``max_bytes`` of output, in bounded memory and time.

:func:`decode_body` is pure and fuzzable (fuzz invariant: any bytes with any coding list either
decode within the bound or raise a HeliosError with status 400, 413 or 415).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import parse_qs

import attrs
import brotli
import trio
import zstandard

from helios.asgi.types import Receive, Scope
from helios.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType


class ClientDisconnected(Exception):
    """The client went away (``http.disconnect``) before the body was complete. Not rendered."""


@attrs.frozen
class Headers:
    """Case-insensitive, multi-valued view of ASGI headers (lowercase latin-1 bytes on the wire)."""

    raw: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def from_raw(cls, raw: Iterable[tuple[bytes, bytes]]) -> Headers:
        return cls(tuple((bytes(k).lower(), bytes(v)) for k, v in raw))

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name``, or ``default``."""
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k == key:
                return v.decode("latin-1")
        return default

    def get_all(self, name: str) -> list[str]:
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for k, v in self.raw if k == key]

    def get_list(self, name: str) -> str | None:
        """All values of a list-valued header joined with ``", "`` (RFC 9110 §5.3), or None."""
        values = self.get_all(name)
        return ", ".join(values) if values else None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = name.lower().encode("latin-1")
        return any(k == key for k, _ in self.raw)


@attrs.frozen
class Request:
    """What a handler needs from an HTTP scope; the body is read separately with :func:`read_body`."""

    method: str
    path: str
    raw_path: bytes
    query: dict[str, list[str]]
    headers: Headers
    client: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> Request:
        path: str = scope.get("path", "/")
        raw_path = scope.get("raw_path") or path.encode("utf-8")
        query_string: bytes = scope.get("query_string", b"")
        query = parse_qs(query_string.decode("utf-8", "replace"), keep_blank_values=True)
        client = scope.get("client")
        return cls(
            method=str(scope.get("method", "GET")).upper(),
            path=path,
            raw_path=bytes(raw_path),
            query=query,
            headers=Headers.from_raw(scope.get("headers", ())),
            client=(str(client[0]), int(client[1])) if client else None,
        )

    def query_value(self, name: str) -> str | None:
        """The first value of a query parameter, or None."""
        values = self.query.get(name)
        return values[0] if values else None


# --- content codings ----------------------------------------------------------------------------

SUPPORTED_CODINGS = ("gzip", "deflate", "br", "zstd")
MAX_CODINGS = 4  # layers in one Content-Encoding list; more is a malformed request
MAX_MEMBERS = 1024  # gzip members / zstd frames in one body
OFFLOAD_MIN_BYTES = 4096  # encoded bodies at least this large decode on the worker pool

_OUT_CHUNK = 256 * 1024  # output slice per decompressor call
_IN_CHUNK = 64 * 1024  # input slice per decompressor call
_ZSTD_BLOCK_MAX = 128 * 1024  # one zstd block decodes to at most this
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_SKIPPABLE = b"\x2a\x4d\x18"  # bytes 1-3 of the skippable-frame magics 0x184D2A5?
_ZSTD_WINDOW_FLOOR = 8 * 1024 * 1024  # windows zstd levels 1-19 use; always accepted
_ZSTD_WINDOW_CEILING = 1 << 27  # libzstd's default limit
_ALIASES = {"x-gzip": "gzip"}


def parse_content_encoding(value: str | Sequence[str] | None) -> list[str]:
    """Normalise a Content-Encoding header (or its tokens) to the codings to undo, in order applied.

    ``identity`` and empty list elements vanish; ``x-gzip`` is ``gzip``. Unknown → 415.
    """
    if value is None:
        return []
    tokens = value.split(",") if isinstance(value, str) else list(value)
    codings: list[str] = []
    for token in tokens:
        coding = token.strip().lower()
        coding = _ALIASES.get(coding, coding)
        if not coding or coding == "identity":
            continue
        if coding not in SUPPORTED_CODINGS:
            raise UnsupportedMediaType(
                f"Unsupported Content-Encoding {token.strip()!r}; supported: identity, "
                + ", ".join(SUPPORTED_CODINGS)
            )
        codings.append(coding)
    if len(codings) > MAX_CODINGS:
        raise BadRequest(f"Content-Encoding lists {len(codings)} codings; at most {MAX_CODINGS} are accepted")
    return codings


def decode_body(data: bytes, encodings: str | Sequence[str] | None, max_bytes: int) -> bytes:
    """Undo ``encodings`` (a header value or token list, in the order they were applied).

    Raises PayloadTooLarge when the encoded input, any intermediate layer or the result exceeds
    ``max_bytes``; UnsupportedMediaType for an unknown coding; BadRequest for corrupt or truncated
    data. An empty body stays empty.
    """
    codings = parse_content_encoding(encodings)
    if len(data) > max_bytes:
        raise _too_large(max_bytes, encoded=True)
    for coding in reversed(codings):
        if not data:
            return b""
        decoder = _DECODERS[coding]
        try:
            data = decoder(memoryview(data), _Sink(max_bytes))
        except (zlib.error, brotli.error, zstandard.ZstdError) as exc:
            raise BadRequest(f"Request body is not valid {coding} data: {exc}") from None
    return bytes(data)


async def read_body(
    receive: Receive,
    headers: Headers,
    max_bytes: int,
    *,
    limiter: trio.CapacityLimiter | None = None,
    identity_only: bool = False,
) -> bytes:
    """Read the whole request body, bounded and decoded.

    Checks the codings first (415 before reading), then Content-Length (413 before reading), then
    accumulates ``http.request`` chunks, failing with 413 as soon as the encoded size exceeds
    ``max_bytes``. With a ``limiter`` (the frontend worker pool), bodies that may be expensive to
    decode are decoded in ``trio.to_thread.run_sync(..., limiter=limiter)``; without one decoding
    runs inline. ``identity_only`` turns any real coding into 415 (routes that take raw bodies).
    Raises ClientDisconnected on ``http.disconnect``.
    """
    codings = parse_content_encoding(headers.get_list("content-encoding"))
    if identity_only and codings:
        raise UnsupportedMediaType("This route accepts only identity Content-Encoding")
    content_length = headers.get("content-length")
    if content_length is not None:
        stripped = content_length.strip()
        if not (stripped.isascii() and stripped.isdigit()):
            raise BadRequest("Invalid Content-Length header")
        if int(stripped) > max_bytes:
            raise _too_large(max_bytes, encoded=True)

    body = bytearray()
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "http.disconnect":
            raise ClientDisconnected
        if kind != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            if len(body) + len(chunk) > max_bytes:
                raise _too_large(max_bytes, encoded=True)
            body += chunk
        if not message.get("more_body", False):
            break

    if not codings or not body:
        return bytes(body)
    data = bytes(body)
    del body
    if limiter is not None and (len(data) >= OFFLOAD_MIN_BYTES or {"br", "zstd"} & set(codings)):
        return await trio.to_thread.run_sync(decode_body, data, codings, max_bytes, limiter=limiter)
    return decode_body(data, codings, max_bytes)


# --- private helpers ----------------------------------------------------------------------------


class _Sink:
    """Collects decoded output; raises 413 the moment the total exceeds the bound."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.chunks: list[bytes] = []
        self.limit = limit
        self.size = 0

    @property
    def remaining(self) -> int:
        return self.limit - self.size

    def ask(self) -> int:
        """How much output to request next: one past the bound is enough to detect overflow."""
        return min(_OUT_CHUNK, self.remaining + 1)

    def write(self, chunk: bytes) -> None:
        if chunk:
            self.size += len(chunk)
            if self.size > self.limit:
                raise _too_large(self.limit, encoded=False)
            self.chunks.append(chunk)

    def result(self) -> bytes:
        return b"".join(self.chunks)


def _too_large(max_bytes: int, *, encoded: bool) -> PayloadTooLarge:
    which = "Request body" if encoded else "Decoded request body"
    return PayloadTooLarge(f"{which} exceeds the limit of {max_bytes} bytes")


def _corrupt(coding: str, what: str) -> BadRequest:
    return BadRequest(f"Request body is not valid {coding} data: {what}")


def _inflate_member(view: memoryview, start: int, wbits: int, sink: _Sink, coding: str) -> int:
    """Inflate one zlib/gzip/raw-deflate stream starting at ``start``; returns where it ended."""
    d = zlib.decompressobj(wbits)
    pos = start
    buf: bytes | memoryview = b""
    while not d.eof:
        if not buf and pos < len(view):
            buf = view[pos : pos + _IN_CHUNK]
            pos += len(buf)
        chunk = d.decompress(buf, sink.ask())
        sink.write(chunk)
        tail = d.unconsumed_tail
        if not chunk and len(tail) == len(buf) and not d.eof:
            raise _corrupt(coding, "truncated stream")
        buf = tail
    return pos - len(d.unused_data) - len(buf)


def _decode_gzip(view: memoryview, sink: _Sink) -> bytes:
    pos, members = 0, 0
    while pos < len(view):
        if members and view[pos] == 0:  # trailing zero padding, as gzip(1) and Python accept
            if bytes(view[pos:]).count(0) != len(view) - pos:
                raise _corrupt("gzip", "data after the last member")
            break
        members += 1
        if members > MAX_MEMBERS:
            raise _corrupt("gzip", f"more than {MAX_MEMBERS} members")
        pos = _inflate_member(view, pos, 16 + zlib.MAX_WBITS, sink, "gzip")
    return sink.result()


def _decode_deflate(view: memoryview, sink: _Sink) -> bytes:
    """HTTP "deflate" is zlib-wrapped (RFC 9110); raw deflate, which some clients send, is accepted."""
    if _looks_like_zlib(view):
        try:
            end = _inflate_member(view, 0, zlib.MAX_WBITS, sink, "deflate")
        except (zlib.error, BadRequest) as exc:
            # Perhaps a raw stream whose first bytes happen to form a zlib header; if it is not
            # that either, the zlib diagnosis is the useful one.
            try:
                return _decode_raw_deflate(view, _Sink(sink.limit))
            except (zlib.error, BadRequest):
                raise exc from None
        if end != len(view):
            raise _corrupt("deflate", "data after the end of the stream")
        return sink.result()
    return _decode_raw_deflate(view, sink)


def _decode_raw_deflate(view: memoryview, sink: _Sink) -> bytes:
    end = _inflate_member(view, 0, -zlib.MAX_WBITS, sink, "deflate")
    if end != len(view):
        raise _corrupt("deflate", "data after the end of the stream")
    return sink.result()


def _looks_like_zlib(view: memoryview) -> bool:
    if len(view) < 2:
        return False
    cmf, flg = view[0], view[1]
    return cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf << 8 | flg) % 31 == 0


def _decode_br(view: memoryview, sink: _Sink) -> bytes:
    d = brotli.Decompressor()
    for start in range(0, len(view), _IN_CHUNK):
        sink.write(d.process(view[start : start + _IN_CHUNK], output_buffer_limit=sink.ask()))
        while not d.can_accept_more_data():
            chunk = d.process(b"", output_buffer_limit=sink.ask())
            if not chunk and not d.can_accept_more_data():
                raise _corrupt("br", "decoder made no progress")
            sink.write(chunk)
    # All input is in; the decoder may still hold output it withheld under the buffer limit.
    while not d.is_finished():
        chunk = d.process(b"", output_buffer_limit=sink.ask())
        if not chunk:
            raise _corrupt("br", "truncated stream")
        sink.write(chunk)
    return sink.result()


def _decode_zstd(view: memoryview, sink: _Sink) -> bytes:
    """Frame by frame; each frame's declared size and window are checked before decoding it.

    ``ZstdDecompressionObj.decompress`` has no output cap, so input is fed in slices sized so that
    one call cannot produce much more than the remaining budget (a block header is 3 bytes and a
    block decodes to at most 128 KiB).
    """
    window_limit = _zstd_window_limit(sink.limit)
    dctx = zstandard.ZstdDecompressor(max_window_size=window_limit)
    pos, frames = 0, 0
    while pos < len(view):
        frames += 1
        if frames > MAX_MEMBERS:
            raise _corrupt("zstd", f"more than {MAX_MEMBERS} frames")
        if len(view) - pos >= 4 and view[pos] & 0xF0 == 0x50 and view[pos + 1 : pos + 4] == _ZSTD_SKIPPABLE:
            # A skippable frame: 4-byte magic, 4-byte little-endian size, then that many bytes.
            if len(view) - pos < 8:
                raise _corrupt("zstd", "truncated skippable frame")
            end = pos + 8 + int.from_bytes(view[pos + 4 : pos + 8], "little")
            if end > len(view):
                raise _corrupt("zstd", "truncated skippable frame")
            pos = end
            continue
        if view[pos : pos + 4] == _ZSTD_MAGIC:
            params = zstandard.get_frame_parameters(bytes(view[pos : pos + 18]))
            if params.content_size != zstandard.CONTENTSIZE_UNKNOWN and params.content_size > sink.remaining:
                raise _too_large(sink.limit, encoded=False)
            if params.window_size > window_limit:
                raise PayloadTooLarge(
                    f"zstd frame needs a {params.window_size}-byte window; at most {window_limit} is accepted"
                )
        dobj = dctx.decompressobj(write_size=_OUT_CHUNK)
        fed = pos
        while not dobj.eof:
            if fed >= len(view):
                raise _corrupt("zstd", "truncated frame")
            step = max(64, min(_IN_CHUNK, sink.remaining * 3 // _ZSTD_BLOCK_MAX))
            piece = view[fed : fed + step]
            fed += len(piece)
            sink.write(dobj.decompress(piece))
        pos = fed - len(dobj.unused_data)
    return sink.result()


def _zstd_window_limit(max_bytes: int) -> int:
    limit = _ZSTD_WINDOW_FLOOR
    while limit < max_bytes and limit < _ZSTD_WINDOW_CEILING:
        limit *= 2
    return limit


_DECODERS: dict[str, Callable[[memoryview, _Sink], bytes]] = {
    "gzip": _decode_gzip,
    "deflate": _decode_deflate,
    "br": _decode_br,
    "zstd": _decode_zstd,
}
