"""Structured output in the engine with the default model (SmolLM2-135M): llguidance masks on the
constrained rows of a batch, raw logprobs, forced tokens, and property tests.

Property tests (hypothesis, few examples each in CI; max_tokens small). The JSON schema subset
they draw from, which every schema keeps to so that an answer always fits the output limit:

- at most 3 properties per object, nesting depth at most 2, every property required or not;
- values: ``boolean``, ``null``, ``integer`` with ``minimum``/``maximum`` in [-1000, 1000], ``string``
  with ``maxLength`` <= 6 or an ``enum`` of short strings, ``array`` with ``maxItems`` <= 2 of
  those, and nested objects; ``additionalProperties: false`` on every object.

Regexes: concatenations of at most 4 pieces, each a literal word, a class ([a-z], [0-9], [A-F]) with a
bounded repeat {1,n<=4}, or an alternation of two literals.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import jsonschema
import llguidance
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.domain.events import FailureKind
from helios.domain.generation import OutputConstraint
from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.output_tracker import OutputTracker
from helios.engine.records import GRAMMAR_FAILURE, EngineFinish, EngineRequest
from helios.engine.structured import UNPRODUCIBLE_MESSAGE, Envelope, GrammarBatch, GrammarConstraint
from helios.errors import BadRequest
from helios.serving.structured import GrammarCompiler

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"


class Served:
    """The default model in a real EngineCore, with the serving side's grammar compiler."""

    def __init__(self) -> None:
        from helios.loaders.default_model import ensure_default_model
        from helios.runtime import load_model

        torch.manual_seed(0)
        loaded = load_model(ensure_default_model(quiet=True), weights="float32")
        self.tok = loaded.checkpoint.tokenizer
        self.model, self.config = loaded.model, loaded.checkpoint.config
        self.compiler = GrammarCompiler(self.tok)

    def engine(self) -> EngineCore:
        return EngineCore(self.model,
                          EngineConfig(num_pages=256, max_active=16, prefill_chunk_size=512, max_model_len=1024,
                                       prefix_caching=False), torch.float32)

    def constraint(self, c: OutputConstraint) -> GrammarConstraint:
        return trio.run(self.compiler.constraint, c)

    def prompt(self, ask: str) -> tuple[int, ...]:
        return tuple(self.tok.encode(PROMPT.format(ask=ask), add_special_tokens=False))

    def request(self, rid: str, ask: str, seed: int, max_tokens: int, constraint: GrammarConstraint | None = None,
                **kw: Any) -> EngineRequest:
        return EngineRequest(rid, self.prompt(ask), SamplingParams(temperature=0.8, seed=seed), max_tokens,
                             eos_token_ids=frozenset(self.tok.eos_token_ids), constraint=constraint, **kw)

    def run(self, requests: list[EngineRequest], core: EngineCore | None = None) -> dict[str, Any]:
        core = core or self.engine()
        outs: dict[str, dict[str, Any]] = {r.request_id: {"ids": [], "finish": None, "logprobs": []}
                                           for r in requests}
        for r in requests:
            core.add(r)
        for _ in range(2000):
            if not core.scheduler.has_work:
                break
            for o in core.step():
                out = outs[o.request_id]
                out["ids"].extend(o.new_token_ids)
                out["logprobs"].extend(o.logprobs or ())
                if o.finish is not None:
                    out["finish"], out["error"] = o.finish, o.error
            core.scheduler.check_integrity()
        assert not core.scheduler.has_work
        return outs

    def text(self, ids: list[int]) -> str:
        eos = set(self.tok.eos_token_ids)
        return str(self.tok.decode([t for t in ids if t not in eos], skip_special_tokens=False))


