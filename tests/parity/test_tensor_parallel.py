"""Tensor and expert parallelism (`helios.models.tp`, `helios.engine.tp`) against one rank.

Tiny random float32 checkpoints whose head counts divide by 2, saved with transformers'
``save_pretrained``: a Qwen2 (q/k/v bias, tied embeddings: the head's vocabulary shard comes from
the embedding) with an odd vocabulary (271 rows: the last rank's shard is shorter and padded for the
gather), a Llama 3 (untied head), and a Qwen3-MoE (q/k norm, a dense first layer, 8 experts top-2).
Two ranks are two spawned processes on gloo (127.0.0.1, a free port), one thread each; rank 0 runs
the real `EngineCore` (scheduler, paged KV, chunked prefill, batching, prefix cache, sampler) over a
`TensorParallelLeader`, rank 1 `serve_worker`. Every generated token must equal the one-rank run's
and every logprob (chosen and alternatives, and the prompt scores) be within 1e-5 of it; the second
wave's prefix-cache hit must be the same. MoE: tensor parallel (each expert's columns split) and
expert parallel (4 experts a rank, tokens dispatched with all-to-all). A model whose heads do not
divide is refused at build time with the counts in the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from helios.models.architecture import BuildOptions
from helios.models.config import ModelConfig
from helios.models.tp import ParallelContext, check_divisible
from helios.runtime import load_model
from tests.parity import tp_ranks
from tests.parity.tiny import write_byte_tokenizer

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
_COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _models() -> dict[str, torch.nn.Module]:
    return {
        "qwen2": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **_COMMON, vocab_size=271, num_hidden_layers=2, tie_word_embeddings=True)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **_COMMON, vocab_size=272, num_hidden_layers=2, head_dim=16, rope_theta=500000.0)),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **_COMMON, vocab_size=272, num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True)),
    }


def _checkpoint(name: str, root: Path) -> Path:
    model = _models()[name]
    torch.manual_seed(sorted(_models()).index(name))
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if pname.endswith("norm.weight")
                        else 0.2 * torch.randn_like(param))
    model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: _checkpoint(name, tmp_path_factory.mktemp(name)) for name in ("qwen2", "llama", "qwen3_moe")}


def _one_rank(root: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tp_ranks.drive(load_model(root, weights="float32", dtype="float32").model)
    finally:
        torch.set_num_threads(threads)


def _two_ranks(root: Path, tmp_path: Path, *, expert_parallel: bool = False) -> dict[str, Any]:
    out = tmp_path / "rank0.json"
    mp.spawn(tp_ranks.rank_main, args=(2, tp_ranks.free_port(), str(root), expert_parallel, str(out)), nprocs=2,
             join=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _assert_same(one: dict[str, Any], two: dict[str, Any]) -> None:
    assert one.keys() == two.keys()
    worst = 0.0
    for rid in one:
        a, b = one[rid], two[rid]
        assert a["tokens"] == b["tokens"], rid
        assert a["cached"] == b["cached"], rid
        for records in ("logprobs", "prompt"):
            assert len(a[records]) == len(b[records]), (rid, records)
            for ra, rb in zip(a[records], b[records], strict=True):
                assert (ra is None) == (rb is None), (rid, records)
                if ra is None:
                    continue
                assert ra[0] == rb[0], (rid, records)
                worst = max(worst, abs(ra[1] - rb[1]))
                assert [t[0] for t in ra[2]] == [t[0] for t in rb[2]], (rid, records)
                assert [t[2:] for t in ra[2]] == [t[2:] for t in rb[2]], (rid, records)  # prompt ranks
                worst = max(worst, *(abs(x[1] - y[1]) for x, y in zip(ra[2], rb[2], strict=True)), 0.0)
    assert worst <= TOLERANCE, worst
    print(f"largest logprob difference: {worst:.3g}")
    assert one["again"]["cached"] > 0  # the second wave hit the prefix cache
    assert any(p is not None for p in one["scored"]["prompt"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_dense_tp2_matches_one_rank(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    two = _two_ranks(checkpoints[name], tmp_path)
    assert two.pop("_experts") == []
    _assert_same(_one_rank(checkpoints[name]), two)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_moe_matches_one_rank(expert_parallel: bool, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    root = checkpoints["qwen3_moe"]
    two = _two_ranks(root, tmp_path, expert_parallel=expert_parallel)
    assert two.pop("_experts") == ([4, 4] if expert_parallel else [8, 8])  # layers 1 and 2 are sparse
    _assert_same(_one_rank(root), two)


def test_heads_that_do_not_divide_are_refused() -> None:
    """The default model's shape (SmolLM2-135M: 9 query heads, 3 KV heads): a clear error naming
    the counts, at build time, before any weight is read (no process group is needed to build)."""
    from helios.models.llama import build

    config = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    ctx = ParallelContext(0, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide 9 query heads / 3 KV heads"):
        check_divisible(config, ctx)
    with pytest.raises(ValueError, match="9 query heads / 3 KV heads"):
        build(config, BuildOptions(parallel=ctx))
    check_divisible(config, ParallelContext(0, 3))  # 3 divides both (and 1536)


def test_expert_counts_that_do_not_divide_are_refused(checkpoints: dict[str, Path]) -> None:
    import attrs

    from helios.loaders.checkpoint import load_checkpoint

    config = load_checkpoint(checkpoints["qwen3_moe"], torch.float32).config
    config = attrs.evolve(config, num_heads=6, num_kv_heads=3)  # heads 3 ranks divide, 8 experts not
    with pytest.raises(ValueError, match="expert parallelism over 3 ranks does not divide 8 experts"):
        check_divisible(config, ParallelContext(0, 3, expert_parallel=True))
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size 32"):
        check_divisible(config, ParallelContext(0, 3))


def test_families_without_sharding_are_refused(tmp_path: Path) -> None:
    """Only the families of `tp.TP_ARCHITECTURES` shard; any other is refused by name."""
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=272, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=1, max_position_embeddings=128))
    model.save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="tensor parallelism is built for"):
        load_model(tmp_path, weights="float32", dtype="float32", parallel=ParallelContext(0, 2))


def _serve_two_ranks(root: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`helios serve ROOT --tensor-parallel-size 2` (float32, a small pool, one thread) on a free port."""
    port = tp_ranks.free_port()
    config = tmp_path / "helios.toml"
    config.write_text("[engine]\nkv_memory_gib = 0.01\nmax_active = 4\n[cache]\nhost_memory_gib = 0\n"
                      "[model]\nthreads = 1\nweight_cache = false\n")
    log = tmp_path / "serve.log"
    env = dict(os.environ, HELIOS_CONFIG=str(config), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "helios.cli", "serve", str(root), "--port", str(port),
                             "--weights", "float32", "--tensor-parallel-size", "2", *extra],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_helios_serve_with_two_ranks_answers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """`helios serve --tensor-parallel-size 2` end to end: it spawns rank 1, answers a greedy
    completion with logprobs, and on SIGTERM stops rank 1 (which logs its forward count) and exits 0."""
    import signal

    import httpx

    from tests.server.conftest import wait_healthy

    proc, url, log = _serve_two_ranks(checkpoints["llama"], tmp_path)
    try:
        wait_healthy(proc, url, log, timeout=240)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompt = [3, 250, 17, 99, 101, 5, 64, 200]
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log.read_text()
    assert status == 0, text[-3000:]
    assert "tensor-parallel rank 1 stopped after" in text, text[-3000:]


