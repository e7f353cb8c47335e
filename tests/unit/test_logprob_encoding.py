"""Logprob entries between the engine and the wire: which tokens get entries, their text offsets, and the
Chat / Completions / prompt-score encodings (spec: Generation and Prompt log probabilities)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from helios.domain.events import FinishCause
from helios.domain.generation import ChildUpdate
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.domain.model import TokenVocabulary
from helios.domain.shapes import to_json
from helios.engine.records import EngineFinish, RequestOutput
from helios.frontends.openai.logprobs import (
    chat_logprobs,
    completion_logprob_arrays,
    prompt_logprob_arrays,
    prompt_scores,
)
from helios.loaders.tokenizer import Tokenizer
from helios.serving.output import OutputProcessor

# The renderings as the JSON a response carries.


def chat_logprobs_content(records: Any, vocab: TokenVocabulary, as_ids: bool | None) -> Any:
    return to_json(chat_logprobs(records, vocab, as_ids))


def completion_logprobs(*args: Any, **kwargs: Any) -> Any:
    return to_json(completion_logprob_arrays(*args, **kwargs))


def prompt_completion_logprobs(*args: Any, **kwargs: Any) -> tuple[Any, int]:
    block, off = prompt_logprob_arrays(*args, **kwargs)
    return to_json(block), off


def prompt_logprobs_json(scores: Any, k: int, vocab: TokenVocabulary) -> Any:
    return to_json(prompt_scores(scores, k, vocab))


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    from helios.loaders.default_model import ensure_default_model
    from helios.loaders.gguf_loader import GGUFFile

    return Tokenizer.from_gguf_metadata(GGUFFile(ensure_default_model(quiet=True)).metadata)


def _record(token_id: int, top: Sequence[tuple[int, float]] = ()) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, 1, tuple(top))


def _run(token_ids: Sequence[int], *, finish: EngineFinish = EngineFinish.LENGTH, stop: Sequence[str] = (),
         ) -> list[ChildUpdate]:
    tok = tokenizer()
    proc = OutputProcessor(tok.incremental_detokenizer(), stop=stop)
    updates = []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        updates.append(proc.process(RequestOutput("r", (t,), logprobs=(_record(t),), finish=finish if last else None)))
        if updates[-1].finish is not None:
            break
    return updates


def test_offsets_count_released_characters_inside_multi_token_spans() -> None:
    tok = tokenizer()
    text = "a😀b 日本語 🎉🏽 ok"
    ids = tok.encode(text, add_special_tokens=False)
    updates = _run(ids)
    offsets = [o for u in updates for o in u.logprob_offsets]
    assert len(offsets) == len(ids) == sum(len(u.logprobs or ()) for u in updates)
    pieces = [tok.token_bytes(i) for i in ids]
    expected = [len(b"".join(pieces[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert offsets == expected
    assert any(a == b for a, b in itertools.pairwise(offsets))  # a character spans tokens
    assert "".join(e.text for u in updates for e in u.events if hasattr(e, "text")) == text


def test_terminating_eos_has_no_entry_but_ignored_eos_keeps_it() -> None:
    tok = tokenizer()
    eos = tok.eos_token_ids[0]
    ids = [*tok.encode("Hi", add_special_tokens=False), eos]
    stopped = _run(ids, finish=EngineFinish.EOS)
    assert [r.token_id for u in stopped for r in (u.logprobs or ())] == ids[:-1]
    assert stopped[-1].finish is not None and stopped[-1].finish.cause is FinishCause.EOS
    ignored = _run(ids, finish=EngineFinish.LENGTH)  # ignore_eos: the engine does not stop at EOS
    assert [r.token_id for u in ignored for r in (u.logprobs or ())] == ids
    token_stop = _run(ids, finish=EngineFinish.STOP_TOKEN)
    assert [r.token_id for u in token_stop for r in (u.logprobs or ())] == ids[:-1]


def test_token_clipped_by_a_string_stop_keeps_its_entry() -> None:
    tok = tokenizer()
    ids = tok.encode("Hello world, and more text after it", add_special_tokens=False)
    updates = _run(ids, stop=["o wor"])
    kept = [r.token_id for u in updates for r in (u.logprobs or ())]
    assert updates[-1].finish is not None and updates[-1].finish.cause is FinishCause.STOP_STRING
    # Every token up to the one that completes the stop keeps its entry; nothing after it.
    decoded, needed = "", 0
    while "o wor" not in decoded:
        decoded += tok.token_bytes(ids[needed]).decode()
        needed += 1
    assert kept == ids[:needed]


class _Vocab:
    """A `TokenVocabulary`: a token's exact bytes from a table."""

    def __init__(self, table: dict[int, bytes]) -> None:
        self.table = table

    def token_bytes(self, token_id: int) -> bytes:
        return self.table[token_id]


