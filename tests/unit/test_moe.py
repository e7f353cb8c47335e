"""The MoE block (`helios.models.moe`): routing against transformers' routers (ties, groups, the
correction bias, renormalisation, the scaling factor), the expert grouping against a per-token
loop, and a layer's feed-forward with Qwen2-MoE's gated shared expert against transformers'
``Qwen2MoeSparseMoeBlock``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from helios.models.moe import RouterSpec, expert_mix, route
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM
from helios.models.quant import DenseLinear

transformers = pytest.importorskip("transformers")
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

HIDDEN = 16


def _qwen_router(weight: Tensor, top_k: int, norm: bool) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=weight.shape[0], num_experts_per_tok=top_k,
                                      norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


def _glm_router(weight: Tensor, bias: Tensor, spec: RouterSpec) -> torch.nn.Module:
    cfg = transformers.Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=spec.num_experts,
                                     num_experts_per_tok=spec.top_k, n_group=spec.n_group, topk_group=spec.topk_group,
                                     norm_topk_prob=spec.norm_topk_prob,
                                     routed_scaling_factor=spec.routed_scaling_factor)
    router = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    return router


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_routing_is_transformers(norm: bool) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(40, HIDDEN), torch.randn(8, HIDDEN)
    _, ref_weights, ref_ids = _qwen_router(weight, 2, norm)(x)
    weights, ids = route(x @ weight.T, RouterSpec(num_experts=8, top_k=2, norm_topk_prob=norm))
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights)
    sums = weights.sum(-1)
    if norm:
        assert torch.allclose(sums, torch.ones(40))
    else:
        assert (sums < 1).all()


def test_softmax_ties_break_as_transformers() -> None:
    """Equal logits (rows of zeros, and pairs of duplicated router rows) choose the experts
    transformers chooses."""
    torch.manual_seed(1)
    weight = torch.randn(8, HIDDEN)
    weight[5] = weight[2]
    weight[7] = weight[2]
    x = torch.randn(12, HIDDEN)
    x[:4] = 0.0  # every logit 0: an 8-way tie
    _, ref_weights, ref_ids = _qwen_router(weight, 2, True)(x)
    weights, ids = route(x @ weight.T, RouterSpec(num_experts=8, top_k=2, norm_topk_prob=True))
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert torch.equal(weights[:4], torch.full((4, 2), 0.5))


@pytest.mark.parametrize(("n_group", "topk_group", "norm", "scale"), [(1, 1, True, 1.0), (4, 2, True, 2.5),
                                                                      (4, 1, False, 1.0), (2, 1, True, 1.8)])
def test_sigmoid_routing_is_transformers(n_group: int, topk_group: int, norm: bool, scale: float) -> None:
    torch.manual_seed(2)
    x, weight, bias = torch.randn(64, HIDDEN), torch.randn(8, HIDDEN), 0.3 * torch.randn(8)
    spec = RouterSpec(num_experts=8, top_k=2, scoring="sigmoid", norm_topk_prob=norm, n_group=n_group,
                      topk_group=topk_group, routed_scaling_factor=scale)
    _, ref_weights, ref_ids = _glm_router(weight, bias, spec)(x)
    weights, ids = route(x @ weight.T, spec, bias)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert weights.dtype == torch.float32
    if norm:
        assert torch.allclose(weights.sum(-1), torch.full((64,), scale))


def test_groups_exclude_the_best_single_expert() -> None:
    """Groups of 4: the top expert (0.9) is in the group whose two best sum lower; with one group
    allowed it is not chosen."""
    logits = torch.logit(torch.tensor([[0.9, 0.1, 0.1, 0.1, 0.8, 0.7, 0.1, 0.1]]))
    grouped = RouterSpec(num_experts=8, top_k=2, scoring="sigmoid", n_group=2, topk_group=1)
    _, ids = route(logits, grouped)
    assert sorted(ids[0].tolist()) == [4, 5]
    _, ids = route(logits, RouterSpec(num_experts=8, top_k=2, scoring="sigmoid"))
    assert sorted(ids[0].tolist()) == [0, 4]


def test_correction_bias_moves_selection_not_weights() -> None:
    logits = torch.logit(torch.tensor([[0.9, 0.8, 0.2, 0.1]]))
    spec = RouterSpec(num_experts=4, top_k=2, scoring="sigmoid", norm_topk_prob=False)
    weights, ids = route(logits, spec)
    assert sorted(ids[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    weights, ids = route(logits, spec, bias)
    chosen = sorted(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert [e for e, _ in chosen] == [0, 2]
    assert chosen[0][1] == pytest.approx(0.9) and chosen[1][1] == pytest.approx(0.2)  # unbiased scores


def test_router_spec_checks() -> None:
    with pytest.raises(ValueError, match="top_k"):
        RouterSpec(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="n_group"):
        RouterSpec(num_experts=6, top_k=2, n_group=4)
    with pytest.raises(ValueError, match="topk_group"):
        RouterSpec(num_experts=8, top_k=2, n_group=2, topk_group=3)


def test_expert_mix_is_the_per_token_sum() -> None:
    torch.manual_seed(3)
    experts, inter, tokens, k = 6, 8, 20, 3
    gate_up, down = torch.randn(experts, 2 * inter, HIDDEN), torch.randn(experts, HIDDEN, inter)
    x = torch.randn(tokens, HIDDEN)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    ids[:, 0] = 4  # a popular expert; expert 5 may get none
    ids[ids == 5] = 1 if not (ids == 1).all() else 2
    weights = torch.rand(tokens, k)
    got = expert_mix(x, weights, ids, gate_up, down)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            gu = gate_up[e] @ x[t]
            want[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert expert_mix(x[:0], weights[:0], ids[:0], gate_up, down).shape == (0, HIDDEN)


def test_gated_shared_expert_is_qwen2_moe() -> None:
    """An MoE layer with Qwen2-MoE's shared expert and its sigmoid gate (``shared_expert_gate``)."""
    torch.manual_seed(4)
    hf_cfg = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                         norm_topk_prob=False)
    block = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    cfg = MoEConfig(arch="qwen2_moe", vocab_size=32, hidden_size=HIDDEN, intermediate_size=24, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, moe_layers=(True,),
                    router=RouterSpec(num_experts=8, top_k=2), moe_intermediate_size=12, shared_intermediate_size=20,
                    shared_name="shared_expert", shared_expert_gate=True)
    layer = MoEForCausalLM(cfg).layers[0]
    parts = layer.projection_parts()
    assert [s for s, _ in parts["gate_up_proj"]] == ["mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight"]
    state = block.state_dict()
    targets = layer.weight_targets()
    with torch.no_grad():
        targets["mlp.gate.weight"].copy_(state["gate.weight"])
        targets["mlp.shared_expert_gate.weight"].copy_(state["shared_expert_gate.weight"])
        inter = 12
        for e in range(8):
            targets[f"mlp.experts.{e}.gate_proj.weight"].copy_(state["experts.gate_up_proj"][e, :inter])
            targets[f"mlp.experts.{e}.up_proj.weight"].copy_(state["experts.gate_up_proj"][e, inter:])
            targets[f"mlp.experts.{e}.down_proj.weight"].copy_(state["experts.down_proj"][e])
    layer.set_projection("gate_up_proj", DenseLinear(torch.cat([state["shared_expert.gate_proj.weight"],
                                                                state["shared_expert.up_proj.weight"]])))
    layer.set_projection("down_proj", DenseLinear(state["shared_expert.down_proj.weight"].clone()))
    x = torch.randn(10, HIDDEN)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = layer.feed_forward(x)
    assert (got - expected).abs().max().item() < 1e-5


