"""Serving-key checks (spec: "Transport and admission").

OpenAI-style routes take ``Authorization: Bearer KEY``. Anthropic routes also accept
``x-api-key: KEY``; when a request carries both headers, both must match. An empty or absent key
disables authentication. Comparisons are constant-time. /health and /metrics are not checked.
"""

from __future__ import annotations

import hmac

from helios.asgi.request import Headers
from helios.errors import Unauthorized

_MISSING = "Missing API key; pass it as 'Authorization: Bearer KEY'"
_INVALID = "Incorrect API key provided"


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer`` header (scheme case-insensitive), or None."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def check_bearer(headers: Headers, key: str | None) -> None:
    if not key:
        return
    token = bearer_token(headers)
    if token is None and "authorization" not in headers:
        raise Unauthorized(_MISSING)
    if token is None or not _matches(token, key):
        raise Unauthorized(_INVALID, code="invalid_api_key")


def check_anthropic(headers: Headers, key: str | None) -> None:
    if not key:
        return
    api_key = headers.get("x-api-key")
    has_authorization = "authorization" in headers
    if api_key is None and not has_authorization:
        raise Unauthorized("Missing API key; pass it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'")
    # Evaluate both before deciding, so timing does not reveal which header failed.
    api_key_ok = api_key is None or _matches(api_key.strip(), key)
    token = bearer_token(headers) if has_authorization else None
    bearer_ok = not has_authorization or (token is not None and _matches(token, key))
    if not (api_key_ok and bearer_ok):
        raise Unauthorized(_INVALID, code="invalid_api_key")


def _matches(given: str, key: str) -> bool:
    # Header values are latin-1 decoded wire bytes; the configured key is text (UTF-8 on the wire).
    return hmac.compare_digest(given.encode("latin-1"), key.encode("utf-8"))
