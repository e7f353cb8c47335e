"""Numerical parity of `Gemma4ForCausalLM` with transformers' ``Gemma4ForCausalLM`` (fp32).

Tiny random Gemma 4 text models (hidden 64, 4 layers: sliding, full, sliding, full; window 8; the
full layers with their own head dim and proportional RoPE), saved with ``save_pretrained`` and loaded
through `load_checkpoint` and the registry:

- ``ple``: per-layer embeddings, KV sharing (the last two layers reuse layers 0 and 1), double-wide
  MLPs on the sharing layers, a final logit soft cap, tied embeddings;
- ``moe``: the MoE block beside every dense MLP, attention_k_eq_v with one global kv head, an untied
  head.

Logits of a whole prompt longer than the window, chunked prefill plus decode steps through
`DenseAttention` (each layer's window and K/V shape), greedy generation of 32 tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models import registry
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.gemma4 import Gemma4Config, Gemma4ForCausalLM, kv_sources
from helios.models.interface import FullAttentionSpec, SlidingWindowSpec
from helios.models.quant import WeightFormat
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
WINDOW = 8
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 180, 77, 23, 160, 2]  # 20 > WINDOW
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _hf_config(variant: str) -> object:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                  pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if variant == "ple":
        return transformers.Gemma4TextConfig(
            **common, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
            use_double_wide_mlp=True, final_logit_softcapping=6.0)
    return transformers.Gemma4TextConfig(
        **common, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 1e5, "factor": 2.0}})


def _tiny_hf_model(variant: str, config: Any = None) -> torch.nn.Module:
    model = transformers.Gemma4ForCausalLM(config or _hf_config(variant))
    torch.manual_seed(0 if variant == "ple" else 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):  # w itself multiplies: weights near 1
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand_like(b))
    return model.eval()


@pytest.fixture(scope="module", params=["ple", "moe"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model(request.param)
    root = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root, ("<eos>", "<bos>", "<end_of_turn>"))
    return hf_model, root


def test_config_and_cache_specs(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    assert isinstance(model, Gemma4ForCausalLM)
    cfg, hf_cfg = model.config, hf_model.config
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf_cfg.layer_types)
    modes = hf_cfg.kv_sharing_modes
    assert [src is not None for src in (cfg.kv_source or (None,) * cfg.num_layers)] == [m == "reuse" for m in modes]
    specs = model.cache_specs()
    for i, spec in enumerate(specs):
        layer = hf_model.model.layers[i].self_attn
        assert isinstance(spec, SlidingWindowSpec if cfg.sliding_layers[i] else FullAttentionSpec)
        assert spec.head_dim == layer.head_dim
        assert spec.num_kv_heads == hf_cfg.num_attention_heads // layer.num_key_value_groups
    assert all(s.window == WINDOW for s in specs if isinstance(s, SlidingWindowSpec))


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} prompt fp32: max abs logit diff {diff:.6g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_window_matters(pair: tuple[torch.nn.Module, Path]) -> None:
    """Without the windows the last logits differ: the test prompt exercises them."""
    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    specs = model.cache_specs()
    cfg = model.config
    full = DenseAttention(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          kv_shapes=[(s.num_kv_heads, s.head_dim) for s in specs])  # type: ignore[union-attr]
    windowless = our_logits(model, full, PROMPT, 0)
    assert (windowless[-1] - hf_logits(hf_model, PROMPT)[-1]).abs().max().item() > 1e-2


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)  # the K/V buffers grow
    chunks = [(0, 3), (3, 12), (12, 15)] + [(i, i + 1) for i in range(15, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    assert attn.num_tokens == len(PROMPT)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} chunked prefill + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    whole = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert (got - whole).abs().max().item() < FP32_TOLERANCE  # float32 rounding of other SDPA paths only


def test_greedy_generation(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    assert isinstance(model, Gemma4ForCausalLM)
    prompt = PROMPT[:10]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_generate(model, prompt, max_new_tokens=32) == expected


def test_keep_rows(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root, architecture="gemma4")
    everything = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    keep = torch.tensor([len(PROMPT) - 1, 2])
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model), keep=keep)
        kept = model.compute_logits(hidden)
    assert torch.allclose(kept, everything[keep], atol=1e-5, rtol=0)


def test_packed_state_round_trip(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root, architecture="gemma4")
    state, kinds = model.packed_state()
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    a = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    b = our_logits(again, DenseAttention.for_model(again), PROMPT, 0)
    assert torch.equal(a, b)


def test_shared_layers_ignore_unused_kv_weights(pair: tuple[torch.nn.Module, Path]) -> None:
    """Checkpoints may carry k/v projections for the KV-sharing layers: ignored, as transformers does."""
    _, root = pair
    model = load_ours(root, architecture="gemma4")
    cfg = model.config
    assert isinstance(cfg, Gemma4Config)
    if not cfg.kv_source:
        pytest.skip("no KV sharing in this variant")
    tensors = dict(safetensors.torch.load_file(root / "model.safetensors"))
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    tensors["model.layers.3.self_attn.k_norm.weight"] = torch.zeros(cfg.global_head_dim)
    again = Gemma4ForCausalLM(cfg)
    again.load_weights(tensors)
    assert torch.equal(our_logits(model, DenseAttention.for_model(model), PROMPT, 0),
                       our_logits(again, DenseAttention.for_model(again), PROMPT, 0))


def test_bfloat16_runs_close(pair: tuple[torch.nn.Module, Path]) -> None:
    """bfloat16 weights and activations: logits about as far from float32's as transformers' own
    bfloat16 run is (rounding noise is CPU-dependent, and a routing flip near a tie may move a
    token's logits more than rounding alone: a factor-2 margin on the mean error)."""
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    expected = hf_logits(hf_model, PROMPT)
    hf_bf16 = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert got.dtype == torch.float32
    ours, theirs = (got - expected).abs().mean().item(), (hf_bf16 - expected).abs().mean().item()
    print(f"{root.name} bfloat16: mean abs logit error {ours:.3g} (transformers bfloat16: {theirs:.3g})")
    assert ours < 2 * theirs + 1e-3
    assert ours < 0.05 * expected.abs().max().item()


def test_int8_weight_format(pair: tuple[torch.nn.Module, Path]) -> None:
    """The per-layer projections (q alone, q/k, q/k/v; MLPs of two widths) in a quantized format:
    they run, pack for the CPU and survive a packed-state round trip."""
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.float32)
    options = BuildOptions(dtype=torch.float32, weights=WeightFormat(kind="int8"))
    model = checkpoint.architecture.build(checkpoint.config, options)
    model.load_weights(checkpoint.tensors)
    model.pack_cpu_weights()
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    expected = hf_logits(hf_model, PROMPT)
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()
    state, kinds = model.packed_state()
    assert set(kinds.values()) == {"int8:0"}
    again = checkpoint.architecture.build(checkpoint.config, options)
    again.load_packed_state(state, kinds)
    assert torch.equal(got, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
    assert 0 < model.decode_weight_bytes()


# -- config parsing ----------------------------------------------------------------------------------


def test_hf_config_forms() -> None:
    base = {"model_type": "gemma4_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "sliding_window": 8, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "hidden_size_per_layer_input": 0}
    cfg = Gemma4Config.from_hf_config(base)
    assert cfg.sliding_layers == (True,) * 5 + (False,)  # the default pattern (every 6th layer global)
    assert (cfg.global_head_dim, cfg.global_kv_heads, cfg.kv_source) == (32, 1, ())
    forced = Gemma4Config.from_hf_config({**base, "layer_types": ["sliding_attention"] * 6})
    assert forced.sliding_layers == (True,) * 5 + (False,)  # the last layer is forced global
    assert Gemma4Config.from_hf_config({**base, "attention_k_eq_v": False}).global_kv_heads == 2
    base = {**base, "layer_types": ["sliding_attention", "full_attention"] * 3, "num_kv_shared_layers": 2}
    cfg = Gemma4Config.from_hf_config(base)
    assert cfg.kv_source == (None, None, None, None, 2, 3)
    assert registry.for_hf_config(base).name == "gemma4"
    # transformers 5.24's saved form of the same shapes
    saved = {**base, "per_layer_config": {str(i): {"head_dim": 32, "num_key_value_heads": 1} for i in (1, 3, 5)}}
    del saved["global_head_dim"], saved["num_global_key_value_heads"]
    assert Gemma4Config.from_hf_config(saved) == cfg
    wrapped = {"model_type": "gemma4", "architectures": ["Gemma4ForCausalLM"], "text_config": base}
    assert registry.for_hf_config(wrapped).parse_hf_config(wrapped) == cfg
    with pytest.raises(NotImplementedError, match="bidirectional"):
        Gemma4Config.from_hf_config({**base, "use_bidirectional_attention": "all"})
    with pytest.raises(NotImplementedError, match="rope_type"):
        Gemma4Config.from_hf_config({**base, "rope_parameters": {"full_attention": {"rope_type": "yarn"}}})
    with pytest.raises(NotImplementedError, match="per_layer_config"):
        Gemma4Config.from_hf_config({**saved, "per_layer_config": {"5": {"intermediate_size": 8}}})


def test_kv_sources_match_transformers() -> None:
    for types, shared in ((["sliding_attention", "full_attention"] * 3, 3), (LAYER_TYPES, 2), (LAYER_TYPES, 0),
                          (["sliding_attention", "sliding_attention", "full_attention"] * 3, 4)):
        hf = transformers.Gemma4TextConfig(num_hidden_layers=len(types), layer_types=list(types),
                                           num_kv_shared_layers=shared)
        modes = hf.kv_sharing_modes
        ours = kv_sources([t == "sliding_attention" for t in types], shared) or (None,) * len(types)
        assert [src is not None for src in ours] == [m == "reuse" for m in modes]
        for i, src in enumerate(ours):
            if src is not None:
                assert modes[src] == "store" and types[src] == types[i]


# -- the engine (paged cache, chunked prefill, a batch of requests) --------------------------------------


def test_engine_greedy_matches_transformers(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through `EngineCore`: the per-layer K/V shapes and windows on the paged cache, prefill chunks
    of 5 (pages of 4) and batched decode; 32 greedy tokens per request as transformers generates them."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest

    hf_model, root = pair
    model = load_ours(root, architecture="gemma4")
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=96, max_active=4, prefill_chunk_size=5,
                                          max_model_len=128), torch.float32, "cpu")
    prompts = [PROMPT, PROMPT[:11], PROMPT[5:]]
    reqs = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=32, ignore_eos=True)
            for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(500):
        if not core.scheduler.has_work:
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not core.scheduler.has_work
    for req, prompt in zip(reqs, prompts, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens[req.request_id] == expected, req.request_id
