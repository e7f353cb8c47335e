"""Numerical parity of MiMo-V2-Flash (`helios.models.mimo_v2_flash`) with transformers'
``MiMoV2FlashForCausalLM`` (fp32, eager attention: sinks on the sliding layers).

A tiny random seeded model: hidden 64, four layers (full, sliding, sliding, full; window 8),
layer 0 a dense MLP and the others 8 experts top-2 in 2 groups (DeepSeek-V3 routing with a random
correction bias), 4 heads over 1 kv head on full layers and 2 on sliding ones, head_dim 24 for q/k
and 16 for v (the cache pads V to 24), partial rotary (0.334 and 0.5) with a theta per layer kind,
random non-zero sinks and the value scale. Prompts are longer than the window. Saved with
``save_pretrained`` and loaded through `load_checkpoint` and the registry: prompt logits, chunked
prefill against one pass, 32 greedy tokens, the packed-state round trip, and the engine (paged
cache with per-group kv heads, chunked prefill, two requests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.interface import FullAttentionSpec, SlidingWindowSpec
from helios.models.mimo_v2_flash import MiMoV2FlashForCausalLM, config_from_hf
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 77, 150, 23, 8, 111]
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, sliding_window=8,
              layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
              rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.334},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
              attention_value_scale=0.8, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _tiny_hf_model(**overrides: Any) -> torch.nn.Module:
    config = transformers.MiMoV2FlashConfig(**{**CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = transformers.MiMoV2FlashForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model()
    root = tmp_path_factory.mktemp("mimo-v2-flash")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_config_and_cache_specs(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, MiMoV2FlashForCausalLM)
    cfg = model.config
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf_model.config.layer_types)
    assert cfg.moe_layers == tuple(t == "sparse" for t in hf_model.config.mlp_layer_types) == (False, True, True, True)
    assert any(cfg.sliding_layers) and not all(cfg.sliding_layers)
    assert (cfg.rotary, cfg.sliding_rotary_dim) == (8, 12)
    assert model.cache_specs() == (FullAttentionSpec(1, 24), SlidingWindowSpec(2, 24, 8),
                                   SlidingWindowSpec(2, 24, 8), FullAttentionSpec(1, 24))
    assert len(PROMPT) > 2 * cfg.sliding_window
    # transformers' defaults and its reading of the reference implementation's sliding_window_size
    default = config_from_hf({"num_hidden_layers": 12, "sliding_window_size": 128})
    hf_default = transformers.MiMoV2FlashConfig(num_hidden_layers=12, sliding_window_size=128)
    assert default.sliding_window == hf_default.sliding_window == 129
    assert default.sliding_layers == tuple(t == "sliding_attention" for t in hf_default.layer_types)
    assert default.moe_layers == tuple(t == "sparse" for t in hf_default.mlp_layer_types)
    assert (default.rotary, default.sliding_rotary_dim, default.v_head_dim, default.sliding_kv_heads) == (64, 64, 128, 8)
    assert default.value_scale == hf_default.attention_value_scale


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"mimo prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_sinks_and_value_scale_matter(pair: tuple[torch.nn.Module, Path]) -> None:
    """Zeroing the sinks, or dropping the value scale, moves the logits (the test exercises them)."""
    _, root = pair
    model = load_ours(root)
    assert isinstance(model, MiMoV2FlashForCausalLM)
    base = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    layers = model._decoder_layers()
    with torch.no_grad():
        for layer in layers:
            if layer.sinks is not None:
                layer.sinks.zero_()
    assert (base - our_logits(model, DenseAttention.for_model(model), PROMPT, 0)).abs().max().item() > 1e-2
    model = load_ours(root)
    assert isinstance(model, MiMoV2FlashForCausalLM)
    for layer in model._decoder_layers():
        layer.value_scale = 1.0
    assert (base - our_logits(model, DenseAttention.for_model(model), PROMPT, 0)).abs().max().item() > 1e-2


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 12), (12, 15)] + [(i, i + 1) for i in range(15, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    assert (got - expected).abs().max().item() < FP32_TOLERANCE
    one_pass = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert (got - one_pass).abs().max().item() < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, MiMoV2FlashForCausalLM)
    generation = hf_model.generation_config
    eos, generation.eos_token_id = generation.eos_token_id, None
    try:
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, do_sample=False)[0, 6:]
    finally:
        generation.eos_token_id = eos
    expected = generated.tolist()
    assert len(expected) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == expected


def test_keep_rows_and_packed_state(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root)
    everything = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    keep = torch.tensor([len(PROMPT) - 1, 2])
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model), keep=keep)
        kept = model.compute_logits(hidden)
    assert torch.allclose(kept, everything[keep], atol=1e-5, rtol=0)
    state, kinds = model.packed_state()
    assert "layers.1.sinks" in state and "layers.0.sinks" not in state
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    assert torch.equal(everything, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
    total = sum(int(p.numel() * p.element_size()) for p in model.parameters())
    assert 0 < model.decode_weight_bytes() < total


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through the engine (a full group of 1 kv head and a sliding group of 2, chunked prefill,
    two requests batched) against transformers' logits of each whole sequence."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    model = load_ours(root)
    core = EngineCore(model, EngineConfig(page_size=2, num_pages=64, max_active=4, prefill_chunk_size=5,
                                          max_model_len=64), torch.float32)
    prompts = [PROMPT, PROMPT[3:11]]
    outs = run(core, [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=10,
                                    ignore_eos=True, num_top_logprobs=1) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        tokens = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        logprobs = [lp for o in outs[f"r{i}"] for lp in (o.logprobs or ())]
        assert len(tokens) == 10
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert t == int(row.argmax()), (i, j)
            assert abs(lp.logprob - float(row[t])) < 1e-4, (i, j)


def test_bfloat16_runs_close(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, torch.bfloat16)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert got.dtype == torch.float32
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()
