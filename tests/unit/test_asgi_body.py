"""Request bodies: size bounds, content codings, decompression bombs (spec: Transport and admission)."""

from __future__ import annotations

import gzip
import time
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import brotli
import pytest
import trio
import zstandard

from helios.asgi.request import (
    ClientDisconnected,
    Headers,
    decode_body,
    parse_content_encoding,
    read_body,
)
from helios.asgi.types import Message
from helios.errors import BadRequest, HeliosError, PayloadTooLarge, UnsupportedMediaType

MiB = 1 << 20
TEXT = ('{"model":"m","messages":[{"role":"user","content":"héllo wörld ✓"}]}' * 500).encode()


def _run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn)


def _receiver(chunks: list[bytes], *, disconnect_after: bool = False) -> tuple[Any, list[int]]:
    """An ASGI receive() yielding ``chunks`` as http.request messages; counts calls."""
    calls = [0]

    async def receive() -> Message:
        i = calls[0]
        calls[0] += 1
        if i < len(chunks):
            return {
                "type": "http.request",
                "body": chunks[i],
                "more_body": i < len(chunks) - 1 or disconnect_after,
            }
        if disconnect_after:
            return {"type": "http.disconnect"}
        await trio.sleep_forever()
        raise AssertionError

    return receive, calls


def _headers(**values: str) -> Headers:
    return Headers.from_raw([(k.replace("_", "-").encode(), v.encode()) for k, v in values.items()])


def _zstd_stream(data: bytes, **params: Any) -> bytes:
    cparams = zstandard.ZstdCompressionParameters(compression_level=3, write_content_size=False, **params)
    c = zstandard.ZstdCompressor(compression_params=cparams).compressobj()
    return c.compress(data) + c.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": lambda d: zstandard.ZstdCompressor().compress(d),
    "identity": lambda d: d,
}


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_round_trip(coding: str) -> None:
    assert decode_body(ENCODERS[coding](TEXT), coding, MiB) == TEXT


def test_raw_deflate_is_accepted() -> None:
    c = zlib.compressobj(wbits=-15)
    assert decode_body(c.compress(TEXT) + c.flush(), "deflate", MiB) == TEXT


def test_zstd_without_content_size_and_multiple_frames() -> None:
    frames = _zstd_stream(TEXT) + zstandard.ZstdCompressor().compress(b"tail")
    assert decode_body(frames, "zstd", MiB) == TEXT + b"tail"
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    assert decode_body(skippable + frames, "zstd", MiB) == TEXT + b"tail"
    for truncated in (skippable[:-1], skippable[:6]):
        with pytest.raises(BadRequest):
            decode_body(frames + truncated, "zstd", MiB)


def test_many_tiny_members_are_refused() -> None:
    with pytest.raises(BadRequest, match="members"):
        decode_body(gzip.compress(b"") * 2000, "gzip", MiB)
    with pytest.raises(BadRequest, match="frames"):
        decode_body(zstandard.ZstdCompressor().compress(b"") * 2000, "zstd", MiB)


def test_gzip_members_and_zero_padding() -> None:
    data = gzip.compress(TEXT) + gzip.compress(b"more") + b"\0" * 16
    assert decode_body(data, "gzip", MiB) == TEXT + b"more"


def test_coding_list_applies_in_reverse_order() -> None:
    data = zstandard.ZstdCompressor().compress(brotli.compress(gzip.compress(TEXT)))
    assert decode_body(data, "gzip, br ,zstd", MiB) == TEXT
    assert decode_body(data, ["GZip", "identity", "br", "zstd"], MiB) == TEXT
    with pytest.raises(BadRequest):  # wrong order
        decode_body(data, "zstd, br, gzip", MiB)


def test_parse_content_encoding() -> None:
    assert parse_content_encoding(None) == []
    assert parse_content_encoding("identity") == []
    assert parse_content_encoding(" X-GZIP , , identity,br") == ["gzip", "br"]
    with pytest.raises(UnsupportedMediaType):
        parse_content_encoding("gzip, compress")
    with pytest.raises(BadRequest):
        parse_content_encoding(",".join(["gzip"] * 5))


