"""Generation and prompt logprob options and their Chat / Completions wire shapes.

Spec: api.md, "Generation log probabilities" and "Prompt log probabilities". The engine hands over
plain records (token ids with fp32 logprobs and ranks); this module validates the request options
and turns the records into the protocols' shapes (`helios.frontends.openai.shapes`):

- Chat (and Responses) entries: ``{"token", "logprob", "bytes", "top_logprobs": [...]}`` where
  ``top_logprobs`` lists the natural alternatives, or the explicit ``logprob_token_ids`` in caller
  order with the sampled token appended when absent.
- Completions arrays: parallel ``tokens``, ``token_logprobs``, ``top_logprobs`` (one map per
  position, keyed by token string; the chosen token first, then the alternatives; the first entry
  wins when several ids decode alike) and ``text_offset`` (Unicode characters).
- Prompt scores: a list aligned with prompt positions, None first, each entry mapping token ids to
  ``{"logprob", "rank", "decoded_token"}``: the actual token, then up to k natural alternatives.

``bytes`` are a token's exact bytes (partial UTF-8 included); ``token`` decodes them with U+FFFD
replacement, or reads ``token_id:<id>`` under ``return_tokens_as_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.domain.model import ModelInfo, TokenVocabulary
from helios.errors import BadRequest
from helios.frontends.openai import shapes

MAX_TOP = 20
MAX_EXPLICIT_IDS = 128
PROMPT_LOGPROBS_DISABLED = (
    "prompt logprobs are not available on this server: the core was exported without --prompt-logprobs "
    "(re-export it with --prompt-logprobs, or enable [server] prompt_logprobs)"
)


def validate_logprob_options(
    *, logprobs: bool | None, top_logprobs: int | None, logprob_token_ids: list[int] | None, info: ModelInfo,
    param: str = "top_logprobs",
) -> tuple[int | None, tuple[int, ...] | None]:
    """Chat/Responses rules. Returns (number of natural alternatives or None, explicit ids or None)."""
    if top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_TOP:
            raise BadRequest(f"{param} must be between 0 and {MAX_TOP}", param=param)
        if top_logprobs > 0 and not logprobs:
            raise BadRequest(f"{param} requires logprobs to be true", param=param)
    explicit = validate_explicit_ids(logprob_token_ids, info)
    if not logprobs:
        if explicit:
            raise BadRequest("logprob_token_ids requires generation logprobs to be enabled", param="logprob_token_ids")
        return None, None
    check_capacity(top_logprobs or 0, info, param=param if top_logprobs else "logprobs")
    return top_logprobs or 0, explicit


def check_capacity(k: int, info: ModelInfo, *, param: str) -> None:
    """Generation logprobs need a core with logprob outputs and at most its natural capacity."""
    if info.max_top_logprobs == 0:
        raise BadRequest("this model's core has no generation logprob outputs (allow_logprobs is false); "
                         "re-export it with logprob outputs to request logprobs", param=param)
    if k > info.max_top_logprobs:
        raise BadRequest(f"{param} exceeds this model's capacity of {info.max_top_logprobs} alternatives",
                         param=param)


def validate_explicit_ids(ids: list[int] | None, info: ModelInfo) -> tuple[int, ...] | None:
    """At most 128 ids before deduplication, each within the vocabulary (the wire type makes them
    integers); duplicates keep the first."""
    if not ids:
        return None
    if len(ids) > MAX_EXPLICIT_IDS:
        raise BadRequest(f"logprob_token_ids accepts at most {MAX_EXPLICIT_IDS} ids", param="logprob_token_ids")
    if not all(0 <= i < info.vocab_size for i in ids):
        raise BadRequest(f"logprob_token_ids must contain token ids within 0..{info.vocab_size - 1}",
                         param="logprob_token_ids")
    if info.max_top_logprobs == 0:
        raise BadRequest("this model's core has no explicit-ID logprob inputs; re-export it with logprob outputs "
                         "to use logprob_token_ids", param="logprob_token_ids")
    return tuple(dict.fromkeys(ids))


def validate_prompt_logprobs(value: int | None, info: ModelInfo, *, stream: bool) -> int | None:
    if value is None:
        return None
    if stream:
        raise BadRequest("prompt_logprobs is not supported with streaming", param="prompt_logprobs")
    if not 0 <= value <= MAX_TOP:
        raise BadRequest(f"prompt_logprobs must be between 0 and {MAX_TOP}", param="prompt_logprobs")
    require_prompt_scoring(info, param="prompt_logprobs")
    return value


def require_prompt_scoring(info: ModelInfo, *, param: str) -> None:
    if not info.prompt_logprobs:
        raise BadRequest(PROMPT_LOGPROBS_DISABLED, param=param)


# -- encoders -------------------------------------------------------------------------------------


def token_text(vocab: TokenVocabulary, token_id: int, as_ids: bool | None = False) -> str:
    """A token's text: its bytes decoded with U+FFFD replacement, or ``token_id:<id>`` where `as_ids`."""
    if as_ids:
        return f"token_id:{token_id}"
    return vocab.token_bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(records: Sequence[TokenLogprob], vocab: TokenVocabulary,
                  as_ids: bool | None) -> list[shapes.ChatLogprob]:
    return [shapes.ChatLogprob(token=token_text(vocab, r.token_id, as_ids), logprob=r.logprob,
                               bytes=vocab.token_bytes(r.token_id),
                               top_logprobs=[shapes.TopLogprob(token=token_text(vocab, t, as_ids), logprob=lp,
                                                               bytes=vocab.token_bytes(t))
                                             for t, lp in r.top])
            for r in records]


