"""Numerical parity of DeepSeek-V3.2 (`helios.models.deepseek_v32`: DeepSeek-V3's MLA with the DSA
indexer's top-k key selection) with transformers' ``DeepseekV32ForCausalLM`` (fp32).

Tiny random seeded models (hidden 64, 4 heads, 8 experts, top-2, a dense leading layer; the
indexer: 4 heads of 16, 8 of them rotary) with ``index_topk`` 7, well under the 24-token prompt,
so that most queries attend to a strict subset of their context:

- ``plain``: no rope scaling, cache rows of 24 + 8 + 16 = 48 elements;
- ``yarn``: YaRN rope scaling (``mscale`` and ``mscale_all_dim``: the cos/sin factor, which the
  indexer's RoPE takes too, and the softmax scale), rows of 16 + 16 + 16.

Saved with ``save_pretrained`` and loaded through `load_checkpoint` and the registry: prompt
logits (and that the selection changes them: the same model with a top-k past the prompt gives
other logits), chunked prefill and one-token decode in `DenseAttention`, 32 greedy tokens, and
through the engine (the paged cache with the indexer keys in the latent rows, pages of 4,
prefill chunks of 5, two requests batched, a prefix-cache hit) the greedy tokens and logprobs
against transformers' logits of each whole sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.interface import LatentAttentionSpec, SparseIndex
from helios.models.latent_attention import sparse_selection
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v32", allow_module_level=True)

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 180, 77, 23, 260, 150, 48, 2, 111, 66]
TOP_K = 7
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
              q_lora_rank=32, index_topk=TOP_K, index_head_dim=16, index_n_heads=16, pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
VARIANTS = {
    "plain": dict(kv_lora_rank=24, qk_rope_head_dim=8, n_group=4, topk_group=2, n_shared_experts=1,
                  routed_scaling_factor=2.5),
    "yarn": dict(kv_lora_rank=16, qk_rope_head_dim=16, n_group=2, topk_group=1, n_shared_experts=1,
                 routed_scaling_factor=2.5,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, mscale=0.9, mscale_all_dim=0.7,
                                      original_max_position_embeddings=64, beta_fast=32, beta_slow=1)),
}


def _tiny_hf_model(variant: str, **overrides: int) -> torch.nn.Module:
    model = transformers.DeepseekV32ForCausalLM(
        transformers.DeepseekV32Config(**{**COMMON, **VARIANTS[variant], **overrides}))
    torch.manual_seed(sorted(VARIANTS).index(variant))
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


def _save(model: torch.nn.Module, root: Path) -> Path:
    model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return root


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model(request.param)
    return hf_model, _save(hf_model, tmp_path_factory.mktemp(f"deepseek-v32-{request.param}"))


def test_config(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, DeepseekV32ForCausalLM)
    cfg, hf_cfg = model.config, hf_model.config
    assert isinstance(cfg, DeepseekV32Config) and cfg.arch == "deepseek_v32" and cfg.rope_interleave
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (16, 16, TOP_K)
    row = hf_cfg.kv_lora_rank + hf_cfg.qk_rope_head_dim + hf_cfg.index_head_dim
    assert model.cache_specs() == (LatentAttentionSpec(row),) * 3
    assert model._decoder_layers()[0].scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert model.rope_factor == pytest.approx(hf_model.model.rotary_emb.attention_scaling, rel=1e-12)


def test_prompt_logits(pair: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """Logits of the 24-token prompt; with a top-k past the prompt (dense attention) both sides
    agree again and differ from the sparse ones, so the selection is what is being compared."""
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE
    dense_hf = _tiny_hf_model(root.name.split("-")[-1].rstrip("0123456789"), index_topk=64)
    dense = load_ours(_save(dense_hf, tmp_path / "dense"))
    dense_expected = hf_logits(dense_hf, PROMPT)
    assert (our_logits(dense, DenseAttention.for_model(dense), PROMPT, 0) - dense_expected).abs().max() < FP32_TOLERANCE
    # no query sees more than top_k keys yet: the same attention
    assert (dense_expected[:TOP_K] - expected[:TOP_K]).abs().max().item() < FP32_TOLERANCE
    assert (dense_expected[TOP_K:] - expected[TOP_K:]).abs().max().item() > 0.1


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    """Prefill chunks, then one-token steps, each selecting over the cached indexer keys: every
    position's logits are transformers' of the whole prompt."""
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 9), (9, 11), (11, 18)] + [(i, i + 1) for i in range(18, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    diff = (got - expected).abs().max().item()
    print(f"{root.name} chunked + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, 6:].tolist()
    assert len(expected) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == expected


def test_packed_state_round_trip(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root)
    state, kinds = model.packed_state()
    assert "layers.0.index_weights" in state and "layers.0.index_norm_bias" in state
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    a = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert torch.equal(a, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))


def test_sparse_selection() -> None:
    """The selection against a direct computation: the top-k causal keys by index score, every
    causal key while there are at most k; equal scores go to the earlier key."""
    torch.manual_seed(3)
    heads, dim, length, k = 16, 8, 20, 5
    q, keys, weights = torch.randn(length, heads, dim), torch.randn(length, dim), torch.randn(length, heads)
    mask = sparse_selection(SparseIndex(q, weights, k), keys, 0)
    for p in range(length):
        scores = torch.stack([(weights[p] * torch.relu(q[p] @ keys[j] * dim ** -0.5)).sum() for j in range(p + 1)])
        chosen = set(scores.topk(min(k, p + 1)).indices.tolist())
        assert set(mask[p].nonzero()[:, 0].tolist()) == chosen, p
    tail = sparse_selection(SparseIndex(q[12:], weights[12:], k), keys, 12)
    assert torch.equal(tail, mask[12:])
    # every key scored 0 (all ReLUs zero): the first k
    ties = sparse_selection(SparseIndex(q[:1].expand(3, -1, -1), weights[:3], k), torch.zeros(length, dim), 17)
    assert ties.nonzero()[:, 1].view(3, k).tolist() == [list(range(k))] * 3


@pytest.mark.parametrize("decode_kernel", [None, False])
def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path], decode_kernel: bool | None) -> None:
    """Through the engine (pages of 4 rows with the indexer keys in them, prefill chunks of 5
    tokens, two requests batched) against transformers' logits of each whole sequence (32
    greedy tokens, the first request's equal to transformers' generate); then the first prompt
    again, served from the prefix cache, gives the same tokens and logprobs."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    model = load_ours(root)
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=5,
                                          max_model_len=96), torch.float32)
    if decode_kernel is False:
        backend = core.runner.backend
        backend.group_kernels = [(False, False)] * len(backend.group_kernels)
        backend.decode_kernel = False
    num_tokens = 32 if decode_kernel is None else 12

    def request(rid: str, prompt: list[int]) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=num_tokens,
                             ignore_eos=True, num_top_logprobs=1)

    prompts = [PROMPT, PROMPT[3:15]]
    outs = run(core, [request(f"r{i}", p) for i, p in enumerate(prompts)])
    again = run(core, [request("again", PROMPT)])["again"]
    assert sum(o.num_cached_tokens for o in again) >= 16  # whole pages of the first prompt
    results = {**{f"r{i}": (p, outs[f"r{i}"]) for i, p in enumerate(prompts)}, "again": (PROMPT, again)}
    worst = 0.0
    for rid, (prompt, request_outs) in results.items():
        tokens = [t for o in request_outs for t in o.new_token_ids]
        logprobs = [lp for o in request_outs for lp in (o.logprobs or ())]
        assert len(tokens) == num_tokens
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert t == int(row.argmax()), (rid, j)
            worst = max(worst, abs(lp.logprob - float(row[t])))
        if rid == "r0" and num_tokens == 32:
            with torch.no_grad():
                expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                             do_sample=False)[0, len(prompt):].tolist()
            assert tokens == expected
    first = [lp.logprob for o in outs["r0"] for lp in (o.logprobs or ())]
    cached = [lp.logprob for o in again for lp in (o.logprobs or ())]
    print(f"{root.name} engine (decode_kernel={decode_kernel}): max abs logprob diff {worst:.3g}, "
          f"cache hit vs one pass {max(abs(a - b) for a, b in zip(first, cached, strict=True)):.3g}")
    assert worst < 1e-4
    assert max(abs(a - b) for a, b in zip(first, cached, strict=True)) < 1e-5