def test_empty_body_with_coding_is_empty() -> None:
    assert decode_body(b"", "gzip", MiB) == b""


# --- bounds ---------------------------------------------------------------------------------------


def test_decoded_bound_is_inclusive() -> None:
    data = bytes(MiB)
    for coding in ("gzip", "deflate", "br", "zstd"):
        assert decode_body(ENCODERS[coding](data), coding, MiB) == data
        with pytest.raises(PayloadTooLarge):
            decode_body(ENCODERS[coding](data + b"x"), coding, MiB)
    with pytest.raises(PayloadTooLarge):
        decode_body(_zstd_stream(data + b"x"), "zstd", MiB)


def test_encoded_over_limit_is_413_before_decoding() -> None:
    with pytest.raises(PayloadTooLarge, match=r"^Request body exceeds"):
        decode_body(b"x" * (MiB + 1), "gzip", MiB)
    with pytest.raises(PayloadTooLarge):
        decode_body(b"x" * (MiB + 1), None, MiB)


@pytest.fixture(scope="module")
def bombs() -> dict[str, tuple[bytes, str]]:
    """Bodies that decode to 1 GiB of zeros, built without compressing 1 GiB where avoidable."""
    zeros = bytes(MiB)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)  # self-contained, repeatable
    raw = segment * 1024 + b"\x03\x00"  # plus a final empty block
    gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + raw + b"\0" * 8  # trailer never reached
    bc = brotli.Compressor(quality=0)
    br = b"".join([bc.process(zeros) for _ in range(1024)] + [bc.finish()])
    zc = zstandard.ZstdCompressor(level=1).compressobj()
    zs = b"".join([zc.compress(zeros) for _ in range(1024)] + [zc.flush()])
    frame = zstandard.ZstdCompressor(level=1).compress(zeros)
    return {
        "gzip": (gz, "gzip"),
        "zlib": (b"\x78\x9c" + raw + b"\0" * 4, "deflate"),
        "raw-deflate": (raw, "deflate"),
        "br": (br, "br"),
        "zstd-stream": (zs, "zstd"),
        "zstd-frames": (frame * 1024, "zstd"),
        "zstd-declared": (zstandard.ZstdCompressor(level=1).compress(bytes(64 * MiB)), "zstd"),
        "gzip-in-br": (brotli.compress(gzip.compress(bytes(16 * MiB))), "gzip, br"),
    }


@pytest.mark.parametrize(
    "name", ["gzip", "zlib", "raw-deflate", "br", "zstd-stream", "zstd-frames", "zstd-declared", "gzip-in-br"]
)
def test_decompression_bomb_is_413_fast_and_small(bombs: dict[str, tuple[bytes, str]], name: str) -> None:
    data, coding = bombs[name]
    limit = 8 * MiB
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(PayloadTooLarge):
            decode_body(data, coding, limit)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 5.0
    assert peak < limit + 8 * MiB, f"peak {peak / MiB:.1f} MiB"


def test_zstd_window_over_limit_is_413() -> None:
    data = _zstd_stream(b"x" * 1000, window_log=27)
    with pytest.raises(PayloadTooLarge, match="window"):
        decode_body(data, "zstd", MiB)
    assert decode_body(data, "zstd", 128 * MiB) == b"x" * 1000


