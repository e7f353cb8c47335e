"""What the family parity tests share: a byte-level tokenizer for the tiny checkpoints' folders,
loading a saved folder with Helios's own loader, and the two sides' logits (transformers' forward,
and Helios's forward with a given attention backend, positions from ``start``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions, LoadableCausalLM
from helios.models.dense_attention import DenseAttention


def write_byte_tokenizer(root: Path, specials: Sequence[str] = ("<eos>", "<bos>")) -> None:
    """A 256-symbol BPE without merges (one id per byte-like symbol) plus ``specials``, and a
    tokenizer_config naming ``<eos>``: enough for the loader, the ids map one to one."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(0x100 + i): i for i in range(256)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "add_bos_token": False}))


def load_ours(root: Path, dtype: torch.dtype = torch.float32, *, architecture: str | None = None) -> LoadableCausalLM:
    """The saved folder as Helios loads it (``architecture``: the registry entry it must pick)."""
    checkpoint = load_checkpoint(root, dtype)
    if architecture is not None:
        assert checkpoint.architecture.name == architecture
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=dtype))
    model.load_weights(checkpoint.tensors)
    return model


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def our_logits(model: LoadableCausalLM, attn: DenseAttention, ids: list[int], start: int) -> Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(start, start + len(ids)), attn))
