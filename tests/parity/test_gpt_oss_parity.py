"""Numerical parity of gpt-oss (`helios.models.gpt_oss`) with transformers' ``GptOssForCausalLM``
(fp32, eager attention: the sinks in the softmax's denominator).

Tiny random seeded models (hidden 64, 8 experts, top-2, 4 heads over 2 kv heads, head_dim 16):
four layers alternating sliding (window 8) and full attention with YaRN rope scaling, and two layers
(full, then sliding with window 5) with plain RoPE, no attention biases and tied embeddings; sinks,
router and expert biases random, large enough that the clamped SwiGLU clamps. Prompts are longer
than the windows. Saved with ``save_pretrained`` and loaded through `load_checkpoint` and the
registry: prompt logits, chunked prefill + decode, 32 greedy tokens, the packed-state round trip,
the engine's greedy tokens and logprobs (paged cache, chunked prefill, two requests), bfloat16 near
float32, and YaRN's frequencies against transformers' ``ROPE_INIT_FUNCTIONS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.config import yarn_inv_freq
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.gpt_oss import GptOssForCausalLM
from helios.models.interface import FullAttentionSpec, SlidingWindowSpec
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 77, 150, 23, 8, 111]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=2, eos_token_id=1)
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
VARIANTS: dict[str, dict[str, Any]] = {
    "yarn": dict(num_hidden_layers=4, sliding_window=8, rope_parameters=YARN),
    "plain": dict(num_hidden_layers=2, sliding_window=5, layer_types=["full_attention", "sliding_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
                  tie_word_embeddings=True),
}


def _tiny_hf_model(variant: str, **overrides: Any) -> torch.nn.Module:
    config = transformers.GptOssConfig(**{**COMMON, **VARIANTS[variant], **overrides})
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    torch.manual_seed(sorted(VARIANTS).index(variant))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            elif "experts" in name:
                param.copy_(0.5 * torch.randn_like(param))  # gate/up past +-7 now and then: clamped
            else:
                param.copy_(0.2 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model(request.param)
    root = tmp_path_factory.mktemp(f"gpt-oss-{request.param}")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_config_and_cache_specs(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, GptOssForCausalLM)
    cfg, hf = model.config, hf_model.config
    assert [s == "sliding_attention" for s in hf.layer_types] == list(cfg.sliding_layers)
    assert any(cfg.sliding_layers) and not all(cfg.sliding_layers)
    specs = model.cache_specs()
    for sliding, spec in zip(cfg.sliding_layers, specs, strict=True):
        assert spec == (SlidingWindowSpec(2, 16, hf.sliding_window) if sliding else FullAttentionSpec(2, 16))
    assert len(PROMPT) > 2 * hf.sliding_window
    assert (cfg.rope_scaling is not None) == (hf.rope_parameters["rope_type"] == "yarn")


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_sinks_and_clamp_matter(pair: tuple[torch.nn.Module, Path]) -> None:
    """The test weights exercise what is particular to gpt-oss: zeroing the sinks moves the logits,
    and some expert pre-activations are past the clamp."""
    _, root = pair
    model = load_ours(root)
    assert isinstance(model, GptOssForCausalLM)
    base = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    layer = model._decoder_layers()[0]
    with torch.no_grad():
        x = torch.randn(16, model.config.hidden_size)
        assert (x @ layer.experts_gate_up[0] + layer.experts_gate_up_bias[0]).abs().max().item() > model.config.swiglu_limit
        for lay in model._decoder_layers():
            lay.sinks.zero_()
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
    assert isinstance(model, GptOssForCausalLM)
    # No stop token (``min_new_tokens`` would mask it out of the logits, greedy_generate does not).
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
    assert "layers.0.sinks" in state and "layers.0.experts_gate_up" in state
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    assert torch.equal(everything, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
    total = sum(int(p.numel() * p.element_size()) for p in model.parameters())
    assert 0 < model.decode_weight_bytes() < total


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through the engine (paged cache with a sliding-window group, chunked prefill, two requests
    batched; decode steps the CPU decode kernel would serve take the sink path) against
    transformers' logits of each whole sequence."""
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