# --- corrupt data ------------------------------------------------------------------------------


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_garbage_is_400(coding: str) -> None:
    with pytest.raises(BadRequest):
        decode_body(b"this is not compressed at all", coding, MiB)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_truncated_is_400(coding: str) -> None:
    data = ENCODERS[coding](TEXT)
    for cut in (1, 4, len(data) // 2):
        with pytest.raises(BadRequest):
            decode_body(data[:-cut], coding, MiB)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_trailing_garbage_is_400(coding: str) -> None:
    with pytest.raises(BadRequest):
        decode_body(ENCODERS[coding](TEXT) + b"junk", coding, MiB)


def test_gzip_bad_checksum_is_400() -> None:
    data = bytearray(gzip.compress(TEXT))
    data[-8] ^= 0xFF
    with pytest.raises(BadRequest):
        decode_body(bytes(data), "gzip", MiB)


def test_errors_are_helios_errors_with_statuses() -> None:
    for data, coding, status in [(b"x", "gzip", 400), (b"x", "lzma", 415), (b"x" * 10, "gzip", 413)]:
        with pytest.raises(HeliosError) as info:
            decode_body(data, coding, 5)
        assert info.value.status == status
        assert info.value.to_openai()["error"]["message"]


# --- read_body --------------------------------------------------------------------------------


def test_read_body_chunks_and_decodes() -> None:
    data = gzip.compress(TEXT)
    receive, _ = _receiver([data[:10], data[10:100], b"", data[100:]])
    body = _run(lambda: read_body(receive, _headers(content_encoding="gzip"), MiB))
    assert body == TEXT


def test_read_body_identity() -> None:
    receive, _ = _receiver([b"ab", b"cd"])
    assert _run(lambda: read_body(receive, Headers(), 4)) == b"abcd"


def test_read_body_offloads_to_the_worker_pool() -> None:
    data = zstandard.ZstdCompressor().compress(TEXT)

    async def main() -> bytes:
        limiter = trio.CapacityLimiter(1)
        receive, _ = _receiver([data])
        return await read_body(receive, _headers(content_encoding="zstd"), MiB, limiter=limiter)

    assert _run(main) == TEXT


def test_read_body_rejects_as_soon_as_exceeded() -> None:
    receive, calls = _receiver([b"x" * 600, b"x" * 600, b"x" * 600, b"x" * 600])
    with pytest.raises(PayloadTooLarge):
        _run(lambda: read_body(receive, Headers(), 1000))
    assert calls[0] == 2


def test_read_body_content_length_over_limit_reads_nothing() -> None:
    receive, calls = _receiver([b"x"])
    with pytest.raises(PayloadTooLarge):
        _run(lambda: read_body(receive, _headers(content_length="1001"), 1000))
    assert calls[0] == 0
    with pytest.raises(BadRequest):
        _run(lambda: read_body(receive, _headers(content_length="1²"), 1000))


def test_read_body_unknown_coding_is_415_before_reading() -> None:
    receive, calls = _receiver([b"x"])
    with pytest.raises(UnsupportedMediaType):
        _run(lambda: read_body(receive, _headers(content_encoding="gzip, snappy"), 1000))
    assert calls[0] == 0


def test_read_body_identity_only() -> None:
    receive, _ = _receiver([gzip.compress(b"{}")])
    with pytest.raises(UnsupportedMediaType):
        _run(lambda: read_body(receive, _headers(content_encoding="gzip"), 1000, identity_only=True))
    receive, _ = _receiver([b"{}"])
    body = _run(lambda: read_body(receive, _headers(content_encoding="identity"), 1000, identity_only=True))
    assert body == b"{}"


def test_read_body_decoded_bomb_is_413() -> None:
    data = zstandard.ZstdCompressor().compress(bytes(4 * MiB))
    receive, _ = _receiver([data])
    with pytest.raises(PayloadTooLarge):
        _run(
            lambda: read_body(
                receive, _headers(content_encoding="zstd"), MiB, limiter=trio.CapacityLimiter(2)
            )
        )


def test_read_body_disconnect() -> None:
    receive, _ = _receiver([b"partial"], disconnect_after=True)
    with pytest.raises(ClientDisconnected):
        _run(lambda: read_body(receive, Headers(), 1000))


def test_multiple_content_encoding_headers_combine() -> None:
    data = brotli.compress(gzip.compress(TEXT))
    headers = Headers.from_raw([(b"content-encoding", b"gzip"), (b"Content-Encoding", b"br")])
    receive, _ = _receiver([data])
    assert _run(lambda: read_body(receive, headers, MiB)) == TEXT
