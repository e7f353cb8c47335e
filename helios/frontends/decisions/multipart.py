"""multipart/form-data bodies (RFC 7578) for System One image assets: sans-IO parsing of a whole body.

Only what System One needs: the boundary from the Content-Type, each part's headers
(Content-Disposition's ``name``, Content-Type) and its bytes. Every malformation is a 400.
"""

from __future__ import annotations

import itertools
import re

import attrs

from helios.errors import BadRequest

MAX_PARTS = 257  # the JSON request and at most 256 image parts
MAX_HEADER_BYTES = 8192


@attrs.frozen
class FormPart:
    name: str
    content_type: str
    """The part's media type, lower case, without parameters ("" when absent)."""
    data: bytes = attrs.field(repr=False)


_QUOTED_OR_SEMICOLON = re.compile(r'"(?:\\.|[^"\\])*"?|;', re.S)
"""A quoted string (its backslash escapes included; unterminated: to the end) or a semicolon."""


def header_params(value: str) -> tuple[str, dict[str, str]]:
    """``form-data; name="a"; filename="b.png"`` -> ("form-data", {"name": "a", "filename": "b.png"}):
    split on the semicolons outside quoted strings."""
    cuts = [-1, *(m.start() for m in _QUOTED_OR_SEMICOLON.finditer(value) if m.group() == ";"), len(value)]
    head, *rest = (value[a + 1:b] for a, b in itertools.pairwise(cuts))
    params: dict[str, str] = {}
    for item in rest:
        key, eq, val = item.partition("=")
        if not eq:
            continue
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] == '"':
            val = val[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        params[key.strip().lower()] = val
    return head.strip().lower(), params


def boundary_of(content_type: str) -> bytes:
    kind, params = header_params(content_type)
    if kind != "multipart/form-data":
        raise BadRequest(f"multipart bodies must be multipart/form-data, not {kind}")
    boundary = params.get("boundary", "")
    if not 1 <= len(boundary) <= 70:
        raise BadRequest("multipart/form-data needs a boundary parameter of 1 to 70 characters")
    if not boundary.isascii():
        raise BadRequest("the multipart boundary must be ASCII")
    return boundary.encode("ascii")


def parse_form_data(body: bytes, content_type: str) -> list[FormPart]:
    """The parts of a multipart/form-data body, in order."""
    delimiter = b"--" + boundary_of(content_type)
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2:start] != b"\r\n"):
        raise BadRequest("the multipart body has no opening boundary")
    pos = start + len(delimiter)
    parts: list[FormPart] = []
    while True:
        if body.startswith(b"--", pos):
            return parts  # the closing delimiter (an epilogue after it is ignored)
        eol = body.find(b"\r\n", pos)
        if eol < 0 or body[pos:eol].strip(b" \t"):
            raise BadRequest("malformed multipart boundary line")
        pos = eol + 2
        end = body.find(b"\r\n" + delimiter, pos)
        if end < 0:
            raise BadRequest("the multipart body ends without its closing boundary")
        parts.append(_part(body[pos:end], len(parts)))
        if len(parts) > MAX_PARTS:
            raise BadRequest(f"the multipart body has more than {MAX_PARTS} parts")
        pos = end + 2 + len(delimiter)


def _part(raw: bytes, index: int) -> FormPart:
    head, blank, data = raw.partition(b"\r\n\r\n")
    if raw.startswith(b"\r\n"):
        head, data = b"", raw[2:]
    elif not blank:
        raise BadRequest(f"multipart part {index + 1} has no blank line after its headers")
    if len(head) > MAX_HEADER_BYTES:
        raise BadRequest(f"multipart part {index + 1} has headers over {MAX_HEADER_BYTES} bytes")
    try:
        lines = head.decode("utf-8").split("\r\n") if head else []
    except UnicodeDecodeError:
        raise BadRequest(f"multipart part {index + 1} has headers that are not UTF-8") from None
    headers: dict[str, str] = {}
    for line in lines:
        key, colon, value = line.partition(":")
        if not colon or not key.strip():
            raise BadRequest(f"multipart part {index + 1} has a malformed header line")
        headers[key.strip().lower()] = value.strip()
    disposition, params = header_params(headers.get("content-disposition", ""))
    if disposition != "form-data" or not params.get("name"):
        raise BadRequest(f"multipart part {index + 1} needs Content-Disposition: form-data with a name")
    if headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        raise BadRequest(f"multipart part {index + 1} ('{params['name']}') must not be content-encoded")
    media = header_params(headers.get("content-type", ""))[0]
    return FormPart(params["name"], media, data)