def completion_logprob_arrays(records: Sequence[TokenLogprob], offsets: Sequence[int], vocab: TokenVocabulary,
                              as_ids: bool | None, explicit: bool, start_offset: int = 0,
                              into: shapes.CompletionLogprobs | None = None) -> shapes.CompletionLogprobs:
    """Completions arrays for generated tokens (appended to `into`, the echoed prompt's, where given);
    ``offsets`` come from the output pipeline."""
    block = shapes.CompletionLogprobs() if into is None else into
    for r, off in zip(records, offsets, strict=True):
        block.tokens.append(token_text(vocab, r.token_id, as_ids))
        block.token_logprobs.append(r.logprob)
        pairs = r.top if explicit else [(r.token_id, r.logprob), *r.top]
        block.top_logprobs.append(_keyed(pairs, vocab, as_ids))
        block.text_offset.append(start_offset + off)
    return block


def prompt_logprob_arrays(prompt_ids: Sequence[int], scores: Sequence[PromptLogprob | None], k: int,
                          vocab: TokenVocabulary, as_ids: bool | None, start_offset: int = 0,
                          first_position: int = 0) -> tuple[shapes.CompletionLogprobs, int]:
    """Completions arrays for echoed prompt positions ``first_position ..`` (``scores`` aligned with
    them; None for position 0). Offsets count the characters of the preceding decoded token strings.
    Returns the arrays and the offset after the last position."""
    block = shapes.CompletionLogprobs()
    off = start_offset
    for i, score in enumerate(scores):
        token_id = prompt_ids[first_position + i]
        block.tokens.append(token_text(vocab, token_id, as_ids))
        block.text_offset.append(off)
        off += len(token_text(vocab, token_id))
        block.token_logprobs.append(None if score is None else score.logprob)
        block.top_logprobs.append(None if score is None else _keyed(
            [(score.token_id, score.logprob, score.rank), *score.top[:k]], vocab, as_ids))
    return block, off


def prompt_scores(scores: Sequence[PromptLogprob | None], k: int,
                  vocab: TokenVocabulary) -> shapes.PromptLogprobs:
    """The ``prompt_logprobs`` field: the actual token first, then up to ``k`` natural alternatives."""
    return [None if score is None else _scored(score, k, vocab) for score in scores]


def _scored(score: PromptLogprob, k: int, vocab: TokenVocabulary) -> dict[str, shapes.PromptScore]:
    """One position's entry (the first entry of an id wins)."""
    entry: dict[str, shapes.PromptScore] = {}
    for token_id, logprob, rank in [(score.token_id, score.logprob, score.rank), *score.top[:k]]:
        entry.setdefault(str(token_id), shapes.PromptScore(logprob=logprob, rank=rank,
                                                           decoded_token=token_text(vocab, token_id)))
    return entry


def _keyed(entries: Sequence[tuple[int, float] | tuple[int, float, int]], vocab: TokenVocabulary,
           as_ids: bool | None) -> dict[str, float]:
    """Logprobs keyed by token string (entries are (id, logprob) or (id, logprob, rank)); the first
    entry wins where several ids decode alike."""
    top: dict[str, float] = {}
    for entry in entries:
        top.setdefault(token_text(vocab, entry[0], as_ids), entry[1])
    return top
