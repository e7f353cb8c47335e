"""Numerical parity of `LlamaForCausalLM` with transformers on random tiny models.

Each model is saved with ``save_pretrained(safe_serialization=True)`` and loaded back through
`load_checkpoint`'s safetensors path, then compared: logits of a whole prompt, chunked prefill plus
token-by-token decode with `DenseAttention`, greedy continuations, and a flattened two-sequence batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helios.loaders.checkpoint import load_checkpoint
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.llama import LlamaForCausalLM
from tests.numerics import FP32_TOLERANCE, tolerance_for

transformers = pytest.importorskip("transformers")

VOCAB = 272
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271]

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}


def _llama3() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, rope_theta=500000.0,
                                                                  rope_scaling=_LLAMA3_ROPE))


def _smollm_like() -> torch.nn.Module:  # tied embeddings, linear rope scaling, MHA
    cfg = {**_COMMON, "num_key_value_heads": 4}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **cfg, tie_word_embeddings=True, rope_theta=100000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}))


def _mistral() -> torch.nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON, head_dim=16, rope_theta=1e6))


def _qwen2() -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True))


def _qwen3() -> torch.nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON, head_dim=32, rope_theta=1e6))


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama3": _llama3, "smollm": _smollm_like, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
}


def _write_tokenizer(root: Path) -> None:
    """A byte-level BPE tokenizer without merges: enough for `load_checkpoint` to find one."""
    tokenizers = pytest.importorskip("tokenizers")
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    spelled = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    vocab = {spelled[b]: b for b in range(256)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.save(str(root / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": template, "add_bos_token": False}))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that every part of the network moves the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    name = request.param
    hf_model = MODELS[name]()
    _randomize(hf_model, seed=sorted(MODELS).index(name))
    hf_model.eval()
    root = tmp_path_factory.mktemp(name)
    # Small shards for one model, so the sharded index path is exercised too.
    shard = {"max_shard_size": "40KB"} if name == "llama3" else {}
    hf_model.save_pretrained(root, safe_serialization=True, **shard)
    _write_tokenizer(root)
    return hf_model, root


def _ours(root: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    checkpoint = load_checkpoint(root, dtype)
    model = LlamaForCausalLM(checkpoint.config, dtype=dtype)
    model.load_weights(checkpoint.tensors)
    return model


def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _report(label: str, diff: float, scale: float) -> None:
    print(f"{label}: max abs logit diff {diff:.3g} (max |logit| {scale:.3g})")


def test_checkpoint_metadata(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.float32)
    assert checkpoint.model_id == root.name
    assert checkpoint.source_path == str(root)
    assert checkpoint.config.vocab_size == VOCAB
    assert checkpoint.config.tie_word_embeddings == bool(hf_model.config.tie_word_embeddings)
    assert checkpoint.chat_template is not None and "<|im_start|>" in checkpoint.chat_template
    assert checkpoint.tokenizer.eos_token_ids[0] == checkpoint.tokenizer.token_to_id("<|endoftext|>")
    assert "<|im_end|>" in [checkpoint.tokenizer.id_to_token(i) for i in checkpoint.tokenizer.eos_token_ids]


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = _ours(root)
    expected = _hf_logits(hf_model, PROMPT)
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model))
        got = model.compute_logits(hidden)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    _report(f"{root.name} prompt fp32", diff, expected.abs().max().item())
    assert expected.abs().max().item() > 1.0  # the comparison is not between near-zero logits
    assert diff < FP32_TOLERANCE


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = _ours(root)
    expected = _hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)  # forces the K/V buffers to grow
    chunks = [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, len(PROMPT))]
    outputs = []
    with torch.no_grad():
        for start, end in chunks:
            hidden = model(torch.tensor(PROMPT[start:end]), torch.arange(start, end), attn)
            outputs.append(model.compute_logits(hidden))
    assert attn.num_tokens == len(PROMPT)
    diff = (torch.cat(outputs) - expected).abs().max().item()
    _report(f"{root.name} incremental fp32", diff, expected.abs().max().item())
    assert diff < FP32_TOLERANCE


def test_greedy_generation(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = _ours(root)
    ids = list(PROMPT[:6])
    for _ in range(10):
        ids.append(int(_hf_logits(hf_model, ids)[-1].argmax()))
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=10) == ids[6:]


def test_flattened_batch_of_two_sequences(pair: tuple[torch.nn.Module, Path]) -> None:
    """Rows of different sequences in one forward, each at its own positions."""
    hf_model, root = pair
    model = _ours(root)
    first, second = PROMPT[:7], PROMPT[3:]
    backends = [DenseAttention.for_model(model), DenseAttention.for_model(model)]

    def two_sequences(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = len(first)
        return torch.cat([backends[0](layer_idx, q[:n], k[:n], v[:n]), backends[1](layer_idx, q[n:], k[n:], v[n:])])

    with torch.no_grad():
        hidden = model(torch.tensor(first + second),
                       torch.cat([torch.arange(len(first)), torch.arange(len(second))]), two_sequences)
        got = model.compute_logits(hidden)
    expected = torch.cat([_hf_logits(hf_model, first), _hf_logits(hf_model, second)])
    diff = (got - expected).abs().max().item()
    _report(f"{root.name} flat batch fp32", diff, expected.abs().max().item())
    assert diff < FP32_TOLERANCE


@pytest.mark.parametrize("lm_head_fp32", [False, True])
def test_bfloat16_close_to_float32(pair: tuple[torch.nn.Module, Path], lm_head_fp32: bool) -> None:
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = LlamaForCausalLM(checkpoint.config, dtype=torch.bfloat16, lm_head_fp32=lm_head_fp32)
    model.load_weights(checkpoint.tensors)
    assert model.embed_tokens.dtype == torch.bfloat16
    expected = _hf_logits(hf_model, PROMPT)
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model))
        got = model.compute_logits(hidden)
    assert hidden.dtype == torch.bfloat16 and got.dtype == torch.float32
    if lm_head_fp32:  # logits not rounded to bf16
        assert torch.allclose(got, hidden.float() @ model.lm_head.float().t(), atol=1e-4, rtol=0)
    diff = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    _report(f"{root.name} prompt bf16 (lm_head_fp32={lm_head_fp32}) vs fp32 reference", diff, scale)
    # Rounding to bf16 at every layer moved these logits by up to 0.028 * scale (7 roundings of
    # 2**-8), with native AVX512-BF16 kernels and with AVX2 ones alike; 13 roundings leave ~2x.
    assert diff < tolerance_for(torch.bfloat16, scale, roundings=13)


def test_load_weights_reports_missing_and_unexpected(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    checkpoint = load_checkpoint(root, torch.float32)
    model = LlamaForCausalLM(checkpoint.config)
    tensors = dict(checkpoint.tensors)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weights.*up_proj"):
        model.load_weights(missing)
    with pytest.raises(ValueError, match=r"unexpected weights.*bogus"):
        model.load_weights({**tensors, "model.layers.0.bogus.weight": torch.zeros(1)})
    wrong = {**tensors, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected shape"):
        model.load_weights(wrong)
