"""Would int8 activations keep the default model's answers? The evidence behind not multiplying
prefill projections in int8 (docs/benchmarks.md, "512-token TTFT, each server alone").

    .venv/bin/python scripts/probe_int8_activations.py [--weights float32]

Runs three greedy prompts on the default model twice: as loaded, and with every projection's input
rounded the way llama.cpp's Q8 activation blocks round it (32 columns per block, one float scale
max|x| / 127 per block, codes round(x / scale)), which an int8 x int8 GEMM would need. Prints the
answers and the first token's two best logprobs of each. The weights stay the checkpoint's.
"""

from __future__ import annotations

import argparse

import jinja2.sandbox
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.loaders.default_model import ensure_default_model
from helios.models import cpu_kernels, quant
from helios.runtime import load_model

QUESTIONS = ("What is the capital of France?", "What is the capital of Germany?", "Write a haiku about the sea.")


def q8_blocks(x: Tensor) -> Tensor:
    """``x`` rounded to Q8 blocks of 32 columns (a scale per block, int8 codes), back in its dtype."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (codes * scale).reshape(x.shape).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="float32", help="dense weights, so that every projection is one matmul")
    args = ap.parse_args()
    rounding = {"on": False}
    plain = quant.dense_matmul

    def dense_matmul(x: Tensor, w: Tensor | None, onednn: Tensor | None = None) -> Tensor:
        return plain(q8_blocks(x) if rounding["on"] else x, w, onednn)

    quant.dense_matmul = dense_matmul  # type: ignore[assignment]
    cpu_kernels.set_enabled(False)  # the dense projections go through dense_matmul (the head is kept)
    loaded = load_model(ensure_default_model(), weights=args.weights, dtype=args.weights, cache_dir=None)
    tok = loaded.checkpoint.tokenizer
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        loaded.checkpoint.chat_template)
    torch.set_grad_enabled(False)
    for question in QUESTIONS:
        ids = tok.encode(template.render(messages=[{"role": "user", "content": question}],
                                         add_generation_prompt=True))
        for on in (False, True):
            rounding["on"] = on
            core = EngineCore(loaded.model,
                              EngineConfig(page_size=16, num_pages=64, max_active=4, prefill_chunk_size=512,
                                           max_model_len=1024), loaded.choice.dtype)
            core.add(EngineRequest("r", tuple(ids), SamplingParams(temperature=0.0), max_tokens=12,
                                   num_top_logprobs=2))
            out: list[int] = []
            first = None
            while core.scheduler.has_work:
                for o in core.step():
                    out += o.new_token_ids
                    if first is None and o.logprobs:
                        first = o.logprobs[0]
            assert first is not None
            top = ", ".join(f"{tok.decode([t])!r} {lp:.4f}" for t, lp in first.top)
            print(f"{question!r} {'Q8 activations' if on else 'as loaded     '}: {tok.decode(out)!r}; first token {top}")


if __name__ == "__main__":
    main()
