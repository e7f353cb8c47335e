"""A digest of every engine output for a fixed workload on the default model, to compare two trees.

    .venv/bin/python scripts/output_digest.py [--speculative MODE]

Runs three prompts (greedy with top-5 logprobs, seeded top-p sampling, one prompt-scoring request)
through `EngineCore` in chunks of 64 and prints the SHA-256 of every `RequestOutput`'s tokens,
logprobs, prompt logprobs, finish and forced indices. Run it from two checkouts (each with
``PYTHONPATH`` at its root): equal digests mean bit-identical outputs. Works with trees before the
cache-spec engine too (their `EngineCore` took the model config).
"""
import argparse
import hashlib
import inspect
import json

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.loaders.default_model import default_cache_dir, ensure_default_model
from helios.runtime import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--speculative", default="off", help="[speculative] mode: off, ngram or adaptive")
args = ap.parse_args()
loaded = load_model(ensure_default_model(), cache_dir=default_cache_dir() / "packed")
cfg = EngineConfig(page_size=16, num_pages=400, max_active=8, prefill_chunk_size=64, max_model_len=2048,
                   speculative=SpeculativeConfig(mode=args.speculative))
params = list(inspect.signature(EngineCore.__init__).parameters)
if "model_config" in params:
    core = EngineCore(loaded.model, loaded.checkpoint.config, cfg, loaded.choice.dtype)
else:
    core = EngineCore(loaded.model, cfg, loaded.choice.dtype)
tok = loaded.checkpoint.tokenizer
def ids(text):
    return tuple(tok.encode(text))
prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
           "The quick brown fox " * 30]
reqs = []
for i, p in enumerate(prompts):
    reqs.append(EngineRequest(f"g{i}", ids(p), SamplingParams(temperature=0.0), max_tokens=40, num_top_logprobs=5))
    reqs.append(EngineRequest(f"s{i}", ids(p), SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i), max_tokens=40,
                              num_top_logprobs=2))
reqs.append(EngineRequest("p0", ids(prompts[2]), SamplingParams(temperature=0.0), max_tokens=0, prompt_logprobs=3))
for r in reqs:
    core.add(r)
out = {}
steps = 0
while core.scheduler.has_work:
    for o in core.step():
        rec = out.setdefault(o.request_id, [])
        rec.append(repr((o.new_token_ids, o.logprobs, o.prompt_logprobs, o.finish, o.forced)))
    steps += 1
digest = hashlib.sha256()
for rid in sorted(out):
    digest.update(rid.encode())
    digest.update("".join(out[rid]).encode())
print(json.dumps({"steps": steps, "digest": digest.hexdigest(), "n": {k: len(v) for k, v in sorted(out.items())}}))
