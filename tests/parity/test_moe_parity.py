"""Numerical parity of the MoE families (`helios.models.qwen3_moe`, `helios.models.glm4_moe`) with
transformers' ``Qwen3MoeForCausalLM`` and ``Glm4MoeForCausalLM`` (fp32).

Tiny random seeded models (hidden 64, 8 experts, top-2): Qwen3-MoE with a dense ``mlp_only_layers``
layer, and with ``decoder_sparse_step`` 2, tied embeddings and renormalised weights; GLM-4-MoE with a
dense leading layer, grouped routing (4 groups, 2 chosen), a random score correction bias, one shared
expert, q/k/v bias, q/k norm, partial rotary and a routed scaling factor, and a variant without
groups or q/k norm, with two shared experts and unnormalised weights. Saved with ``save_pretrained``
(per-expert tensors) and loaded through `load_checkpoint` and the registry: prompt logits, chunked
prefill + decode, 32 greedy tokens, the engine's greedy tokens and logprobs, the packed-state round
trip, and the same weights as a llama.cpp-style GGUF file (stacked expert tensors).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1)
VARIANTS = {
    "qwen3": ("qwen3_moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                mlp_only_layers=[0], norm_topk_prob=False)),
    "qwen3-step2": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True,
                                      tie_word_embeddings=True)),
    "glm": ("glm4_moe", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
                             routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                             partial_rotary_factor=0.5)),
    "glm-plain": ("glm4_moe", dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                                   n_shared_experts=2, norm_topk_prob=False, use_qk_norm=False)),
}


def _tiny_hf_model(variant: str) -> torch.nn.Module:
    kind, extra = VARIANTS[variant]
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**COMMON, **extra))
    else:
        model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**COMMON, **extra))
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


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model(request.param)
    root = tmp_path_factory.mktemp(f"moe-{request.param}")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_config(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, MoEForCausalLM)
    cfg, hf_cfg = model.config, hf_model.config
    assert cfg.arch == hf_cfg.model_type
    sparse = [type(layer.mlp).__name__.endswith(("SparseMoeBlock", "MoE")) for layer in hf_model.model.layers]
    assert list(cfg.moe_layers) == sparse and any(sparse) and not all(sparse)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    if cfg.arch == "glm4_moe":
        assert cfg.rotary == int(hf_cfg.head_dim * hf_cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        assert cfg.router.n_group == hf_cfg.n_group and cfg.router.scoring == "sigmoid"
        assert cfg.shared_intermediate_size == hf_cfg.moe_intermediate_size * hf_cfg.n_shared_experts


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
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 9), (9, 11)] + [(i, i + 1) for i in range(11, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    assert (got - expected).abs().max().item() < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    assert isinstance(model, MoEForCausalLM)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, 6:].tolist()
    assert len(expected) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == expected


def test_keep_rows(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root)
    everything = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    keep = torch.tensor([len(PROMPT) - 1, 2])
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model), keep=keep)
        kept = model.compute_logits(hidden)
    assert torch.allclose(kept, everything[keep], atol=1e-5, rtol=0)


def test_packed_state_round_trip(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root)
    state, kinds = model.packed_state()
    cfg = model.config
    assert isinstance(cfg, MoEConfig)
    for i, moe in enumerate(cfg.moe_layers):  # an MoE layer's gate/up projection is its shared experts'
        assert (f"layers.{i}.gate_up_proj" in kinds) == (not moe or cfg.shared_intermediate_size > 0)
        assert (f"layers.{i}.experts_gate_up" in state) == moe
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    a = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    b = our_logits(again, DenseAttention.for_model(again), PROMPT, 0)
    assert torch.equal(a, b)


def test_the_engine_serves_it(pair: tuple[torch.nn.Module, Path]) -> None:
    """Through the engine (paged cache, chunked prefill, two requests batched: the routed tokens of
    both requests share one expert grouping) against transformers' logits of each whole sequence."""
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
    """bfloat16 activations and weights: the same greedy first token and logits near float32's (a
    routing flip near a tie may move a token's logits more than rounding alone)."""
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert got.dtype == torch.float32
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()


