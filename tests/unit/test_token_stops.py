"""Token stops (stop_token_ids and the native stop_token_sequences) and token observations
(return_token_ids, return_token_timestamps): request validation, where the scheduler ends a request,
and what text, logprob entries and timestamps the output pipeline makes of it."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from helios.domain.events import FinishCause, OutputEvent, TextDelta
from helios.domain.generation import ChildUpdate, GenerationOptions, TokenObservation, TokenStops
from helios.domain.logprobs import TokenLogprob
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.engine.kv.manager import KVCacheManager
from helios.engine.records import EngineFinish, EngineRequest, RequestOutput, RunnerOutput
from helios.engine.scheduler import Scheduler, SeqStatus
from helios.errors import BadRequest
from helios.frontends.common import token_stop_reason
from helios.frontends.openai import chat, completions, responses
from helios.serving.output import OutputProcessor

VOCAB = 1000
INFO = ModelInfo(
    model_id="org/model", aliases=("smol",), created=0, max_model_len=8192, vocab_size=VOCAB,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
DECODERS: dict[str, Callable[..., Any]] = {
    "chat": lambda **f: chat.decode_chat({"messages": [{"role": "user", "content": "Hi"}], **f}, INFO),
    "completions": lambda **f: completions.decode_completion({"prompt": "Hi", **f}, INFO),
    "responses": lambda **f: responses.decode_responses({"input": "Hi", **f}, INFO),
}


def options(protocol: str, **fields: Any) -> GenerationOptions:
    """The generation options the protocol's decode hands the serving path."""
    return DECODERS[protocol](**fields).generation.options


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", list(DECODERS))
def test_token_stops_reach_the_plan(protocol: str) -> None:
    opts = options(protocol, stop_token_ids=[3], stop_token_sequences=[[5, 6], [7], [8, 9, 10]])
    assert opts.token_stops == TokenStops((3,), ((5, 6), (7,), (8, 9, 10)))
    omitted: list[int] | None
    for omitted in (None, []):
        assert options(protocol, stop_token_sequences=omitted).token_stops == TokenStops()
    # Sixteen in all, each up to 64 ids, is the limit.
    opts = options(protocol, stop_token_ids=list(range(6)), stop_token_sequences=[[VOCAB - 1] * 64] * 10)
    assert len(opts.token_stops.ids) + len(opts.token_stops.sequences) == 16


BAD_TOKEN_STOPS: list[tuple[dict[str, Any], str, str]] = [
    ({"stop_token_ids": list(range(6)), "stop_token_sequences": [[1, 2]] * 11}, "at most 16 token stops",
     "stop_token_sequences"),
    ({"stop_token_sequences": [[1]] * 17}, "at most 16 token stops", "stop_token_sequences"),
    ({"stop_token_ids": list(range(17))}, "at most 16", "stop_token_ids"),
    ({"stop_token_sequences": [[1] * 65]}, "at most 64", "stop_token_sequences"),
    ({"stop_token_sequences": [[1], []]}, "is empty", "stop_token_sequences"),
    ({"stop_token_sequences": [1, 2]}, "array of token-id arrays", "stop_token_sequences"),
    ({"stop_token_sequences": [[1, True]]}, "array of token-id arrays", "stop_token_sequences"),
    ({"stop_token_sequences": [["1"]]}, "array of token-id arrays", "stop_token_sequences"),
    ({"stop_token_sequences": "1 2"}, "array of token-id arrays", "stop_token_sequences"),
    ({"stop_token_sequences": [[1, VOCAB]]}, "outside the vocabulary", "stop_token_sequences"),
    ({"stop_token_sequences": [[-1, 2]]}, "outside the vocabulary", "stop_token_sequences"),
    ({"stop_token_ids": [VOCAB]}, "outside the vocabulary", "stop_token_ids"),
    ({"stop": ["END"], "stop_token_sequences": [[1, 2]]}, "cannot be combined", "stop"),
    ({"stop": "END", "stop_token_ids": [1]}, "cannot be combined", "stop"),
]


@pytest.mark.parametrize("protocol", list(DECODERS))
@pytest.mark.parametrize("fields, message, param", BAD_TOKEN_STOPS)
def test_token_stop_violations_are_400(protocol: str, fields: dict[str, Any], message: str, param: str) -> None:
    with pytest.raises(BadRequest, match=message) as err:
        DECODERS[protocol](**fields)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("protocol", ["chat", "completions"])