@pytest.mark.parametrize("extra", [
    {},
    {"truncate": True},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0},
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"attention_factor": 1.3},
])
def test_yarn_matches_transformers(extra: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**YARN, **extra}
    config = transformers.GptOssConfig(**{**COMMON, "max_position_embeddings": 8192}, num_hidden_layers=2,
                                       rope_parameters=rope)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, factor = yarn_inv_freq(16, rope["rope_theta"], rope, 8192)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_mxfp4_checkpoint(tmp_path: Path) -> None:
    """A checkpoint with MXFP4 experts (``quantization_config`` mxfp4, ``*_blocks`` / ``*_scales``
    as OpenAI publishes them): dequantized on load as transformers' ``convert_moe_packed_tensors``
    does (the reference model holds that function's output), prompt logits at fp32 parity."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from helios.models.gpt_oss import config_from_hf

    hf_model = _tiny_hf_model("yarn")
    cfg = hf_model.config
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator, dtype=torch.uint8)
                scales = torch.randint(123, 126, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8)
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                name = f"model.layers.{i}.mlp.experts.{proj}"
                del state[name]
                state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_ours(tmp_path)
    expected = hf_logits(hf_model, PROMPT)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - expected).abs().max().item()
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE
    with pytest.raises(NotImplementedError, match="'fp8'"):
        config_from_hf({**config, "quantization_config": {"quant_method": "fp8"}})


def test_the_engine_in_bfloat16_matches_dense_attention(pair: tuple[torch.nn.Module, Path]) -> None:
    """A bfloat16 cache (where the CPU prefill kernel would serve the prefill chunks, and the decode
    kernel the decode rows): the sink layers' torch paths give the logits of `DenseAttention`'s."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    _, root = pair
    model = load_ours(root, torch.bfloat16)
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=7,
                                          max_model_len=64), torch.bfloat16)
    outs = run(core, [EngineRequest("r", tuple(PROMPT), SamplingParams(temperature=0.0), max_tokens=6,
                                    ignore_eos=True, num_top_logprobs=1)])
    tokens = [t for o in outs["r"] for t in o.new_token_ids]
    logprobs = [lp.logprob for o in outs["r"] for lp in (o.logprobs or ())]
    ref = torch.log_softmax(our_logits(model, DenseAttention.for_model(model), [*PROMPT, *tokens], 0).double(), dim=-1)
    for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + j]
        assert abs(lp - float(row[t])) < 0.05, j
        assert float(row[t]) > float(row.max()) - 0.05, j


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_runtime_load_model_and_weight_cache(pair: tuple[torch.nn.Module, Path], tmp_path: Path, weights: str) -> None:
    """`runtime.load_model` (the registry, the weight format of the attention projections,
    `pack_cpu_weights`) and the packed-weight cache: the cached model's logits are the fresh one's."""
    from helios.runtime import load_model

    hf_model, root = pair
    loaded = load_model(root, weights=weights, dtype="float32", cache_dir=tmp_path / "packed")
    model = loaded.model
    assert isinstance(model, GptOssForCausalLM)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    expected = hf_logits(hf_model, PROMPT)
    if weights == "float32":
        assert (got - expected).abs().max().item() < FP32_TOLERANCE
    else:  # int8 attention projections on random weights; a routing flip moves a token's logits further
        assert ((got - expected).abs().mean() / expected.abs().mean()).item() < 0.3
    assert loaded.cache_key and any((tmp_path / "packed").rglob("*"))
    again = load_model(root, weights=weights, dtype="float32", cache_dir=tmp_path / "packed").model
    assert torch.equal(got, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))


def test_sink_attention_blocks_and_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sink_attention` against transformers' eager gpt-oss attention (concatenated sink column),
    whole and in query blocks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from helios.models import attention_sinks

    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 11, 16), torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16)
    sinks = torch.randn(4)
    mask = torch.ones(11, 11, dtype=torch.bool).tril() & ~torch.ones(11, 11, dtype=torch.bool).tril(-5)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    additive = torch.zeros(11, 11).masked_fill(~mask, float("-inf"))
    want = eager_attention_forward(module, q, k, v, additive, scaling=0.25)[0].transpose(1, 2)
    whole = attention_sinks.sink_attention(q, k, v, sinks, 0.25, mask)
    monkeypatch.setattr(attention_sinks, "MAX_SCORES", 4 * 11 * 3)  # blocks of 3 queries
    blocks = attention_sinks.sink_attention(q, k, v, sinks, 0.25, mask)
    assert torch.allclose(whole, want, atol=1e-6, rtol=0)
    assert torch.allclose(blocks, whole, atol=1e-7, rtol=0)