@pytest.fixture(scope="module")
def served() -> Served:
    return Served()


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def test_constrained_rows_keep_to_their_masks_beside_unconstrained_neighbours(served: Served) -> None:
    schema = served.constraint(OutputConstraint("json_schema", PERSON))
    regex = served.constraint(OutputConstraint("regex", r"[A-Z][a-z]{2,5} [0-9]{2}"))
    choice = served.constraint(OutputConstraint("choice", ("red", "green", "blue")))
    asks = [("Describe a person as JSON.", schema), ("Name and number?", regex), ("A color?", choice)]
    free = [served.request(f"free{i}", "Tell me a story.", seed=100 + i, max_tokens=24) for i in range(3)]
    constrained = [served.request(f"c{i}", ask, seed=i, max_tokens=48, constraint=c)
                   for i, (ask, c) in enumerate(asks)]
    outs = served.run(constrained + free)

    person = json.loads(served.text(outs["c0"]["ids"]))
    jsonschema.validate(person, PERSON)
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", served.text(outs["c1"]["ids"]))
    assert served.text(outs["c2"]["ids"]) in ("red", "green", "blue")
    for i, (_, c) in enumerate(asks):
        out = outs[f"c{i}"]
        assert out["finish"] is EngineFinish.EOS
        # An independent matcher accepts every generated token in order (the mask was respected).
        answer = out["ids"][:-1]  # without the EOS
        m = llguidance.LLMatcher(c.vocab.ll_tokenizer, c.grammar)
        assert m.validate_tokens(answer) == len(answer)
        assert m.consume_tokens(answer) and m.is_accepting()
    # Unconstrained seeded neighbours are what they are alone: the mask touched only its rows.
    alone = served.run([served.request(f"free{i}", "Tell me a story.", seed=100 + i, max_tokens=24)
                        for i in range(3)])
    for i in range(3):
        assert outs[f"free{i}"]["ids"] == alone[f"free{i}"]["ids"]


def test_a_pickled_constraint_compiles_again_and_generates_the_same(served: Served) -> None:
    """What a data-parallel rank receives (engine/dp.py): the constraint pickles as its grammar and
    compiles again against the receiving process's vocabulary; the constrained output is the same."""
    import pickle

    from helios.engine import structured

    c = served.constraint(OutputConstraint("json_schema", PERSON))
    assert c.json_slices
    before = structured._process_vocab
    built: list[int] = []

    def vocab() -> Any:
        built.append(1)
        return c.vocab

    structured.set_process_vocab(vocab)
    try:
        copy = pickle.loads(pickle.dumps(c))
        again = pickle.loads(pickle.dumps(c))
    finally:
        structured.set_process_vocab(before)
    assert built == [1] and copy.matcher is not c.matcher and copy.grammar == c.grammar
    assert (copy.json_slices, copy.envelope, copy.description) == (c.json_slices, c.envelope, c.description)
    outs = served.run([served.request("orig", "Describe a person as JSON.", seed=3, max_tokens=48, constraint=c),
                       served.request("copy", "Describe a person as JSON.", seed=3, max_tokens=48, constraint=copy),
                       served.request("again", "Describe a person as JSON.", seed=3, max_tokens=48, constraint=again)])
    assert outs["orig"]["ids"] == outs["copy"]["ids"] == outs["again"]["ids"]
    jsonschema.validate(json.loads(served.text(outs["copy"]["ids"])), PERSON)


def test_logprobs_stay_raw_under_the_mask(served: Served) -> None:
    """The chosen token's logprob is the unmasked distribution's: a constrained answer token that
    the model alone finds unlikely keeps its low logprob (it is not renormalised over the mask)."""
    c = served.constraint(OutputConstraint("choice", ("zebra",)))
    core = served.engine()
    req = served.request("lp", "Say hello.", seed=1, max_tokens=8, constraint=c, num_top_logprobs=1)
    out = served.run([req], core)
    assert served.text(out["lp"]["ids"]) == "zebra"
    records = out["lp"]["logprobs"]
    assert records and records[0].logprob < -5.0  # "z..." is far from the free model's first choice
    assert records[0].top[0][0] != records[0].token_id  # the natural top alternative is not the mask's


def test_forced_tokens_are_committed_without_sampling(served: Served) -> None:
    """A long fixed literal: after its first token the grammar forces the rest; steps are fewer than
    tokens (several committed per step) and the text is exact."""
    literal = "The quick brown fox jumps over the lazy dog"
    c = served.constraint(OutputConstraint("regex", re.escape(literal)))
    core = served.engine()
    core.add(served.request("ff", "Anything.", seed=3, max_tokens=40, constraint=c))
    ids: list[int] = []
    steps = 0
    while core.scheduler.has_work:
        for o in core.step():
            ids.extend(o.new_token_ids)
        steps += 1
    assert served.text(ids) == literal
    assert steps < len(ids) - 1  # prefill + far fewer decode steps than tokens


def test_a_grammar_that_rejects_a_committed_token_ends_the_request_with_its_error(served: Served) -> None:
    """The engine's failure path: a matcher that refuses a committed token (here a budget-forced
    token the gate cannot know, simulated by a matcher already in its error state) ends that
    request with the structured-output error, and its neighbour runs on."""
    c = served.constraint(OutputConstraint("regex", "[a-z]{3}"))
    broken = llguidance.LLMatcher(c.vocab.ll_tokenizer, llguidance.LLMatcher.grammar_from_regex("[a-"))
    assert broken.is_error()
    bad = GrammarConstraint(broken, c.vocab, grammar="[a-")
    outs = served.run([served.request("bad", "Hi.", seed=1, max_tokens=8, constraint=bad),
                       served.request("ok", "Hi.", seed=2, max_tokens=8, constraint=c)])
    assert outs["bad"]["finish"] is EngineFinish.ERROR and outs["bad"]["error"].startswith(GRAMMAR_FAILURE)
    assert outs["ok"]["finish"] is EngineFinish.EOS and re.fullmatch("[a-z]{3}", served.text(outs["ok"]["ids"]))


