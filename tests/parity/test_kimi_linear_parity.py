"""Numerical parity of `helios.models.kimi_linear` with transformers' ``KimiLinearForCausalLM``
(fp32, its torch fallbacks: the chunked KDA rule in blocks of 64 for a prompt, the recurrent one
for cached decode), and of the per-channel gated delta rule with its one-token update.

A tiny random seeded model (hidden 64, four layers: three KDA layers of 4 heads x 16, one MLA
layer without RoPE; a dense first layer, then 8 experts, top 2, sigmoid routing with a nonzero
correction bias, one shared expert), saved with ``save_pretrained`` and loaded through
`load_checkpoint` and the registry. The decay rates ``exp(A_log)`` are drawn in (0.01, 1), as in
tests/parity/test_qwen3_next_parity.py (whose helpers run the model directly and through the
engine) and for the same reason.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helios.models.gated_delta import chunked_scan, l2norm, recurrent_step
from helios.models.interface import LatentAttentionSpec, RecurrentStateSpec
from helios.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM, config_from_hf
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_gguf_families_parity import _LLAMA_CPP, _RUNNER
from tests.parity.test_qwen3_next_parity import (
    OneSequence,
    _engine_run,
    check_speculation_rolls_back,
    hf_generate,
    prompt_of,
)
from tests.parity.tiny import hf_logits, load_ours, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, num_experts=8,
              num_experts_per_token=2, num_shared_experts=1, max_position_embeddings=1024, pad_token_id=0,
              bos_token_id=2, eos_token_id=1,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def tiny_hf_model() -> torch.nn.Module:
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**CONFIG))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in (0.01, 1)
                p.copy_(torch.empty_like(p).uniform_(0.01, 1.0).log())
            elif name.endswith("conv1d.weight"):
                p.copy_(0.6 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("norm.weight"):  # plain-weight RMSNorms
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_hf_model()


@pytest.fixture(scope="module")
def model(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> KimiLinearForCausalLM:
    root = tmp_path_factory.mktemp("kimi-linear")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    built = load_ours(root, architecture="kimi_linear")
    assert isinstance(built, KimiLinearForCausalLM)
    return built


def test_config(model: KimiLinearForCausalLM) -> None:
    cfg = model.config
    assert isinstance(cfg, KimiLinearConfig) and cfg.arch == "kimi_linear" and not cfg.rope
    assert cfg.linear_layers == (True, True, False, True)
    assert cfg.moe_layers == (False, True, True, True)
    assert cfg.router.routed_scaling_factor == pytest.approx(2.446)
    specs = model.cache_specs()
    assert isinstance(specs[0], RecurrentStateSpec) and specs[0].shapes == ((3, 3 * 64), (4, 16, 16))
    assert specs[2] == LatentAttentionSpec(32 + 8)


def test_release_config_spelling() -> None:
    """The release's ``config.json`` keys (``linear_attn_config`` with 1-based layer lists,
    ``first_k_dense_replace``) give the layer kinds transformers derives from them."""
    release = {k: v for k, v in CONFIG.items() if k not in ("layer_types", "linear_head_dim", "linear_num_heads",
                                                            "linear_conv_kernel_dim")}
    release.update(model_type="kimi_linear", first_k_dense_replace=2, linear_attn_config={
        "full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 4,
        "short_conv_kernel_size": 3})
    hf = transformers.KimiLinearConfig(**release)
    cfg = config_from_hf(release)
    assert cfg.linear_layers == tuple(t == "linear_attention" for t in hf.layer_types) == (True, False, True, False)
    assert cfg.moe_layers == tuple(t == "sparse" for t in hf.mlp_layer_types) == (False, False, True, True)
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.conv_kernel) == (16, 4, 3)


def test_prompt_logits(model: KimiLinearForCausalLM, hf_model: torch.nn.Module) -> None:
    """A 300-token prompt in one pass: transformers' chunked rule over five blocks of 64."""
    ids = prompt_of(300)
    expected = hf_logits(hf_model, ids)
    diff = (OneSequence(model).logits(model, ids, 0) - expected).abs().max().item()
    print(f"kimi_linear prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_chunk_boundaries_and_decode(model: KimiLinearForCausalLM, hf_model: torch.nn.Module) -> None:
    """Chunks of 1, 3, 61, 100 and 25 tokens, then one-token decode steps, against transformers'
    logits of the whole 200-token sequence."""
    ids = prompt_of(200, salt=1)
    expected = hf_logits(hf_model, ids)
    seq = OneSequence(model)
    cuts = [0, 1, 4, 65, 165, 190, *range(191, 201)]
    got = torch.cat([seq.logits(model, ids[a:b], a) for a, b in itertools.pairwise(cuts)])
    diff = (got - expected).abs().max().item()
    print(f"kimi_linear chunked + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_the_engine_serves_it(model: KimiLinearForCausalLM, hf_model: torch.nn.Module) -> None:
    """Three requests of 230, 170 and 90 tokens batched through the engine (paged latent rows for
    the MLA layer, recurrent state slots for the KDA layers, prefill chunks of 48 so every scan is
    split, then batched decode): 32 greedy tokens each identical to transformers' generate,
    logprobs within 1e-4 of transformers' log-softmax over the whole sequence."""
    prompts = [prompt_of(230, 3), prompt_of(170, 4), prompt_of(90, 5)]
    batched = _engine_run(model, prompts, chunk=48, max_tokens=32)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        got = batched[f"r{i}"]
        tokens = [t for t, _, _ in got]
        assert tokens == hf_generate(hf_model, prompt, 32), i
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp, top) in enumerate(got):
            row = ref[len(prompt) - 1 + j]
            worst = max(worst, abs(lp - float(row[t])), *(abs(v - float(row[a])) for a, v in top))
    print(f"kimi_linear engine fp32: max abs logprob diff {worst:.3g}")
    assert worst < FP32_TOLERANCE


def test_speculation_rolls_the_recurrent_state_back(model: KimiLinearForCausalLM, hf_model: torch.nn.Module) -> None:
    check_speculation_rolls_back(model, hf_model, prompt_of(60, 3), (5, 10, 15, 20, 25, 30))


def test_packed_state_round_trip(model: KimiLinearForCausalLM, tmp_path: Path) -> None:
    """The packed state (the runtime's weight cache) restores a model giving the same logits."""
    state, kinds = model.packed_state()
    again = KimiLinearForCausalLM(model.config)
    again.load_packed_state(state, kinds)
    ids = prompt_of(70, salt=2)
    assert torch.equal(OneSequence(model).logits(model, ids, 0), OneSequence(again).logits(again, ids, 0))


def test_bfloat16_runs_close(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """bfloat16 weights and activations (the states stay float32): logits near float32's."""
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    model = load_ours(tmp_path, torch.bfloat16)
    ids = prompt_of(120, salt=9)
    expected = hf_logits(hf_model, ids)
    got = OneSequence(model).logits(model, ids, 0)
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()


def _release_folder(hf_model: torch.nn.Module, root: Path) -> Path:
    """``hf_model`` saved as the release's checkpoints are: its ``config.json`` spelling
    (``linear_attn_config``, ``first_k_dense_replace``, ``moe_router_activation_func``) and the dense
    layer's MLP under ``mlp.`` (transformers' save writes it under ``block_sparse_moe.``), with a
    tokenizer of VOCAB tokens for the converter."""
    from safetensors.torch import load_file, save_file

    hf_model.save_pretrained(root, safe_serialization=True)
    config = json.loads((root / "config.json").read_text())
    types = config.pop("layer_types")
    config.pop("mlp_layer_types")
    config["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "head_dim": config.pop("linear_head_dim"), "num_heads": config.pop("linear_num_heads"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim")}
    config.update(first_k_dense_replace=1, moe_router_activation_func="sigmoid")
    (root / "config.json").write_text(json.dumps(config))
    dense = tuple(f".block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down"))
    state = {name.replace(".block_sparse_moe.", ".mlp.") if name.endswith(dense) else name: t
             for name, t in load_file(root / "model.safetensors").items()}
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    write_byte_tokenizer(root)
    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                     "added_tokens": []}))
    return root


