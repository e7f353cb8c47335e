"""The default model on CUDA (the engine-vs-reference test runs on CUDA as a device parameter of
tests/unit/test_engine.py::test_engine_matches_dense_reference).

Skipped where no CUDA device is present (CPU CI); `scripts/gpu_check.sh` runs these on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from tests.unit.test_engine import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CPU CI skips CUDA tests)")


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
    core = EngineCore(model, EngineConfig(page_size=16, num_pages=64, max_active=4,
                                                       prefill_chunk_size=512, max_model_len=1024),
                      torch.float32, "cuda")
    outs = run(core, [EngineRequest("q", tuple(ids), SamplingParams(temperature=0.0), max_tokens=24,
                                    eos_token_ids=frozenset(tok.eos_token_ids))])
    text = tok.decode([t for o in outs["q"] for t in o.new_token_ids], skip_special_tokens=True)
    assert "Paris" in text, text
