"""Wire validation and encoding helpers the protocol frontends share: stops, token stops, token
observations, ids and timestamps, thinking budgets and tool choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any, Literal

from helios.domain.conversation import ToolChoice
from helios.domain.events import Finish, FinishCause
from helios.domain.generation import TokenObservation, TokenStops
from helios.domain.shapes import OMIT
from helios.errors import BadRequest


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def validate_stops(stop: Any, param: str = "stop") -> tuple[str, ...]:
    """At most four nonempty strings totalling at most 4096 UTF-8 bytes."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'{param}' must be a string or an array of strings", param=param)
    if len(stops) > 4:
        raise BadRequest(f"'{param}' accepts at most 4 sequences", param=param)
    if any(s == "" for s in stops):
        raise BadRequest(f"'{param}' sequences must be nonempty", param=param)
    if sum(len(s.encode()) for s in stops) > 4096:
        raise BadRequest(f"'{param}' sequences total more than 4096 UTF-8 bytes", param=param)
    return tuple(stops)


MAX_TOKEN_STOPS = 16
"""Token stops per request: `stop_token_ids` entries and `stop_token_sequences` entries together."""
MAX_TOKEN_STOP_LEN = 64
"""Token ids per `stop_token_sequences` entry."""


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _check_vocab(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for i in ids:
        if not 0 <= i < vocab_size:
            raise BadRequest(f"'{param}' contains {i}, outside the vocabulary (0..{vocab_size - 1})", param=param)


def validate_token_stops(stop_token_ids: Any, stop_token_sequences: Any, vocab_size: int, *,
                         string_stops: tuple[str, ...] = ()) -> TokenStops:
    """Spec, "Reasoning, sampling, and usage": token stops (stop_token_ids and stop_token_sequences
    together) accept at most sixteen nonempty sequences of at most 64 vocabulary ids each, and one
    request cannot combine string stops with token stops. Null and empty arrays are omission."""
    if stop_token_ids is not None and not _is_id_list(stop_token_ids):
        raise BadRequest("'stop_token_ids' must be an array of token ids", param="stop_token_ids")
    ids = tuple(stop_token_ids or ())
    if len(ids) > MAX_TOKEN_STOPS:
        raise BadRequest(f"'stop_token_ids' accepts at most {MAX_TOKEN_STOPS} token ids", param="stop_token_ids")
    _check_vocab(ids, vocab_size, "stop_token_ids")
    param = "stop_token_sequences"
    if stop_token_sequences is not None and (not isinstance(stop_token_sequences, list)
                                             or not all(_is_id_list(s) for s in stop_token_sequences)):
        raise BadRequest(f"'{param}' must be an array of token-id arrays", param=param)
    sequences = [tuple(seq) for seq in stop_token_sequences or ()]
    for k, seq in enumerate(sequences):
        if not seq:
            raise BadRequest(f"'{param}[{k}]' is empty; each sequence needs at least one token id", param=param)
        if len(seq) > MAX_TOKEN_STOP_LEN:
            raise BadRequest(f"'{param}[{k}]' has {len(seq)} token ids; at most {MAX_TOKEN_STOP_LEN} are "
                             "allowed", param=param)
        _check_vocab(seq, vocab_size, param)
    if len(ids) + len(sequences) > MAX_TOKEN_STOPS:
        raise BadRequest(f"at most {MAX_TOKEN_STOPS} token stops are allowed (stop_token_ids and "
                         f"stop_token_sequences together); got {len(ids) + len(sequences)}",
                         param=param if sequences else "stop_token_ids")
    stops = TokenStops(ids, tuple(sequences))
    if stops and string_stops:
        raise BadRequest("string stops cannot be combined with token stops", param="stop")
    return stops


def validate_min_tokens(min_tokens: int | None) -> int:
    """vLLM's min_tokens: a non-negative count (null is 0). Bounded by max_tokens where that is set
    (`Service.prepare`)."""
    if min_tokens is None:
        return 0
    if min_tokens < 0:
        raise BadRequest("min_tokens must be greater than or equal to 0", param="min_tokens")
    return min_tokens


def token_stop_reason(finish: Finish | None, token_ids: list[int], stops: TokenStops) -> str | int | list[int] | None:
    """vLLM's `stop_reason`: the matched string, the matched stop token id, or (a multi-token stop,
    the longest one the output ends with, as the output pipeline withholds it) its ids."""
    if finish is None:
        return None
    if finish.cause is FinishCause.STOP_TOKEN and stops.sequences:
        matched = max((s for s in stops.sequences if len(s) <= len(token_ids) and tuple(token_ids[-len(s):]) == s),
                      key=len, default=None)
        if matched is not None and len(matched) > 1:
            return list(matched)
    return finish.matched_stop


def decode_observation(return_token_ids: bool | None, return_token_timestamps: bool | None) -> TokenObservation:
    """vLLM's ``return_token_ids`` and Helios's ``return_token_timestamps`` (see `TokenObservation`).
    Timestamps imply the ids they are parallel to: ``return_token_ids: false`` with
    ``return_token_timestamps: true`` is a 400."""
    if return_token_timestamps and return_token_ids is False:
        raise BadRequest("return_token_timestamps returns timestamps parallel to token_ids; it cannot be "
                         "combined with return_token_ids: false", param="return_token_timestamps")
    return TokenObservation(ids=bool(return_token_ids or return_token_timestamps),
                            timestamps=bool(return_token_timestamps))


def observation_fields(observe: TokenObservation, token_ids: Any, timestamps: Any) -> dict[str, Any]:
    """The generated-token fields of one choice (or chunk choice), as its shape's keyword arguments:
    absent (`OMIT`) when not asked for."""
    return {"token_ids": token_ids if observe.ids else OMIT,
            "token_timestamps": timestamps if observe.timestamps else OMIT}



MAX_THINKING_BUDGET = 2**31 - 1


def thinking_budget(value: int | None, default: int | None) -> tuple[int | None, str | None]:
    """A Chat, Responses or Messages `thinking_token_budget` → (the budget, the field a 400 names when the
    model's reasoning format cannot honour it; None for the `[server]` default, which start-up
    validated and which is dropped where a request's format cannot honour it). An explicit budget is
    a positive 32-bit integer; omitted or null takes the default."""
    if value is None:
        return default, None
    if not 0 < value <= MAX_THINKING_BUDGET:  # an integer: the wire types it
        raise BadRequest("thinking_token_budget must be a positive 32-bit integer", param="thinking_token_budget")
    return value, "thinking_token_budget"


TOOL_CHOICE_WORDING: dict[str, tuple[str, str, str]] = {
    "chat": ("required", "tool_choice.function.name", "'{}'"),
    "responses": ("required", "tool_choice.name", "'{}'"),
    "messages": ("any", "tool_choice.name", "{!r}"),
}
"""Each protocol's wording of a tool_choice 400: its name for the required mode, the param of the
named tool, and how the name is quoted."""


def decide_tool_choice(protocol: str, declared: Collection[str],
                       mode: Literal["auto", "none", "required"] | None = None, name: str | None = None) -> ToolChoice:
    """Chat's, Responses' or Messages' tool_choice among the declared tool names → the neutral choice.

    A named tool (`name`) must be declared; the required mode needs a declared tool; no mode (None)
    is "auto" where a tool is declared and "none" where none is. A protocol's own checks (Responses:
    the named tool's kind) follow."""
    required, name_param, quoted = TOOL_CHOICE_WORDING[protocol]
    if name is not None:
        if name not in declared:
            raise BadRequest(f"tool_choice names {quoted.format(name)}, which is not a declared tool", param=name_param)
        return ToolChoice("named", name)
    if mode == "required" and not declared:
        raise BadRequest(f"tool_choice '{required}' needs at least one declared tool", param="tool_choice")
    return ToolChoice(mode or ("auto" if declared else "none"))