def test_token_observation_options(protocol: str) -> None:
    def observe(**fields: Any) -> TokenObservation:
        return options(protocol, **fields).observe

    assert observe() == TokenObservation(False, False)
    assert observe(return_token_ids=True) == TokenObservation(True, False)
    assert observe(return_token_timestamps=True) == TokenObservation(True, True)  # implies the ids
    assert observe(return_token_ids=True, return_token_timestamps=True) == TokenObservation(True, True)
    assert observe(return_token_ids=False, return_token_timestamps=False) == TokenObservation(False, False)
    with pytest.raises(BadRequest, match="return_token_ids: false") as err:
        observe(return_token_ids=False, return_token_timestamps=True)
    assert err.value.param == "return_token_timestamps"
    with pytest.raises(BadRequest, match="return_token_ids"):
        observe(return_token_ids=1)


def test_responses_has_no_token_observations() -> None:
    for name in ("return_token_ids", "return_token_timestamps"):
        with pytest.raises(BadRequest, match="unrecognized"):
            DECODERS["responses"](**{name: True})
    assert options("responses").observe == TokenObservation(False, False)


def test_stop_reason_names_the_matched_sequence() -> None:
    from helios.domain.events import Finish

    stops = TokenStops((9,), ((4, 5), (3, 4, 5), (6,)))
    finish = Finish(FinishCause.STOP_TOKEN, matched_stop=5)
    assert token_stop_reason(finish, [1, 3, 4, 5], stops) == [3, 4, 5]  # the longest that matches
    assert token_stop_reason(finish, [1, 2, 4, 5], stops) == [4, 5]
    assert token_stop_reason(Finish(FinishCause.STOP_TOKEN, matched_stop=6), [1, 6], stops) == 6
    assert token_stop_reason(Finish(FinishCause.STOP_TOKEN, matched_stop=9), [1, 9], stops) == 9
    assert token_stop_reason(Finish(FinishCause.EOS), [1, 2], stops) is None
    assert token_stop_reason(None, [], stops) is None


@pytest.mark.parametrize("protocol", list(DECODERS))
def test_min_tokens_reaches_the_plan(protocol: str) -> None:
    assert options(protocol, min_tokens=7).min_tokens == 7
    assert options(protocol, min_tokens=None).min_tokens == options(protocol).min_tokens == 0
    with pytest.raises(BadRequest, match="greater than or equal to 0") as err:
        options(protocol, min_tokens=-1)
    assert err.value.param == "min_tokens"


# -- the scheduler ends the request at the completing token -----------------------------------------


def _scheduler() -> Scheduler:
    return Scheduler(KVCacheManager(num_pages=32, page_size=4), max_active=4, prefill_chunk_size=64, max_model_len=256)


def _drive(s: Scheduler, script: Sequence[Sequence[int]]) -> list[RequestOutput]:
    """Steps with a stand-in runner that commits the next group of `script` for request "a"."""
    outputs: list[RequestOutput] = []
    for group in script:
        out = s.schedule()
        assert any(c.samples for c in out.chunks)
        outputs += s.update(out, RunnerOutput(sampled={"a": tuple(group)}))
        s.check_integrity()
        if outputs[-1].finish is not None:
            break
    return outputs


def test_a_sequence_stop_ends_at_its_last_token() -> None:
    s = _scheduler()
    seq = s.add(EngineRequest("a", (1, 2, 3), SamplingParams(temperature=0.0), 20,
                              stop_token_sequences=((7, 8, 9), (40, 41))), None)
    outs = _drive(s, [[7], [8], [5], [7], [8], [9], [11]])
    assert [o.new_token_ids for o in outs] == [(7,), (8,), (5,), (7,), (8,), (9,)]
    assert [o.finish for o in outs] == [None] * 5 + [EngineFinish.STOP_TOKEN]
    assert seq.status is SeqStatus.FINISHED and s.kv.num_free == 32 and not s.has_work


def test_several_tokens_committed_at_once_stop_at_the_first_that_completes_a_sequence() -> None:
    s = _scheduler()
    s.add(EngineRequest("a", (1, 2, 3), SamplingParams(temperature=0.0), 20, stop_token_sequences=((7, 8),)), None)
    outs = _drive(s, [[5], [6, 7, 8, 9, 10]])  # a speculative step: the stop completes mid-way
    assert outs[-1].new_token_ids == (6, 7, 8) and outs[-1].finish is EngineFinish.STOP_TOKEN


def test_a_sequence_never_matches_across_the_prompt() -> None:
    s = _scheduler()
    s.add(EngineRequest("a", (1, 2, 7), SamplingParams(temperature=0.0), 3, stop_token_sequences=((7, 8),)), None)
    outs = _drive(s, [[8], [7], [8]])
    assert [o.finish for o in outs] == [None, None, EngineFinish.STOP_TOKEN]  # not at the first 8