def test_the_gate_leaves_reasoning_and_tool_envelopes_free(served: Served) -> None:
    """The gate's states over single-token delimiters (here SmolLM2's spare special tokens 3-6):
    free reasoning, a few separators, a free tool call, EOS after a call, then the grammar alone."""
    base = served.constraint(OutputConstraint("regex", "[a-z]{3}"))
    env = Envelope(reasoning_open=3, reasoning_close=4, tool_open=5, tool_close=6)
    state = OutputTracker(attrs.evolve(base, envelope=env))
    ws = next(iter(base.vocab.whitespace_ids))
    word = served.tok.encode("abc", add_special_tokens=False)
    eos = served.tok.eos_token_ids[0]
    assert state.is_masking and state.is_token_allowed(3) and state.is_token_allowed(5)
    assert not state.is_token_allowed(4) and not state.is_token_allowed(ws) and not state.is_token_allowed(eos)
    assert state.advance(3) and not state.is_masking  # reasoning: anything goes
    assert state.advance(ws) and state.advance(word[0]) and state.advance(4)
    assert state.is_masking and not state.is_token_allowed(3)  # reasoning happens once
    for _ in range(4):  # a few separators after </think>, then no more
        assert state.is_token_allowed(ws) and state.advance(ws)
    assert not state.is_token_allowed(ws)
    assert state.advance(5) and not state.is_masking  # a free tool call
    assert state.advance(word[0]) and state.advance(6)
    assert state.is_token_allowed(eos)  # a turn of calls may end here
    assert all(state.advance(t) for t in word) and state.mode.value == "answer"
    assert not state.is_token_allowed(5) and state.is_token_allowed(eos)
    assert not state.advance(word[0]) and state.error  # a fourth letter breaks [a-z]{3}


def test_masks_fit_logits_wider_than_the_tokenizer(served: Served) -> None:
    """Models often pad their output vocabulary past the tokenizer's (Qwen: 151936 vs 151669):
    llguidance fills exactly one bit per tokenizer token, and the padding columns are never allowed."""
    c = served.constraint(OutputConstraint("choice", ("yes", "no")))
    num_tokens = c.vocab.ll_tokenizer.vocab_size
    padded = num_tokens + 70
    state = OutputTracker(c)
    job = GrammarBatch(padded, overlap=False).start([None, state])
    assert job is not None
    mask, rows = job.result(padded, torch.device("cpu"))
    assert rows == [1] and mask.shape == (1, padded)
    assert not mask[0, num_tokens:].any()
    allowed = mask[0].nonzero().flatten().tolist()
    assert allowed and all(served.tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)


def test_compile_errors_name_the_field(served: Served) -> None:
    from helios.errors import BadRequest

    for c in (OutputConstraint("regex", "[a-", param="structured_outputs.regex"),
              OutputConstraint("grammar", "start: nothing_defined", param="structured_outputs.grammar"),
              OutputConstraint("json_schema", {"type": "frob"}, param="response_format.json_schema", strict=True)):
        with pytest.raises(BadRequest) as err:
            served.constraint(c)
        assert err.value.param == c.param and c.param in err.value.message


def test_the_compiled_grammar_cache_is_keyed_by_the_canonical_schema(served: Served) -> None:
    compiler = served.compiler
    before = compiler.num_compiled
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    b = {"properties": {"y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"}
    first = served.constraint(OutputConstraint("json_schema", a))
    second = served.constraint(OutputConstraint("json_schema", b))
    assert first.matcher is second.matcher and compiler.num_compiled == before + 1


# -- property tests ---------------------------------------------------------------------------------

_LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"type": "string", "enum": xs}),
)


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.sampled_from(["a", "b", "id", "name", "ok"]), children, min_size=1, max_size=3)
    return st.tuples(props, st.booleans()).map(lambda t: {
        "type": "object", "properties": t[0], "additionalProperties": False,
        **({"required": sorted(t[0])} if t[1] else {})})


_VALUE = st.one_of(_LEAF, st.integers(1, 2).flatmap(
    lambda n: _LEAF.map(lambda leaf: {"type": "array", "items": leaf, "maxItems": n})))
