"""Parity of the GGUF path: tiny transformers models written to GGUF files the way llama.cpp's
converter does (q/k rows permuted for the llama architecture; F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors),
loaded through `load_checkpoint`, against transformers on exactly the weights the file holds."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.gguf_loader import permute_rotary_rows, unpermute_rotary_rows
from helios.models.dense_attention import DenseAttention
from helios.models.llama import LlamaForCausalLM
from tests.numerics import FP32_TOLERANCE

Q = gguf.GGMLQuantizationType


_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def _tiny_hf_model(arch: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=50000.0))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=50000.0))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, rope_theta=50000.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model.eval()


def _write_gguf(path: Path, arch: str, model: torch.nn.Module, quantize: dict[str, Q]) -> dict[str, torch.Tensor]:
    """Write ``model`` the way llama.cpp's converter would; returns the weights as the file holds them."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny-test")
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [chr(0x100 + i) for i in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "x"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 258)
    as_stored: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        array = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            array = permute_rotary_rows(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = permute_rotary_rows(array, cfg.num_key_value_heads)
        qtype = next((q for key, q in quantize.items() if key in hf_name), Q.F32) if array.ndim == 2 else Q.F32
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(hf_name), array)
            stored = array
        elif qtype == Q.F16:
            writer.add_tensor(_gguf_name(hf_name), array.astype(np.float16))
            stored = array.astype(np.float16).astype(np.float32)
        else:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(_gguf_name(hf_name), packed, raw_dtype=qtype)
            stored = gguf.quants.dequantize(packed, qtype).reshape(array.shape)
        if arch == "llama" and ".q_proj." in hf_name:
            stored = unpermute_rotary_rows(stored, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            stored = unpermute_rotary_rows(stored, cfg.num_key_value_heads)
        as_stored[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return as_stored


@pytest.mark.parametrize(("arch", "quantize"), [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"mlp.": Q.Q8_0, "o_proj": Q.Q4_0, "q_proj": Q.Q4_1, "k_proj": Q.F16, "v_proj": Q.BF16,
               "embed": Q.Q8_0}),
])
def test_gguf_model_matches_transformers(tmp_path: Path, arch: str, quantize: dict[str, Q]) -> None:
    hf_model = _tiny_hf_model(arch)
    path = tmp_path / "tiny.gguf"
    stored = _write_gguf(path, arch, hf_model, quantize)
    with torch.no_grad():
        hf_model.load_state_dict(stored)  # the reference sees exactly the (de)quantized weights

    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.model_id == "tiny"  # the file name
    assert checkpoint.config.arch == arch
    assert checkpoint.config.attention_bias == (arch == "qwen2")
    assert checkpoint.config.qk_norm == (arch == "qwen3")
    assert not checkpoint.config.tie_word_embeddings
    assert checkpoint.tokenizer.eos_token_ids == (258, 256)  # eos, then <|endoftext|>
    model = LlamaForCausalLM(checkpoint.config)
    model.load_weights(checkpoint.tensors)

    ids = torch.tensor([5, 77, 200, 3, 259, 18, 140, 99, 7, 250])
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
        got = model.compute_logits(model(ids, torch.arange(len(ids)), DenseAttention.for_model(model)))
    diff = (got - expected).abs().max().item()
    print(f"gguf {arch} {sorted(quantize)}: max abs logit diff {diff:.3g} (logit scale {expected.abs().max():.3g})")
    assert diff < FP32_TOLERANCE
