"""Tokenizer: construction from tokenizer.json and from GGUF metadata, round trips, token bytes and
streaming detokenization on small hand-made vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from helios.loaders.tokenizer import IncrementalDetokenizer, Tokenizer


def gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte (written out independently)."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = gpt2_byte_chars()
MERGES = [("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo"), ("Ġ", "w"), ("1", "2"), ("12", "3")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID = 256 + len(MERGES)
IM_END_ID = ENDOFTEXT_ID + 2
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def byte_level_vocab() -> tuple[list[str], list[str]]:
    tokens = list(BYTE_CHARS) + ["".join(pair) for pair in MERGES] + SPECIALS + ["<tool_call>"]
    merges = [f"{a} {b}" for a, b in MERGES]
    return tokens, merges


def write_tokenizer_dir(root: Path, add_bos: bool | None = None) -> Path:
    tokens, merges = byte_level_vocab()
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                              merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    root.mkdir(parents=True, exist_ok=True)
    backend.save(str(root / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>"},
                                 "chat_template": TEMPLATE}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def hf_tokenizer(tmp_path: Path) -> Tokenizer:
    root = write_tokenizer_dir(tmp_path)
    return Tokenizer.from_hf_files(root / "tokenizer.json", json.loads((root / "tokenizer_config.json").read_text()),
                                   {"eos_token_id": [ENDOFTEXT_ID, IM_END_ID]}, TEMPLATE)


def gguf_metadata(pre: str) -> dict[str, object]:
    tokens, merges = byte_level_vocab()
    types = [1] * len(tokens)
    for i in range(len(tokens) - 4, len(tokens) - 1):
        types[i] = 3
    types[-1] = 4
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
    }


SAMPLES = ["hello world", "Héllo wörld 中文 😀🎉", "a 123 b", "<|im_start|>user\nhello<|im_end|>\n",
           "tabs\tand\nnewlines  ", "<tool_call>{}</tool_call>"]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_and_token_bytes(hf_tokenizer: Tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert b"".join(hf_tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_merges_and_special_tokens(hf_tokenizer: Tokenizer) -> None:
    hello = hf_tokenizer.token_to_id("hello")
    assert hf_tokenizer.encode("hello") == [hello]
    ids = hf_tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert ids == [hf_tokenizer.token_to_id("<|im_start|>"), hello, hf_tokenizer.token_to_id("<|im_end|>")]
    assert hf_tokenizer.decode(ids) == "hello"
    # <tool_call> is an added token but not special: kept whole, and kept when decoding.
    tool = hf_tokenizer.token_to_id("<tool_call>")
    assert tool not in hf_tokenizer.special_token_ids
    assert hf_tokenizer.encode("<tool_call>") == [tool]
    assert hf_tokenizer.decode([tool]) == "<tool_call>"
    assert hf_tokenizer.special_token_ids == {hf_tokenizer.token_to_id(t) for t in SPECIALS}


def test_token_bytes_of_single_bytes(hf_tokenizer: Tokenizer) -> None:
    for value in (0x00, 0x20, 0x0A, 0x41, 0x80, 0xC3, 0xFF):
        assert hf_tokenizer.token_bytes(value) == bytes([value])
    assert hf_tokenizer.token_bytes(hf_tokenizer.token_to_id("Ġw") or -1) == b" w"
    assert hf_tokenizer.token_bytes(hf_tokenizer.token_to_id("<|im_end|>") or -1) == b"<|im_end|>"
    assert len(hf_tokenizer.all_token_bytes()) == hf_tokenizer.vocab_size


def test_bos_eos_from_configs(tmp_path: Path, hf_tokenizer: Tokenizer) -> None:
    im_start = hf_tokenizer.token_to_id("<|im_start|>")
    im_end = hf_tokenizer.token_to_id("<|im_end|>")
    assert hf_tokenizer.bos_token_id == im_start and hf_tokenizer.bos_token == "<|im_start|>"
    # eos_token first, then generation_config's list, deduplicated.
    assert hf_tokenizer.eos_token_ids == (im_end, ENDOFTEXT_ID)
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert not hf_tokenizer.add_bos_token  # the tokenizer.json has no post-processor adding it
    root = write_tokenizer_dir(tmp_path / "bos", add_bos=True)
    with_bos = Tokenizer.from_hf_files(root / "tokenizer.json",
                                       json.loads((root / "tokenizer_config.json").read_text()))
    assert with_bos.encode("hello") == [im_start, with_bos.token_to_id("hello")]
    assert with_bos.encode("hello", add_special_tokens=False) == [with_bos.token_to_id("hello")]
    # No doubled BOS when the text already starts with it.
    assert with_bos.encode("<|im_start|>hello") == [im_start, with_bos.token_to_id("hello")]


def test_incremental_detokenizer_never_splits_characters(hf_tokenizer: Tokenizer) -> None:
    text = "Héllo 中文 😀 wörld 🎉👍🏽!"
    ids = hf_tokenizer.encode(text)
    assert len(ids) > len(text)  # multi-byte characters are spread over several byte tokens
    detok = IncrementalDetokenizer(hf_tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # The four bytes of the emoji: nothing until the last one.
    emoji_ids = hf_tokenizer.encode("😀")
    detok = hf_tokenizer.incremental_detokenizer()
    assert [detok.push(i) for i in emoji_ids] == ["", "", "", "😀"]
    assert not detok.has_pending_bytes


def test_incremental_detokenizer_special_tokens(hf_tokenizer: Tokenizer) -> None:
    ids = hf_tokenizer.encode("<|im_start|>hello<|im_end|><tool_call>")
    assert hf_tokenizer.incremental_detokenizer().push_many(ids) == "hello<tool_call>"
    keep = hf_tokenizer.incremental_detokenizer(skip_special_tokens=False)
    assert keep.push_many(ids) == "<|im_start|>hello<|im_end|><tool_call>"


def test_incremental_detokenizer_invalid_bytes_do_not_stall(hf_tokenizer: Tokenizer) -> None:
    detok = hf_tokenizer.incremental_detokenizer()
    # A lone continuation byte is invalid: replaced at once; then normal text flows.
    assert detok.push(0x80) == "\ufffd"
    assert detok.push(hf_tokenizer.token_to_id("hello") or -1) == "hello"
    # A truncated character at the end becomes U+FFFD on flush.
    assert detok.push(0xE4) == ""
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize("text", SAMPLES)
def test_gguf_byte_level_matches_tokenizer_json(hf_tokenizer: Tokenizer, text: str) -> None:
    gguf_tok = Tokenizer.from_gguf_metadata(gguf_metadata("gpt2"))
    assert gguf_tok.encode(text) == hf_tokenizer.encode(text)
    ids = gguf_tok.encode(text)
    assert gguf_tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(gguf_tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_gguf_special_and_eos_tokens() -> None:
    tok = Tokenizer.from_gguf_metadata(gguf_metadata("gpt2"))
    eot, im_start, im_end = (tok.token_to_id(t) for t in SPECIALS)
    assert tok.special_token_ids == {eot, im_start, im_end}
    # eos from metadata, plus <|im_end|> because the chat template ends turns with it.
    assert tok.eos_token_ids == (eot, im_end)
    assert tok.bos_token_id == im_start and not tok.add_bos_token
    assert tok.encode("<tool_call>") == [tok.token_to_id("<tool_call>")]
    assert tok.decode(tok.encode("<|im_start|>hello<tool_call>")) == "hello<tool_call>"


@pytest.mark.parametrize(("pre", "expected"), [
    ("gpt2", ["a", "Ġ", "123"]),          # " 123" is one GPT-2 chunk: "Ġ" then merged "123"
    ("smollm", ["a", "Ġ", "1", "2", "3"]),  # digits split one by one before byte-level BPE
    ("qwen2", ["a", "Ġ", "1", "2", "3"]),   # \p{N} single digits
    ("llama-bpe", ["a", "Ġ", "123"]),     # \p{N}{1,3}
])
def test_gguf_pre_tokenizers(pre: str, expected: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(pre))
    assert [tok.id_to_token(i) for i in tok.encode("a 123")] == expected
    assert tok.decode(tok.encode("a 123 hello")) == "a 123 hello"


def spm_metadata() -> dict[str, object]:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "hello", "▁hello", "▁w"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    # Longer merged pieces must win: give them higher scores.
    for name in ("▁hello", "hello", "llo", "ll", "▁he", "he", "▁h", "▁w"):
        scores[tokens.index(name)] = 10.0 + len(name)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_gguf_sentencepiece() -> None:
    tok = Tokenizer.from_gguf_metadata(spm_metadata())
    ids = tok.encode("hello")
    assert ids[0] == 1 and tok.add_bos_token
    assert [tok.id_to_token(i) for i in ids[1:]] == ["▁hello"]
    text = "hello wé"
    ids = tok.encode(text, add_special_tokens=False)
    # é is not a piece: it falls back to its two UTF-8 bytes.
    assert [tok.id_to_token(i) for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == text
    assert tok.token_bytes(tok.token_to_id("<0xC3>") or -1) == b"\xc3"
    assert tok.token_bytes(tok.token_to_id("▁hello") or -1) == b" hello"
    detok = tok.incremental_detokenizer()
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == " " + text  # the streamed text keeps the word-start marker's space
    assert tok.decode([1, *ids, 2]) == text