def test_bfloat16_router_logits_through_the_float32_copy() -> None:
    """A softmax router of a bfloat16 model: its logits are the bfloat16 product's value (exact
    products, float32 sums, one rounding: within half a bfloat16 unit of float64 after the float32
    sum's error), and the widened copy follows an in-place change of the weight."""
    cfg = MoEConfig(arch="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=24, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=32, moe_layers=(True,),
                    router=RouterSpec(num_experts=8, top_k=2), moe_intermediate_size=12)
    layer = MoEForCausalLM(cfg, dtype=torch.bfloat16).layers[0]
    assert layer.router is not None and layer.router.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    for _ in range(2):
        with torch.no_grad():
            layer.router.copy_(torch.randn(8, 64, generator=g))
        got = layer._router_logits(x)
        want = x.double() @ layer.router.double().t()
        assert got.dtype == torch.bfloat16
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert ((got.double() - want).abs() <= 0.5 * ulp + 64 * 2.0**-24 * (x.double().abs() @ layer.router.double().abs().t())).all()
        assert torch.equal(got, torch.nn.functional.linear(x.float(), layer.router.float()).to(torch.bfloat16))


# -- config.json parsing ------------------------------------------------------------------------------

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json (transformers 4 spelling)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
GLM45_AIR = {  # zai-org/GLM-4.5-Air's config.json
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
    "vocab_size": 151552,
}


def test_real_config_jsons() -> None:
    from helios.models import registry

    arch = registry.for_hf_config(QWEN3_30B_A3B)
    cfg = arch.parse_hf_config(QWEN3_30B_A3B)
    assert isinstance(cfg, MoEConfig) and arch.name == cfg.arch == "qwen3_moe"
    assert all(cfg.moe_layers) and len(cfg.moe_layers) == 48 and cfg.qk_norm and not cfg.attention_bias
    assert cfg.router == RouterSpec(num_experts=128, top_k=8, norm_topk_prob=True)
    assert (cfg.rotary, cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (128, 768, 0)
    # a dense copy of the attention alone (the routed experts are not converted by weight formats)
    assert cfg.projection_params() == 48 * ((4096 + 2 * 512) * 2048 + 2048 * 4096)

    arch = registry.for_hf_config(GLM45_AIR)
    cfg = arch.parse_hf_config(GLM45_AIR)
    assert isinstance(cfg, MoEConfig) and cfg.arch == "glm4_moe"
    assert cfg.moe_layers == (False,) + (True,) * 45 and cfg.rotary == 64 and cfg.attention_bias and not cfg.qk_norm
    assert cfg.router == RouterSpec(num_experts=128, top_k=8, scoring="sigmoid", norm_topk_prob=True)
    assert cfg.shared_intermediate_size == 1408 and cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_qwen3_moe_sparse_layers_and_refusals() -> None:
    from helios.models.qwen3_moe import config_from_hf

    small = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert config_from_hf(small).moe_layers == (False, True, False, False, False, True)
    spelled = {k: v for k, v in small.items() if k != "num_experts"} | {"num_local_experts": 16}
    assert config_from_hf(spelled).router.num_experts == 16  # transformers 5's saved spelling
    with pytest.raises(NotImplementedError, match="sliding"):
        config_from_hf({**small, "use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**small, "hidden_act": "gelu"})
