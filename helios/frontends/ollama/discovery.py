"""Ollama model discovery: GET /api/tags and POST /api/show (spec: api.md, "Ollama model discovery").

Only discovery is implemented; /api/chat, /api/generate and model management are not. Names match
the /v1/models identifier; /api/show also accepts the checkpoint identifier and every alias. The
metadata comes from the loaded contract and serving limits, never from the model's name. Errors use
Ollama's {"error": message} shape (the app renders them for paths under /api/).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from helios.errors import NotFound
from helios.frontends.fields import honoured, wire_field
from helios.frontends.wire import NonEmptyStr, structure

if TYPE_CHECKING:
    from helios.domain.model import ModelInfo

UNKNOWN_TIME = "0001-01-01T00:00:00Z"
FORMAT = "flare"


DETAILS = {"parent_model": "", "format": FORMAT, "family": "", "families": [], "parameter_size": "",
           "quantization_level": ""}
"""Ollama's details object; family, parameter-count and quantization labels are unavailable."""


def metadata(info: ModelInfo) -> dict[str, Any]:
    """What /api/show answers and the digest covers: details, model_info and capabilities.

    model_info is general.name plus the flare.* limits (a vision model's image limits too, under the
    flare card's names); general.architecture names the flare.* prefix so that clients which look up
    `<architecture>.context_length` find the serving limit."""
    limits = {"context_length": info.max_model_len, "vocab_size": info.vocab_size,
              **(info.vision.card_fields() if info.has_vision else {})}
    flags = {"vision": info.has_vision, "tools": info.has_tools, "thinking": info.has_reasoning}
    return {"details": DETAILS,
            "model_info": {"general.architecture": FORMAT, "general.name": info.public_id,
                           **{f"{FORMAT}.{k}": v for k, v in limits.items()}},
            "capabilities": ["completion", *(cap for cap, on in flags.items() if on)]}


def digest(info: ModelInfo) -> str:
    """A SHA-256 cache key over the prepared model identity and the advertised discovery details.
    It is not an Ollama manifest digest."""
    identity = {"model_id": info.model_id, "aliases": list(info.aliases), "public_id": info.public_id,
                "recipe": info.recipe, **metadata(info)}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tags(info: ModelInfo) -> dict[str, Any]:
    """GET /api/tags: the loaded model as Ollama's local-model listing."""
    return {"models": [{"name": info.public_id, "model": info.public_id, "modified_at": UNKNOWN_TIME, "size": 0,
                        "digest": digest(info), "details": DETAILS}]}


@attrs.define(kw_only=True)
class ShowWire:
    """POST /api/show's body. Ollama reads only its own keys, so other keys are ignored."""

    __wire_lenient__: ClassVar[bool] = True
    model: NonEmptyStr = wire_field(honoured("the /v1/models identifier, the checkpoint identifier or an alias"),
                                    required=True)
    verbose: bool | None = wire_field(honoured("accepted; verbose and plain modes return the same metadata"))


def show(info: ModelInfo, body: dict[str, Any]) -> dict[str, Any]:
    """POST /api/show for {"model": NAME, "verbose"?: bool}. Verbose and plain modes are the same."""
    name = structure(body, ShowWire).model
    if name != info.public_id and not info.knows(name):
        raise NotFound(f"model '{name}' not found", code="model_not_found")
    return {**metadata(info), "modified_at": UNKNOWN_TIME}
