"""A tiny random llama-architecture GGUF file, written with the ``gguf`` package (llama.cpp's own
writer and quantizers), for loader, weight-format and cache tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 260
HEAD_DIM = HIDDEN // HEADS


def write_tiny_gguf(path: Path, *, projections: Q = Q.Q4_1, embeddings: Q = Q.Q8_0, seed: int = 0) -> Path:
    """Random weights (norms near 1); projections and the tied embeddings in the given types."""
    rng = np.random.default_rng(seed)
    arch = "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny-test")
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.context_length", 256)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", INTER)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_bool("general.test_flag", True)
    writer.add_array("general.test_floats", [0.5, -1.25])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [chr(0x100 + i) for i in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "x"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 258)

    def add(name: str, array: np.ndarray, qtype: Q) -> None:
        array = array.astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, array)
        elif qtype == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", 0.5 * rng.standard_normal((VOCAB, HIDDEN)), embeddings)
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), Q.F32)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for layer in range(LAYERS):
        add(f"blk.{layer}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), Q.F32)
        add(f"blk.{layer}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), Q.F32)
        for part, shape in shapes.items():
            add(f"blk.{layer}.{part}.weight", 0.15 * rng.standard_normal(shape), projections)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
