"""`LlamaForCausalLM.forward(embeds=...)`: given rows take the given features before layer 0."""

from __future__ import annotations

import torch

from helios.models.config import ModelConfig
from helios.models.dense_attention import DenseAttention
from helios.models.llama import LlamaForCausalLM

CFG = ModelConfig(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def test_embeds_replace_rows_before_layer_zero() -> None:
    model = _model()
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    pos = torch.arange(6)
    rows = torch.tensor([2, 4])
    features = torch.randn(2, CFG.hidden_size)
    with torch.no_grad():
        got = model(ids, pos, DenseAttention.for_model(model), embeds=(rows, features))
        # The same rows injected by hand: zero the embedding table's row of a fresh id and compare.
        h = model.embed_tokens[ids].clone()
        h[rows] = features
        plain = model(ids, pos, DenseAttention.for_model(model))
        table = model.embed_tokens.detach().clone()
        extended = torch.cat([table, features])
        model.embed_tokens.data = extended
        ids2 = ids.clone()
        ids2[rows] = torch.tensor([CFG.vocab_size, CFG.vocab_size + 1])
        want = model(ids2, pos, DenseAttention.for_model(model))
        model.embed_tokens.data = table
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[:2], plain[:2])  # rows before the first injected one are causal-unaffected
    assert not torch.allclose(got[2:], plain[2:])


def test_no_embeds_is_the_plain_forward() -> None:
    model = _model()
    ids = torch.tensor([7, 8, 9])
    with torch.no_grad():
        a = model(ids, torch.arange(3), DenseAttention.for_model(model))
        b = model(ids, torch.arange(3), DenseAttention.for_model(model), embeds=None)
    assert torch.equal(a, b)
