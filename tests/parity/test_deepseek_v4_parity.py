"""Numerical parity of DeepSeek V4 (`helios.models.deepseek_v4`: sliding-window attention,
compressed sparse / heavily compressed attention, hyper-connections, hash and top-k MoE) with
transformers' ``DeepseekV4ForCausalLM`` (fp32).

A tiny random seeded model (hidden 64, 4 heads of 32 with 8 rotary dimensions, one kv head; 5
layers: sliding, CSA, HCA, CSA, HCA; the first two MLPs hash-routed, the others top-2 of 8;
``hc_mult`` 3 with 6 Sinkhorn iterations; a sliding window of 16; CSA rate 4 with ``index_topk``
5, HCA rate 8), so that a 100-token prompt runs well past the window, completes 12 HCA entries and
25 CSA entries of which each late query sees only 5. Saved with ``save_pretrained`` (whose names
are DeepSeek's under ``model.``) and loaded through `load_checkpoint` and the registry: the
prompt's logits, chunked prefill at boundaries off the compress rates then one-token decode, 32
greedy tokens against transformers' generate, and through the engine (pages of 4, prefill chunks
of 7, two requests batched, then a prefix-cache hit) every logprob against transformers' logits of
the whole sequence.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from helios.models.deepseek_v4 import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    config_from_hf,
    hf_name,
)
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.interface import CompressedSpec, RowWindowSpec, SlidingWindowSpec
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import (
    DEEPSEEK_V4_CONFIG,
    hf_logits,
    load_ours,
    our_logits,
    tiny_deepseek_v4,
    write_byte_tokenizer,
)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v4", allow_module_level=True)

VOCAB = DEEPSEEK_V4_CONFIG["vocab_size"]
LAYER_TYPES = [SLIDING, CSA, HCA, CSA, HCA]
_gen = torch.Generator().manual_seed(11)
PROMPT = torch.randint(3, VOCAB - 1, (100,), generator=_gen).tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = tiny_deepseek_v4()
    root = tmp_path_factory.mktemp("deepseek-v4")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_config(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root, architecture="deepseek_v4")
    assert isinstance(model, DeepseekV4ForCausalLM)
    cfg = model.config
    assert isinstance(cfg, DeepseekV4Config)
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.hash_layers == (True, True, False, False, False)
    assert (cfg.csa_rate, cfg.hca_rate, cfg.rotary, cfg.index_topk) == (4, 8, 8, 5)
    # Raw rows per token ([k | kv | gate], CSA with the indexer's kv / gate) for the last 16
    # positions (the sliding window; CSA's 2 x 4 and HCA's 8 are shorter), then one entry stream
    # per compressed layer (layers 1..4: cache indices 5..8), a row per rate positions.
    assert model.cache_specs() == (SlidingWindowSpec(1, 32, 16), RowWindowSpec(5 * 32 + 4 * 16, 16),
                                   RowWindowSpec(3 * 32, 16), RowWindowSpec(5 * 32 + 4 * 16, 16),
                                   RowWindowSpec(3 * 32, 16), CompressedSpec(32 + 16, 4), CompressedSpec(32, 8),
                                   CompressedSpec(32 + 16, 4), CompressedSpec(32, 8))


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    """The 100-token prompt's logits; the selection matters (a top-k past every entry gives other
    logits on both sides)."""
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"deepseek_v4 prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE
    dense = tiny_deepseek_v4(index_topk=64)
    assert (hf_logits(dense, PROMPT) - expected)[40:].abs().max().item() > 0.01


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    """Prefill chunks that end inside compress windows (3, 7, 13, ... tokens), then one-token steps:
    every position's logits are transformers' of the whole prompt."""
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    bounds = [0, 3, 10, 23, 24, 41, 60, 77, 90]
    chunks = list(itertools.pairwise(bounds)) + [(i, i + 1) for i in range(90, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    diff = (got - expected).abs().max().item()
    print(f"deepseek_v4 chunked + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    prompt = PROMPT[:30]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, len(prompt):].tolist()
    assert len(expected) == 32
    assert greedy_generate(model, prompt, max_new_tokens=32) == expected


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through the engine (pages of 4, prefill chunks of 7, two requests batched) against
    transformers' logits of each whole sequence (greedy tokens and logprobs; the first request's
    tokens equal to transformers' generate); then the first prompt again, served from the prefix
    cache, gives the same logprobs."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    model = load_ours(root)
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=160, max_active=4, prefill_chunk_size=7,
                                          max_model_len=160), torch.float32)
    num_tokens = 20

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=num_tokens,
                             ignore_eos=True, num_top_logprobs=1)

    prompts = [PROMPT[:86], PROMPT[5:66]]
    outs = run(core, [request(f"r{i}", p) for i, p in enumerate(prompts)])
    again = run(core, [request("again", prompts[0])])["again"]
    hit = again[0].num_cached_tokens
    assert hit >= 64 and hit % 8 == 4  # whole pages of 4: the hit ends inside an HCA window
    worst = 0.0
    for rid, prompt, request_outs in (("r0", prompts[0], outs["r0"]), ("r1", prompts[1], outs["r1"]),
                                      ("again", prompts[0], again)):
        tokens = [t for o in request_outs for t in o.new_token_ids]
        logprobs = [lp for o in request_outs for lp in (o.logprobs or ())]
        assert len(tokens) == num_tokens
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert t == int(row.argmax()), (rid, j)
            worst = max(worst, abs(lp.logprob - float(row[t])))
        if rid == "r0":
            with torch.no_grad():
                expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                                             min_new_tokens=num_tokens, do_sample=False)[0, len(prompt):].tolist()
            assert tokens == expected
    first = [lp.logprob for o in outs["r0"] for lp in (o.logprobs or ())]
    cached = [lp.logprob for o in again for lp in (o.logprobs or ())]
    again_diff = max(abs(a - b) for a, b in zip(first, cached, strict=True))
    print(f"deepseek_v4 engine: max abs logprob diff {worst:.3g}, cache hit ({hit} tokens) vs one pass "
          f"{again_diff:.3g}")
    assert worst < 1e-4
    assert again_diff < 1e-5


def test_raw_windows_set_by_the_rates(tmp_path: Path) -> None:
    """A sliding window (4) shorter than the rates: the raw rows a layer keeps are those of its
    partial window (HCA: 8) and, in CSA, the window before it (2 x 4). Through the engine with two
    running requests (pages of 4, chunks of 5, off every rate), the raw pools hold at most their
    windows and chunks, and the tokens and logprobs are transformers'; then a follow-up turn (the
    first conversation and three more tokens) hits the prefix cache up to a point inside an HCA
    window (the last raw pages of a finished request are the last evicted) and gives what one pass
    without the cache gives."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.kv.coordinator import KVCacheCoordinator, RowWindowPool
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model = tiny_deepseek_v4(sliding_window=4)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    model = load_ours(tmp_path)
    specs = model.cache_specs()
    assert specs[:5] == (SlidingWindowSpec(1, 32, 4), RowWindowSpec(5 * 32 + 4 * 16, 8), RowWindowSpec(3 * 32, 8),
                         RowWindowSpec(5 * 32 + 4 * 16, 8), RowWindowSpec(3 * 32, 8))

    def engine(caching: bool) -> EngineCore:
        return EngineCore(model, EngineConfig(page_size=4, num_pages=80, max_active=2, prefill_chunk_size=5,
                                              max_model_len=120, prefix_caching=caching), torch.float32)

    core = engine(True)
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator)
    raw = [s for s in kv.sliding if isinstance(s, RowWindowPool)]
    assert raw and all(r.lazy for r in raw)
    held = [0]

    def watch() -> None:  # the raw pools' held pages after every step
        held[0] = max(held[0], *(r.num_held() for r in raw))

    num_tokens = 12

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=num_tokens,
                             ignore_eos=True, num_top_logprobs=1)

    prompts = [PROMPT[:74], PROMPT[7:51]]
    outs = run(core, [request(f"r{i}", p) for i, p in enumerate(prompts)], each_step=watch)
    # Two requests: each at most (8 - 1) // 4 + 3 pages besides its chunk (5 positions: 2 pages).
    assert 0 < held[0] <= 2 * ((8 - 1) // 4 + 3 + 2) < raw[0].num_pages
    turn = [*prompts[0], *(t for o in outs["r0"] for t in o.new_token_ids), *PROMPT[80:83]]
    again = run(core, [request("again", turn)], each_step=watch)["again"]
    hit = again[0].num_cached_tokens
    assert hit == 84 and hit % 8  # 74 + 11 computed positions: 21 pages, inside an HCA window
    one_pass = run(engine(False), [request("again", turn)])["again"]
    worst = 0.0
    for rid, prompt, request_outs in (("r0", prompts[0], outs["r0"]), ("r1", prompts[1], outs["r1"]),
                                      ("again", turn, again)):
        tokens = [t for o in request_outs for t in o.new_token_ids]
        logprobs = [lp for o in request_outs for lp in (o.logprobs or ())]
        assert len(tokens) == num_tokens
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert t == int(row.argmax()), (rid, j)
            worst = max(worst, abs(lp.logprob - float(row[t])))
    cached = [lp.logprob for o in again for lp in (o.logprobs or ())]
    uncached = [lp.logprob for o in one_pass for lp in (o.logprobs or ())]
    print(f"deepseek_v4 raw windows of 8: max abs logprob diff {worst:.3g}, raw pages held at most {held[0]} of "
          f"{raw[0].num_pages}, cache hit {hit} tokens")
    assert worst < 1e-4
    assert max(abs(a - b) for a, b in zip(cached, uncached, strict=True)) < 1e-5


@pytest.mark.parametrize("verify_as_decode", [True, False])
def test_speculative_verification_is_exact(pair: tuple[torch.nn.Module, Path], verify_as_decode: bool) -> None:
    """n-gram drafts over repetitive prompts, verified as decode tokens or as small prefill chunks
    (rejected drafts leave rows, and entries of windows they completed, that later steps rewrite):
    the tokens plain greedy decoding gives."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from helios.engine.speculative import SpeculativeConfig
    from tests.unit.test_engine import run

    _, root = pair
    model = load_ours(root)
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 4, [40, 41, 42] * 9]
    results = {}
    for mode in ("off", "ngram"):
        core = EngineCore(model, EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=32,
                                              max_model_len=96, speculative=SpeculativeConfig(mode=mode)),
                          torch.float32)
        core.runner.batch.verify_as_decode = verify_as_decode
        outs = run(core, [EngineRequest(f"s{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=24,
                                        ignore_eos=True) for i, p in enumerate(prompts)])
        results[mode] = {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
        if mode == "ngram":
            stats = core.stats().speculative
            assert stats is not None and stats.verify_steps > 0
            print(f"deepseek_v4 ngram (verify_as_decode={verify_as_decode}): {stats.accepted_drafts} of "
                  f"{stats.verification_drafts} drafts accepted")
            assert 0 < stats.accepted_drafts < stats.verification_drafts  # some rejected
    assert results["ngram"] == results["off"]


def test_packed_state_and_bfloat16(pair: tuple[torch.nn.Module, Path]) -> None:
    """The packed state (weight cache) restores the same logits; bfloat16 weights and activations
    stay as close to float32 as transformers' own bfloat16 run does (this tiny random model is
    sensitive: routing and the indexer's selection flip under rounding)."""
    from helios.loaders.checkpoint import load_checkpoint
    from helios.models.architecture import BuildOptions

    hf_model, root = pair
    model = load_ours(root)
    state, kinds = model.packed_state()
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    ours = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert torch.equal(ours, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
    expected = hf_logits(hf_model, PROMPT)
    hf_bf16 = (hf_logits(tiny_deepseek_v4().to(torch.bfloat16), PROMPT) - expected).abs().mean().item()
    bf16 = load_ours(root, torch.bfloat16)
    ours_bf16 = (our_logits(bf16, DenseAttention.for_model(bf16), PROMPT, 0) - expected).abs().mean().item()
    print(f"deepseek_v4 bf16: mean abs logit error {ours_bf16:.3g} (transformers bf16: {hf_bf16:.3g})")
    assert ours_bf16 < 2 * hf_bf16


def test_deepseek_release_names(pair: tuple[torch.nn.Module, Path]) -> None:
    """The saved weights under DeepSeek's own release names (no ``model.`` prefix, ``embed`` /
    ``head`` / ``hc_head_*``, per-expert ``w1`` / ``w2`` / ``w3``, a hash layer's unused router
    bias, an MTP block) load into the same model."""
    from safetensors.torch import load_file

    _, root = pair
    saved = load_file(str(root / "model.safetensors"))
    renamed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "head.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    release = {renamed.get(k, k.removeprefix("model.")): v for k, v in saved.items()}
    assert "layers.1.attn.indexer.compressor.ape" in release and "layers.3.ffn.experts.7.w3.weight" in release
    release["layers.0.ffn.gate.bias"] = torch.randn(8)
    release["mtp.0.attn.wq_a.weight"] = torch.randn(32, 64)
    model = load_ours(root)
    again = load_ours(root)
    again.load_weights(release)
    attn = DenseAttention.for_model(model)
    assert torch.equal(our_logits(model, attn, PROMPT, 0), our_logits(again, DenseAttention.for_model(again),
                                                                      PROMPT, 0))


def test_checkpoint_names() -> None:
    """DeepSeek's names, transformers' save_pretrained mix and transformers' own all land on the
    transformers names; the MTP layers are dropped."""
    expected = {
        "layers.3.attn.wq_a.weight": "model.layers.3.self_attn.q_a_proj.weight",
        "model.layers.3.attn.wq_b.weight": "model.layers.3.self_attn.q_b_proj.weight",
        "layers.3.attn.indexer.wq_b.weight": "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.attn.indexer.compressor.ape": "model.layers.3.self_attn.compressor.indexer.position_bias",
        "layers.3.attn.indexer.compressor.norm.weight": "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        "layers.3.attn.indexer.weights_proj.weight":
            "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.attn.compressor.wgate.weight": "model.layers.3.self_attn.compressor.gate_proj.weight",
        "layers.3.attn.norm.weight": "model.layers.3.self_attn.kv_norm.weight",
        "layers.3.attn.q_norm.weight": "model.layers.3.self_attn.q_a_norm.weight",
        "layers.3.attn.attn_sink": "model.layers.3.self_attn.sinks",
        "layers.3.hc_ffn_fn": "model.layers.3.ffn_hc.fn",
        "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "layers.3.ffn.gate.tid2eid": "model.layers.3.mlp.gate.tid2eid",
        "layers.3.ffn.experts.7.w3.weight": "model.layers.3.mlp.experts.7.up_proj.weight",
        "layers.3.ffn.shared_experts.w2.weight": "model.layers.3.mlp.shared_experts.down_proj.weight",
        "layers.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "norm.weight": "model.norm.weight",
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight":
            "model.layers.1.self_attn.compressor.indexer.kv_norm.weight",
        "model.layers.0.mlp.experts.gate_up_proj": "model.layers.0.mlp.experts.gate_up_proj",
    }
    for name, want in expected.items():
        assert hf_name(name) == want, name
    assert hf_name("mtp.0.attn.wq_a.weight") is None


def test_legacy_config_keys_and_refusals() -> None:
    base = {**DEEPSEEK_V4_CONFIG, "model_type": "deepseek_v4"}
    del base["layer_types"], base["compress_rates"], base["mlp_layer_types"], base["qk_rope_head_dim"]
    legacy = config_from_hf({**base, "compress_ratios": [0, 4, 128, 4, 128], "compress_rate_hca": 8,
                             "num_hash_layers": 2, "qk_rope_head_dim": 16})
    assert legacy.layer_types == tuple(LAYER_TYPES) and (legacy.csa_rate, legacy.hca_rate) == (4, 8)
    assert legacy.hash_layers == (True, True, False, False, False) and legacy.rotary == 16
    default = config_from_hf(base)
    assert default.layer_types == (HCA, HCA, HCA, CSA, HCA) and default.hash_layers[:3] == (True,) * 3
    from helios.models import registry

    assert registry.for_hf_config({"architectures": ["DeepseekV4ForCausalLM"]}).name == "deepseek_v4"
    with pytest.raises(NotImplementedError, match="quantization_config"):
        config_from_hf({**base, "quantization_config": {"quant_method": "fp8"}})


YARN = dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
                                 beta_slow=1.0))

