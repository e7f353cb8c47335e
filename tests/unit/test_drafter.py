"""Draft-model speculation (helios/engine/drafter.py) on tiny random models.

The target's outputs never depend on the drafter: greedy and seeded sampled tokens are identical with
and without one, whether the drafter is the target itself (every draft accepted) or another random
model (most drafts rejected: rollback on both sides every round). The drafter's state is released
when a request finishes, is aborted or is preempted, and its pool passes its integrity checks
after every step. The real-model pair (Qwen2.5-Coder 1.5B drafted by 0.5B) is in
tests/parity/test_draft_model.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.drafter import Drafter
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.models import cpu_kernels
from helios.models.interface import PrefixLogitsLM
from helios.models.llama import LlamaForCausalLM
from tests.unit.test_engine import CFG, tiny_model
from tests.unit.tiny_gguf import Q, write_tiny_gguf

TARGET = tiny_model()


def other_model(seed: int) -> LlamaForCausalLM:
    """A random model with the target's vocabulary and other weights (a poor drafter)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(attrs.evolve(CFG, num_layers=1))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def drafter(model: torch.nn.Module, num_pages: int = 64, **kw: object) -> Drafter:
    return Drafter(model, torch.float32, num_pages=num_pages, page_size=4, max_active=4,  # type: ignore[arg-type]
                   max_model_len=96, prefill_chunk_size=16, **kw)  # type: ignore[arg-type]


def engine(mode: str = "off", draft: Drafter | None = None, depth: int = 4, **kw: object) -> EngineCore:
    cfg = EngineConfig(**{"page_size": 4, "num_pages": 64, "max_active": 4, "prefill_chunk_size": 16,
                          "max_model_len": 96, **kw})  # type: ignore[arg-type]
    cfg = attrs.evolve(cfg, speculative=SpeculativeConfig(mode=mode, max_depth=depth))
    return EngineCore(TARGET, cfg, torch.float32, drafter=draft)


