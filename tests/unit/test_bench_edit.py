"""helios bench --workload editing (helios/clients/bench_edit.py) against the in-process fake SSE server."""

from __future__ import annotations

import json

import pytest

from helios.clients import bench, bench_edit
from helios.clients.bench import StreamRecord
from tests.unit.test_bench import MODEL, FakeConfig, fake_server


def test_the_prompt_is_a_fixed_source_file_of_about_a_thousand_tokens() -> None:
    source = bench_edit.load_source()
    assert 3500 < len(source) < 4500  # ~1,100 tokens with SmolLM2's tokenizer
    assert "REORDER_MARGIN" in source and "MAX_BATCH = 500" in source and "total value" in source
    body = bench_edit.edit_body("m", source, 100, extra_body={"seed": 3, "temperature": None})
    assert body["messages"][-1]["content"].endswith(f"```python\n{source}```")
    assert body["stream"] is True and "ignore_eos" not in body and "temperature" not in body and body["seed"] == 3
    assert body == bench_edit.edit_body("m", source, 100, extra_body={"seed": 3, "temperature": None})


def test_editing_workload_against_a_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = FakeConfig(ttft=0.005, itl=0.001), FakeConfig(ttft=0.01, itl=0.004, model="smol")
    with fake_server(fast) as url, fake_server(slow) as baseline:
        code = bench.main(["--url", url, "--baseline-url", baseline, "--workload", "editing", "--max-tokens", "20",
                           "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "editing" and report["rounds"] == bench_edit.DEFAULT_ROUNDS
    assert report["target"]["model"] == MODEL and report["baseline"]["model"] == "smol"
    for role in ("target", "baseline"):
        rounds = report[role]["rounds"]
        assert len(rounds) == 2 and all(r["output_tokens"] == 20 and r["error"] is None for r in rounds)
        assert "speculative" not in rounds[0]  # the fake server has no speculative counters
    assert report["decode_ratio"] > 1.0
    for cfg in (fast, slow):
        assert len(cfg.bodies) == 2
        for body in cfg.bodies:
            assert body["temperature"] == 0.0 and body["max_tokens"] == 20 and body["stream"] is True
            assert bench_edit.load_source() in body["messages"][-1]["content"]


def test_a_server_without_stream_options_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = FakeConfig(reject=frozenset({"stream_options"}))
    with fake_server(cfg) as url:
        code = bench.main(["--url", url, "--workload", "editing", "--max-tokens", "8", "--rounds", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "editing workload: one stream, 1 round(s), max_tokens 8" in out
    assert "round 1:" in out and "8 tokens" in out
    assert "stream_options" not in cfg.bodies[-1]


def test_speculative_counters_of_a_round() -> None:
    rec = StreamRecord(t_send=0.0, t_end=2.0, chunks=[(0.5, 1), (1.0, 4), (1.5, 5)])
    before = {"verification_drafts": 10, "verification_rounds": 10, "accepted_drafts": 5, "draft_rounds": 3,
              "verify_steps": 3}
    after = {"verification_drafts": 40, "verification_rounds": 20, "accepted_drafts": 27, "draft_rounds": 12,
             "verify_steps": 12}
    r = bench_edit.summarize_round(rec, before, after)
    assert r["ttft_ms"] == 500.0 and r["output_tokens"] == 10 and r["decode_tok_s"] == 9.0
    assert r["speculative"] == {"verification_drafts": 30, "verification_rounds": 10, "accepted_drafts": 22,
                                "draft_rounds": 9, "verify_steps": 9, "depth": 3.0}
    assert "speculative" not in bench_edit.summarize_round(rec, None, after)


def test_code_writing_workload_sends_the_task(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = FakeConfig()
    with fake_server(cfg) as url:
        code = bench.main(["--url", url, "--workload", "code-writing", "--rounds", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "code-writing" and report["max_tokens"] == bench_edit.CODE_WRITING_MAX_TOKENS
    (body,) = cfg.bodies
    assert body["messages"] == bench_edit.code_writing_messages() and body["temperature"] == 0.0
    assert report["target"]["rounds"][0]["output_tokens"] > 0
