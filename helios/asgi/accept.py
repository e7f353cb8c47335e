"""Accept-header negotiation for /metrics (spec: "Health and metrics").

The route answers JSON when the query has ``format=json``, or when the Accept header gives
``application/json`` a higher quality than ``text/plain``; at equal quality the earlier media range
wins. ``format=prometheus`` selects text regardless of Accept; any other format value is a 400.
No Accept header (and every Prometheus scraper) gets text.

A media type's quality comes from the most specific range that matches it (``type/subtype`` over
``type/*`` over ``*/*``, RFC 9110 §12.5.1); unmatched types have quality 0. Malformed ranges and
q-values are ignored rather than rejected.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

JSON = "application/json"
TEXT = "text/plain"


@attrs.frozen
class MediaRange:
    type: str
    subtype: str
    quality: float
    position: int

    def specificity(self, media_type: str) -> int:
        """How specifically this range matches ``media_type``: 2, 1, 0, or -1 for no match."""
        main, _, sub = media_type.partition("/")
        if self.type == "*" and self.subtype == "*":
            return 0
        if self.type != main:
            return -1
        if self.subtype == "*":
            return 1
        return 2 if self.subtype == sub else -1


def parse_accept(accept: str) -> list[MediaRange]:
    ranges: list[MediaRange] = []
    for position, item in enumerate(accept.split(",")):
        media, *params = item.split(";")
        main, slash, sub = media.strip().lower().partition("/")
        if not slash or not main or not sub or (main == "*" and sub != "*"):
            continue
        quality: float | None = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                quality = _parse_quality(value.strip())
        if quality is not None:
            ranges.append(MediaRange(main, sub, quality, position))
    return ranges


def quality_of(ranges: Sequence[MediaRange], media_type: str) -> tuple[float, int]:
    """(quality, position of the deciding range) for ``media_type``; (0.0, -1) when unmatched."""
    best: MediaRange | None = None
    best_specificity = -1
    for candidate in ranges:
        specificity = candidate.specificity(media_type)
        if specificity > best_specificity:
            best, best_specificity = candidate, specificity
    if best is None:
        return 0.0, -1
    return best.quality, best.position


def prefers_json(accept: str | None) -> bool:
    """True when Accept ranks application/json above text/plain, or equal and listed first."""
    if not accept or not accept.strip():
        return False
    ranges = parse_accept(accept)
    json_q, json_pos = quality_of(ranges, JSON)
    text_q, text_pos = quality_of(ranges, TEXT)
    if json_q <= 0.0:
        return False
    if json_q != text_q:
        return json_q > text_q
    return json_pos < text_pos


def _parse_quality(value: str) -> float | None:
    try:
        quality = float(value)
    except ValueError:
        return None
    if not 0.0 <= quality <= 1.0:  # also rejects NaN
        return None
    return quality
