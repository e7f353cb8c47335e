"""Generation logprob options and their Chat / Completions wire shapes (spec: Generation log probabilities)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from helios.errors import BadRequest
from helios.serving.pipeline import ModelInfo, Service


def validate_logprob_options(
    *, logprobs: bool | None, top_logprobs: int | None, logprob_token_ids: list[int] | None, info: ModelInfo,
    param: str = "top_logprobs",
) -> tuple[int | None, tuple[int, ...] | None]:
    """Chat/Responses rules. Returns (number of natural alternatives or None, explicit ids or None)."""
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= 20:
            raise BadRequest(f"{param} must be between 0 and 20", param=param)
        if top_logprobs > 0 and not logprobs:
            raise BadRequest(f"{param} requires logprobs to be true", param=param)
    explicit = validate_explicit_ids(logprob_token_ids, info)
    if not logprobs:
        if explicit:
            raise BadRequest("logprob_token_ids requires generation logprobs to be enabled", param="logprob_token_ids")
        return None, None
    if info.max_top_logprobs == 0:
        raise BadRequest("this model was loaded without generation logprob outputs", param="logprobs")
    k = top_logprobs or 0
    if k > info.max_top_logprobs:
        raise BadRequest(f"{param} exceeds this model's capacity of {info.max_top_logprobs}", param=param)
    return k, explicit


def validate_explicit_ids(ids: list[int] | None, info: ModelInfo) -> tuple[int, ...] | None:
    if not ids:
        return None
    if len(ids) > 128:
        raise BadRequest("logprob_token_ids accepts at most 128 ids", param="logprob_token_ids")
    seen: dict[int, None] = {}
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < info.vocab_size:
            raise BadRequest(
                f"logprob_token_ids must contain token ids within 0..{info.vocab_size - 1}", param="logprob_token_ids"
            )
        seen.setdefault(i, None)
    return tuple(seen)


def token_entry(svc: Service, token_id: int, logprob: float, as_ids: bool | None) -> dict[str, Any]:
    raw = svc.token_bytes(token_id)
    text = f"token_id:{token_id}" if as_ids else raw.decode("utf-8", errors="replace")
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs_content(records: Sequence[Any], svc: Service, as_ids: bool | None) -> list[dict[str, Any]]:
    out = []
    for r in records:
        entry = token_entry(svc, r.token_id, r.logprob, as_ids)
        entry["top_logprobs"] = [token_entry(svc, t, lp, as_ids) for t, lp in r.top]
        out.append(entry)
    return out
