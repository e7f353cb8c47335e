"""The one error the output parsers raise."""

from __future__ import annotations

from collections.abc import Sequence

from helios.domain.events import OutputEvent


class ToolParseError(Exception):
    """Generated output holds a tool call that cannot be published.

    Raised for malformed envelopes, empty tool names, invalid argument syntax, arguments past 8 MiB,
    and (from `finish()` at a natural completion) recognized but incomplete calls. It is the model's
    failure, not the client's: buffered requests answer HTTP 500, streams end in an error event.

    `events` holds what the failing `feed`/`finish` call produced before the failure (text or
    complete calls ahead of the bad envelope), so a stream can deliver them before its error event.
    After a ToolParseError the parser is spent: every later call raises the same error again.
    """

    def __init__(self, message: str, events: Sequence[OutputEvent] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.events: tuple[OutputEvent, ...] = tuple(events)
