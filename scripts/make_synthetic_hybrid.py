"""Build the synthetic Qwen3.5 hybrid benchmark model (issue 29): random weights, realistic proportions.

    .venv/bin/python scripts/make_synthetic_hybrid.py [--out ~/.cache/helios-synthetic/qwen3_5-hybrid]
        [--seed 0] [--force]

No small hybrid (recurrent + attention) checkpoint can be fetched here, so the checkpoint and
speculation figures for recurrent layouts are taken on this one:

1. A transformers ``Qwen3_5TextConfig`` (dense MLPs): 16 layers, three Gated DeltaNet layers then
   one full-attention layer, four times; hidden 1,024, MLP 3,072; attention 8 query / 2 KV heads of
   128 (Qwen3.5's gated attention, partial RoPE); Gated DeltaNet 8 key heads and 16 value heads of
   128, conv kernel 4; the Qwen2 vocabulary (151,936), tied embeddings.
2. Random weights, seeded per tensor as `make_synthetic_moe.py` seeds them: normal, std 0.02 for the
   matrices (0.005 for the two that write into the residual stream, ``o_proj`` and ``out_proj``),
   norm weights 0 (Qwen3.5's norms scale by 1 + w), the conv weights std 0.3, ``A_log`` the log of a
   uniform draw in (0.01, 1) and ``dt_bias`` 0. Saved with ``save_pretrained`` as bf16 safetensors.
3. The Qwen2 tokenizer of the Qwen2.5-Coder GGUF beside them (`make_synthetic_moe.save_tokenizer`):
   ``tokenizer.json``, ``tokenizer_config.json`` with its chat template, ``generation_config.json``.

Helios serves the folder (``helios serve FOLDER``). A few minutes on 2 cores, about 0.9 GB of disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_synthetic_moe import DEFAULT_TOKENIZER_GGUF, save_tokenizer, tensor_seed

DEFAULT_OUT = Path.home() / ".cache" / "helios-synthetic" / "qwen3_5-hybrid"


def model_config(vocab_size: int, bos_id: int, eos_id: int) -> Any:
    from transformers import Qwen3_5TextConfig

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 4
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=3072, num_hidden_layers=len(layer_types),
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
        linear_num_value_heads=16, layer_types=layer_types, tie_word_embeddings=True, bos_token_id=bos_id,
        eos_token_id=eos_id, pad_token_id=eos_id, rope_theta=1e7)


def fill(name: str, shape: tuple[int, ...], seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    if name.endswith("norm.weight"):
        return torch.zeros(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.01, 1.0, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.zeros(shape)
    std = 0.3 if name.endswith("conv1d.weight") else 0.005 if name.endswith(("o_proj.weight", "out_proj.weight")) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=g)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tokenizer-gguf", type=Path, default=DEFAULT_TOKENIZER_GGUF)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    out: Path = args.out.expanduser()
    if (out / "model.safetensors").exists() and not args.force:
        print(f"{out}: already built")
        return
    import torch
    from transformers import Qwen3_5ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ids = save_tokenizer(args.tokenizer_gguf, out)
    config = model_config(ids["vocab_size"], ids["bos"], ids["eos"])
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(fill(name, tuple(param.shape), args.seed))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    numel = sum(p.numel() for p in model.parameters())
    manifest = {"config": config.to_dict(), "parameters": numel, "seed": args.seed,
                "seconds": round(time.monotonic() - t0, 1)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    print(f"{out}: {numel / 1e6:.1f}M parameters in {manifest['seconds']} s")


if __name__ == "__main__":
    main()
