"""The processes of the tensor-parallel tests (`test_tensor_parallel.py`): tiny checkpoints, one
engine run as plain values, and the rank entry point that `torch.multiprocessing` spawns. No
transformers import here, so a spawned rank starts quickly."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.tp import TensorParallelLeader, WorkerSetup, serve_worker
from helios.models.interface import CausalLM
from helios.models.tp import ParallelContext
from helios.runtime import load_model

ENGINE = EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=6, max_model_len=64)
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 255, 12, 44]


def requests(wave: int) -> list[EngineRequest]:
    """Wave 0: greedy with top logprobs, greedy with prompt scores (chunked over several steps) and
    seeded sampling, batched together. Wave 1 (after wave 0 finished): the first prompt again,
    served from the prefix cache (the pages every rank wrote in wave 0)."""
    greedy = SamplingParams(temperature=0.0)
    if wave == 1:
        return [EngineRequest("again", tuple(PROMPT), greedy, max_tokens=6, ignore_eos=True, num_top_logprobs=2)]
    return [
        EngineRequest("greedy", tuple(PROMPT), greedy, max_tokens=8, ignore_eos=True, num_top_logprobs=3),
        EngineRequest("scored", tuple(PROMPT[2:11]), greedy, max_tokens=5, ignore_eos=True, num_top_logprobs=1,
                      prompt_logprobs=2),
        EngineRequest("seeded", tuple(PROMPT[5:]), SamplingParams(temperature=0.8, seed=7), max_tokens=6,
                      ignore_eos=True, num_top_logprobs=1),
    ]


def drive(model: CausalLM) -> dict[str, Any]:
    """Both waves through a fresh `EngineCore` over ``model``: per request its tokens, logprob
    records, prompt scores and cached prompt tokens, as JSON values."""
    core = EngineCore(model, ENGINE, torch.float32)
    if isinstance(model, TensorParallelLeader):
        model.start_workers(WorkerSetup(num_pages=ENGINE.num_pages, page_size=ENGINE.page_size, kv_dtype="auto",
                                        num_state_slots=ENGINE.max_active))
    result: dict[str, Any] = {}
    for wave in (0, 1):
        batch = requests(wave)
        for r in batch:
            core.add(r)
            result[r.request_id] = {"tokens": [], "logprobs": [], "prompt": [], "cached": 0}
        for _ in range(200):
            if not core.scheduler.has_work:
                break
            for out in core.step():
                rec = result[out.request_id]
                assert out.error is None, out.error
                rec["tokens"].extend(out.new_token_ids)
                rec["logprobs"].extend([lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs or ())
                rec["prompt"].extend(None if p is None else [p.token_id, p.logprob, [list(t) for t in p.top]]
                                     for p in out.prompt_logprobs or ())
                rec["cached"] = max(rec["cached"], out.num_cached_tokens)
            core.scheduler.check_integrity()
        assert not core.scheduler.has_work
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_main(rank: int, world: int, port: int, root: str, expert_parallel: bool, out: str) -> None:
    """One rank (spawned: ``rank`` first): gloo on 127.0.0.1, one thread; rank 0 drives the engine
    and writes its results to ``out``, the others serve their shards."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = ParallelContext(rank, world, expert_parallel=expert_parallel)
        loaded = load_model(root, weights="float32", dtype="float32", parallel=ctx)
        if rank == 0:
            leader = TensorParallelLeader(loaded.model, ctx)
            result = drive(leader)
            leader.stop_workers()
            # What the shard holds: routed experts per MoE layer (all 8, or 4 under expert parallelism).
            result["_experts"] = [int(stack.shape[0]) for layer in loaded.model.modules()
                                  if (stack := getattr(layer, "experts_gate_up", None)) is not None]
            Path(out).write_text(json.dumps(result))
        else:
            forwards = serve_worker(loaded.model, ctx, torch.float32, torch.device("cpu"))
            assert forwards > 0
    finally:
        dist.destroy_process_group()