# -- GGUF -------------------------------------------------------------------------------------------

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def _write_gguf(path: Path, model: torch.nn.Module, q8: bool = False) -> None:
    """``model`` as llama.cpp's converters write qwen3moe / glm4moe: stacked expert tensors, the
    metadata keys they write (GLM: ``leading_dense_block_count``, ``rope.dimension_count``, a
    ``nextn_predict_layers`` layer, whose tensors are written and not loaded), F32 tensors; with
    ``q8`` the projections and experts as Q8_0 blocks, and ``model``'s weights replaced by what the
    blocks hold (so it is the reference for the file)."""
    cfg = model.config
    glm = cfg.model_type == "glm4_moe"
    arch = "glm4moe" if glm else "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    nextn = 1 if glm else 0
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers + nextn)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    if glm:
        writer.add_uint32(f"{arch}.expert_count", cfg.n_routed_experts)
        writer.add_uint32(f"{arch}.expert_shared_count", cfg.n_shared_experts)
        writer.add_uint32(f"{arch}.leading_dense_block_count", cfg.first_k_dense_replace)
        writer.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
        writer.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
        writer.add_uint32(f"{arch}.expert_gating_func", 2)
        writer.add_uint32(f"{arch}.expert_group_count", cfg.n_group)
        writer.add_uint32(f"{arch}.expert_group_used_count", cfg.topk_group)
        writer.add_uint32(f"{arch}.nextn_predict_layers", nextn)
        partial = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
        writer.add_uint32(f"{arch}.rope.dimension_count", int(cfg.head_dim * partial))
    else:
        writer.add_uint32(f"{arch}.expert_count", cfg.num_experts)
    add_test_vocab(writer)
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    post_norm = "post_attention_norm.weight" if glm else "ffn_norm.weight"

    def add(name: str, array: np.ndarray) -> None:
        if q8 and array.ndim >= 2 and not name.startswith(("token_embd", "output.")) and "ffn_gate_inp" not in name:
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)

    state = model.state_dict()
    if q8:
        with torch.no_grad():
            for hf_name, tensor in state.items():
                if tensor.dim() >= 2 and "embed" not in hf_name and "lm_head" not in hf_name \
                        and not hf_name.endswith("mlp.gate.weight"):
                    if hf_name.endswith("mlp.experts.gate_up_proj"):  # quantized as gate and up, like the file
                        halves = tensor.chunk(2, dim=1)
                        tensor.copy_(torch.cat([_q8_round_trip(h) for h in halves], dim=1))
                    else:
                        tensor.copy_(_q8_round_trip(tensor))
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if hf_name in fixed:
            add(fixed[hf_name], array)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> gate and up, [E, I, H] each
            inter = array.shape[1] // 2
            add(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(array[:, :inter]))
            add(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(array[:, inter:]))
            continue
        name = post_norm if rest == "post_attention_layernorm.weight" else _HF_TO_GGUF[rest]
        add(f"blk.{layer}.{name}", array)
    if glm:  # the next-token-prediction layer: stored, not loaded
        writer.add_tensor(f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight",
                          np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_test_vocab(writer: gguf.GGUFWriter) -> None:
    """The test tokenizer (`_write_tokenizer`'s 256 byte tokens, then special ones up to VOCAB) as a
    GGUF ``gpt2`` vocabulary."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(256)] + [f"<t{i}>" for i in range(VOCAB - 256)])
    writer.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 257)


def _q8_round_trip(tensor: Tensor) -> Tensor:
    kind = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(tensor.detach().numpy().astype(np.float32), kind)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, kind), dtype=np.float32).reshape(tensor.shape))


@pytest.mark.parametrize(("variant", "q8"), [("qwen3-step2", False), ("glm", False), ("glm", True)])
def test_gguf_matches_transformers(tmp_path: Path, variant: str, q8: bool) -> None:
    """F32 files, and Q8_0 ones (2-D projections read as codes, the 3-D expert tensors dequantized)
    against transformers with the weights the blocks hold."""
    hf_model = _tiny_hf_model(variant)
    if variant.startswith("qwen3"):  # llama.cpp renormalises qwen3moe's chosen weights (norm_topk_prob)
        assert hf_model.config.norm_topk_prob
    path = tmp_path / f"tiny-{variant}.gguf"
    _write_gguf(path, hf_model, q8=q8)
    checkpoint = load_checkpoint(path, torch.float32)
    cfg = checkpoint.config
    assert isinstance(cfg, MoEConfig) and cfg.arch == hf_model.config.model_type
    assert cfg.num_layers == hf_model.config.num_hidden_layers
    model = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    if q8:
        from helios.models.quant import GroupQuantized

        assert isinstance(checkpoint.weights["model.layers.1.self_attn.q_proj.weight"], GroupQuantized)
    model.load_weights(checkpoint.weights)  # the checkpoint's own forms, as the runtime loads them
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    print(f"tiny {variant} GGUF fp32: max abs logit diff {diff.item():.3g}")
    assert diff.item() < FP32_TOLERANCE


# -- other expert layouts and weight formats -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["qwen3", "glm"])
def test_transformers_fused_expert_tensors(variant: str) -> None:
    """transformers 5's in-memory state dict ([E, 2I, H] gate_up, [E, H, I] down per layer) loads
    like the per-expert checkpoint."""
    hf_model = _tiny_hf_model(variant)
    state = hf_model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    cfg = registry_config(hf_model)
    model = MoEForCausalLM(cfg)
    model.load_weights(state)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    assert diff.item() < FP32_TOLERANCE


def registry_config(hf_model: torch.nn.Module) -> MoEConfig:
    from helios.models import registry

    config = hf_model.config.to_dict()
    cfg = registry.for_hf_config(config).parse_hf_config(config)
    assert isinstance(cfg, MoEConfig)
    return cfg


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_formats_quantize_each_expert(pair: tuple[torch.nn.Module, Path], kind: str) -> None:
    """A quantized `WeightFormat` builds every routed expert's gate/up and down with
    `quant.build_linear` (int8 per row / int4 groups of 32): logits near float32's, the packed
    state round trip exact, and a decode step counting top_k of the experts' bytes."""
    from helios.models.quant import Int4Linear, Int8Linear, WeightFormat

    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.float32)
    fmt = WeightFormat(kind)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32, weights=fmt))
    model.load_weights(checkpoint.tensors)
    assert isinstance(model, MoEForCausalLM)
    cfg = model.config
    moe_layer = model._decoder_layers()[cfg.moe_layers.index(True)]
    gate_up, down = moe_layer.routed_experts()
    assert not isinstance(gate_up, Tensor) and len(gate_up) == cfg.router.num_experts
    assert all(isinstance(m, Int8Linear if kind == "int8" else Int4Linear) for m in (*gate_up, *down))
    # each expert's modules hold that expert's weights (gate rows, then up rows)
    layer_idx = cfg.moe_layers.index(True)
    x = torch.randn(5, cfg.hidden_size)
    bound = 0.02 if kind == "int8" else 0.15
    for e in (0, cfg.router.num_experts - 1):
        weight = {part: checkpoint.tensors[f"model.layers.{layer_idx}.mlp.experts.{e}.{part}_proj.weight"]
                  for part in ("gate", "up", "down")}
        for module, dense in ((gate_up[e], torch.cat([weight["gate"], weight["up"]])), (down[e], weight["down"])):
            want = x[:, : dense.shape[1]] @ dense.T
            with torch.no_grad():
                err = (module(x[:, : dense.shape[1]].contiguous()) - want).norm() / want.norm()
            assert err.item() < bound, (e, err.item())
    # end to end, with the other projections dense (their int8 / int4 error on these random weights,
    # the llama family's, is several times the experts'): near float32's
    state, kinds = model.packed_state()
    dense = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    dense.load_weights(checkpoint.tensors)
    mixed = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32, weights=fmt))
    mixed.load_packed_state(state, kinds)
    for quantized, plain in zip(mixed._decoder_layers(), dense._decoder_layers(), strict=True):
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if getattr(plain, attr) is not None:
                quantized.set_projection(attr, getattr(plain, attr))
    expected = hf_logits(hf_model, PROMPT)
    rel = ((our_logits(mixed, DenseAttention.for_model(mixed), PROMPT, 0) - expected).abs().mean()
           / expected.abs().mean()).item()
    print(f"{root.name} {kind} experts: mean abs logit error / mean |logit| {rel:.3g}")
    assert rel < (0.03 if kind == "int8" else 0.3)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    assert f"layers.{cfg.moe_layers.index(True)}.experts_down_0" in kinds
    again = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32, weights=fmt))
    again.load_packed_state(state, kinds)
    assert torch.equal(got, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
    everything = sum(int(p.numel() * p.element_size()) for p in model.parameters())
    assert model.decode_weight_bytes() < everything


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_runtime_load_model_and_weight_cache(pair: tuple[torch.nn.Module, Path], tmp_path: Path, weights: str) -> None:
    """`runtime.load_model` (the registry, the weight format, `pack_cpu_weights`) and the
    packed-weight cache: the cached model's logits are the freshly built one's."""
    from helios.runtime import load_model

    hf_model, root = pair
    loaded = load_model(root, weights=weights, dtype="float32", cache_dir=tmp_path / "packed")
    model = loaded.model
    assert isinstance(model, MoEForCausalLM)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    if weights == "float32":
        assert (got - hf_logits(hf_model, PROMPT)).abs().max().item() < FP32_TOLERANCE
    assert loaded.cache_key and any((tmp_path / "packed").rglob("*"))
    again = load_model(root, weights=weights, dtype="float32", cache_dir=tmp_path / "packed").model
    assert torch.equal(got, our_logits(again, DenseAttention.for_model(again), PROMPT, 0))