def _greedy(model: KimiLinearForCausalLM, prompt: list[int], n: int) -> list[int]:
    seq = OneSequence(model)
    logits = seq.logits(model, prompt, 0)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits = seq.logits(model, tokens[-1:], len(prompt) + len(tokens) - 1)
    return tokens


def test_release_folder_loads(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """The release's folder layout (config spelling, ``mlp.`` dense names) loads at parity."""
    model = load_ours(_release_folder(hf_model, tmp_path / "release"), architecture="kimi_linear")
    ids = prompt_of(160, salt=6)
    diff = (OneSequence(model).logits(model, ids, 0) - hf_logits(hf_model, ids)).abs().max().item()
    assert diff < FP32_TOLERANCE


@pytest.mark.skipif(not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")
def test_real_converter_gguf_matches_transformers(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    """The release-style folder converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32) to
    ``kimi-linear``: the config it implies, a 240-token prompt's logits within 1e-4 of transformers,
    32 greedy tokens equal to ``generate``."""
    root = _release_folder(hf_model, tmp_path / "hf")
    path = tmp_path / "tiny-kimi-linear.gguf"
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(root), str(path), "f32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    model = load_ours(path, architecture="kimi_linear")
    assert isinstance(model, KimiLinearForCausalLM)
    cfg = model.config
    assert cfg.linear_layers == (True, True, False, True) and cfg.moe_layers == (False, True, True, True)
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel) == (4, 16, 4) and not cfg.rope
    assert cfg.router.norm_topk_prob and cfg.router.routed_scaling_factor == pytest.approx(2.446)
    ids = prompt_of(240, salt=7)
    diff = (OneSequence(model).logits(model, ids, 0) - hf_logits(hf_model, ids)).abs().max().item()
    print(f"kimi-linear GGUF (llama.cpp's converter): max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    prompt = prompt_of(100, salt=8)
    assert _greedy(model, prompt, 32) == hf_generate(hf_model, prompt, 32)


# -- the per-channel rule ------------------------------------------------------------------------------


def test_per_channel_chunked_scan_matches_the_recurrence() -> None:
    """`chunked_scan` with a decay per key channel (blocks of 8 over 37 tokens, from a nonzero
    state) against the token-by-token `recurrent_step`, in float64."""
    g = torch.Generator().manual_seed(0)
    heads, n, dk, dv = 3, 37, 8, 5
    q = l2norm(torch.randn(heads, n, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(heads, n, dk, generator=g, dtype=torch.float64))
    v = torch.randn(heads, n, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(heads, n, dk, generator=g, dtype=torch.float64)
    beta = torch.rand(heads, n, generator=g, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=g, dtype=torch.float64)
    out, final = chunked_scan(q, k, v, decay, beta, s0, block=8)
    s = s0[None]
    rows = []
    for t in range(n):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        rows.append(o[0])
    assert torch.allclose(out, torch.stack(rows, dim=1), atol=1e-10)
    assert torch.allclose(final, s[0], atol=1e-10)


def test_per_channel_rule_matches_transformers_kda() -> None:
    """The chunked rule against transformers' ``chunk_kimi_delta_attention`` (float32, its own
    q/k L2 norm), outputs and final state, over 150 tokens from a nonzero state."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    g = torch.Generator().manual_seed(1)
    n, heads, dk, dv = 150, 3, 16, 16
    q, k = torch.randn(1, n, heads, dk, generator=g), torch.randn(1, n, heads, dk, generator=g)
    v = torch.randn(1, n, heads, dv, generator=g)
    decay = -torch.rand(1, n, heads, dk, generator=g)
    beta = torch.rand(1, n, heads, generator=g)
    s0 = torch.randn(1, heads, dk, dv, generator=g)
    want, want_state = chunk_kimi_delta_attention(q, k, v, decay, beta, initial_state=s0.clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, state = chunked_scan((l2norm(q[0]) * dk ** -0.5).transpose(0, 1), l2norm(k[0]).transpose(0, 1),
                              v[0].transpose(0, 1), decay[0].transpose(0, 1), beta[0].t(), s0[0])
    assert torch.allclose(got.transpose(0, 1), want[0], atol=1e-5)
    assert torch.allclose(state, want_state[0], atol=1e-5)
