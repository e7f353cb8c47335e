"""Token logprob records: what the engine's sampler and prompt scorer produce and what every
protocol's logprob encoder reads. Plain values (fp32-accurate Python floats), no torch, no trio.

The engine builds these directly (they cross the thread boundary inside `RequestOutput`), so the
serving side and the frontends read them typed, never as `Any`.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class TokenLogprob:
    """One generated position: the chosen token, its logprob and rank in the raw distribution, and
    the requested alternatives (id, logprob) by decreasing logprob."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class PromptLogprob:
    """One prompt position's score: the token at that position given everything before it."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float, int], ...]
    """Natural alternatives (id, logprob, rank) by decreasing logprob, then increasing id."""
