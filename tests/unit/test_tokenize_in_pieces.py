"""Long texts are tokenized in pieces (issue 17: one large prompt must not hold the GIL or take ~130
bytes of tokenizer memory per prompt byte): the ids are exactly the whole text's, for every
tokenizer Helios splits, and tokenizers whose pre-tokenization a cut could change are not split."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.loaders.tokenizer import Tokenizer
from tests.unit.test_tokenizer import gguf_metadata, spm_metadata

# Pieces that stress the cut rule: letters on both sides of a space, runs of spaces, digits,
# punctuation, contractions, newlines, non-ASCII letters, and special and added tokens.
ATOMS = ["a", "Z", "hello", " ", "  ", "\n", "\t", "1", "234", "!", "'s", "'T", "é", "中文", "😀", "-",
         "<|im_end|>", "<|im_start|>", "<tool_call>", "x y", "ab cd", " \n ", "’"]
texts = st.lists(st.sampled_from(ATOMS), max_size=80).map("".join)


def whole(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.backend.encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module", params=["gpt2", "smollm", "qwen2", "llama-bpe", "default-model"])
def small_pieces(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "default-model":
        from helios.loaders.default_model import ensure_default_model
        from helios.loaders.gguf_loader import GGUFFile

        tok = Tokenizer.from_gguf_metadata(GGUFFile(ensure_default_model(quiet=True)).metadata)
    else:
        tok = Tokenizer.from_gguf_metadata(gguf_metadata(request.param))
    assert tok.splittable
    tok.chunk_chars = 3  # cut at nearly every opportunity
    return tok


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_pieces_give_the_whole_texts_ids(small_pieces: Tokenizer, text: str) -> None:
    assert small_pieces.encode(text, add_special_tokens=False) == whole(small_pieces, text)
    assert len(list(small_pieces._pieces(text))) >= 1


def test_a_long_text_is_actually_cut(small_pieces: Tokenizer) -> None:
    text = "hello world " * 50
    assert len(list(small_pieces._pieces(text))) > 10
    assert small_pieces.encode(text, add_special_tokens=False) == whole(small_pieces, text)


def test_sentencepiece_is_not_split() -> None:
    """Metaspace prepends its marker per input and treats the text as one word: never cut."""
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    assert not tok.splittable
    tok.chunk_chars = 3
    assert list(tok._pieces("hello world " * 10)) == ["hello world " * 10]


def test_a_long_prompt_tokenizes_without_holding_the_gil() -> None:
    """Another thread keeps running while a multi-megabyte text tokenizes (the backend's single
    `encode` held the GIL for the whole call: this thread stopped for seconds)."""
    from helios.loaders.default_model import ensure_default_model
    from helios.loaders.gguf_loader import GGUFFile

    tok = Tokenizer.from_gguf_metadata(GGUFFile(ensure_default_model(quiet=True)).metadata)
    text = "hello world " * (4 * 1024 * 1024 // 12)
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    elapsed = time.perf_counter() - start
    done.set()
    ticker.join()
    assert len(ids) == 2 * (len(text) // 12) + 1  # "hello", " world", " hello", ..., and the final " "
    assert elapsed > 0.5 and len(gaps) > 20
    assert max(gaps) < 0.1, f"another thread stopped for {max(gaps) * 1000:.0f} ms of a {elapsed:.1f} s tokenization"


def test_max_tokens_counts_without_building_the_ids(small_pieces: Tokenizer) -> None:
    from helios.loaders.tokenizer import PromptTooLong

    text = "hello world " * 40
    full = small_pieces.encode(text)
    assert small_pieces.encode(text, max_tokens=len(full)) == full
    with pytest.raises(PromptTooLong) as err:
        small_pieces.encode(text, max_tokens=len(full) - 1)
    assert err.value.num_tokens == len(full)
    with pytest.raises(PromptTooLong) as err:
        small_pieces.encode(text, max_tokens=0)
    assert err.value.num_tokens == len(full)
    assert small_pieces.encode("", add_special_tokens=False, max_tokens=0) == []


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe", "spm"])
def test_splittable_reads_the_components_that_the_whole_serialization_holds(pre: str) -> None:
    """`_is_splittable` reads the normalizer's and pre-tokenizer's own JSON (not ``to_str()``, which
    serializes the whole vocabulary): they are exactly the whole serialization's entries."""
    tok = Tokenizer.from_gguf_metadata(spm_metadata() if pre == "spm" else gguf_metadata(pre))
    spec = json.loads(tok.backend.to_str())
    for name in ("normalizer", "pre_tokenizer"):
        component = getattr(tok.backend, name)
        assert (None if component is None else json.loads(component.__getstate__())) == spec[name]
