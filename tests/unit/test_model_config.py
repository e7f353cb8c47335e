"""ModelConfig from Hugging Face config dicts, and the RoPE frequencies it implies."""

from __future__ import annotations

import math

import pytest
import torch

from helios.models.config import ModelConfig, normalize_rope_scaling
from helios.models.llama import rope_inv_freq

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_llama_defaults() -> None:
    cfg = ModelConfig.from_hf_config({**BASE, "model_type": "llama"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rope_scaling) == (16, 2, 10000.0, None)
    assert not cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.q_size, cfg.kv_size) == (64, 32)


def test_qwen_flags() -> None:
    qwen2 = ModelConfig.from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                        "use_sliding_window": False, "tie_word_embeddings": True})
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.tie_word_embeddings
    assert qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 32, "attention_bias": False})
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32


def test_rope_spellings() -> None:
    legacy = ModelConfig.from_hf_config({**BASE, "model_type": "llama", "rope_theta": 5e5,
                                         "rope_scaling": {"type": "linear", "factor": 4.0}})
    v5 = ModelConfig.from_hf_config({**BASE, "model_type": "llama",
                                     "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 4.0}})
    assert legacy.rope_theta == v5.rope_theta == 5e5
    assert legacy.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = ModelConfig.from_hf_config({**BASE, "model_type": "llama",
                                        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    assert normalize_rope_scaling({"type": "linear", "factor": 1.0}) is None


def test_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_config({**BASE, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.from_hf_config({**BASE, "model_type": "llama", "num_key_value_heads": 3})


def test_rope_inv_freq() -> None:
    cfg = ModelConfig.from_hf_config({**BASE, "model_type": "llama"})
    inv = rope_inv_freq(cfg)
    assert inv.dtype == torch.float32 and inv.shape == (8,)
    assert inv[0].item() == 1.0 and inv[1].item() == pytest.approx(10000 ** (-2 / 16))
    linear = rope_inv_freq(ModelConfig.from_hf_config(
        {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    assert torch.allclose(linear, inv / 2)
    llama3 = rope_inv_freq(ModelConfig.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}))
    wavelen = 2 * math.pi / inv
    short = wavelen < 64 / 4
    long = wavelen > 64 / 1
    assert torch.equal(llama3[short], inv[short])  # high frequencies untouched
    assert torch.allclose(llama3[long], inv[long] / 8)  # low frequencies slowed by the factor
    middle = ~short & ~long
    assert bool(((llama3[middle] < inv[middle]) & (llama3[middle] > inv[middle] / 8)).all())
