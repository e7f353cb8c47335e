"""The error tree: every error knows its HTTP status and its type in each wire protocol.

Errors are typed by who is at fault (h11 style): 4xx classes are the client's, 5xx the server's.
Each class carries its HTTP status, its OpenAI error ``type`` and its Anthropic error type; an
instance carries the message and, for OpenAI-shaped errors, ``param`` and ``code``. The three
renderers produce the bodies the spec names (api.md, "Transport and admission"):

- OpenAI (Chat Completions, Completions, Responses, discovery, auth on every route):
  ``{"error": {"type", "message", "param", "code"}}`` with ``param`` null unless given;
  5xx use ``server_error``.
- Anthropic (Messages): ``{"type": "error", "error": {"type", "message"}}``; 5xx use ``api_error``.
- Ollama discovery: ``{"error": message}``.

No torch, no trio: frontends and the engine-facing serving layer may import this module.
"""

from __future__ import annotations

from typing import Any, ClassVar

Header = tuple[bytes, bytes]


class HeliosError(Exception):
    """Base of every error Helios renders to a client. Used directly, it is a 500."""

    # Class-level defaults; an instance may override ``type`` and ``code`` through __init__.
    status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: tuple[Header, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message: str = message
        self.param: str | None = param
        self.code: str | None = code if code is not None else self.default_code
        self.type: str = type if type is not None else self.openai_type
        self.headers: tuple[Header, ...] = headers  # extra response headers (Allow, Retry-After)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status})"

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "param": self.param, "code": self.code}}

    def to_anthropic(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def to_ollama(self) -> dict[str, Any]:
        return {"error": self.message}


# --- the client's fault -------------------------------------------------------------------------


class BadRequest(HeliosError):
    """Malformed, unsupported or over-context request; also an undecodable body."""

    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class Unauthorized(HeliosError):
    """Missing or invalid serving key."""

    status = 401
    openai_type = "authentication_error"
    anthropic_type = "authentication_error"


class NotFound(HeliosError):
    """Unknown route or unknown model. OpenAI reports it as an invalid request with a code."""

    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"
    default_code = "not_found"

    @classmethod
    def model(cls, name: str) -> NotFound:
        """The OpenAI-style model_not_found error (spec: GET /v1/models/{model})."""
        return cls(f"The model '{name}' does not exist", code="model_not_found")


class MethodNotAllowed(HeliosError):
    """The path exists but not for this method; carries an ``Allow`` header."""

    status = 405
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: tuple[str, ...] = ()) -> None:
        headers = ((b"allow", ", ".join(allowed).encode("ascii")),) if allowed else ()
        super().__init__(message, headers=headers)
        self.allowed: tuple[str, ...] = allowed


class PayloadTooLarge(HeliosError):
    """An encoded or decoded body over max_body_bytes."""

    status = 413
    openai_type = "request_too_large"
    anthropic_type = "request_too_large"


class UnsupportedMediaType(HeliosError):
    """An unknown Content-Encoding (or a compressed body where only identity is accepted)."""

    status = 415
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class UnprocessableEntity(HeliosError):
    """Schema failures on the decisions routes (their frontend renders the detail entries)."""

    status = 422
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class TooManyRequests(HeliosError):
    """HTTP admission slots exhausted."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"


# --- the server's fault -------------------------------------------------------------------------


class InternalError(HeliosError):
    """Execution and output-validation failures."""

    status = 500


class ServiceUnavailable(HeliosError):
    """A full model request queue, paused admission or an unavailable runtime."""

    status = 503