def drive(core: EngineCore, requests: list[EngineRequest], abort_at: dict[str, int] | None = None,
          max_steps: int = 2000) -> dict[str, list[int]]:
    """Run to completion (``abort_at``: abort a request once it has that many tokens), checking the
    target's and the drafter's integrity, and that the drafter holds state only for live requests."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add(r)
    for _ in range(max_steps):
        if not core.scheduler.has_work:
            break
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
        for rid, at in (abort_at or {}).items():
            if len(tokens[rid]) >= at and rid in core.scheduler.by_id:
                core.abort([rid])
        core.scheduler.check_integrity()
        if core.drafter is not None:
            core.drafter.check_integrity(live=[s.request_id for s in core.scheduler.running])
    assert not core.scheduler.has_work
    return tokens


def requests(sampling: SamplingParams, n: int = 3, max_tokens: int = 30) -> list[EngineRequest]:
    prompts = [(5, 17, 3, 29, 11, 2, 23), (40, 41, 42, 7, 7, 7, 7, 7, 7, 8), tuple(range(60, 90))]
    return [EngineRequest(f"r{i}", prompts[i % 3], sampling, max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)]


GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, seed=1234)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft_model", ["self", "other"])
@pytest.mark.parametrize("mode", ["ngram", "adaptive"])
def test_outputs_are_identical_with_and_without_a_draft_model(sampling: SamplingParams, draft_model: str,
                                                              mode: str) -> None:
    reqs = requests(sampling)
    want = drive(engine("off"), reqs)
    model = copy.deepcopy(TARGET) if draft_model == "self" else other_model(7)
    core = engine(mode, drafter(model))
    got = drive(core, reqs)
    assert got == want
    spec = core.stats().speculative
    assert spec is not None and spec.model_draft_rounds > 0
    assert core.drafter is not None and core.drafter.num_states == 0
    assert core.drafter.kv.num_free == core.drafter.kv.num_pages  # every page free or evictable
    if draft_model == "self" and sampling is GREEDY:
        # The target drafting itself (float32, same weights): every round's first draft is accepted.
        assert spec.model_accepted_drafts >= spec.model_draft_rounds


def test_the_draft_model_drafts_the_target_s_greedy_continuation() -> None:
    """Asked directly, a drafter over the target's own weights proposes the target's greedy tokens;
    a second call after the target accepted some reuses the drafts made (no forward) and a
    rejected continuation is rolled back."""
    prompt = [5, 17, 3, 29, 11, 2, 23]
    want = drive(engine("off"), [EngineRequest("a", tuple(prompt), GREEDY, max_tokens=12, ignore_eos=True)])["a"]
    d = drafter(copy.deepcopy(TARGET))
    assert d.propose("a", prompt, 6) == tuple(want[:6])
    ran = d.forward_tokens
    assert d.propose("a", prompt + want[:3], 2) == tuple(want[3:5])  # held already: no forward
    assert d.forward_tokens == ran
    # The target "committed" another token than the draft: the drafter drops the rest and continues.
    other = (want[3] + 1) % CFG.vocab_size
    got = d.propose("a", [*prompt, *want[:3], other], 3)
    assert len(got) == 3
    fresh = drafter(copy.deepcopy(TARGET))
    assert fresh.propose("b", [*prompt, *want[:3], other], 3) == got
    d.check_integrity()
    d.release("a")
    d.release("a")  # idempotent
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages


PREFIX = 48  # of the tiny target's 96 ids


def prefix_only(model: LlamaForCausalLM, rows: int) -> LlamaForCausalLM:
    """``model`` whose whole-vocabulary logits are -inf past the first ``rows`` ids: the reference
    for a drafter that ranks its drafts over those ids alone."""
    whole = model.compute_logits
    model.compute_logits = lambda h: whole(h).index_fill(  # type: ignore[method-assign]
        1, torch.arange(rows, model.vocab_size), float("-inf"))
    return model


def test_a_vocabulary_prefix_ranks_the_drafts_over_the_first_ids() -> None:
    """A drafter with ``vocab_prefix`` proposes the greedy continuation over the first ids alone: the
    drafts of a drafter whose model's other logits are -inf, none past the prefix, where the whole
    vocabulary's drafts take later ids too. A model without `PrefixLogitsLM`, or a prefix as large
    as the vocabulary, ranks over the whole vocabulary."""
    d = drafter(copy.deepcopy(TARGET), vocab_prefix=PREFIX)
    assert d.vocab_prefix == PREFIX and d.sampler.vocab_size == PREFIX
    assert d.runner.compute_logits(torch.randn(2, CFG.hidden_size)).shape == (2, PREFIX)  # those rows alone
    reference = drafter(prefix_only(copy.deepcopy(TARGET), PREFIX))
    whole = drafter(copy.deepcopy(TARGET))
    later = 0
    for i, prompt in enumerate(([5, 17, 3, 29, 11, 2, 23], [40, 41, 42, 7, 7, 7], list(range(60, 90)), [90, 1, 77])):
        got = d.propose(f"p{i}", prompt, 6)
        assert got == reference.propose(f"p{i}", prompt, 6)
        assert len(got) == 6 and max(got) < PREFIX
        later += max(whole.propose(f"p{i}", prompt, 6)) >= PREFIX
    assert later > 0  # the prefix changed some drafts
    assert drafter(copy.deepcopy(TARGET), vocab_prefix=CFG.vocab_size).vocab_prefix == 0
    assert drafter(copy.deepcopy(TARGET), vocab_prefix=PREFIX, token_vocab_size=PREFIX).vocab_prefix == 0


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_are_identical_with_a_vocabulary_prefix(sampling: SamplingParams) -> None:
    reqs = requests(sampling)
    core = engine("adaptive", drafter(copy.deepcopy(TARGET), vocab_prefix=PREFIX))
    assert drive(core, reqs) == drive(engine("off"), reqs)
    spec = core.stats().speculative
    assert spec is not None and spec.model_draft_rounds > 0 and spec.model_accepted_drafts > 0


@pytest.mark.skipif(not cpu_kernels.available(),
                    reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize(("projections", "embeddings"), [(Q.Q4_1, Q.Q8_0), (Q.Q5_0, Q.Q8_0), (Q.Q5_0, Q.Q5_0),
                                                         (Q.Q8_0, Q.F32)],
                         ids=["q8-head-packed", "q8-head-codes", "block-head", "dense-head"])
def test_prefix_logits_are_the_first_columns_of_the_whole_vocabulary_s(tmp_path: Path, projections: Q,
                                                                      embeddings: Q) -> None:
    """`compute_logits_prefix` on every head a GGUF model keeps (its Q8_0 codes with and without their
    bfloat16 tile layout, its own GGUF blocks, a dense float32 head with its oneDNN-packed copy): the
    first columns of `compute_logits`, the same values for quantized heads (each logit computed alone
    by the same kernel: the packed layout's tiles that hold the prefix), within float32 rounding for
    the dense head (sliced, without the packed copy)."""
    from helios.runtime import load_model

    model = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", projections=projections, embeddings=embeddings),
                       cache_dir=None).model
    assert isinstance(model, PrefixLogitsLM)
    vocab = model.vocab_size
    torch.manual_seed(0)
    for n in (1, 8, 24):
        hidden = torch.randn(n, model.config.hidden_size).to(model.dtype)
        whole = model.compute_logits(hidden)
        for rows in (16, 100, vocab):
            got = model.compute_logits_prefix(hidden, rows)
            assert got.shape == (n, rows) and got.dtype == torch.float32
            if embeddings == Q.F32:
                torch.testing.assert_close(got, whole[:, :rows], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, whole[:, :rows]), (n, rows)
    with pytest.raises(ValueError, match="rows must be in"):
        model.compute_logits_prefix(hidden, vocab + 1)


@pytest.mark.skipif(not cpu_kernels.available(),
                    reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")
def test_the_catch_up_after_accepted_drafts_runs_as_decode_rows() -> None:
    """When the target took every draft, the drafter's next forward covers its last draft and the
    target's own token: two positions after the request's context, laid out as decode rows (the
    model's decode path), where the prompt's chunk stays a prefill; the drafts go on being the
    target's greedy tokens."""
    torch.manual_seed(3)
    model = LlamaForCausalLM(attrs.evolve(CFG, head_dim=16))  # heads of 16: the decode kernel's
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    prompt = [5, 17, 3, 29, 11, 2, 23]
    cfg = EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=16, max_model_len=96)
    target = EngineCore(model, cfg, torch.float32)
    want = drive(target, [EngineRequest("a", tuple(prompt), GREEDY, max_tokens=12, ignore_eos=True)])["a"]
    d = drafter(copy.deepcopy(model))
    assert target.attention.decode_kernel and d.runner.batch.verify_as_decode
    layouts: list[tuple[int, int]] = []  # (decode rows, prefill chunks) of each forward
    prepare = d.runner.batch.prepare

    def spy(*args: object, **kw: object) -> object:
        step = prepare(*args, **kw)  # type: ignore[arg-type]
        layouts.append((step.attention.num_decode, len(step.attention.prefills)))
        return step

    d.runner.batch.prepare = spy  # type: ignore[method-assign]
    assert d.propose("a", prompt, 3) == tuple(want[:3])
    assert layouts[0] == (0, 1)  # the prompt
    del layouts[:]
    assert d.propose("a", prompt + want[:4], 3) == tuple(want[4:7])  # all three taken, then the target's token
    assert layouts[0] == (2, 0)  # the last draft and the target's token
    assert all(layout == (1, 0) for layout in layouts[1:])


def test_drafter_state_is_released_on_abort_and_preemption() -> None:
    """Aborted requests (mid-prefill, mid-decode) and preempted ones (a target pool too small for all
    of them) leave no drafter state behind; the outputs of the others are unchanged."""
    reqs = requests(GREEDY, n=4, max_tokens=40)
    d = drafter(copy.deepcopy(TARGET))
    core = engine("ngram", d)
    got = drive(core, reqs, abort_at={"r0": 0, "r1": 5})
    want = drive(engine("off"), reqs[2:])
    assert {k: got[k] for k in ("r2", "r3")} == want
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages
    # Preemption: 16 pages of 4 tokens for four requests growing to ~47 tokens each (compared with
    # the same pool without speculation: a recomputed prefill's float sums differ from decoding's).
    small = engine("ngram", drafter(copy.deepcopy(TARGET)), num_pages=16)
    assert drive(small, reqs) == drive(engine("off", num_pages=16), reqs)
    assert small.scheduler.num_preemptions > 0
    assert small.drafter is not None and small.drafter.num_states == 0


def test_a_full_draft_pool_gives_fewer_drafts_and_never_changes_outputs() -> None:
    """A draft pool too small for every request: a round the pool cannot serve has the drafts made so
    far (maybe none), its state is released, and outputs stay identical."""
    reqs = requests(GREEDY, n=3, max_tokens=40)
    d = drafter(copy.deepcopy(TARGET), num_pages=14)
    core = engine("ngram", d)
    assert drive(core, reqs) == drive(engine("off"), reqs)
    assert d.pool_misses > 0
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages


def test_a_draft_model_needs_speculation_on() -> None:
    with pytest.raises(ValueError, match="needs speculative mode ngram or adaptive"):
        engine("off", drafter(copy.deepcopy(TARGET)))


def test_draft_model_config_is_validated(tmp_path: object) -> None:
    from pathlib import Path

    from helios.config import ConfigError, load_config

    assert load_config().speculative.draft_model == ""
    assert load_config().speculative.draft_vocab == 65536
    path = Path(str(tmp_path)) / "h.toml"
    path.write_text('[speculative]\nmode = "ngram"\ndraft_model = "qwen2.5-coder:0.5b"\n')
    assert load_config(path).speculative.draft_model == "qwen2.5-coder:0.5b"
    path.write_text('[speculative]\nmode = "ngram"\ndraft_model = "qwen2.5-coder:0.5b"\ndraft_vocab = 0\n')
    assert load_config(path).speculative.draft_vocab == 0
    for bad, message in (
        ('draft_model = "qwen2.5-coder:0.5b"', "speculative.draft_model = 'qwen2.5-coder:0.5b' drafts for "
                                               "speculative decoding, which is off"),
        ('mode = "off"\ndraft_model = "x.gguf"', "set speculative.mode to ngram or adaptive"),
        ('mode = "ngram"\ndraft_model = 3', "speculative.draft_model must be a model name or path"),
        ('mode = "ngram"\ndraft_model = " x.gguf"', "surrounding whitespace"),
        ('mode = "ngram"\ndraft_vocab = -1', "speculative.draft_vocab must be 0"),
        ('mode = "ngram"\ndraft_vocab = "65536"', "speculative.draft_vocab must be 0"),
        ('mode = "ngram"\ndraft_vocab = true', "speculative.draft_vocab must be 0"),
    ):
        path.write_text(f"[speculative]\n{bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_the_draft_vocabulary_applies_to_byte_level_bpe_vocabularies_only() -> None:
    """``draft_vocab`` ranks a byte-level BPE vocabulary's first ids (their merge order); a
    SentencePiece vocabulary (ids in another order) drafts over all of its ids."""
    from helios.loaders.tokenizer import Tokenizer
    from helios.runtime import draft_vocab_prefix

    def tokenizer(encoding: str) -> Tokenizer:
        t = Tokenizer.__new__(Tokenizer)
        t.byte_encoding = encoding  # type: ignore[assignment]
        return t

    assert draft_vocab_prefix(65536, tokenizer("byte_level")) == 65536
    assert draft_vocab_prefix(0, tokenizer("byte_level")) == 0
    assert draft_vocab_prefix(65536, tokenizer("sentencepiece")) == 0
    assert draft_vocab_prefix(65536, tokenizer("text")) == 0


def test_an_unknown_draft_model_name_is_refused() -> None:
    from helios.config import ConfigError, HeliosConfig, SpeculativeSection
    from helios.loaders.tokenizer import Tokenizer
    from helios.runtime import load_drafter

    cfg = attrs.evolve(HeliosConfig(), speculative=SpeculativeSection(mode="ngram", draft_model="no-such:model"))
    with pytest.raises(ConfigError, match=r"speculative\.draft_model: "):
        load_drafter(cfg, Tokenizer.__new__(Tokenizer), num_pages=4, max_model_len=64, cache_dir=None)


def test_the_card_and_the_metrics_name_the_draft_model() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from helios.domain.model import ModelInfo
    from helios.frontends.openai.models import speculative_object
    from helios.obs.metrics import ServingMetrics

    info = ModelInfo(model_id="m", aliases=(), created=0, max_model_len=64, vocab_size=CFG.vocab_size,
                     default_max_tokens=16, max_concurrency=4, prefill_chunk_size=16, max_top_logprobs=20,
                     prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=False,
                     speculative_mode="ngram", speculative_max_depth=3, speculative_history=True,
                     speculative_learned="draft")
    card = speculative_object(info)
    assert card["proposers"] == ["ngram", "history", "draft"] and card["learned_drafter"] is True
    mtp = speculative_object(attrs.evolve(info, speculative_learned="mtp"))  # the checkpoint's MTP layers
    assert mtp["proposers"] == ["ngram", "history", "mtp"] and mtp["learned_drafter"] is True
    none = speculative_object(attrs.evolve(info, speculative_learned=None))
    assert none["proposers"] == ["ngram", "history"] and none["learned_drafter"] is False
    off = speculative_object(attrs.evolve(info, speculative_mode="off"))
    assert off["proposers"] == [] and off["learned_drafter"] is False
    d = drafter(copy.deepcopy(TARGET))
    core = engine("ngram", d)
    drive(core, requests(GREEDY, n=1, max_tokens=12))
    stats = core.stats()
    spec = stats.speculative
    assert spec is not None and spec.model_draft_rounds > 0
    assert stats.learned_drafter is True and stats.draft_steps == d.forward_tokens > 0
    snap = ServingMetrics(lambda: (stats, None)).snapshot()
    assert snap["learned_drafter"] is True and snap["draft_steps"] == d.forward_tokens
    samples = {s.name: s.value for f in text_string_to_metric_families(ServingMetrics(lambda: (stats, None)).prometheus())
               for s in f.samples}
    assert samples["flare_draft_model_request_rounds_total"] == spec.model_draft_rounds
    assert samples["flare_draft_model_accepted_draft_tokens_total"] == spec.model_accepted_drafts
    plain = engine("ngram").stats()
    assert plain.learned_drafter is False and plain.draft_steps == 0
