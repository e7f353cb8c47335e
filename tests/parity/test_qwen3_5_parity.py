"""Numerical parity of Qwen3.5 text, dense (``qwen3_5``) and MoE (``qwen3_5_moe``), served by
`helios.models.qwen3_next`, with transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
(fp32, torch fallbacks), and of their GGUF files as llama.cpp's own converter writes them.

Tiny random seeded models (hidden 64, four layers: three Gated DeltaNet layers with two key heads
of two value heads each, one gated full-attention layer; the MoE one 8 experts, top 2, a gated
shared expert in every layer), the weights scaled as in tests/parity/test_qwen3_next_parity.py
(whose helpers run the model directly and through the engine). transformers runs Qwen3.5's
interleaved MRoPE on text positions (three equal position rows), which is plain RoPE over the
rotated share; prompts of a few hundred tokens, engine chunks that split the scan's blocks.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.interface import RecurrentStateSpec
from helios.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_gguf_families_parity import _LLAMA_CPP, _RUNNER
from tests.parity.test_qwen3_next_parity import (
    OneSequence,
    _engine_run,
    check_speculation_rolls_back,
    hf_generate,
    prompt_of,
    seeded,
)
from tests.parity.tiny import hf_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=0,
            bos_token_id=2, eos_token_id=1,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
DENSE = dict(TEXT, intermediate_size=96)
MOE = dict(TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VARIANTS = ["qwen3_5", "qwen3_5_moe"]


def tiny_hf_model(arch: str) -> torch.nn.Module:
    if arch == "qwen3_5":
        return seeded(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**DENSE)))
    return seeded(transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**MOE)))


def _save(model: torch.nn.Module, root: Path) -> Path:
    model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return root


def _load(path: Path, arch: str) -> Qwen3NextForCausalLM:
    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.architecture.name == arch
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.weights)
    assert isinstance(model, Qwen3NextForCausalLM)
    return model


@pytest.fixture(scope="module", params=VARIANTS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, torch.nn.Module, Qwen3NextForCausalLM]:
    arch = str(request.param)
    hf_model = tiny_hf_model(arch)
    root = _save(hf_model, tmp_path_factory.mktemp(arch))
    return arch, hf_model, _load(root, arch)


def test_config(case: tuple[str, torch.nn.Module, Qwen3NextForCausalLM]) -> None:
    arch, _, model = case
    cfg = model.config
    assert isinstance(cfg, Qwen3NextConfig) and cfg.arch == arch
    assert cfg.split_ba and not cfg.value_heads_tiled
    assert cfg.linear_layers == (True, True, False, True)
    assert cfg.moe_layers == ((False,) * 4 if arch == "qwen3_5" else (True,) * 4)
    assert cfg.rotary == 4  # partial_rotary_factor 0.25 of 16
    specs = model.cache_specs()
    assert isinstance(specs[0], RecurrentStateSpec) and specs[0].shapes == ((3, 2 * 32 + 32), (4, 16, 8))


def test_prompt_logits(case: tuple[str, torch.nn.Module, Qwen3NextForCausalLM]) -> None:
    """A 300-token prompt in one pass: transformers' chunked rule over five blocks of 64."""
    arch, hf_model, model = case
    ids = prompt_of(300)
    expected = hf_logits(hf_model, ids)
    diff = (OneSequence(model).logits(model, ids, 0) - expected).abs().max().item()
    print(f"{arch} prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_chunk_boundaries_and_decode(case: tuple[str, torch.nn.Module, Qwen3NextForCausalLM]) -> None:
    """Chunks of 1, 3, 61, 100 and 25 tokens, then one-token decode steps, against transformers'
    logits of the whole 200-token sequence."""
    arch, hf_model, model = case
    ids = prompt_of(200, salt=1)
    expected = hf_logits(hf_model, ids)
    seq = OneSequence(model)
    cuts = [0, 1, 4, 65, 165, 190, *range(191, 201)]
    got = torch.cat([seq.logits(model, ids[a:b], a) for a, b in itertools.pairwise(cuts)])
    diff = (got - expected).abs().max().item()
    print(f"{arch} chunked + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_the_engine_serves_it(case: tuple[str, torch.nn.Module, Qwen3NextForCausalLM]) -> None:
    """Three requests of 230, 170 and 90 tokens batched through the engine (prefill chunks of 48,
    so every scan is split; then batched decode): 32 greedy tokens each identical to transformers'
    generate, logprobs within 1e-4 of transformers' log-softmax over the whole sequence."""
    arch, hf_model, model = case
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
    print(f"{arch} engine fp32: max abs logprob diff {worst:.3g}")
    assert worst < FP32_TOLERANCE


def test_speculation_rolls_the_recurrent_state_back(case: tuple[str, torch.nn.Module, Qwen3NextForCausalLM]) -> None:
    _, hf_model, model = case
    check_speculation_rolls_back(model, hf_model, prompt_of(60, 3), (5, 10, 15, 20, 25, 30))


@pytest.mark.parametrize("arch", VARIANTS)
def test_vision_language_checkpoint_serves_its_text_model(arch: str, tmp_path: Path) -> None:
    """A ``Qwen3_5(Moe)ForConditionalGeneration`` folder (``model.language_model.*``, a vision tower,
    the text config nested): its text model loads under the text entry, the vision weights are
    ignored, and the logits are transformers' (the conditional model on text input)."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    if arch == "qwen3_5":
        config = transformers.Qwen3_5Config(text_config=DENSE, vision_config=vision)
        hf_model = seeded(transformers.Qwen3_5ForConditionalGeneration(config))
    else:
        config = transformers.Qwen3_5MoeConfig(text_config=MOE, vision_config=vision)
        hf_model = seeded(transformers.Qwen3_5MoeForConditionalGeneration(config))
    root = _save(hf_model, tmp_path / arch)
    model = _load(root, arch)
    ids = prompt_of(160, salt=6)
    expected = hf_logits(hf_model, ids)
    diff = (OneSequence(model).logits(model, ids, 0) - expected).abs().max().item()
    print(f"{arch} vision-language checkpoint fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


# -- GGUF, as llama.cpp's own converter writes it ------------------------------------------------------

@pytest.mark.skipif(not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")
@pytest.mark.parametrize("arch", VARIANTS)
def test_real_converter_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    """The tiny checkpoint converted by llama.cpp's ``convert_hf_to_gguf.py`` (F32, ``--no-mtp``:
    the tiny model has none) to ``qwen35`` / ``qwen35moe``: separate ``ssm_beta`` / ``ssm_alpha``,
    value heads tiled (two per key head here); loaded through the registry, its logits on a
    240-token prompt within 1e-4 of transformers and 32 greedy tokens equal to ``generate``."""
    hf_model = tiny_hf_model(arch)
    root = _save(hf_model, tmp_path / "hf")
    # the converter counts the vocabulary: all VOCAB tokens
    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                     "added_tokens": []}))
    path = tmp_path / f"tiny-{arch}.gguf"
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(root), str(path), "f32", "--no-mtp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    model = _load(path, arch)
    cfg = model.config
    assert cfg.split_ba and cfg.value_heads_tiled and cfg.norms_shifted
    assert cfg.linear_layers == (True, True, False, True) and cfg.rotary == 4
    assert cfg.moe_layers == ((False,) * 4 if arch == "qwen3_5" else (True,) * 4)
    ids = prompt_of(240, salt=7)
    expected = hf_logits(hf_model, ids)
    diff = (OneSequence(model).logits(model, ids, 0) - expected).abs().max().item()
    print(f"{arch} GGUF (llama.cpp's converter): max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    prompt = prompt_of(100, salt=8)
    seq = OneSequence(model)
    logits = seq.logits(model, prompt, 0)
    tokens: list[int] = []
    for _ in range(32):
        tokens.append(int(logits[-1].argmax()))
        logits = seq.logits(model, tokens[-1:], len(prompt) + len(tokens) - 1)
    assert tokens == hf_generate(hf_model, prompt, 32)
