"""The prefix cache against the real default model on a real socket (float32): usage reports reuse
in every protocol, a repeat answers as the first time did, and a disk store survives a restart —
and corruption, truncation and deletion of its records (dropped, recomputed, never served)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import EXTERNAL, LiveServer, start_server, stop_server

pytestmark = pytest.mark.skipif(bool(EXTERNAL), reason="starts its own servers with a disk store")

PAGE = 16
SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the rule number {i} when it applies." for i in range(40))
QUESTION = "What is the capital of France?"

TOML = """
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 6144
[engine]
max_active = 4
kv_pages = 420
prefill_chunk_size = 512
[cache]
host_memory_gib = 0.002
disk_dir = "@DISK@"
disk_gib = 1.0
"""


def start(tmp: Path, disk: Path, name: str) -> LiveServer:
    return start_server(tmp, TOML.replace("@DISK@", str(disk)), name)


def metrics(server: LiveServer) -> dict[str, Any]:
    with server.http() as http:
        out: dict[str, Any] = http.get("/metrics?format=json").json()
        return out


def chat(server: LiveServer, **kw: Any) -> Any:
    return server.openai().chat.completions.create(
        model="m", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], **kw)


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path, Path]]:
    tmp = tmp_path_factory.mktemp("prefix")
    disk = tmp / "kv"
    server = start(tmp, disk, "first")
    yield server, tmp, disk
    stop_server(server)


def test_usage_reports_reuse_in_every_protocol(cached: tuple[LiveServer, Path, Path]) -> None:
    server = cached[0]
    first = chat(server, extra_body={"return_token_ids": True})
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    prompt_ids = first.model_extra["prompt_token_ids"]  # type: ignore[index]
    n = len(prompt_ids)
    assert n == first.usage.prompt_tokens and n > 10 * PAGE
    reusable = (n - 1) // PAGE * PAGE  # whole pages, never the last token
    before = metrics(server)

    again = chat(server)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == reusable

    resp = server.openai().responses.create(model="m", instructions=SYSTEM, input=QUESTION, max_output_tokens=8,
                                           temperature=0)
    assert resp.usage is not None and resp.usage.input_tokens == n
    assert resp.usage.input_tokens_details.cached_tokens == reusable
    assert resp.output_text == first.choices[0].message.content

    msg = server.anthropic().messages.create(model="m", system=SYSTEM, max_tokens=8, extra_body={"temperature": 0},
                                             messages=[{"role": "user", "content": QUESTION}])
    counted = server.anthropic().messages.count_tokens(model="m", system=SYSTEM,
                                                       messages=[{"role": "user", "content": QUESTION}])
    assert msg.usage.cache_read_input_tokens == reusable and msg.usage.cache_creation_input_tokens == 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens == n

    # Completions on the same ids, two choices: the prompt (and its reuse) counts once.
    comp = server.openai().completions.create(model="m", prompt=prompt_ids, max_tokens=4, temperature=0, n=2)
    assert comp.usage is not None and comp.usage.prompt_tokens == n
    assert comp.usage.prompt_tokens_details is not None and comp.usage.prompt_tokens_details.cached_tokens == reusable

    after = metrics(server)
    assert after["reused_tokens"] - before["reused_tokens"] >= 4 * reusable
    assert after["cached_pages"] > 0
    # Prefill excludes reuse: the four repeats prefilled only their uncached tails (and the second
    # completion choice, admitted with the first, its whole prompt).
    assert after["prefill_tokens"] - before["prefill_tokens"] < 2 * n


def test_prompt_scoring_starts_uncached_and_publishes_its_pages(cached: tuple[LiveServer, Path, Path]) -> None:
    server = cached[0]
    text = "The quick brown fox jumps over the lazy dog. " * 12
    scored = server.openai().completions.create(model="m", prompt=text, max_tokens=1, temperature=0,
                                                extra_body={"prompt_logprobs": 0})
    assert scored.usage is not None and scored.usage.prompt_tokens_details is not None
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    again = server.openai().completions.create(model="m", prompt=text, max_tokens=1, temperature=0,
                                               extra_body={"prompt_logprobs": 0})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # scoring needs every position's logits
    plain = server.openai().completions.create(model="m", prompt=text, max_tokens=1, temperature=0)
    assert plain.usage is not None and plain.usage.prompt_tokens_details is not None
    assert plain.usage.prompt_tokens_details.cached_tokens == (plain.usage.prompt_tokens - 1) // PAGE * PAGE


LONG = " ".join(f"Entry {i}: the {['red', 'green', 'blue', 'gold'][i % 4]} box holds {i * 7 % 101} coins."
                for i in range(330))


def _ask_long(server: LiveServer) -> Any:
    return server.openai().completions.create(model="m", prompt=LONG + "\nThe box with the most coins is", max_tokens=6,
                                              temperature=0)


def test_a_disk_store_survives_a_restart_and_damaged_records_are_recomputed(
        cached: tuple[LiveServer, Path, Path]) -> None:
    server, tmp, disk = cached
    cold = _ask_long(server)
    assert cold.usage is not None and cold.usage.prompt_tokens > 3500
    n = cold.usage.prompt_tokens
    stop_server(server)  # a graceful stop writes the cached pages to the disk store
    records = sorted((disk).rglob("*.kv"))
    assert len(records) >= n // PAGE

    warm_server = start(tmp, disk, "restarted")
    try:
        warm = _ask_long(warm_server)
        assert warm.choices[0].text == cold.choices[0].text
        assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
        assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE
        m = metrics(warm_server)
        assert m["host_hits"] >= 1 and m["host_reused_tokens"] == (n - 1) // PAGE * PAGE
        assert m["host_disk_records"] >= len(records) // 2 and m["host_bytes_in"] > 0
    finally:
        stop_server(warm_server)

    # Damage the store: flip a byte in one record, truncate another, delete a third, garble a fourth.
    records = sorted(disk.rglob("*.kv"))
    victims = records[:4]
    raw = bytearray(victims[0].read_bytes())
    raw[-100] ^= 0x55
    victims[0].write_bytes(bytes(raw))
    victims[1].write_bytes(victims[1].read_bytes()[:1000])
    victims[2].unlink()
    victims[3].write_bytes(b"garbage")
    damaged = start(tmp, disk, "damaged")
    try:
        again = _ask_long(damaged)
        assert again.choices[0].text == cold.choices[0].text
        with damaged.http() as http:
            assert http.get("/health").json() == {"status": "ok"}
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens < (n - 1) // PAGE * PAGE
        with damaged.http() as http:
            text = http.get("/metrics").text
        io_errors = [line for line in text.splitlines() if line.startswith("flare_host_cache_dropped_total{")
                     and 'reason="io_error"' in line and 'tier="nvme"' in line]
        assert io_errors and float(io_errors[0].rsplit(" ", 1)[1]) >= 1
    finally:
        stop_server(damaged)
