"""GGUF loading: the q/k row un-permutation (and that it turns llama.cpp's interleaved RoPE into the
rotate-half form) and the tensor names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helios.loaders.gguf_loader import gguf_to_hf_name, permute_rotary_rows, unpermute_rotary_rows


def test_unpermute_inverts_permute() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(weight, 4), 4), weight)
    bias = rng.standard_normal(4 * 8).astype(np.float32)
    assert np.array_equal(unpermute_rotary_rows(permute_rotary_rows(bias, 4), 4), bias)
    t = torch.from_numpy(weight)
    assert torch.equal(unpermute_rotary_rows(permute_rotary_rows(t, 4), 4), t)
    # The permutation itself: per head, rows (0, half, 1, half + 1, ...).
    rows = np.arange(2 * 6, dtype=np.float32)[:, None]
    assert permute_rotary_rows(rows, 2)[:6, 0].tolist() == [0, 3, 1, 4, 2, 5]


def test_unpermuted_weights_give_neox_rope_of_interleaved_rope() -> None:
    """Interleaved (GPT-J) RoPE on llama.cpp's rows == rotate-half RoPE on the un-permuted rows."""
    heads, head_dim, cols = 3, 8, 7
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((heads * head_dim, cols))
    x = rng.standard_normal(cols)
    inv_freq = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angle = 5 * inv_freq  # position 5
    half = head_dim // 2

    gguf_rows = permute_rotary_rows(weight, heads)  # as stored by llama.cpp
    y = (gguf_rows @ x).reshape(heads, head_dim)
    even, odd = y[:, 0::2], y[:, 1::2]
    interleaved = np.empty_like(y)
    interleaved[:, 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    interleaved[:, 1::2] = odd * np.cos(angle) + even * np.sin(angle)

    z = (unpermute_rotary_rows(gguf_rows, heads) @ x).reshape(heads, head_dim)
    first, second = z[:, :half], z[:, half:]
    neox = np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                           second * np.cos(angle) + first * np.sin(angle)], axis=1)
    back = unpermute_rotary_rows(interleaved.reshape(-1), heads).reshape(heads, head_dim)
    np.testing.assert_allclose(back, neox, atol=1e-12)


def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(NotImplementedError):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