def test_a_sequence_stop_wins_over_eos_and_length_at_the_same_token() -> None:
    s = _scheduler()
    s.add(EngineRequest("a", (1,), SamplingParams(temperature=0.0), 2, eos_token_ids=frozenset({8}),
                        stop_token_sequences=((7, 8),)), None)
    assert _drive(s, [[7], [8]])[-1].finish is EngineFinish.STOP_TOKEN


def test_no_stop_ends_a_request_within_its_min_tokens() -> None:
    """A token stop, a sequence stop and EOS all commit as ordinary tokens while the output has at
    most min_tokens tokens (the draws mask the one-token ones; this is the scheduler's side), and
    end it from the next token on; the output limit still ends it."""
    s = _scheduler()
    s.add(EngineRequest("a", (1, 2, 3), SamplingParams(temperature=0.0), 20, eos_token_ids=frozenset({0}),
                        stop_token_ids=frozenset({9}), stop_token_sequences=((7, 8),), min_tokens=4), None)
    outs = _drive(s, [[9], [0], [7, 8], [0]])
    assert [o.finish for o in outs] == [None, None, None, EngineFinish.EOS]
    assert [t for o in outs for t in o.new_token_ids] == [9, 0, 7, 8, 0]  # the stop at token 5 ends it
    s = _scheduler()
    s.add(EngineRequest("a", (1, 2, 3), SamplingParams(temperature=0.0), 3, eos_token_ids=frozenset({0}),
                        min_tokens=3), None)
    assert [o.finish for o in _drive(s, [[0], [0], [0]])] == [None, None, EngineFinish.LENGTH]
    s = _scheduler()
    s.add(EngineRequest("a", (1, 2, 3), SamplingParams(temperature=0.0), 20, stop_token_sequences=((7, 8),),
                        min_tokens=2), None)
    assert _drive(s, [[5, 7, 8]])[-1].finish is EngineFinish.STOP_TOKEN  # completed at token 3


def test_no_string_stop_matches_within_min_tokens() -> None:
    proc = OutputProcessor(CharDetokenizer(), stop=("ab",), min_tokens=3)
    texts = [proc.process(RequestOutput("r", (t,))) for t in (1, 2, 1, 2)]
    assert _texts(texts[:3]) == ["", "a", "b"] and texts[2].finish is None  # "ab" at tokens 1-2 is text
    assert texts[3].finish is not None and texts[3].finish.cause is FinishCause.STOP_STRING
    assert "".join(_texts(texts)) == "ab"  # the stop that ends at token 4 is cut


def test_commit_records_carry_the_commit_time() -> None:
    s = _scheduler()
    s.add(EngineRequest("a", (1,), SamplingParams(temperature=0.0), 3), None)
    outs = _drive(s, [[5], [6], [7]])
    times = [o.produced_at for o in outs]
    assert times == sorted(times) and outs[0] == RequestOutput("a", (5,), num_prompt_tokens=1)  # not in eq


# -- the output pipeline withholds the matched sequence ---------------------------------------------


TEXT = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "<", 8: "/", 9: ">", 0: "<eos>"}


class CharDetokenizer:
    """Token id n decodes to TEXT[n]; ids >= 100 are one half of a two-token character."""

    def __init__(self) -> None:
        self.pending = ""

    def push(self, token_id: int) -> str:
        if token_id >= 100:
            if not self.pending:
                self.pending = "é"
                return ""
            self.pending = ""
            return "é"
        return TEXT[token_id]

    def flush(self) -> str:
        out, self.pending = ("\ufffd" if self.pending else ""), ""
        return out


def _lp(tid: int) -> TokenLogprob:
    return TokenLogprob(tid, -0.5, 1, ())


def _run(sequences: Sequence[Sequence[int]], steps: Sequence[tuple[Sequence[int], EngineFinish | None]],
         origin: float | None = None) -> list[ChildUpdate]:
    proc = OutputProcessor(CharDetokenizer(), stop_token_sequences=sequences, origin=origin)
    updates: list[ChildUpdate] = []
    for ids, finish in steps:
        updates.append(proc.process(RequestOutput("r", tuple(ids), logprobs=tuple(_lp(t) for t in ids),
                                                  finish=finish, produced_at=100.0 + len(updates))))
    return updates


def _texts(updates: list[ChildUpdate]) -> list[str]:
    return ["".join(e.text for e in u.events if isinstance(e, TextDelta)) for u in updates]


