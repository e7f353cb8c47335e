"""The engine on CUDA against the same independent references as on the CPU.

Skipped where no CUDA device is present (CPU CI); `scripts/gpu_check.sh` runs these on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineFinish, EngineRequest
from tests.unit.test_engine import CFG, dense_logprobs, run, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CPU CI skips CUDA tests)")


@pytest.mark.parametrize("num_pages", [64, 14])
def test_engine_on_cuda_matches_dense_cpu_reference(num_pages: int) -> None:
    cpu_model = tiny_model()
    gpu_model = tiny_model().to("cuda")
    core = EngineCore(gpu_model, CFG, EngineConfig(page_size=4, num_pages=num_pages, max_active=8,
                                                   prefill_chunk_size=7, max_model_len=128), torch.float32, "cuda")
    prompts = [[(7 * i + 3 * j) % CFG.vocab_size for j in range(n)] for i, n in enumerate((3, 10, 17, 25))]
    reqs = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=1.0, seed=i), max_tokens=12,
                          ignore_eos=True, num_top_logprobs=5) for i, p in enumerate(prompts)]
    outs = run(core, reqs)
    worst = 0.0
    for req, prompt in zip(reqs, prompts, strict=True):
        records = outs[req.request_id]
        assert records[-1].finish is EngineFinish.LENGTH
        tokens = [t for o in records for t in o.new_token_ids]
        lps = [lp for o in records for lp in (o.logprobs or ())]
        ref = dense_logprobs(cpu_model, prompt + tokens)
        for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
            worst = max(worst, abs(lp.logprob - ref[len(prompt) - 1 + i, tok].item()))
    # TF32 matmuls are off by default in torch, so fp32 keeps the CPU bound.
    assert worst < 1e-4, worst
    assert core.kv_manager.num_free == num_pages


def test_default_model_answers_paris_on_cuda() -> None:
    from helios.loaders.checkpoint import load_checkpoint
    from helios.loaders.default_model import ensure_default_model
    from helios.models.llama import LlamaForCausalLM

    ckpt = load_checkpoint(str(ensure_default_model()), torch.float32)
    model = LlamaForCausalLM(ckpt.config, dtype=torch.float32, device="cuda")
    model.load_weights(ckpt.tensors)
    tok = ckpt.tokenizer
    assert ckpt.chat_template is not None
    from helios.loaders.chat_template import ChatTemplate

    prompt = ChatTemplate(ckpt.chat_template).render([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    core = EngineCore(model, ckpt.config, EngineConfig(page_size=16, num_pages=64, max_active=4,
                                                       prefill_chunk_size=512, max_model_len=1024),
                      torch.float32, "cuda")
    outs = run(core, [EngineRequest("q", tuple(ids), SamplingParams(temperature=0.0), max_tokens=24,
                                    eos_token_ids=frozenset(tok.eos_token_ids))])
    text = tok.decode([t for o in outs["q"] for t in o.new_token_ids], skip_special_tokens=True)
    assert "Paris" in text, text
