"""Compare servers' next-token top-20 on the synthetic MoE with a float32 reference of the same file.

    .venv/bin/python scripts/check_synthetic_moe.py [--gguf FILE] [--hf DIR] \
        [--server helios=http://127.0.0.1:8011] [--server llama=http://127.0.0.1:8083]

The reference: every tensor of the GGUF dequantized by llama.cpp's gguf-py (``--llama-src``), put
into transformers' ``Qwen3MoeForCausalLM`` (config and tokenizer from the HF folder that
`scripts/make_synthetic_moe.py` wrote), one forward per prompt with float32 and then bfloat16
activations. For each server (``/v1/completions``, ``max_tokens`` 1, greedy, ``logprobs`` 20) it
prints how many of its top-20 tokens are in the reference's top-20, the reference rank of its top-1
and how far its logprobs are from the reference's. The random model's next-token distribution is
nearly flat and rounding moves it, so compare a server with the float32-against-bfloat16 spread
printed first, not with 20/20 (which a server with float32 activations should give).
Needs about 6 GB of memory (the float32 model).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

HOME = Path.home()
OUT = HOME / ".cache" / "helios-synthetic" / "qwen3moe-a0.2b"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")

# GGUF tensor -> transformers parameter, per layer (the experts' gate and up are concatenated).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def reference_model(gguf_path: Path, hf_dir: Path, llama_src: Path) -> Any:
    import numpy as np
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    sys.path.insert(0, str(llama_src / "gguf-py"))
    from gguf import GGUFReader
    from gguf.quants import dequantize

    weights = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in GGUFReader(str(gguf_path)).tensors}
    config = AutoConfig.from_pretrained(hf_dir)
    state = {"model.embed_tokens.weight": weights["token_embd.weight"],
             "model.norm.weight": weights["output_norm.weight"]}
    if "output.weight" in weights:
        state["lm_head.weight"] = weights["output.weight"]
    for i in range(config.num_hidden_layers):
        for gguf_name, hf_name in LAYER_TENSORS.items():
            state[f"model.layers.{i}.{hf_name}"] = weights[f"blk.{i}.{gguf_name}.weight"]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
            [weights[f"blk.{i}.ffn_gate_exps.weight"], weights[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
    with torch.device("meta"):  # no random init, no second copy: the tensors above are assigned
        model = Qwen3MoeForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"weights not mapped: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers, computed on the CPU
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SystemExit(f"tensors left on the meta device: {left}")
    return model.float().eval()


def server_top(url: str, prompt: str) -> dict[str, float]:
    body = {"model": "x", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 20}
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        logprobs = json.load(response)["choices"][0]["logprobs"]
    if logprobs.get("top_logprobs"):
        return dict(logprobs["top_logprobs"][0])
    return {entry["token"]: entry["logprob"] for entry in logprobs["content"][0]["top_logprobs"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=OUT / "synthetic-qwen3moe-1b-a0.2b-Q4_K_M.gguf")
    parser.add_argument("--hf", type=Path, default=OUT / "hf")
    parser.add_argument("--llama-src", type=Path,
                        default=HOME / ".cache" / "helios-peers" / "llama-src" / "vendor" / "llama.cpp")
    parser.add_argument("--server", action="append", default=[], metavar="NAME=URL")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    servers = dict(spec.split("=", 1) for spec in args.server)
    tops = {name: [server_top(url, p) for p in PROMPTS] for name, url in servers.items()}
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    model = reference_model(args.gguf.expanduser(), args.hf.expanduser(), args.llama_src.expanduser())
    with torch.no_grad():
        ids = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
        fp32 = [torch.log_softmax(model(x).logits[0, -1].double(), -1) for x in ids]
        model.bfloat16()
        bf16 = [torch.log_softmax(model(x).logits[0, -1].double(), -1) for x in ids]
    for j, prompt in enumerate(PROMPTS):
        ref, low = fp32[j], bf16[j]
        ref_top = set(ref.topk(20).indices.tolist())
        corr = float(torch.corrcoef(torch.stack([ref, low]))[0, 1])
        print(f"{prompt!r}: reference top-3 "
              f"{[(tokenizer.decode([i]), round(float(ref[i]), 3)) for i in ref.topk(3).indices.tolist()]}")
        print(f"  bfloat16 activations: top-20 overlap {len(ref_top & set(low.topk(20).indices.tolist()))}/20, "
              f"logit correlation {corr:.3f}")
        for name, top in tops.items():
            token_ids: list[list[int]] = [tokenizer.encode(t, add_special_tokens=False) for t in top[j]]
            known = [(ids_[0], lp) for ids_, lp in zip(token_ids, top[j].values(), strict=True) if len(ids_) == 1]
            overlap = len({i for i, _ in known} & ref_top)
            first_rank = int((ref > ref[known[0][0]]).sum()) + 1 if known else None
            diffs = [abs(float(ref[i]) - lp) for i, lp in known]
            print(f"  {name}: top-20 overlap {overlap}/20, its top-1 at reference rank {first_rank}, "
                  f"|logprob - reference| mean {sum(diffs) / max(len(diffs), 1):.3f} max {max(diffs, default=0):.3f}")


if __name__ == "__main__":
    main()
