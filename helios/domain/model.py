"""What the protocol side may know about the loaded model and its serving limits."""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from helios.domain.images import VisionLimits


@attrs.frozen
class ModelInfo:
    """What the frontends may know about the loaded model and its serving limits."""

    model_id: str
    aliases: tuple[str, ...]
    created: int
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    max_concurrency: int
    prefill_chunk_size: int
    max_top_logprobs: int
    prompt_logprobs: bool
    sampling_defaults: dict[str, Any]
    sampling_ranges: dict[str, Any]
    recipe: str
    has_bos: bool
    thinking_token_budget: int | None = None
    max_output_tokens: int = 0
    """`[server] max_output_tokens`: every request's output limit is at most this (0: no cap)."""
    clamp_max_tokens: bool = True
    """An explicit output limit beyond the context left is cut to what is left (`[server]
    max_tokens_overflow = "clamp"`); False: it is a 400 (``"reject"``, vLLM's rule)."""
    has_reasoning: bool = False
    has_tools: bool = False
    has_vision: bool = False
    """A vision-language model is loaded (``/api/show`` reports ``vision``, the card ``image``)."""
    vision: VisionLimits = VisionLimits()
    """The image limits (all zero for a text-only model)."""
    speculative_mode: str = "off"
    """``[speculative] mode`` (off, ngram, adaptive): what the flare card reports as active."""
    speculative_history: bool = False
    """Speculating requests also draft from other requests' recent outputs (the shared history)."""
    speculative_max_depth: int = 0
    """Drafts verified per request round at most (0 while speculation is off)."""
    speculative_learned: str | None = None
    """The learned drafter that drafts after the lookups, by its proposer's name: ``"draft"`` (a draft
    model, ``[speculative] draft_model``), ``"mtp"`` (the checkpoint's MTP layers) or None."""

    @property
    def public_id(self) -> str:
        return next((a for a in self.aliases if a), self.model_id)

    def knows(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases


class TokenVocabulary(Protocol):
    """A token's exact bytes (partial UTF-8 included): what logprob encoders need of the tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...
