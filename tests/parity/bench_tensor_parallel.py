"""Time the engine's steps with one rank and with N tensor-parallel ranks (a script, not a test).

    PYTHONPATH=. .venv/bin/python tests/parity/bench_tensor_parallel.py [--ranks 2] [--threads 1]
        [--hidden 1024 --layers 8 --heads 16 --kv-heads 8 --inter 2816 --vocab 32000]
        [--prompt 64 --tokens 32 --streams 1 4] [--expert-parallel --experts 8]

A random float32 checkpoint of the given shape (a Llama, or with ``--experts`` a Qwen3-MoE whose
layers are all sparse) is saved once to a temporary folder. Each configuration runs ``--streams``
greedy requests of a ``--prompt``-token prompt and ``--tokens`` output tokens through `EngineCore`
on rank 0 (gloo, ``--threads`` threads per rank) and reports the prefill step's time and the median
decode step. One rank runs in a spawned process too, with the same threads, so both sides start
alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.tp import TensorParallelLeader, WorkerSetup, serve_worker
from helios.models.tp import ParallelContext
from helios.runtime import load_model


def _checkpoint(args: argparse.Namespace, root: Path) -> None:
    import transformers

    from tests.parity.tiny import write_byte_tokenizer

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=4096)
    if args.experts:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.inter // 4))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)


def _rank(rank: int, world: int, port: int, root: str, threads: int, args: dict, out: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ctx = ParallelContext(rank, world, expert_parallel=args["expert_parallel"]) if world > 1 else None
    loaded = load_model(root, weights="float32", dtype="float32", parallel=ctx)
    cfg = EngineConfig(page_size=16, num_pages=2048, max_active=64, prefill_chunk_size=4096, max_model_len=4096)
    if rank:
        assert ctx is not None
        serve_worker(loaded.model, ctx, torch.float32, torch.device("cpu"))
        dist.destroy_process_group()
        return
    model = TensorParallelLeader(loaded.model, ctx) if ctx is not None else loaded.model
    core = EngineCore(model, cfg, torch.float32)
    if isinstance(model, TensorParallelLeader):
        model.start_workers(WorkerSetup(cfg.num_pages, cfg.page_size, "auto", cfg.max_active))
    results = {}
    for streams in args["streams"]:
        for i in range(streams):
            prompt = tuple((7 * i + j) % 250 for j in range(args["prompt"]))
            core.add(EngineRequest(f"s{streams}-{i}", prompt, SamplingParams(temperature=0.0),
                                   max_tokens=args["tokens"], ignore_eos=True))
        times = []
        while core.scheduler.has_work:
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        results[streams] = {"prefill_ms": 1000 * times[0], "decode_ms": 1000 * statistics.median(times[2:])}
    if isinstance(model, TensorParallelLeader):
        model.stop_workers()
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--inter", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=0)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    from tests.parity.tp_ranks import free_port

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        _checkpoint(args, root)
        opts = {"streams": args.streams, "prompt": args.prompt, "tokens": args.tokens,
                "expert_parallel": args.expert_parallel}
        for world in (1, args.ranks):
            out = Path(tmp) / f"r{world}.json"
            mp.spawn(_rank, args=(world, free_port(), str(root), args.threads, opts, str(out)), nprocs=world, join=True)
            for streams, r in json.loads(out.read_text()).items():
                print(f"ranks {world} x {args.threads} thread(s), {streams} stream(s): prefill step "
                      f"{r['prefill_ms']:.1f} ms, decode step median {r['decode_ms']:.2f} ms")


if __name__ == "__main__":
    main()
