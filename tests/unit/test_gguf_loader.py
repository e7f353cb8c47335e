"""GGUF loading: the q/k row un-permutation (and that it turns llama.cpp's interleaved RoPE into the
rotate-half form), the tensor names, and Helios's own GGUF reader against the gguf package's reader
and dequantizer (metadata equal, every tensor equal bit for bit)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.loaders.default_model import ensure_default_model
from helios.loaders.gguf_loader import GGUFFile, permute_rotary_rows, unpermute_rotary_rows
from helios.loaders.gguf_reader import GGUFFormatError, read_gguf
from helios.models.llama import gguf_to_hf_name
from helios.models.quant import GroupQuantized
from tests.unit.tiny_gguf import Q, write_tiny_gguf


def default_model_path() -> Path:
    return ensure_default_model(quiet=True)


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


# -- the GGUF reader ---------------------------------------------------------------------------------


def _gguf_reference(path: Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Metadata and float32 tensors as the gguf package's own reader and dequantizer see them."""
    reader = gguf.GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
               .reshape(tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}
    return metadata, tensors


@pytest.mark.parametrize(("projections", "embeddings"), [(Q.Q4_1, Q.Q8_0), (Q.Q4_0, Q.F16), (Q.Q8_0, Q.F32)])
def test_reader_agrees_with_the_gguf_package(tmp_path: Path, projections: Q, embeddings: Q) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", projections=projections, embeddings=embeddings)
    metadata, tensors = _gguf_reference(path)
    file = GGUFFile(path)
    assert file.metadata == metadata
    assert set(file.tensor_types) == set(tensors)
    for name, expected in tensors.items():
        assert np.array_equal(file.read_tensor(name), expected), name


@pytest.mark.slow
def test_default_model_reads_as_the_gguf_package_reads_it() -> None:
    path = default_model_path()
    metadata, _ = _gguf_reference(path)
    file = GGUFFile(path)
    assert file.metadata == metadata
    reader = gguf.GGUFReader(path)
    for tensor in reader.tensors[:12]:  # every type the file holds (Q8_0 embeddings, F32 norms, Q4_1)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert np.array_equal(file.read_tensor(tensor.name), expected.reshape(shape)), tensor.name


def test_a_truncated_or_foreign_file_is_a_format_error(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(GGUFFormatError):
        read_gguf(tmp_path / "header.gguf")
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf(tmp_path / "other.bin")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        read_gguf(tmp_path / "empty.gguf")


def test_llama_q_rows_are_unpermuted_in_both_forms(tmp_path: Path) -> None:
    """The quantized form (codes, scales and offsets reordered by row) dequantizes to the dense form."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    file = GGUFFile(path)
    source = file.weight_thunks()["model.layers.0.self_attn.q_proj.weight"]()
    dense = file.tensor_thunks(torch.float32)["model.layers.0.self_attn.q_proj.weight"]()
    assert isinstance(source, GroupQuantized)
    assert torch.equal(source.dequantize(), dense)
    raw = torch.from_numpy(file.read_tensor("blk.0.attn_q.weight"))
    assert torch.equal(dense, unpermute_rotary_rows(raw, 4))
