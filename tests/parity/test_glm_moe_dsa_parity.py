"""Numerical parity of GLM-5 (transformers' ``glm_moe_dsa``: DeepSeek-V3.2's DSA with the
indexer's RoPE interleaved and layers that share the previous layer's top-k) with transformers
(fp32), on `helios.models.deepseek_v32`.

Tiny random seeded models as in tests/parity/test_deepseek_v32_parity.py (``index_topk`` 7 under
the 24-token prompt), four layers:

- ``full``: every layer with its own indexer (transformers' default schedule);
- ``shared``: ``indexer_types`` full, shared, full, shared: the shared layers keep latent rows
  without indexer keys (a second cache group in the engine) and attend to the keys the layer
  before selected.

Prompt logits, chunked prefill and decode in `DenseAttention`, 32 greedy tokens, and the engine
(paged, chunked, batched, a prefix-cache hit) against transformers' logits of each sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.models.deepseek_v32 import DeepseekV32ForCausalLM
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.interface import LatentAttentionSpec
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_deepseek_v32_parity import (
    PROMPT,
    TOP_K,
    _save,
    write_dsa_gguf,
)
from tests.parity.tiny import hf_logits, load_ours, our_logits

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
    pytest.skip("this transformers has no glm_moe_dsa", allow_module_level=True)

COMMON = dict(vocab_size=272, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=512,
              q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8, index_topk=TOP_K, index_head_dim=16,
              index_n_heads=16, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {"full": {}, "shared": dict(indexer_types=["full", "shared", "full", "shared"])}


def _tiny(variant: str) -> torch.nn.Module:
    model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**COMMON, **VARIANTS[variant]))
    torch.manual_seed(11 + sorted(VARIANTS).index(variant))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny(request.param)
    return hf_model, _save(hf_model, tmp_path_factory.mktemp(f"glm-dsa-{request.param}"))


def test_config_and_specs(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, DeepseekV32ForCausalLM)
    cfg = model.config
    assert cfg.arch == "glm_moe_dsa" and cfg.index_rope_interleave
    shared = [kind == "shared" for kind in hf_model.config.indexer_types]
    assert [cfg.shares_index(i) for i in range(4)] == shared
    assert model.cache_specs() == tuple(LatentAttentionSpec(32 if s else 48) for s in shared)


def test_prompt_chunked_and_greedy(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    whole = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 9), (9, 11), (11, 18)] + [(i, i + 1) for i in range(18, len(PROMPT))]
    chunked = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    diffs = (whole - expected).abs().max().item(), (chunked - expected).abs().max().item()
    print(f"{root.name} fp32: max abs logit diff {diffs[0]:.3g} one pass, {diffs[1]:.3g} chunked + decode")
    assert expected.abs().max().item() > 1.0 and max(diffs) < FP32_TOLERANCE
    with torch.no_grad():
        greedy = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                   do_sample=False)[0, 6:].tolist()
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == greedy


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    model = load_ours(root)
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=5,
                                          max_model_len=96), torch.float32)

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=16, ignore_eos=True,
                             num_top_logprobs=1)

    prompts = [PROMPT, PROMPT[3:15]]
    outs = run(core, [request(f"r{i}", p) for i, p in enumerate(prompts)])
    again = run(core, [request("again", PROMPT)])["again"]
    assert sum(o.num_cached_tokens for o in again) >= 16
    worst = 0.0
    for prompt, request_outs in ((PROMPT, outs["r0"]), (PROMPT[3:15], outs["r1"]), (PROMPT, again)):
        tokens = [t for o in request_outs for t in o.new_token_ids]
        logprobs = [lp.logprob for o in request_outs for lp in (o.logprobs or ())]
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            assert t == int(ref[len(prompt) - 1 + j].argmax()), j
            worst = max(worst, abs(lp - float(ref[len(prompt) - 1 + j, t])))
    print(f"{root.name} engine: max abs logprob diff {worst:.3g}")
    assert worst < 1e-4


def test_registry_and_schedules() -> None:
    from helios.models import registry
    from helios.models.deepseek_v32 import glm_config_from_hf

    assert registry.for_hf_config({"model_type": "glm_moe_dsa"}).name == "glm_moe_dsa"
    base = dict(COMMON, num_hidden_layers=6)
    assert glm_config_from_hf(base).index_shared == ()
    cfg = glm_config_from_hf({**base, "index_topk_freq": 2, "index_skip_topk_offset": 2})
    hf = transformers.GlmMoeDsaConfig(**base, index_topk_freq=2, index_skip_topk_offset=2)
    assert [cfg.shares_index(i) for i in range(6)] == [kind == "shared" for kind in hf.indexer_types]
    assert glm_config_from_hf({**base, "index_topk_pattern": "FSSFSS"}).index_shared == (
        False, True, True, False, True, True)
    with pytest.raises(ValueError, match="first layer"):
        glm_config_from_hf({**base, "index_topk_pattern": "SFFFFF"})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gguf_matches_transformers(tmp_path: Path, variant: str) -> None:
    """llama.cpp-style ``glm-dsa`` F32 files (``deepseek32``'s layout, ``attention.indexer.types``
    where the model has shared layers, as the converter writes it from ``indexer_types``)."""
    from helios.loaders.checkpoint import load_checkpoint
    from helios.models.architecture import BuildOptions

    hf_model = _tiny(variant)
    path = tmp_path / f"tiny-glm-dsa-{variant}.gguf"
    types = [kind == "full" for kind in hf_model.config.indexer_types]
    write_dsa_gguf(path, hf_model, "glm-dsa", types if variant == "shared" else None)
    checkpoint = load_checkpoint(path, torch.float32)
    cfg = checkpoint.config
    assert cfg.arch == "glm_moe_dsa" and [cfg.shares_index(i) for i in range(4)] == [not t for t in types]
    model = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.weights)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    print(f"tiny glm-dsa {variant} GGUF fp32: max abs logit diff {diff.item():.3g}")
    assert diff.item() < FP32_TOLERANCE