def test_registry_and_refusals() -> None:
    from helios.models import registry
    from helios.models.deepseek_v32 import config_from_hf

    base = {**COMMON, **VARIANTS["plain"], "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}
    assert registry.for_hf_config({"model_type": "deepseek_v32"}).name == "deepseek_v32"
    assert registry.for_hf_config({"architectures": ["DeepseekV32ForCausalLM"]}).name == "deepseek_v32"
    cfg = config_from_hf({**base, "mlp_layer_types": ["dense", "dense", "sparse"]})
    assert list(cfg.moe_layers) == [False, False, True]
    with pytest.raises(ValueError, match="q_lora_rank"):
        config_from_hf({**base, "q_lora_rank": None})
    with pytest.raises(NotImplementedError, match="quantization_config"):
        config_from_hf({**base, "quantization_config": {"quant_method": "fp8"}})


def test_recipe_from_the_template() -> None:
    """DeepSeek-V3.2's chat template (DSML markup, not V4's tool_calls): `plain` with the
    ``deepseek_v3_2`` parser family."""
    from helios.recipes.detect import detect_parser_family, detect_recipe
    from tests.shared_fixtures import shared_fixtures

    fixtures = shared_fixtures("chat_templates")
    if fixtures is None or not (fixtures / "deepseek_v3_2.jinja").exists():
        pytest.skip("no deepseek_v3_2 chat template fixture")
    template = (fixtures / "deepseek_v3_2.jinja").read_text()
    assert detect_recipe("deepseek-ai/DeepSeek-V3.2", "deepseek_v32", template) == "plain"
    assert detect_parser_family(template) == "deepseek_v3_2"


def test_bfloat16_engine_runs_close(pair: tuple[torch.nn.Module, Path]) -> None:
    """bfloat16 weights, activations and cache rows (the indexer keys rounded with them) through
    the engine: most logprobs near transformers' float32 ones (a near-tie in the selection or the
    routing may move a position)."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=32, max_active=2, prefill_chunk_size=8,
                                          max_model_len=64), torch.bfloat16)
    outs = run(core, [EngineRequest("r", tuple(PROMPT), SamplingParams(temperature=0.0), max_tokens=6,
                                    ignore_eos=True, num_top_logprobs=1)])["r"]
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp.logprob for o in outs for lp in (o.logprobs or ())]
    ref = torch.log_softmax(hf_logits(hf_model, [*PROMPT, *tokens]).double(), dim=-1)
    errors = [abs(lp - float(ref[len(PROMPT) - 1 + j, t])) for j, (t, lp) in enumerate(zip(tokens, logprobs,
                                                                                          strict=True))]
    print(f"{root.name} bf16 engine: logprob errors {[round(e, 3) for e in errors]}")
    assert sorted(errors)[len(errors) // 2] < 0.1 and sum(e > 0.25 for e in errors) <= 1


GGUF_INDEXER_NAMES = {"self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
                      "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
                      "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
                      "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
                      "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight"}


def write_dsa_gguf(path: Path, hf_model: torch.nn.Module, arch: str, types: list[bool] | None = None) -> None:
    """``hf_model`` as llama.cpp's DeepseekV32 / GlmMoeDsa converters write it: ``deepseek2``'s
    layout (`test_deepseek_v3_parity._write_gguf`), the indexer's metadata (and ``types``, true
    per layer with an indexer of its own) and tensors."""
    from tests.parity.test_deepseek_v3_parity import _write_gguf

    cfg = hf_model.config
    metadata: dict[str, int | list[bool]] = {"attention.indexer.head_count": cfg.index_n_heads,
                                             "attention.indexer.key_length": cfg.index_head_dim,
                                             "attention.indexer.top_k": cfg.index_topk}
    if types is not None:
        metadata["attention.indexer.types"] = types
    _write_gguf(path, hf_model, True, arch=arch, extra_names=GGUF_INDEXER_NAMES, extra_metadata=metadata)


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    """A llama.cpp-style ``deepseek32`` F32 file (``deepseek2``'s layout, the indexer's metadata
    and ``blk.N.indexer.*`` tensors, an appended next-token-prediction block) against transformers."""
    hf_model = _tiny_hf_model("plain")
    path = tmp_path / "tiny-v32.gguf"
    write_dsa_gguf(path, hf_model, "deepseek32")
    checkpoint = load_checkpoint(path, torch.float32)
    assert isinstance(checkpoint.config, DeepseekV32Config) and checkpoint.config.index_topk == TOP_K
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.weights)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    print(f"tiny deepseek32 GGUF fp32: max abs logit diff {diff.item():.3g}")
    assert diff.item() < FP32_TOLERANCE


@pytest.mark.parametrize("verify_as_decode", [True, False])
def test_speculative_verification_is_exact(pair: tuple[torch.nn.Module, Path], verify_as_decode: bool) -> None:
    """n-gram drafts over repetitive prompts, verified as decode tokens (each position selecting
    over its own context) or as small prefill chunks: the tokens plain greedy decoding gives."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from helios.engine.speculative import SpeculativeConfig
    from tests.unit.test_engine import run

    _, root = pair
    model = load_ours(root)
    prompts = [[5, 6, 7, 8, 9, 10] * 3, [40, 41, 42] * 5]
    results = {}
    for mode in ("off", "ngram"):
        core = EngineCore(model, EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=32,
                                              max_model_len=96, speculative=SpeculativeConfig(mode=mode)),
                          torch.float32)
        core.runner.batch.verify_as_decode = verify_as_decode
        outs = run(core, [EngineRequest(f"s{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=16,
                                        ignore_eos=True) for i, p in enumerate(prompts)])
        results[mode] = {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
        if mode == "ngram":
            stats = core.stats().speculative
            assert stats is not None and stats.verify_steps > 0
    assert results["ngram"] == results["off"]