@pytest.mark.slow
def test_a_dead_rank_ends_the_server_through_its_engine_death_path(checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """Issue 30, item 4 under tensor parallelism: SIGKILL of rank 1, then a request. Its step's
    collective fails, which ends the engine thread (`engine.tp.RankLost`): the request gets the
    protocol's error object, /health is 503, and `helios serve` drains and exits 70."""
    import signal
    import time

    import httpx

    from tests.server.conftest import wait_healthy

    proc, url, log = _serve_two_ranks(checkpoints["llama"], tmp_path, "--shutdown-grace", "2")
    try:
        wait_healthy(proc, url, log, timeout=240)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        ranks = [int(c) for c in children
                 if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        assert len(ranks) == 1, children
        os.kill(ranks[0], signal.SIGKILL)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": [3, 250, 17, 99], "max_tokens": 4, "temperature": 0})
        assert reply.status_code >= 500, reply.text
        assert reply.json()["error"]["type"] == "server_error", reply.text
        deadline, health = time.time() + 20, None
        while time.time() < deadline:
            try:
                health = httpx.get(url + "/health", timeout=5).status_code
            except httpx.TransportError:
                break  # already gone: the drain after the engine's death is short here
            if health == 503:
                break
            time.sleep(0.2)
        assert health in (503, None), health
        status = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert status == 70, text[-3000:]
    assert "RankLost" in text, text[-3000:]
