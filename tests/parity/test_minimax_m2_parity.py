"""Numerical parity of MiniMax-M2 (`helios.models.minimax_m2`) with transformers'
``MiniMaxM2ForCausalLM`` (fp32).

Tiny random seeded models (hidden 64, 4 heads / 2 kv heads of 16, 8 experts, top-2, a random score
correction bias, q/k norms of random weights): partial rotary (``rotary_dim`` 8), and full rotary
with tied embeddings. Saved with ``save_pretrained`` (Mixtral's per-expert ``w1/w2/w3`` names) and
loaded through `load_checkpoint` and the registry: prompt logits, chunked prefill + decode, 32
greedy tokens, the engine's greedy tokens and logprobs, transformers' in-memory (stacked) state
dict, the packed-state round trip, and an int8 build through `runtime.load_model`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.minimax_m2 import config_from_hf, hf_name
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_moe_parity import PROMPT, VOCAB
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              num_local_experts=8, num_experts_per_tok=2)
VARIANTS = {
    "partial": dict(num_hidden_layers=3, rotary_dim=8),
    "full-tied": dict(num_hidden_layers=2, tie_word_embeddings=True),
}


def _tiny_hf_model(variant: str) -> torch.nn.Module:
    model = transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**COMMON, **VARIANTS[variant]))
    torch.manual_seed(100 + sorted(VARIANTS).index(variant))
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
    hf_model = _tiny_hf_model(request.param)
    root = tmp_path_factory.mktemp(f"minimax-{request.param}")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_config(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, MoEForCausalLM)
    cfg, hf_cfg = model.config, hf_model.config
    assert cfg.arch == "minimax_m2" and all(cfg.moe_layers) and cfg.shared_intermediate_size == 0
    assert cfg.rotary == int(hf_cfg.head_dim * hf_cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    assert cfg.router.scoring == "sigmoid" and cfg.router.norm_topk_prob and not cfg.qk_norm_per_head
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    # the q/k norms are over the whole projection: their weights are not per head
    assert hf_model.model.layers[0].self_attn.q_norm.weight.shape == (cfg.q_size,)


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    whole = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 9), (9, 11)] + [(i, i + 1) for i in range(11, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    assert (got - expected).abs().max().item() < FP32_TOLERANCE
    assert (got - whole).abs().max().item() < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, 6:].tolist()
    assert len(expected) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == expected


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through the engine (paged cache, chunked prefill, two requests batched) against
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


def test_transformers_in_memory_state_dict() -> None:
    """transformers 5's state dict (``mlp.gate.weight``, ``mlp.e_score_correction_bias``, stacked
    ``mlp.experts.gate_up_proj`` / ``down_proj``) loads like the checkpoint."""
    hf_model = _tiny_hf_model("partial")
    state = hf_model.state_dict()
    assert "model.layers.0.mlp.e_score_correction_bias" in state
    from helios.models import registry

    arch = registry.for_hf_config(hf_model.config.to_dict())
    model = arch.build(arch.parse_hf_config(hf_model.config.to_dict()), BuildOptions(dtype=torch.float32))
    model.load_weights(state)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    assert diff.item() < FP32_TOLERANCE


def test_packed_state_round_trip(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root)
    state, kinds = model.packed_state()
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    a = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert torch.equal(a, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))


def test_runtime_int8(pair: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """`runtime.load_model` with int8 weights (every expert built by `quant.build_linear`): logits
    near float32's, and the packed-weight cache gives the same model back."""
    from helios.runtime import load_model

    hf_model, root = pair
    loaded = load_model(root, weights="int8", dtype="float32", cache_dir=tmp_path / "packed")
    model = loaded.model
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert ((got - expected).abs().mean() / expected.abs().mean()).item() < 0.1
    again = load_model(root, weights="int8", dtype="float32", cache_dir=tmp_path / "packed").model
    assert torch.equal(got, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))


def test_checkpoint_names_and_refusals() -> None:
    base = "model.layers.3.block_sparse_moe."
    assert hf_name(base + "experts.12.w1.weight") == "model.layers.3.mlp.experts.12.gate_proj.weight"
    assert hf_name(base + "experts.12.w3.weight") == "model.layers.3.mlp.experts.12.up_proj.weight"
    assert hf_name(base + "experts.12.w2.weight") == "model.layers.3.mlp.experts.12.down_proj.weight"
    assert hf_name(base + "gate.weight") == "model.layers.3.mlp.gate.weight"
    assert hf_name(base + "e_score_correction_bias") == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert hf_name("model.layers.0.mlp.e_score_correction_bias") == "model.layers.0.mlp.gate.e_score_correction_bias"
    # the original release's config.json keys
    release = dict(COMMON, num_hidden_layers=2, model_type="minimax_m2", rotary_dim=8, rope_theta=5000000,
                   qk_norm_type="per_layer", use_qk_norm=True, scoring_func="sigmoid", use_routing_bias=True,
                   shared_intermediate_size=0)
    cfg = config_from_hf(release)
    assert isinstance(cfg, MoEConfig) and cfg.rotary == 8 and cfg.rope_theta == 5e6 and cfg.router.num_experts == 8
    for bad in (dict(qk_norm_type="per_head"), dict(shared_intermediate_size=64), dict(scoring_func="softmax")):
        with pytest.raises(NotImplementedError):
            config_from_hf({**release, **bad})


def test_router_matches_transformers_in_bfloat16() -> None:
    """The router on bfloat16 activations: logits in bfloat16 (the weight kept in it), sigmoid and
    choice in float32, as ``MiniMaxM2TopKRouter`` computes them: the same experts and weights."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    from helios.models.moe import route

    cfg = config_from_hf(dict(COMMON, num_hidden_layers=1, num_local_experts=16, num_experts_per_tok=4))
    assert not cfg.router.router_fp32
    hf_router = MiniMaxM2TopKRouter(transformers.MiniMaxM2Config(**dict(COMMON, num_hidden_layers=1,
                                                                        num_local_experts=16,
                                                                        num_experts_per_tok=4)))
    torch.manual_seed(7)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn_like(hf_router.weight))
    hf_router = hf_router.to(torch.bfloat16)
    bias = 0.1 * torch.randn(16)
    x = torch.randn(40, 64).to(torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_ids = hf_router(x, bias)
        weights, ids = route(torch.nn.functional.linear(x, hf_router.weight), cfg.router, bias)
    assert torch.equal(ids.sort(dim=-1).values, want_ids.sort(dim=-1).values)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(weights.gather(1, order), want_w.gather(1, want_order))


def test_bfloat16_runs_close(pair: tuple[torch.nn.Module, Path]) -> None:
    """bfloat16 activations and weights (the router's too): the logits near float32's."""
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    assert isinstance(model, MoEForCausalLM)
    assert model._decoder_layers()[0].router.dtype == torch.bfloat16  # type: ignore[union-attr]
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert got.dtype == torch.float32
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()
