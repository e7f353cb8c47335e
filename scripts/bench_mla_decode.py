"""MLA decode: the latent cache's absorbed form against the expanded-KV form (issue 28).

    .venv/bin/python scripts/bench_mla_decode.py [--contexts 1024 4096 16384] [--steps 12] [--layers 2]
        [--hidden 7168] [--modes latent expanded] [--seed 0]

A DeepSeek-V3-shaped model with DeepSeek-V3's attention shapes (128 heads, ``q_lora_rank`` 1536,
``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, hidden
7168, its YaRN rope scaling) but few layers (``--layers``), every one with a small dense MLP
(intermediate 2048) and a 4096-token vocabulary: the attention is the real thing, the rest only
enough to make a step. Random weights, seeded (normal, std 0.02; norms 1), in the weight format and
activation dtype ``weights = auto`` picks for a dense checkpoint here (`runtime.choose_weights`:
bfloat16 on a CPU with AVX512-BF16), built through the registry entry (`BuildOptions`, with
``mla_cache`` "latent" or "expanded", `helios.models.deepseek_v3`).

For each mode and context: a fresh `EngineCore` (pages of 16, prefill chunks of 512 as served by default), one request
whose prompt is ``context`` tokens, stepped until it has prefilled and sampled its first token,
2 warm-up decode steps, then ``--steps`` timed decode steps (one stream, one token each): ms/token
(median and mean) and tokens/s. KV bytes per token come from the model's cache specs (every layer,
the model's dtype); the expanded form's V is zero-padded to K's head size (192) in its
`FullAttentionSpec`, so its figure is given padded (what the pool holds) and unpadded (K 192 + V
128 per head). Prints the CPU flags and threads it ran on.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time
from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.models import cpu_kernels
from helios.models.architecture import BuildOptions
from helios.models.deepseek_v3 import ARCHITECTURES, DeepseekV3ForCausalLM, config_from_hf
from helios.runtime import choose_weights, cpu_flags

PAGE = 16


def hf_config(hidden: int, layers: int) -> dict[str, Any]:
    """DeepSeek-V3's attention (and rope) with ``layers`` dense layers and a small vocabulary."""
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=4096,
                hidden_size=hidden, intermediate_size=2048, moe_intermediate_size=2048, num_hidden_layers=layers,
                num_attention_heads=128, num_key_value_heads=128, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=layers, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=163840,
                rope_theta=10000.0, rope_interleave=True, tie_word_embeddings=False,
                rope_scaling=dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                                  original_max_position_embeddings=4096, beta_fast=32, beta_slow=1))


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors under the checkpoint's names (transformers' model on the meta device
    gives the names and shapes)."""
    import transformers

    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in sorted(hf.named_parameters()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            weights[name] = (0.02 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16)
    return weights


def build(cfg: dict[str, Any], weights: dict[str, torch.Tensor], mode: str) -> DeepseekV3ForCausalLM:
    choice = choose_weights("auto", "auto", "cpu", int4_codes=False)
    model = ARCHITECTURES[0].build(config_from_hf(cfg), BuildOptions(
        dtype=choice.dtype, weights=choice.format, q8_head=cpu_kernels.available(), mla_cache=mode))
    assert isinstance(model, DeepseekV3ForCausalLM)
    model.load_weights(weights)
    model.eval()
    model.pack_cpu_weights()
    return model


def kv_bytes(model: DeepseekV3ForCausalLM) -> tuple[int, int]:
    """Bytes per token of every layer's cache spec, and the same without the expanded form's V padding."""
    cfg = model.config
    size = torch.empty((), dtype=model.dtype).element_size()
    specs = model.cache_specs()
    padded = sum(spec.elements_per_token() for spec in specs) * size
    if not model.expanded:
        return padded, padded
    per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return padded, len(specs) * cfg.num_heads * per_head * size


def decode(model: DeepseekV3ForCausalLM, context: int, steps: int) -> tuple[float, list[float]]:
    """(prefill seconds, per-step decode milliseconds) of one stream at ``context`` prompt tokens."""
    total = context + steps + 8
    core = EngineCore(model, EngineConfig(page_size=PAGE, num_pages=-(-total // PAGE) + 4, max_active=1,
                                          prefill_chunk_size=512, max_model_len=total + PAGE,
                                          prefix_caching=False), model.dtype)
    prompt = tuple((31 * j + 7) % 4000 + 50 for j in range(context))
    core.add(EngineRequest("s", prompt, SamplingParams(temperature=0.0), max_tokens=steps + 4, ignore_eos=True))
    t0 = time.perf_counter()
    while any(s.is_prefilling or s.num_computed == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    prefill = time.perf_counter() - t0
    for _ in range(2):
        core.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t) * 1e3)
    return prefill, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--modes", nargs="+", default=["latent", "expanded"], choices=["latent", "expanded"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    choice = choose_weights("auto", "auto", "cpu", int4_codes=False)
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"{choice.describe()}; Helios CPU kernels: {cpu_kernels.available()}")
    cfg = hf_config(args.hidden, args.layers)
    rows = []
    for mode in args.modes:
        weights = random_weights(cfg, args.seed)  # the same for every mode (seeded), not kept beside the model
        print(f"{args.layers} layers, hidden {args.hidden}, 128 heads, q_lora 1536, kv_lora 512, qk 128+64, v 128; "
              f"{sum(w.numel() for w in weights.values()) / 1e6:.0f}M parameters")
        model = build(cfg, weights, mode)
        del weights
        padded, unpadded = kv_bytes(model)
        per_layer = padded // args.layers
        print(f"\n== {mode}: cache spec {model.cache_specs()[0]}; KV bytes/token {padded:,} for {args.layers} layers "
              f"({per_layer:,} per layer" + (f"; without V's padding {unpadded:,}, {unpadded // args.layers:,} per layer"
                                             if unpadded != padded else "") + ")")
        for context in args.contexts:
            prefill, times = decode(model, context, args.steps)
            med, mean = statistics.median(times), statistics.fmean(times)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(f"   context {context:6d}: prefill {prefill:7.1f} s; decode {med:7.2f} ms/token median "
                  f"({mean:.2f} mean, {min(times):.2f}-{max(times):.2f}), {1e3 / med:6.2f} tok/s; "
                  f"peak RSS so far {peak:.1f} GiB", flush=True)
            rows.append((mode, context, med, per_layer, unpadded // args.layers))
            gc.collect()
        del model
        gc.collect()
    print("\n| mode | context | ms/token (median) | tok/s | KV bytes/token/layer (padded; unpadded) |")
    print("|---|---:|---:|---:|---:|")
    for mode, context, med, per_layer, unpadded in rows:
        print(f"| {mode} | {context:,} | {med:.2f} | {1e3 / med:.2f} | {per_layer:,}; {unpadded:,} |")


if __name__ == "__main__":
    main()
