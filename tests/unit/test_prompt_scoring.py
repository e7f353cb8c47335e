"""Prompt scoring in the engine: chunked prefill scores every prompt position exactly as one forward
pass over the whole prompt does, a 0-output request only scores, and preemption never repeats a score.
"""

from __future__ import annotations

import pytest
import torch

from helios.domain.logprobs import PromptLogprob
from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineFinish, EngineRequest, RequestOutput
from helios.engine.sampling import (
    prompt_scores,
)
from helios.models.config import ModelConfig
from helios.models.dense_attention import DenseAttention
from helios.models.llama import LlamaForCausalLM

VOCAB = 97
PROMPT = (5, 17, 3, 88, 42, 42, 7, 1, 60, 33, 12, 96, 0, 4, 4, 19, 71)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m.eval()


def _core(model: LlamaForCausalLM, chunk: int, num_pages: int = 64) -> EngineCore:
    cfg = EngineConfig(page_size=4, num_pages=num_pages, max_active=4, prefill_chunk_size=chunk, max_model_len=128)
    return EngineCore(model, cfg, torch.float32)


def _run(core: EngineCore, *requests: EngineRequest) -> dict[str, list[RequestOutput]]:
    for r in requests:
        core.add(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(500):
        if not core.scheduler.has_work:
            break
        for o in core.step():
            outs[o.request_id].append(o)
    return outs


def _reference(model: LlamaForCausalLM, ids: tuple[int, ...], k: int) -> list[PromptLogprob | None]:
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention.for_model(model))
        logits = model.compute_logits(hidden)[:-1]
    return [None] + [PromptLogprob(s.token_id, s.logprob, s.rank, s.top)
                     for s in prompt_scores(logits, ids[1:], k)]


def _scores(outs: list[RequestOutput]) -> list[PromptLogprob | None]:
    return [e for o in outs for e in (o.prompt_logprobs or ())]


def _close(got: list[PromptLogprob | None], want: list[PromptLogprob | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g is not None
        assert (g.token_id, g.rank, [t for t, _, _ in g.top]) == (w.token_id, w.rank, [t for t, _, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


@pytest.mark.parametrize("chunk", [3, 5, 64])
def test_chunked_scores_equal_whole_prompt(model: LlamaForCausalLM, chunk: int) -> None:
    core = _core(model, chunk)
    req = EngineRequest("a", PROMPT, SamplingParams(temperature=0.0), max_tokens=2, prompt_logprobs=3)
    outs = _run(core, req)["a"]
    _close(_scores(outs), _reference(model, PROMPT, 3))
    # One output per prefill chunk that scored something, then the sampled tokens.
    assert sum(1 for o in outs if o.new_token_ids) == 2
    assert outs[-1].finish is EngineFinish.LENGTH


def test_zero_output_request_only_scores(model: LlamaForCausalLM) -> None:
    core = _core(model, 4)
    req = EngineRequest("z", PROMPT, SamplingParams(temperature=0.0), max_tokens=0, prompt_logprobs=0)
    outs = _run(core, req)["z"]
    assert all(not o.new_token_ids for o in outs)
    assert outs[-1].finish is EngineFinish.LENGTH and outs[-1].num_prompt_tokens == len(PROMPT)
    _close(_scores(outs), _reference(model, PROMPT, 0))
    assert core.scheduler.generated_tokens == 0 and core.kv_manager.num_free == core.kv_manager.num_pages


def test_scoring_with_a_concurrent_plain_request(model: LlamaForCausalLM) -> None:
    core = _core(model, 6)
    plain = EngineRequest("p", PROMPT[:9], SamplingParams(temperature=0.0), max_tokens=4)
    scored = EngineRequest("s", PROMPT, SamplingParams(temperature=0.0), max_tokens=3, prompt_logprobs=2)
    outs = _run(core, plain, scored)
    assert not _scores(outs["p"])
    _close(_scores(outs["s"]), _reference(model, PROMPT, 2))


def test_preemption_does_not_repeat_scores(model: LlamaForCausalLM) -> None:
    # 7 pages of 4 tokens: two long requests cannot both grow, so the newer one is preempted.
    core = _core(model, 64, num_pages=12)
    first = EngineRequest("f", PROMPT, SamplingParams(temperature=0.0), max_tokens=20, ignore_eos=True)
    second = EngineRequest("s", PROMPT, SamplingParams(temperature=0.0), max_tokens=20, prompt_logprobs=1,
                           ignore_eos=True)
    preempted: list[str] = []
    original = core.scheduler._preempt

    def preempt(seq):  # type: ignore[no-untyped-def]
        preempted.append(seq.request_id)
        original(seq)

    core.scheduler._preempt = preempt  # type: ignore[method-assign]
    outs = _run(core, first, second)
    assert "s" in preempted
    assert sum(len(o.new_token_ids) for o in outs["s"]) == 20
    _close(_scores(outs["s"]), _reference(model, PROMPT, 1))


def test_channel_holds_every_prompt_chunk_while_the_reader_waits() -> None:
    """A paused reader loses nothing: the child's channel also fits one output per scored prefill chunk."""
    import trio

    from helios.serving.engine_client import EngineClient

    class Engine:
        healthy = True

        def __init__(self) -> None:
            self.submitted: list[EngineRequest] = []

        def submit(self, request: EngineRequest) -> None:
            self.submitted.append(request)

        def abort(self, request_ids: object) -> None:
            pass

        def stats(self) -> None:
            return None

    async def main() -> list[RequestOutput]:
        client = EngineClient(max_in_flight=4)
        client.attach(Engine(), trio.lowlevel.current_trio_token())
        req = EngineRequest("r", tuple(range(40)), SamplingParams(), max_tokens=2, prompt_logprobs=0)
        async with client.open_children([req]) as (recv,):
            # Worst case: prefill chunks of one token each, every one with a score, then the tokens.
            outs = [RequestOutput("r", (), prompt_logprobs=(None,)) for _ in range(40)]
            outs += [RequestOutput("r", (7,)), RequestOutput("r", (8,), finish=EngineFinish.LENGTH)]
            client.sink(outs)
            await trio.sleep(0.01)  # the wake-up routes everything before anyone reads
            return [o async for o in recv]

    got = trio.run(main)
    assert len(got) == 42 and got[-1].finish is EngineFinish.LENGTH
