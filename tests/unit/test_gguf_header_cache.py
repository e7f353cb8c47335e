"""The GGUF header cache (`gguf_reader.read_gguf` with ``header_cache``): a hit gives exactly what
parsing the file gives (and the tokenizer built from it encodes and decodes exactly like one built
from a fresh parse), and a corrupt, stale or disagreeing entry is parsed again, never served."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from helios.loaders import gguf_reader
from helios.loaders.gguf_loader import GGUFFile
from helios.loaders.gguf_reader import GGUFContents, read_gguf
from helios.loaders.tokenizer import Tokenizer
from tests.unit.tiny_gguf import write_tiny_gguf

QWEN_05B = Path.home() / ".cache" / "helios" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TEXTS = ["hello world", "def f(x):\n    return x ** 2  # squares\n", "Héllo wörld 中文 😀🎉 ’quoted’",
         "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n", "  spaces\t\ttabs\n\n\n",
         "<tool_call>{\"name\": \"f\"}</tool_call><|endoftext|>"]


def same(a: GGUFContents, b: GGUFContents) -> bool:
    return (a.version, a.metadata, a.tensors) == (b.version, b.metadata, b.tensors)


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.gguf-header.json"))


def no_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> GGUFContents:
        raise AssertionError("parsed the file: the cache entry was not used")

    monkeypatch.setattr(gguf_reader, "_parse", fail)


def test_a_hit_is_the_parse_and_skips_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    fresh = read_gguf(path)
    first = read_gguf(path, cache)
    assert same(first, fresh) and len(entries(cache)) == 1
    no_parse(monkeypatch)
    hit = read_gguf(path, cache)
    assert same(hit, fresh)
    info = next(iter(hit.tensors.values()))
    assert hit.tensor_bytes(info).numpy().tobytes() == fresh.tensor_bytes(info).numpy().tobytes()


@pytest.mark.parametrize("damage", ["body byte", "truncated", "first line", "empty", "other key"])
def test_a_corrupt_entry_is_parsed_again_and_replaced(tmp_path: Path, damage: str) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    fresh = read_gguf(path)
    read_gguf(path, cache)
    (entry,) = entries(cache)
    data = entry.read_bytes()
    head, _, body = data.partition(b"\n")
    if damage == "body byte":  # a flipped digit somewhere in the tensor infos: still valid JSON
        at = body.rindex(b"1")
        data = head + b"\n" + body[:at] + b"2" + body[at + 1:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "first line":
        data = b"{not json\n" + body
    elif damage == "empty":
        data = b""
    else:
        fields = json.loads(head)
        fields["key"] = fields["key"].replace("tiny.gguf", "other.gguf")
        data = json.dumps(fields).encode() + b"\n" + body
    entry.write_bytes(data)
    again = read_gguf(path, cache)
    assert same(again, fresh)
    (rewritten,) = entries(cache)
    assert rewritten.read_bytes() != data  # replaced by a good entry


def test_an_entry_that_disagrees_with_the_file_is_not_served(tmp_path: Path) -> None:
    """A well-formed entry with the right key whose counts differ from the file's (as if the file
    had been rewritten keeping its size and mtime): parsed again."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    fresh = read_gguf(path)
    read_gguf(path, cache)
    (entry,) = entries(cache)
    head, _, body = entry.read_bytes().partition(b"\n")
    header = json.loads(body)
    header["metadata"]["general.extra"] = 1
    new_body = json.dumps(header).encode()
    fields = json.loads(head)
    fields["sha256"] = __import__("hashlib").sha256(new_body).hexdigest()
    entry.write_bytes(json.dumps(fields).encode() + b"\n" + new_body)
    assert same(read_gguf(path, cache), fresh)


def test_a_changed_file_is_a_miss(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    cache = tmp_path / "cache"
    read_gguf(path, cache)
    writer = gguf.GGUFWriter(str(path), "llama")  # the same name, other contents
    writer.add_string("general.name", "changed")
    writer.add_uint32("llama.block_count", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.utime(path, ns=(1, 1))
    changed = read_gguf(path, cache)
    assert changed.metadata["general.name"] == "changed" and same(changed, read_gguf(path))
    assert len(entries(cache)) == 2


def test_an_unwritable_cache_is_only_a_miss(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert same(read_gguf(path, blocker / "cache"), read_gguf(path))


@pytest.mark.skipif(not QWEN_05B.is_file(), reason=f"needs the Qwen2.5-Coder-0.5B GGUF at {QWEN_05B}")
def test_qwen_tokenizer_from_a_hit_is_the_fresh_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_file = GGUFFile(QWEN_05B)
    fresh = Tokenizer.from_gguf_metadata(fresh_file.metadata)
    GGUFFile(QWEN_05B, tmp_path)  # writes the entry
    no_parse(monkeypatch)
    hit_file = GGUFFile(QWEN_05B, tmp_path)
    assert hit_file.metadata == fresh_file.metadata and hit_file.tensor_shapes == fresh_file.tensor_shapes
    cached = Tokenizer.from_gguf_metadata(hit_file.metadata)
    assert (cached.vocab_size, cached.bos_token_id, cached.eos_token_ids, cached.add_bos_token, cached.splittable) \
        == (fresh.vocab_size, fresh.bos_token_id, fresh.eos_token_ids, fresh.add_bos_token, fresh.splittable)
    for text in TEXTS:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(ids, skip_special_tokens=False)
        assert cached.decode(ids) == fresh.decode(ids)
    assert cached.backend.to_str() == fresh.backend.to_str()
