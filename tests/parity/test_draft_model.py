"""Draft-model speculation with real models (issue 33): Qwen2.5-Coder-1.5B drafted by -0.5B (one
tokenizer), and 0.5B drafted by itself (a cheap valid pair).

Greedy outputs are token-identical with and without the drafter, and so are seeded sampled ones; the
drafter's drafts are accepted (every one when the target drafts itself); a drafter with another
tokenizer (Qwen drafting for the default SmolLM2 model) is refused at start with a plain message.
The files come from the model catalog (fetched once, then cached); the loads use the packed-weight
cache.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.drafter import Drafter
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.models import cpu_kernels
from helios.runtime import LoadedModel

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_kernels.available(),
                       reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}"),
]

PROMPT = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n"
          "<|im_start|>assistant\n")


def _load(name: str) -> LoadedModel:
    from helios.loaders import catalog
    from helios.runtime import load_model

    torch.set_num_threads(1)
    return load_model(catalog.ensure(name, quiet=True), cache_dir=catalog.default_cache_dir() / "packed")


@pytest.fixture(scope="module")
def small() -> LoadedModel:
    return _load("qwen2.5-coder:0.5b")


def _drafter(loaded: LoadedModel, vocab_prefix: int = 0) -> Drafter:
    return Drafter(loaded.model, loaded.choice.dtype, num_pages=64, page_size=16, max_active=2, max_model_len=1024,
                   token_vocab_size=loaded.checkpoint.tokenizer.vocab_size, vocab_prefix=vocab_prefix)


def _run(target: LoadedModel, sampling: SamplingParams, max_tokens: int,
         drafter: Drafter | None = None) -> tuple[list[int], EngineCore]:
    cfg = EngineConfig(page_size=16, num_pages=64, max_active=2, max_model_len=1024,
                       speculative=SpeculativeConfig(mode="ngram" if drafter else "off", max_depth=4),
                       token_vocab_size=target.checkpoint.tokenizer.vocab_size)
    core = EngineCore(target.model, cfg, target.choice.dtype, drafter=drafter)
    ids = tuple(target.checkpoint.tokenizer.encode(PROMPT, add_special_tokens=False))
    core.add(EngineRequest("r", ids, sampling, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    while core.scheduler.has_work:
        for o in core.step():
            tokens += o.new_token_ids
    if drafter is not None:
        drafter.check_integrity(live=[])
        assert drafter.num_states == 0
    return tokens, core


def test_tokenizers_of_the_pair_match_and_smol_differs(small: LoadedModel) -> None:
    from helios.loaders import catalog
    from helios.loaders.checkpoint import load_checkpoint

    large = load_checkpoint(catalog.ensure("qwen2.5-coder:1.5b", quiet=True), torch.float32)
    assert small.checkpoint.tokenizer.vocabulary_difference(large.tokenizer) is None
    smol = load_checkpoint(catalog.ensure(catalog.DEFAULT_NAME, quiet=True), torch.float32)
    assert smol.tokenizer.vocabulary_difference(small.checkpoint.tokenizer) is not None


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)],
                         ids=["greedy", "seeded"])
def test_the_small_model_drafting_itself(small: LoadedModel, sampling: SamplingParams) -> None:
    want, _ = _run(small, sampling, 40)
    got, core = _run(small, sampling, 40, _drafter(small))
    assert got == want
    spec = core.stats().speculative
    assert spec is not None and spec.model_draft_rounds > 0
    if sampling.is_greedy:  # the same weights and kernels: its greedy drafts are the target's tokens
        assert spec.model_accepted_drafts >= 3 * spec.model_draft_rounds


@pytest.mark.parametrize("vocab_prefix", [0, 65536], ids=["whole-vocabulary", "first-65536-ids"])
def test_the_large_model_drafted_by_the_small_one(small: LoadedModel, vocab_prefix: int) -> None:
    """With the whole vocabulary and with the server's default ``draft_vocab`` (the drafts ranked over
    the first 65,536 ids: the 0.5B's Q8_0 head read for those rows alone)."""
    large = _load("qwen2.5-coder:1.5b")
    greedy = SamplingParams(temperature=0.0)
    want, _ = _run(large, greedy, 32)
    drafter = _drafter(small, vocab_prefix)
    assert drafter.vocab_prefix == vocab_prefix
    got, core = _run(large, greedy, 32, drafter)
    assert got == want
    spec = core.stats().speculative
    assert spec is not None and spec.model_draft_rounds > 0 and spec.model_accepted_drafts > 0


def test_a_draft_model_with_another_tokenizer_is_refused() -> None:
    from helios.config import ConfigError, HeliosConfig, SpeculativeSection
    from helios.loaders import catalog
    from helios.loaders.checkpoint import load_checkpoint
    from helios.runtime import load_drafter

    smol = load_checkpoint(catalog.ensure(catalog.DEFAULT_NAME, quiet=True), torch.float32)
    cfg = attrs.evolve(HeliosConfig(), speculative=SpeculativeSection(mode="ngram",
                                                                      draft_model="qwen2.5-coder:0.5b"))
    with pytest.raises(ConfigError, match="cannot draft for this model: its tokenizer differs"):
        load_drafter(cfg, smol.tokenizer, num_pages=8, max_model_len=256,
                     cache_dir=catalog.default_cache_dir() / "packed")
