"""What one MTP draft costs next to a target decode step, on a synthetic DeepSeek-V3-shaped model.

    .venv/bin/python scripts/bench_mtp.py [--layers 12] [--hidden 768] [--vocab 32768] [--experts 16]
        [--dtype bfloat16] [--context 512] [--steps 40] [--threads 1] [--streams 1]

Random weights (seeded; transformers' ``DeepseekV3ForCausalLM`` of ``--layers + 1`` layers, the last
one the MTP module's block, plus seeded MTP glue weights), loaded in memory through Helios's loaders
(`deepseek_v3`, `models.mtp.load_mtp`). One request of ``--context`` prompt tokens, speculation off:

- ``target step``: the median time of `EngineCore.step` while it decodes (one token per step);
- ``MTP first draft``: `MTPDrafter.propose` at depth 1 after one committed token (the exact
  position of the token before it, then the first draft's logits): what a round's first draft costs;
- ``MTP further draft``: `propose` at depth 4 right after (nothing to catch up: the first draft's
  logits again, then 3 positions with their logits), over 3: an upper bound of one further draft.

With ``--streams N`` (N > 1) the drafter holds N requests (``--context`` random prompt tokens each,
then ``--steps`` committed tokens, the target's hidden states from one forward per request), and the
two figures are per request and draft of a round of all N, asked one request after the other
(``sequential``: each `propose` alone, as before the scheduler announced its rounds) and announced
first (``joint``: `prefetch` for all, then `propose`: one forward per depth for all N); the steps
alternate between the two.

Random weights accept (almost) no drafts, so no speed-up is measured here: the ratio bounds what a
draft costs, not how many are accepted (docs/benchmarks.md, "MTP speculation").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.mtp import MTPDrafter
    from helios.engine.records import EngineRequest
    from helios.engine.scheduler import RequestState
    from helios.models import registry
    from helios.models.architecture import BuildOptions
    from helios.models.mtp import load_mtp

    dtype = getattr(torch, args.dtype)
    h = args.hidden
    config = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=h // 2,
                  num_hidden_layers=args.layers + 1, num_attention_heads=h // 128, num_key_value_heads=h // 128,
                  n_routed_experts=args.experts, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2,
                  n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=h // 2, kv_lora_rank=h // 4,
                  qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=4096,
                  rope_interleave=True)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    del hf
    n = args.layers
    g = torch.Generator().manual_seed(1)
    prefix = f"model.layers.{n}."
    state.update({prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                  prefix + "eh_proj.weight": 0.02 * torch.randn(h, 2 * h, generator=g),
                  prefix + "shared_head.norm.weight": torch.ones(h)})
    hf_config = {**config, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                 "num_hidden_layers": n, "num_nextn_predict_layers": 1}
    architecture = registry.for_hf_config(hf_config)
    cfg = architecture.config_from_hf(hf_config)
    target = architecture.build(cfg, BuildOptions(dtype=dtype))
    target.load_weights(state)
    target.eval()
    target.pack_cpu_weights()
    predictor = load_mtp(target, architecture, state)
    del state

    page = 16
    pages = -(-(args.context + args.steps + 64) // page) + 2
    core = EngineCore(target, EngineConfig(page_size=page, num_pages=pages, max_active=1, prefill_chunk_size=512,
                                           max_model_len=pages * page), dtype)
    prompt = torch.randint(3, args.vocab, (args.context,), generator=g).tolist()
    core.add(EngineRequest("r", tuple(prompt), SamplingParams(temperature=0.0), max_tokens=args.steps + 8,
                           ignore_eos=True))
    tokens = list(prompt)
    times: list[float] = []
    while core.scheduler.has_work:
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        if core.scheduler.running and not core.scheduler.running[0].is_prefilling and len(tokens) > len(prompt):
            times.append(dt)
        for o in outs:
            tokens += o.new_token_ids

    step = statistics.median(times)
    print(f"synthetic DeepSeek-V3 shape: {n} layers + 1 MTP, hidden {h}, vocab {args.vocab}, {args.dtype}, "
          f"{args.threads} threads, context {args.context}")
    print(f"target decode step  median {step * 1e3:7.2f} ms over {len(times)} steps")
    if args.streams > 1:
        _streams(args, target, predictor, dtype, page, step, g)
        return
    drafter = MTPDrafter(predictor, dtype, num_pages=pages, page_size=page, max_active=1, max_model_len=pages * page)
    with torch.inference_mode():
        hidden = target(torch.tensor(tokens), torch.arange(len(tokens)), _dense(target))
    base = len(prompt)
    seq = RequestState(EngineRequest("d", tuple(prompt), SamplingParams(temperature=0.0), max_tokens=1),
                       list(prompt), base, None, 0)
    # As in the engine: a step hands over its rows; a row runs once the token after it is committed.
    drafter.capture(seq, 0, hidden[:base])
    first: list[float] = []
    deep: list[float] = []
    for i in range(args.steps):
        committed = tokens[: base + i + 1]
        t0 = time.perf_counter()
        drafter.propose("d", committed, 1)  # one exact position (the last committed one's) and a draft
        t1 = time.perf_counter()
        drafter.propose("d", committed, 4)  # the first draft's logits again, then 3 positions and drafts
        t2 = time.perf_counter()
        first.append(t1 - t0)
        deep.append((t2 - t1) / 3)
        seq.token_ids[:] = committed
        drafter.capture(seq, len(committed) - 1, hidden[len(committed) - 1 : len(committed)])
    draft = statistics.median(deep)
    print(f"MTP first draft     median {statistics.median(first) * 1e3:7.2f} ms "
          f"({statistics.median(first) / step:.3f} of a step)")
    print(f"MTP further draft   median {draft * 1e3:7.2f} ms ({draft / step:.3f} of a step)")


def _streams(args: argparse.Namespace, target: torch.nn.Module, predictor: object, dtype: torch.dtype, page: int,
             step: float, g: torch.Generator) -> None:
    from helios.domain.sampling import SamplingParams
    from helios.engine.mtp import MTPDrafter
    from helios.engine.records import EngineRequest
    from helios.engine.scheduler import RequestState

    count, base = args.streams, args.context
    pages = count * (-(-(base + args.steps + 64) // page) + 2)
    drafter = MTPDrafter(predictor, dtype, num_pages=pages, page_size=page, max_active=count,  # type: ignore[arg-type]
                         max_model_len=base + args.steps + 64)
    tokens, hidden, seqs = [], [], []
    for r in range(count):
        ids = torch.randint(3, args.vocab, (base + args.steps + 1,), generator=g).tolist()
        with torch.inference_mode():
            hidden.append(target(torch.tensor(ids), torch.arange(len(ids)), _dense(target)))
        tokens.append(ids)
        seq = RequestState(EngineRequest(f"r{r}", tuple(ids[:base]), SamplingParams(temperature=0.0), max_tokens=1),
                           list(ids[:base]), base, None, 0)
        drafter.capture(seq, 0, hidden[r][:base])
        seqs.append(seq)
    times: dict[str, tuple[list[float], list[float]]] = {"sequential": ([], []), "joint": ([], [])}
    for i in range(args.steps):
        mode = "joint" if i % 2 else "sequential"
        committed = [t[: base + i + 1] for t in tokens]
        t0 = time.perf_counter()
        for depth in (1, 4):  # as `main`: the first draft (with the catch-up), then 3 more
            if mode == "joint":
                for r, ids in enumerate(committed):
                    drafter.prefetch(f"r{r}", ids, depth)
            for r, ids in enumerate(committed):
                drafter.propose(f"r{r}", ids, depth)
            if depth == 1:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        times[mode][0].append((t1 - t0) / count)
        times[mode][1].append((t2 - t1) / (3 * count))
        for r, ids in enumerate(committed):
            seqs[r].token_ids[:] = ids
            drafter.capture(seqs[r], len(ids) - 1, hidden[r][len(ids) - 1 : len(ids)])
    print(f"{count} streams, per request and draft:")
    for mode, (first, deep) in times.items():
        a, b = statistics.median(first), statistics.median(deep)
        print(f"  {mode:10}  first draft {a * 1e3:7.2f} ms ({a / step:.3f} of a step)   "
              f"further draft {b * 1e3:7.2f} ms ({b / step:.3f} of a step)")


def _dense(model: torch.nn.Module) -> object:
    from helios.models.dense_attention import DenseAttention

    return DenseAttention.for_model(model)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
