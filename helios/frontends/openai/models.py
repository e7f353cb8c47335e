"""GET /v1/models and /v1/models/{model}: one vLLM-compatible card with the flare object."""

from __future__ import annotations

import hashlib
from typing import Any

from helios.domain.images import VisionLimits
from helios.domain.model import ModelInfo
from helios.errors import NotFound


def model_card(info: ModelInfo, created: int) -> dict[str, Any]:
    perm_id = "modelperm-" + hashlib.sha256(f"{info.model_id}:{created}".encode()).hexdigest()[:24]
    return {
        "id": info.public_id,
        "object": "model",
        "created": created,
        "owned_by": "local",
        "root": info.model_id,
        "parent": None,
        "max_model_len": info.max_model_len,
        "permission": [{
            "id": perm_id,
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": info.max_top_logprobs > 0,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
        "flare": {
            "vocab_size": info.vocab_size,
            "max_top_logprobs": info.max_top_logprobs,
            "max_concurrency": info.max_concurrency,
            "prefill_chunk_size": info.prefill_chunk_size,
            "default_max_tokens": info.default_max_tokens,
            "sampling_defaults": info.sampling_defaults,
            "thinking_token_budget": info.thinking_token_budget,
            "sampling_ranges": info.sampling_ranges,
            # The image limits (spec: all zero for a text-only core), then the modalities.
            **(info.vision.card_fields() if info.has_vision else VisionLimits().card_fields()),
            "input_modalities": ["text", "image"] if info.has_vision else ["text"],
            "output_modalities": ["text"],
            "speculative": speculative_object(info),
        },
    }


def speculative_object(info: ModelInfo) -> dict[str, Any]:
    """What speculative decoding is active (the spec leaves the card's field to the server): the
    mode, its depth limit, the proposers that draft in the order they are asked, and whether a learned
    drafter (a draft model, ``"draft"``, or the checkpoint's MTP layers, ``"mtp"``) is one of them."""
    on = info.speculative_mode != "off"
    learned = info.speculative_learned if on else None
    proposers = [p for p in ("ngram", "history" if info.speculative_history else None, learned) if on and p]
    return {
        "mode": info.speculative_mode,
        "max_depth": info.speculative_max_depth if on else 0,
        "proposers": proposers,
        "adaptive_depth": info.speculative_mode == "adaptive",
        "history_drafts": "history" in proposers,
        "learned_drafter": learned is not None,
    }


def list_models(info: ModelInfo, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(info, created)]}


def get_model(info: ModelInfo, created: int, name: str) -> dict[str, Any]:
    if not info.knows(name) and name != info.public_id:
        raise NotFound.model(name)
    return model_card(info, created)