def test_the_matched_sequence_is_withheld_whole() -> None:
    updates = _run([(7, 8, 9)], [([1], None), ([7], None), ([8], None), ([9], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["a", "", "", ""]
    last = updates[-1]
    assert last.finish is not None and last.finish.cause is FinishCause.STOP_TOKEN and last.finish.matched_stop == 9
    # Every token is reported; the logprob entries are those of every token but the terminating one.
    assert [t for u in updates for t in u.token_ids] == [1, 7, 8, 9]
    assert [lp.token_id for u in updates for lp in (u.logprobs or ())] == [1, 7, 8]
    assert last.num_output_tokens == 4


def test_held_text_is_released_when_the_tail_stops_being_a_prefix() -> None:
    updates = _run([(7, 8, 9)], [([7], None), ([8], None), ([2], None), ([7], None), ([7], None), ([8], None),
                                 ([0], EngineFinish.EOS)])
    assert _texts(updates) == ["", "", "</b", "", "<", "", "</"]  # EOS releases what was held
    assert updates[-1].finish is not None and updates[-1].finish.cause is FinishCause.EOS


def test_overlapping_sequences_release_only_what_is_not_the_match() -> None:
    # "a b c" is held as a prefix of (1, 2, 3, 4); then (3, 5) completes: "ab" is released, "c" withheld.
    updates = _run([(1, 2, 3, 4), (3, 5)], [([1, 2], None), ([3], None), ([5], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["", "", "ab"]


def test_the_longest_matching_sequence_is_withheld() -> None:
    updates = _run([(8, 9), (7, 8, 9)], [([1, 7, 8, 9], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["a"]
    updates = _run([(8, 9), (7, 8, 9)], [([1, 2, 8, 9], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["ab"]


def test_one_token_stops_and_length_behave_as_before() -> None:
    updates = _run([(9,)], [([1, 7], None), ([9], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["a<", ""]  # nothing held for a one-token stop
    updates = _run([(7, 8, 9)], [([1, 7], None), ([8], EngineFinish.LENGTH)])
    assert _texts(updates) == ["a", "</"]


def test_a_character_straddling_the_sequence_start_goes_with_it() -> None:
    updates = _run([(101, 9)], [([1, 100], None), ([101], None), ([9], EngineFinish.STOP_TOKEN)])
    assert _texts(updates) == ["a", "", ""]


def test_token_timestamps_count_from_the_origin() -> None:
    updates = _run([], [([1, 2], None), ([3], None), ([0], EngineFinish.EOS)], origin=99.5)
    assert [u.token_timestamps for u in updates] == [(0.5, 0.5), (1.5,), (2.5,)]
    assert _run([], [([1], None)])[0].token_timestamps == ()  # no origin, no timestamps


class _Recorder:
    """A parser that records what it is fed: the text and the ids that came with it."""

    def __init__(self) -> None:
        self.fed: list[tuple[str, list[int]]] = []

    def feed(self, text: str, token_ids: Sequence[int]) -> list[OutputEvent]:
        self.fed.append((text, list(token_ids)))
        return [TextDelta(text)] if text else []

    def finish(self, *, truncated: bool = False) -> list[OutputEvent]:
        return []


@pytest.mark.parametrize("stop, sequences", [(("fed",), ()), ((), ((7, 8, 9),)), (("cab",), ())])
@pytest.mark.parametrize("seed", range(20))
def test_ids_reach_the_parser_with_their_text(seed: int, stop: tuple[str, ...],
                                              sequences: tuple[tuple[int, ...], ...]) -> None:
    """Text held back (a string stop's lookahead, a token stop's prefix) keeps its token ids back with
    it: at every feed, the ids fed so far decode to exactly the text fed so far. (The parsers read
    delimiter tokens by id; an id that arrived an update before its text was a lone id.)"""
    rng = random.Random(seed)
    parser = _Recorder()
    proc = OutputProcessor(CharDetokenizer(), stop=stop, stop_token_sequences=sequences, parser=parser)
    ids = [rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in range(rng.randint(1, 30))]
    cursor = 0
    while cursor < len(ids) and proc.finished is None:
        step = ids[cursor: cursor + rng.randint(1, 3)]
        cursor += len(step)
        last = cursor >= len(ids)
        u = proc.process(RequestOutput("r", tuple(step), finish=EngineFinish.LENGTH if last else None))
        text = "".join(t for t, _ in parser.fed)
        fed_ids = [i for _, i2 in parser.fed for i in i2]
        if u.finish is None:
            assert "".join(TEXT[i] for i in fed_ids) == text
    assert [i for _, i2 in parser.fed for i in i2] == ids[:cursor]