def _vocab(table: dict[int, bytes]) -> TokenVocabulary:
    return _Vocab(table)


def test_chat_entries_exact_bytes_and_replacement_text() -> None:
    vocab = _vocab({1: b"\xf0\x9f", 2: b"\x98\x80", 3: b"ok"})
    content = chat_logprobs_content([_record(1, [(3, -0.1), (1, -0.5)]), _record(2)], vocab, False)
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xF0, 0x9F]
    assert [e["token"] for e in content[0]["top_logprobs"]] == ["ok", "\ufffd"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "😀"
    as_ids = chat_logprobs_content([_record(1, [(3, -0.1)])], vocab, True)
    assert as_ids[0]["token"] == "token_id:1" and as_ids[0]["bytes"] == [0xF0, 0x9F]
    assert as_ids[0]["top_logprobs"][0]["token"] == "token_id:3"


def test_completion_maps_keep_the_first_entry_and_the_chosen_token() -> None:
    vocab = _vocab({1: b"\xf0", 2: b"\x9f", 3: b"x", 4: b"y"})
    natural = completion_logprobs([TokenLogprob(4, -3.0, 9, ((1, -0.2), (2, -0.4), (3, -0.9)))], [5],
                                  vocab, False, explicit=False, start_offset=10)
    assert natural["tokens"] == ["y"] and natural["token_logprobs"] == [-3.0] and natural["text_offset"] == [15]
    assert natural["top_logprobs"] == [{"y": -3.0, "\ufffd": -0.2, "x": -0.9}]  # 1 and 2 decode alike
    assert list(natural["top_logprobs"][0]) == ["y", "\ufffd", "x"]  # the chosen token first
    by_id = completion_logprobs([TokenLogprob(4, -3.0, 9, ((1, -0.2), (2, -0.4)))], [0], vocab, True,
                                explicit=False)
    assert by_id["top_logprobs"] == [{"token_id:4": -3.0, "token_id:1": -0.2, "token_id:2": -0.4}]
    explicit = completion_logprobs([TokenLogprob(4, -3.0, 9, ((3, -0.9), (4, -3.0)))], [0], vocab, False,
                                   explicit=True)
    assert explicit["top_logprobs"] == [{"x": -0.9, "y": -3.0}]  # caller order, sampled appended


def test_prompt_scores_encodings() -> None:
    vocab = _vocab({5: b"The", 6: b" cat", 7: b" sat", 8: b"\xe2"})
    scores = [None, PromptLogprob(6, -2.0, 3, ((7, -0.5, 1), (8, -1.0, 2), (6, -2.0, 3))),
              PromptLogprob(7, -0.1, 1, ((7, -0.1, 1), (6, -3.0, 2)))]
    field = prompt_logprobs_json(scores, 1, vocab)
    assert field[0] is None
    assert field[1] == {"6": {"logprob": -2.0, "rank": 3, "decoded_token": " cat"},
                        "7": {"logprob": -0.5, "rank": 1, "decoded_token": " sat"}}
    assert field[2] == {"7": {"logprob": -0.1, "rank": 1, "decoded_token": " sat"}}
    arrays, end = prompt_completion_logprobs([5, 6, 7], scores, 2, vocab, True)
    assert arrays["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]
    assert arrays["token_logprobs"] == [None, -2.0, -0.1]
    assert arrays["top_logprobs"][0] is None
    assert arrays["top_logprobs"][1] == {"token_id:6": -2.0, "token_id:7": -0.5, "token_id:8": -1.0}
    assert arrays["text_offset"] == [0, 3, 7] and end == 11  # decoded strings, not token_id strings
    tail, _ = prompt_completion_logprobs([5, 6, 7], scores[2:], 2, vocab, False, start_offset=7,
                                         first_position=2)
    assert tail["tokens"] == [" sat"] and tail["text_offset"] == [7]


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_field_always_has_the_actual_token(k: int) -> None:
    vocab = _vocab({1: b"a", 2: b"b", 3: b"c", 4: b"d"})
    score = PromptLogprob(4, -9.0, 4, ((1, -0.1, 1), (2, -0.2, 2), (3, -0.3, 3)))
    entry = prompt_logprobs_json([score], k, vocab)[0]
    assert entry is not None and next(iter(entry)) == "4" and len(entry) == k + 1