SCHEMAS = _object(st.one_of(_VALUE, _object(_VALUE)))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_random_schemas_always_yield_valid_json(served: Served, schema: dict[str, Any], seed: int) -> None:
    c = served.constraint(OutputConstraint("json_schema", schema))
    out = served.run([served.request("j", "Reply with JSON.", seed=seed, max_tokens=256, constraint=c),
                      served.request("n", "Say something.", seed=seed, max_tokens=8)])["j"]
    assert out["finish"] is EngineFinish.EOS, (served.text(out["ids"]), out["finish"])
    jsonschema.validate(json.loads(served.text(out["ids"])), schema)


_PIECE = st.one_of(
    st.sampled_from(["ab", "id-", "x", "_"]).map(re.escape),
    st.tuples(st.sampled_from(["[a-z]", "[0-9]", "[A-F]"]), st.integers(1, 4)).map(lambda t: f"{t[0]}{{1,{t[1]}}}"),
    st.tuples(st.sampled_from(["yes", "no", "cat"]), st.sampled_from(["dog", "maybe"])).map(
        lambda t: f"({t[0]}|{t[1]})"),
)
REGEXES = st.lists(_PIECE, min_size=1, max_size=4).map("".join)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(regex=REGEXES, seed=st.integers(0, 2**31))
def test_random_regexes_yield_full_matches(served: Served, regex: str, seed: int) -> None:
    c = served.constraint(OutputConstraint("regex", regex))
    out = served.run([served.request("r", "Answer briefly.", seed=seed, max_tokens=48, constraint=c),
                      served.request("n", "Hello!", seed=seed + 1, max_tokens=8)])["r"]
    assert out["finish"] is EngineFinish.EOS
    assert re.fullmatch(regex, served.text(out["ids"])), (regex, served.text(out["ids"]))



ASTRAL = "\U00040000"  # UTF-8 F1 80 80 80: SmolLM2's vocabulary has no token holding the byte 0xF1


def test_text_the_vocabulary_cannot_give_is_refused_before_generation(served: Served) -> None:
    """A grammar whose forced start needs a byte no token holds is the client's 400, naming its
    field: tokenizing the forced text once dropped the byte, llguidance committed the remaining
    continuation bytes as tokens, and the request failed as a server error."""
    vocab = served.compiler.vocab
    assert 0xF1 in vocab.missing_bytes and ord("a") not in vocab.missing_bytes
    for kind, spec in [("regex", ASTRAL), ("regex", "ab" + ASTRAL), ("choice", [ASTRAL]),
                       ("json_schema", {"const": ASTRAL})]:
        with pytest.raises(BadRequest) as info:
            served.constraint(OutputConstraint(kind, spec))
        assert info.value.param == OutputConstraint(kind, spec).param
        assert UNPRODUCIBLE_MESSAGE in str(info.value)
    # The same characters where the vocabulary has their bytes, and a choice that can avoid them.
    assert served.constraint(OutputConstraint("regex", "ñ")) is not None
    assert served.constraint(OutputConstraint("choice", ["yes", ASTRAL])) is not None


def test_a_grammar_that_reaches_such_text_after_a_choice_ends_as_the_clients_failure(served: Served) -> None:
    """After the choice the grammar forces the byte the vocabulary lacks: the request ends with an
    UNPRODUCIBLE failure (the client's 400 in every protocol) and a plain message, never a wrong
    token; a neighbour in the same steps is untouched."""
    c = served.constraint(OutputConstraint("regex", "(a|b)" + ASTRAL))
    ok = served.constraint(OutputConstraint("regex", "[a-z]{3}"))
    core = served.engine()
    core.add(served.request("dead", "Hi.", seed=1, max_tokens=8, constraint=c))
    core.add(served.request("ok", "Hi.", seed=2, max_tokens=8, constraint=ok))
    finals: dict[str, Any] = {}
    ids: dict[str, list[int]] = {"dead": [], "ok": []}
    while core.scheduler.has_work:
        for o in core.step():
            ids[o.request_id].extend(o.new_token_ids)
            if o.finish is not None:
                finals[o.request_id] = o
    dead = finals["dead"]
    assert dead.finish is EngineFinish.ERROR and dead.failure is FailureKind.UNPRODUCIBLE
    assert dead.error == f"{GRAMMAR_FAILURE}: {UNPRODUCIBLE_MESSAGE}"
    assert served.text(ids["dead"]) in ("", "a", "b")  # nothing past the choice was committed
    assert finals["ok"].finish is EngineFinish.EOS and re.fullmatch("[a-z]{3}", served.text(ids["ok"]))
    assert finals["ok"].failure is None
