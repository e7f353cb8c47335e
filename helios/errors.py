"""The error tree: every error knows its HTTP status and its type in each wire protocol.

Errors are typed by who is at fault (h11 style): 4xx classes are the client's, 5xx the server's.
Each class carries its HTTP status, its OpenAI error ``type`` and its Anthropic error type; an
instance carries the message and, for OpenAI-shaped errors, ``param`` and ``code``. The three
renderers produce the bodies the spec names (api.md, "Transport and admission"):

- OpenAI (Chat Completions, Completions, Responses, discovery, auth on every route):
  ``{"error": {"type", "message", "param", "code"}}`` with ``param`` null unless given;
  5xx use ``server_error``.
- Anthropic (Messages): ``{"type": "error", "error": {"type", "message"}}``; 5xx use ``api_error``;
  an error with ``details`` adds the Anthropic API's typed ``error.details`` object (its
  ``error_code`` is what the SDK keys fallbacks on, e.g. ``thread_unsupported_request``).
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
        details: dict[str, Any] | None = None,
    ) -> None:
        message = scalar_text(message)  # it may echo request text; rendering it must never fail
        super().__init__(message)
        self.message: str = message
        self.param: str | None = None if param is None else scalar_text(param)
        self.code: str | None = code if code is not None else self.default_code
        self.type: str = type if type is not None else self.openai_type
        self.headers: tuple[Header, ...] = headers  # extra response headers (Allow, Retry-After)
        self.error_details: dict[str, Any] | None = details  # Anthropic's error.details (OpenAI shape: none)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status})"

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "param": self.param, "code": self.code}}

    def to_anthropic(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.anthropic_type, "message": self.message}
        if self.error_details is not None:
            error["details"] = self.error_details
        return {"type": "error", "error": error}

    def to_ollama(self) -> dict[str, Any]:
        return {"error": self.message}


def scalar_text(text: str) -> str:
    """`text` with any lone UTF-16 surrogate replaced by U+FFFD, so it always encodes as UTF-8."""
    if text.isascii():
        return text
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


# --- the client's fault -------------------------------------------------------------------------


class BadRequest(HeliosError):
    """Malformed, unsupported or over-context request; also an undecodable body."""

    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    """The prompt, or the prompt plus the requested output, does not fit the context.

    Each protocol words it as its own API does, because clients recover from it by reading the
    numbers back (Claude Code retries with a smaller ``max_tokens``; OpenAI clients key on the
    ``context_length_exceeded`` code):

    - OpenAI shape: vLLM's wording, ``code: "context_length_exceeded"`` and ``param`` naming the
      field to shrink (the input field when the prompt alone is too long, else the output limit).
    - Anthropic shape: the Messages API's own sentences, "prompt is too long: N tokens > M
      maximum" and "input length and `max_tokens` exceed context limit: X + Y > Z, ...".
    """

    default_code = "context_length_exceeded"

    def __init__(
        self,
        *,
        prompt_tokens: int,
        limit: int,
        max_tokens: int | None = None,
        prompt_alone: bool = False,
        input_param: str = "messages",
        output_param: str = "max_tokens",
    ) -> None:
        """`prompt_alone`: the prompt leaves no room for one output token, whatever the limit."""
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.max_tokens = max_tokens
        if prompt_alone or max_tokens is None:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
            param = input_param
        else:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {prompt_tokens} input tokens, "
                f"for a total of {prompt_tokens + max_tokens} tokens. Please reduce the length of "
                f"the input or the output limit."
            )
            param = output_param
        super().__init__(message, param=param)

    def anthropic_message(self) -> str:
        if self.max_tokens is None or self.prompt_tokens > self.limit:
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.limit} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + {self.max_tokens} "
            f"> {self.limit}, decrease input length or `max_tokens` and try again"
        )

    def to_anthropic(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.anthropic_message()}}


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
