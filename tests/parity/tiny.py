"""What the family parity tests share: a byte-level tokenizer for the tiny checkpoints' folders,
loading a saved folder with Helios's own loader, and the two sides' logits (transformers' forward,
and Helios's forward with a given attention backend, positions from ``start``); the tiny DeepSeek V4
(`tiny_deepseek_v4`); an engine with an MTP drafter and a loop that steps it with integrity checks
(`mtp_engine`, `drive_mtp`: the MTP tests)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from helios.engine.core import EngineConfig, EngineCore
from helios.engine.mtp import MTPDrafter
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions, LoadableCausalLM
from helios.models.deepseek_v4 import CSA, HCA, SLIDING
from helios.models.dense_attention import DenseAttention
from helios.models.mtp import MultiTokenPredictor


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


DEEPSEEK_V4_CONFIG: dict[str, Any] = dict(
    vocab_size=272, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, layer_types=[SLIDING, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 8}, hc_mult=3,
    hc_sinkhorn_iters=6, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], sliding_window=16, o_groups=2,
    o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=5, swiglu_limit=0.8, max_position_embeddings=512,
    pad_token_id=0, bos_token_id=2, eos_token_id=1)
"""The tiny DeepSeek V4 of the parity tests (`tests/parity/test_deepseek_v4_parity.py` says what it exercises)."""


def tiny_deepseek_v4(**overrides: Any) -> torch.nn.Module:
    """transformers' ``DeepseekV4ForCausalLM`` of `DEEPSEEK_V4_CONFIG` and ``overrides`` (eager
    attention), its weights seeded random: norms near 1, the rest N(0, 0.2), hash tables and router
    biases random."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV4Config(**{**DEEPSEEK_V4_CONFIG, **overrides})
    config._attn_implementation = "eager"
    model = transformers.DeepseekV4ForCausalLM(config)
    randomize(model, 0)
    return model.eval()


def randomize(model: torch.nn.Module, seed: int, *, hash_experts: int = 8) -> None:
    """Seed ``seed``, then every parameter of ``model`` random: norms near 1, the rest N(0, 0.2);
    router correction biases 0.1 N(0, 1), hash-routing tables (``tid2eid``) random experts below
    ``hash_experts``."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, hash_experts, buffer.shape))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))


def follow_cycle(model: torch.nn.Module, g: torch.Generator, outputs: tuple[str, ...],
                 scale: float) -> tuple[list[int], Tensor, Tensor]:
    """Make ``model`` (a transformers causal LM) follow a cycle through the tokens 3..vocab-1: a
    random embedding (from ``g``), a head mapping each token's embedding to its successor's logit,
    the final norm 1, and every parameter named with one of ``outputs`` (the layers' output
    projections) scaled by ``scale`` so the residual stays near the embedding. The successor table,
    the embedding and the head."""
    vocab, hidden = model.model.embed_tokens.weight.shape
    order = (torch.randperm(vocab - 3, generator=g) + 3).tolist()
    successor = list(range(vocab))
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        successor[a] = b
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.zeros(vocab, hidden)
    head[torch.tensor(successor)] = 4.0 * embed  # logits[successor[t]] = 4 <e_t, x>
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        model.model.norm.weight.fill_(1.0)
        for name, param in model.named_parameters():
            if name.endswith(outputs):
                param.mul_(scale)
    return successor, embed, head


def mtp_engine(target: LoadableCausalLM, predictor: MultiTokenPredictor, *, mtp: bool, num_pages: int = 64,
               mode: str = "ngram", depth: int = 3, chunk: int = 5, max_active: int = 3,
               max_model_len: int = 128) -> tuple[EngineCore, MTPDrafter | None]:
    """An engine over ``target`` (pages of 4, prefill chunks of ``chunk``), speculating in ``mode``
    (up to ``depth`` drafts, no history lookups) with ``predictor`` as its MTP drafter when ``mtp``,
    else without speculation; the drafter (None without)."""
    cfg = EngineConfig(page_size=4, num_pages=num_pages, max_active=max_active, prefill_chunk_size=chunk,
                       max_model_len=max_model_len,
                       speculative=SpeculativeConfig(mode=mode if mtp else "off", max_depth=depth, history=False))
    drafter = MTPDrafter(predictor, torch.float32, num_pages=num_pages + max_active, page_size=4,
                         max_active=max_active, max_model_len=max_model_len) if mtp else None
    return EngineCore(target, cfg, torch.float32, drafter=drafter), drafter


def drive_mtp(core: EngineCore, drafter: MTPDrafter | None, requests: Sequence[EngineRequest],
              abort_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Step to completion, checking both pools after every step and that the MTP drafter holds state
    for live requests only (``abort_at``: abort a request once it has that many tokens); each
    request's tokens."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add(r)
    for _ in range(2000):
        if not core.scheduler.has_work:
            break
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
        for rid, n in (abort_at or {}).items():
            if len(tokens[rid]) >= n and rid in core.scheduler.by_id:
                core.abort([rid])
        core.scheduler.check_integrity()
        if drafter is not None:
            drafter.check_integrity(live=list(core.scheduler.by_id))
    assert not core.scheduler.has_work
    if drafter is not None:
        drafter.check_integrity(live=[])
        assert drafter.num_states == 0
    return tokens