# transformers' names (suffixes of model.layers.{i}.) -> llama.cpp's deepseek4 ones (gguf-py's
# constants; the converter's `DeepseekV4Model._map_dsv4_tensor_name`).
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn_sinks.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight", "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight", "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "attn_hc.fn": "hc_attn_fn.weight", "attn_hc.base": "hc_attn_base.weight", "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight", "ffn_hc.base": "hc_ffn_base.weight", "ffn_hc.scale": "hc_ffn_scale.weight",
}


def _write_gguf(path: Path, model: torch.nn.Module, *, mtp: bool = True,
                nextn_tensors: dict[str, Any] | None = None) -> None:
    """``model`` as llama.cpp's DeepseekV4Model converter lays it out (deepseek4; F32 here, where the
    converter makes the experts MXFP4): its metadata keys, the tensors in their own layout, the
    experts stacked, ``tid2eid`` as I32, the hash layers without a correction bias, and (``mtp``) a
    trailing MTP block: ``nextn_tensors`` (GGUF name -> float32 array), or a stand-in (two of its
    tensors)."""
    import gguf
    import numpy as np

    cfg = model.config
    arch = "deepseek4"
    writer = gguf.GGUFWriter(str(path), arch)
    n, nextn = cfg.num_hidden_layers, int(mtp)
    ratios = [{SLIDING: 0, CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}[t] for t in cfg.layer_types]
    u32 = {"block_count": n + nextn, "nextn_predict_layers": nextn, "context_length": cfg.max_position_embeddings,
           "embedding_length": cfg.hidden_size, "attention.head_count": cfg.num_attention_heads,
           "attention.head_count_kv": 1, "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
           "rope.dimension_count": cfg.qk_rope_head_dim, "attention.q_lora_rank": cfg.q_lora_rank,
           "attention.sliding_window": cfg.sliding_window, "expert_feed_forward_length": cfg.moe_intermediate_size,
           "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
           "expert_shared_count": cfg.n_shared_experts, "expert_gating_func": 4,
           "attention.indexer.head_count": cfg.index_n_heads, "attention.indexer.key_length": cfg.index_head_dim,
           "attention.indexer.top_k": cfg.index_topk, "attention.output_group_count": cfg.o_groups,
           "attention.output_lora_rank": cfg.o_lora_rank, "hyper_connection.count": cfg.hc_mult,
           "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
           "hash_layer_count": cfg.mlp_layer_types.count("hash_moe")}
    for name, value in u32.items():
        writer.add_uint32(f"{arch}.{name}", value)
    floats = {"attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "expert_weights_scale": cfg.routed_scaling_factor,
              "rope.freq_base": cfg.rope_parameters["main"]["rope_theta"],
              "attention.compress_rope_freq_base": cfg.compress_rope_theta, "hyper_connection.epsilon": cfg.hc_eps}
    for name, value in floats.items():
        writer.add_float32(f"{arch}.{name}", value)
    writer.add_bool(f"{arch}.expert_weights_norm", True)
    writer.add_array(f"{arch}.attention.compress_ratios", [*ratios, 0][: n + nextn])
    writer.add_array(f"{arch}.swiglu_clamp_exp", [float(cfg.swiglu_limit)] * (n + nextn))
    writer.add_array(f"{arch}.swiglu_clamp_shexp", [float(cfg.swiglu_limit)] * (n + nextn))
    rope = cfg.rope_parameters["compress"]
    if rope.get("rope_type") == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(256)] + [f"<t{i}>" for i in range(VOCAB - 256)])
    writer.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 257)
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
             "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
    for hf, tensor in model.state_dict().items():
        if hf in fixed:
            writer.add_tensor(fixed[hf], tensor.detach().numpy().astype(np.float32))
            continue
        _, _, layer, rest = hf.split(".", 3)
        if rest == "mlp.gate.tid2eid":
            writer.add_tensor(f"blk.{layer}.ffn_gate_tid2eid.weight", tensor.numpy().astype(np.int32))
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if rest == "mlp.experts.gate_up_proj":
            inter = array.shape[1] // 2
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(array[:, :inter]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(array[:, inter:]))
        else:
            writer.add_tensor(f"blk.{layer}.{_HF_TO_GGUF[rest]}", array)
    if mtp and nextn_tensors is not None:
        for name, array in nextn_tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif mtp:
        writer.add_tensor(f"blk.{n}.nextn.eh_proj.weight", np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), np.float32))
        writer.add_tensor(f"blk.{n}.attn_norm.weight", np.ones(cfg.hidden_size, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_yarn_and_gguf_match_transformers(tmp_path: Path) -> None:
    """The compressed layers' YaRN RoPE (transformers' config: a flat ``rope_parameters``, applied
    to the compressed layers only, its cos/sin factor 1) through the saved folder and through a
    llama.cpp-style ``deepseek4`` F32 file: both within 1e-4 of transformers."""
    from helios.loaders.checkpoint import load_checkpoint
    from helios.models.architecture import BuildOptions

    hf_model = tiny_deepseek_v4(**YARN)
    assert hf_model.config.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hf_model.config.rope_parameters["main"]["rope_type"] == "default"
    expected = hf_logits(hf_model, PROMPT)
    plain = hf_logits(tiny_deepseek_v4(), PROMPT)
    assert (plain - expected).abs().max().item() > 0.01  # the scaling matters
    folder = tmp_path / "yarn"
    hf_model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    model = load_ours(folder)
    assert model.config.compress_yarn is not None
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - expected).abs().max().item()
    path = tmp_path / "tiny-v4.gguf"
    _write_gguf(path, hf_model)
    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.architecture.name == "deepseek_v4"
    cfg = checkpoint.config
    assert isinstance(cfg, DeepseekV4Config)
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.hash_layers == (True, True, False, False, False)
    assert (cfg.hca_rate, cfg.swiglu_limit, cfg.compress_yarn is not None) == (8, pytest.approx(0.8), True)
    gguf_model = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    gguf_model.load_weights(checkpoint.weights)
    gguf_diff = (our_logits(gguf_model, DenseAttention.for_model(gguf_model), PROMPT, 0) - expected).abs().max().item()
    print(f"deepseek_v4 yarn fp32: folder {diff:.3g}, GGUF {gguf_diff:.3g}")
    assert diff < FP32_TOLERANCE and gguf_diff < FP32_TOLERANCE
