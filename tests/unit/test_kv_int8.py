"""`[engine] kv_dtype = "int8"` end to end: the configuration key, and the default model
(SmolLM2-135M, loaded as `helios serve` loads it) served from an int8 KV cache: the greedy answer,
prefix-cache hits, host-store restores and speculative verification over int8 pages.

The numbers (logprob drift against the default cache, decode speed) are in docs/benchmarks.md,
"Int8 KV cache"; these tests pin behaviour, not drift."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.config import ConfigError, load_config
from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.runtime import LoadedModel, load_model
from tests.unit.test_engine import run

ANSWER = "The capital of France is Paris."


# -- configuration -------------------------------------------------------------------------------------


def test_kv_dtype_defaults_to_auto_and_takes_int8(tmp_path: Path) -> None:
    assert load_config(None, {}).engine.kv_dtype == "auto"
    toml = tmp_path / "helios.toml"
    toml.write_text('[engine]\nkv_dtype = "int8"\n')
    assert load_config(toml).engine.kv_dtype == "int8"


@pytest.mark.parametrize("value", ["fp8", "INT8", "bfloat16", 8, True])
def test_an_unknown_kv_dtype_is_refused_by_name(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^engine\.kv_dtype must be one of auto, int8, got "):
        load_config(None, {"engine": {"kv_dtype": value}})


def test_kv_prefault_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.kv_prefault must be true or false, got 'yes'"):
        load_config(None, {"engine": {"kv_prefault": "yes"}})


def test_the_engine_refuses_an_unknown_kv_dtype() -> None:
    from tests.unit.test_engine import tiny_model

    with pytest.raises(ValueError, match="kv_dtype must be one of auto, int8, got 'fp8'"):
        EngineCore(tiny_model(), EngineConfig(num_pages=8, kv_dtype="fp8"), torch.float32)


# -- the default model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    from helios.loaders.default_model import ensure_default_model

    return load_model(ensure_default_model(quiet=True))


@pytest.fixture(scope="module")
def loaded32() -> LoadedModel:
    """The default model in float32: its rows do not depend on how many share a step (a bfloat16
    model's prefill drifts by up to ~0.06 in a logprob between a chunk of 70 rows and one of 22, with
    any KV dtype), so a prefix hit must reproduce the tokens of no hit."""
    from helios.loaders.default_model import ensure_default_model

    return load_model(ensure_default_model(quiet=True), weights="float32")


def _prompt(loaded: LoadedModel, question: str) -> list[int]:
    from helios.loaders.chat_template import ChatTemplate

    ckpt = loaded.checkpoint
    assert ckpt.chat_template is not None
    text = ChatTemplate(ckpt.chat_template).render([{"role": "user", "content": question}])
    ids: list[int] = ckpt.tokenizer.encode(text, add_special_tokens=False)
    return ids


def _engine(loaded: LoadedModel, kv_dtype: str = "int8", **kw: object) -> EngineCore:
    settings: dict[str, object] = {"page_size": 16, "num_pages": 64, "max_active": 4, "prefill_chunk_size": 512,
                                   "max_model_len": 1024, "kv_dtype": kv_dtype, "fingerprint": b"default-model", **kw}
    cfg = EngineConfig(**settings)  # type: ignore[arg-type]
    return EngineCore(loaded.model, cfg, loaded.choice.dtype)


def _greedy(core: EngineCore, loaded: LoadedModel, rid: str, ids: list[int],
            max_tokens: int = 24) -> tuple[list[int], int]:
    """The greedy tokens of one request and its cached prompt tokens."""
    tokens, _, cached = _greedy_logprobs(core, loaded, rid, ids, max_tokens)
    return tokens, cached


def _greedy_logprobs(core: EngineCore, loaded: LoadedModel, rid: str, ids: list[int],
                     max_tokens: int) -> tuple[list[int], list[float], int]:
    """The greedy tokens of one request, their logprobs and its cached prompt tokens."""
    eos = frozenset(loaded.checkpoint.tokenizer.eos_token_ids)
    outs = run(core, [EngineRequest(rid, tuple(ids), SamplingParams(temperature=0.0), max_tokens=max_tokens,
                                    eos_token_ids=eos, num_top_logprobs=0)])[rid]
    logprobs = [lp.logprob for o in outs for lp in (o.logprobs or ())]
    return [t for o in outs for t in o.new_token_ids], logprobs, max(o.num_cached_tokens for o in outs)


@pytest.mark.slow
def test_the_default_model_answers_paris_from_an_int8_cache(loaded: LoadedModel) -> None:
    tok = loaded.checkpoint.tokenizer
    core = _engine(loaded)
    assert core.kv.k[0].dtype == torch.int8 and core.kv.is_quantized(29)
    tokens, _ = _greedy(core, loaded, "q", _prompt(loaded, "What is the capital of France?"))
    assert tok.decode(tokens, skip_special_tokens=True) == ANSWER


@pytest.mark.slow
def test_an_int8_prefix_hit_gives_the_tokens_of_no_hit(loaded32: LoadedModel) -> None:
    """The same long prompt twice on one engine: the second reuses the first's int8 pages (its
    remaining prompt tokens attend to their dequantized rows) and must produce the greedy tokens of
    an engine without the prefix cache, their logprobs to float32 noise."""
    loaded = loaded32
    ids = _prompt(loaded, "Explain in two sentences why the sky is blue, and then name three primary colors. "
                          "Keep the answer short and plain.")
    cold, cold_lp, _ = _greedy_logprobs(_engine(loaded, prefix_caching=False), loaded, "cold", ids, 32)
    core = _engine(loaded)
    first, _, cached_first = _greedy_logprobs(core, loaded, "a", ids, 32)
    again, again_lp, cached = _greedy_logprobs(core, loaded, "b", ids, 32)
    assert cached_first == 0 and cached == (len(ids) - 1) // 16 * 16 and cached > 0
    assert first == cold and again == cold
    assert max(abs(a - b) for a, b in zip(again_lp, cold_lp, strict=True)) < 1e-3


@pytest.mark.slow
def test_speculative_verification_over_int8_pages(loaded32: LoadedModel) -> None:
    """n-gram drafts verified over the int8 cache (the verification chunk reads the dequantized
    context): the tokens of plain int8 decoding (float32 model: see `loaded32`)."""
    loaded = loaded32
    ids = _prompt(loaded, "What is the capital of France?")
    plain, _ = _greedy(_engine(loaded), loaded, "p", ids)
    core = _engine(loaded, speculative=SpeculativeConfig(mode="ngram", max_depth=4))
    drafted, _ = _greedy(core, loaded, "s", ids)
    assert core.scheduler.spec_stats.snapshot().verification_drafts > 0
    assert drafted == plain
