"""Kimi K2.5 (transformers' ``kimi_k25``: a DeepSeek-V3 ``text_config`` behind a MoonViT tower): the
text model loads through `helios.models.deepseek_v3` (the loader's ``kimi_k25`` family in
`helios.models.vision.registry` renames ``language_model.model.*`` / ``language_model.lm_head``;
the vision tower and projector weights are ignored with a log line).

A tiny random seeded ``Kimi_K25ForConditionalGeneration`` (hidden 64, 4 heads, 8 experts, a dense
leading layer, one vision layer) saved with ``save_pretrained``: fp32 prompt logits and chunked
prefill + absorbed decode against transformers' text-only forward, and 32 greedy tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helios.models.deepseek_v3 import DeepseekV3ForCausalLM
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.vision.registry import vision_family
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_k25")

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 180, 77, 23, 260, 150, 48, 2, 111, 66]
TEXT = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32,
            kv_lora_rank=24, qk_rope_head_dim=8, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1,
            tie_word_embeddings=False)
VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2, pos_emb_height=4,
              pos_emb_width=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    config = transformers.Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
                                         tie_word_embeddings=False)
    hf_model = transformers.Kimi_K25ForConditionalGeneration(config)
    torch.manual_seed(25)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    root = tmp_path_factory.mktemp("kimi-k25")
    hf_model.eval().save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    return hf_model, root


def test_text_config_and_ignored_vision(pair: tuple[torch.nn.Module, Path], caplog: pytest.LogCaptureFixture) -> None:
    _, root = pair
    assert json.loads((root / "config.json").read_text())["model_type"] == "kimi_k25"
    with caplog.at_level(logging.INFO, logger="helios.loaders.safetensors_loader"):
        model = load_ours(root, architecture="deepseek_v3")
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert model.config.num_layers == 3 and model.config.q_lora_rank == 32 and not model.config.tie_word_embeddings
    assert any("kimi_k25: text model only" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"kimi_k25 prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_chunked_prefill_and_absorbed_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)
    chunks = [(0, 3), (3, 9), (9, 11)] + [(i, i + 1) for i in range(11, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    diff = (got - expected).abs().max().item()
    print(f"kimi_k25 chunked + absorbed decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_greedy_32_tokens(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, 6:].tolist()
    assert len(expected) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == expected


def test_release_naming_loads_the_same(pair: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """Moonshot's files say ``language_model.model.layers.N`` (transformers' save writes ``blocks``)."""
    hf_model, root = pair
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    tensors = load_file(str(root / "model.safetensors"))
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model = load_ours(tmp_path)
    diff = (our_logits(model, DenseAttention.for_model(model), PROMPT, 0) - hf_logits(hf_model, PROMPT)).abs().max()
    assert diff.item() < FP32_TOLERANCE


def test_the_outer_config_decides_tying() -> None:
    """transformers' ``Kimi_K25Config`` defaults ``tie_word_embeddings`` to True and ties by it."""
    family = vision_family({"model_type": "kimi_k25"})
    assert family is not None and not family.tower
    text = {"model_type": "kimi_k2", "tie_word_embeddings": False}
    assert family.text_config({"model_type": "kimi_k25", "text_config": text})["tie_word_embeddings"] is True
    outer_false = {"model_type": "kimi_k25", "text_config": text, "tie_word_embeddings": False}
    assert family.text_config(outer_false)["tie_word_embeddings"] is False
    assert transformers.Kimi_K25Config(text_config=dict(text, model_type="deepseek_v3")).tie_word_embeddings is True


def test_runtime_load_model(pair: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    """`runtime.load_model` serves the text model (no vision tower is built)."""
    from helios.runtime import load_model

    hf_model, root = pair
    loaded = load_model(root, weights="float32", dtype="float32", cache_dir=tmp_path / "packed")
    assert isinstance(loaded.model, DeepseekV3ForCausalLM)
    got = our_logits(loaded.model, DenseAttention.for_model(loaded.model), PROMPT, 0)
    assert (got - hf_logits(hf_model, PROMPT)).abs().max().item() < FP32_TOLERANCE
