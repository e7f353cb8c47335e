"""Image prompts in the engine (issue 16 items 4 and 5): features injected at placeholder positions
through bounded feature windows during chunked prefill, and image identity in the prefix cache.

A tiny random Llama text model and a small real torch tower (a linear projection of each image's
prepared rows) stand in for a vision-language model: the engine sees only `ImageInput` spans, a
loader and an encoder, so its plumbing is checked here against a dense single-sequence forward with
the same rows injected by hand. The real Idefics3 model runs end to end in tests/server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineFinish, EngineRequest, ImageInput, RequestOutput
from helios.engine.speculative import SpeculativeConfig
from helios.models.config import ModelConfig
from helios.models.dense_attention import DenseAttention
from helios.models.llama import LlamaForCausalLM
from tests.unit.test_engine import run

CFG = ModelConfig(arch="llama", vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256)
IMG, OPEN, SEP, CLOSE = 90, 91, 92, 93  # the placeholder token and framing tokens


class Tower(torch.nn.Module):
    """A stand-in vision tower: prepared input [tokens, 4] -> features [tokens, hidden]."""

    image_token_id = IMG

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.proj = torch.nn.Linear(4, CFG.hidden_size)
        self.calls = 0

    def encode(self, prepared: Any) -> torch.Tensor:
        self.calls += 1
        return self.proj(prepared.to(self.proj.weight.device))


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def pixels(seed: int, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, 4, generator=torch.Generator().manual_seed(seed))


class Loads:
    """Counting loaders: how often each image's prepared input was asked for."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def loader(self, seed: int, tokens: int) -> Callable[[], Any]:
        def load() -> torch.Tensor:
            self.count[seed] = self.count.get(seed, 0) + 1
            return pixels(seed, tokens)
        return load


def image_span(tiles: int = 2, per_tile: int = 3) -> list[int]:
    """OPEN, then tiles of placeholders separated by SEP, then CLOSE (framing inside the span)."""
    out = [OPEN]
    for t in range(tiles):
        if t:
            out.append(SEP)
        out.extend([IMG] * per_tile)
    return [*out, CLOSE]


def build(parts: list[Any], loads: Loads) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Prompt ids from text id lists and ("image", seed) items; the spans cover OPEN .. CLOSE."""
    ids: list[int] = []
    images: list[ImageInput] = []
    for part in parts:
        if isinstance(part, tuple):
            seed = part[1]
            span = image_span()
            tokens = span.count(IMG)
            images.append(ImageInput(len(ids), len(span), tokens, f"image-{seed}|settings",
                                     loads.loader(seed, tokens)))
            ids.extend(span)
        else:
            ids.extend(part)
    return ids, tuple(images)


def text(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 80, (n,), generator=g).tolist()


def engine(chunk: int = 64, num_pages: int = 64, device: str = "cpu",
           **kw: Any) -> tuple[EngineCore, Tower, LlamaForCausalLM]:
    """The engine (on ``device``) and a CPU copy of its model and tower for the dense reference."""
    model, tower = tiny_model(), Tower()
    cfg = EngineConfig(page_size=4, num_pages=num_pages, max_active=8, prefill_chunk_size=chunk, max_model_len=160,
                       **kw)
    if device == "cpu":
        return EngineCore(model, cfg, torch.float32, "cpu", vision=tower), tower, model
    return (EngineCore(tiny_model().to(device), cfg, torch.float32, device, vision=Tower().to(device)),
            tower, model)


def request(rid: str, ids: list[int], images: tuple[ImageInput, ...], max_tokens: int = 4,
            **kw: Any) -> EngineRequest:
    return EngineRequest(rid, tuple(ids), SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True,
                         num_top_logprobs=3, images=images, **kw)


def dense_logprobs(model: LlamaForCausalLM, tower: Tower, ids: list[int],
                   images: tuple[ImageInput, ...]) -> torch.Tensor:
    """The whole sequence in one dense forward with every image's rows injected by hand."""
    rows: list[int] = []
    feats: list[torch.Tensor] = []
    calls = tower.calls
    with torch.inference_mode():
        for image in images:
            span = range(image.offset, image.offset + image.length)
            rows.extend(p for p in span if ids[p] == IMG)
            feats.append(tower.encode(image.load()))
        tower.calls = calls
        embeds = (torch.tensor(rows), torch.cat(feats)) if rows else None
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention.for_model(model), embeds=embeds)
        return torch.log_softmax(model.compute_logits(hidden).double(), dim=-1)


def first_logprobs(outs: list[RequestOutput]) -> dict[int, float]:
    lp = next(o.logprobs for o in outs if o.logprobs)[0]
    return dict(lp.top)


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device (CPU CI skips CUDA tests)"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("chunk", [64, 5, 3, 1])
def test_features_land_at_placeholders_across_chunk_boundaries(chunk: int, device: str) -> None:
    """Chunk sizes that split images anywhere (3 and 5 split inside tiles, 1 token at a time) give
    the dense forward's logprobs (on CUDA too, against the CPU reference); each image is encoded
    once, and a window lives only while a request's prefill stopped inside an image."""
    core, tower, model = engine(chunk=chunk, device=device)
    loads = Loads()
    ids, images = build([text(1, 5), ("image", 7), text(2, 3), ("image", 8), text(3, 2)], loads)
    windows: list[int] = []
    outs = run(core, [request("a", ids, images)], each_step=lambda: windows.append(core.runner.images.num_windows))
    assert loads.count == {7: 1, 8: 1} and core.runner.images.encoded == 2
    got = tokens_of(outs["a"])
    ref = dense_logprobs(model, tower, ids, images)
    assert got[0] == int(ref[-1].argmax())
    for t, p in first_logprobs(outs["a"]).items():
        assert p == pytest.approx(float(ref[-1, t]), abs=1e-5)
    assert max(windows) <= 1 and windows[-1] == 0
    assert outs["a"][-1].finish is EngineFinish.LENGTH


def test_another_image_changes_the_answer_and_never_hits_the_cache() -> None:
    core, tower, model = engine()
    loads = Loads()
    ids, images_a = build([text(1, 9), ("image", 7), text(2, 6)], loads)
    _, images_b = build([text(1, 9), ("image", 8), text(2, 6)], loads)
    outs = run(core, [request("a", ids, images_a)])
    outs_b = run(core, [request("b", ids, images_b)])
    assert loads.count == {7: 1, 8: 1}
    a, b = first_logprobs(outs["a"]), first_logprobs(outs_b["b"])
    assert a != b
    # Same tokens, another image: the hit stops at the last page before the image's span (offset 9).
    assert outs_b["b"][-1].num_cached_tokens == 8
    ref = dense_logprobs(model, tower, ids, images_b)
    for t, p in b.items():
        assert p == pytest.approx(float(ref[-1, t]), abs=1e-5)


def test_the_same_image_twice_hits_and_is_not_loaded_again() -> None:
    core, tower, _ = engine()
    loads = Loads()
    ids, images = build([text(1, 9), ("image", 7), text(2, 6)], loads)
    first = run(core, [request("a", ids, images)])
    ids2, images2 = build([text(1, 9), ("image", 7), text(2, 6)], loads)
    second = run(core, [request("b", ids2, images2)])
    image = images2[0]
    cached = second["b"][-1].num_cached_tokens
    assert cached >= image.offset + image.length  # the whole span is reused
    assert loads.count == {7: 1} and tower.calls == 1  # neither load nor encode the second time
    assert tokens_of(first["a"]) == tokens_of(second["b"])
    assert first_logprobs(first["a"]) == pytest.approx(first_logprobs(second["b"]), abs=1e-6)


def test_a_cached_prefix_ending_inside_an_image_encodes_it_and_uses_the_later_rows() -> None:
    """The prompt ends with the image's span: a repeat's hit stops before its last token, inside
    the image, whose whole encode then runs again; the rows past the hit match the dense forward."""
    core, tower, model = engine(chunk=4)
    loads = Loads()
    ids, images = build([text(1, 5), ("image", 7)], loads)  # 5 + 9 tokens: pages end at 4, 8, 12
    run(core, [request("a", ids, images)])
    outs = run(core, [request("b", ids, images)])
    assert outs["b"][-1].num_cached_tokens == 12  # inside the span 5 .. 14
    assert loads.count == {7: 2} and tower.calls == 2
    ref = dense_logprobs(model, tower, ids, images)
    for t, p in first_logprobs(outs["b"]).items():
        assert p == pytest.approx(float(ref[-1, t]), abs=1e-5)


def test_appending_an_image_keeps_the_earlier_messages_reused() -> None:
    core, tower, model = engine()
    loads = Loads()
    ids, images = build([text(1, 6), ("image", 7), text(2, 7)], loads)
    run(core, [request("a", ids, images)])
    ids2, images2 = build([text(1, 6), ("image", 7), text(2, 7), ("image", 8), text(3, 3)], loads)
    outs = run(core, [request("b", ids2, images2)])
    assert outs["b"][-1].num_cached_tokens == 20  # every full page before the appended image (at 22)
    assert loads.count == {7: 1, 8: 1}  # the first image is not loaded again
    ref = dense_logprobs(model, tower, ids2, images2)
    for t, p in first_logprobs(outs["b"]).items():
        assert p == pytest.approx(float(ref[-1, t]), abs=1e-5)


def test_prompt_scores_at_placeholders_are_null() -> None:
    core, tower, model = engine(chunk=5)
    loads = Loads()
    ids, images = build([text(1, 4), ("image", 7), text(2, 3)], loads)
    outs = run(core, [request("a", ids, images, prompt_logprobs=1)])
    scores = [s for o in outs["a"] for s in (o.prompt_logprobs or ())]
    assert len(scores) == len(ids)
    ref = dense_logprobs(model, tower, ids, images)
    for p, s in enumerate(scores):
        if p == 0 or ids[p] == IMG:
            assert s is None
        else:
            assert s is not None and s.logprob == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-5)
    assert sum(1 for s in scores if s is None) == 1 + images[0].tokens


def test_an_image_that_cannot_be_prepared_fails_only_its_request() -> None:
    core, _, _ = engine(chunk=8)
    loads = Loads()
    ids, images = build([text(1, 5), ("image", 7), text(2, 3)], loads)

    def broken() -> Any:
        raise OSError("truncated image data")

    bad = (ImageInput(images[0].offset, images[0].length, images[0].tokens, "broken|settings", broken),)
    short = (ImageInput(images[0].offset, images[0].length, images[0].tokens + 1, "short|settings",
                        images[0].load),)
    outs = run(core, [request("bad", ids, bad), request("good", ids, images), request("short", ids, short)])
    assert outs["bad"][-1].finish is EngineFinish.ERROR
    assert "OSError: truncated image data" in (outs["bad"][-1].error or "")
    assert outs["short"][-1].finish is EngineFinish.ERROR
    assert "placeholder tokens" in (outs["short"][-1].error or "")
    assert outs["good"][-1].finish is EngineFinish.LENGTH
    assert core.kv_manager.num_free == core.kv_manager.num_pages
    # Nothing of the failed requests was registered: a fresh good request reuses only good pages.
    again = run(core, [request("again", ids, images)])
    assert tokens_of(again["again"]) == tokens_of(outs["good"])


def test_a_text_only_engine_fails_image_requests_with_a_reason() -> None:
    model = tiny_model()
    core = EngineCore(model, EngineConfig(page_size=4, num_pages=32, max_active=4, prefill_chunk_size=16,
                                               max_model_len=128), torch.float32, "cpu")
    ids, images = build([text(1, 3), ("image", 7)], Loads())
    outs = run(core, [request("a", ids, images)])
    assert outs["a"][-1].finish is EngineFinish.ERROR and "no vision encoder" in (outs["a"][-1].error or "")


def test_preemption_mid_image_recomputes_from_the_image() -> None:
    """A small page pool: requests are preempted and recomputed (their windows dropped); every
    answer still equals its own dense reference."""
    core, tower, model = engine(chunk=6, num_pages=16, prefix_caching=False)
    loads = Loads()
    reqs, refs = [], []
    for i in range(3):
        ids, images = build([text(i, 3 + i), ("image", 10 + i), text(20 + i, 2)], loads)
        reqs.append(request(f"r{i}", ids, images, max_tokens=24))
        refs.append((ids, images))
    outs = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for r, (ids, images) in zip(reqs, refs, strict=True):
        got = tokens_of(outs[r.request_id])
        ref = dense_logprobs(model, tower, ids + got[:-1], images)
        want = [int(ref[len(ids) - 1 + k].argmax()) for k in range(len(got))]
        assert got == want
    assert core.runner.images.num_windows == 0


def test_host_store_pages_keep_their_image_identity() -> None:
    """Evicted pages go to the host store under the same chain hashes: the same image restores
    them (no load), another image with the same tokens does not."""
    core, _, _ = engine(num_pages=12, host_memory_bytes=1 << 20)
    loads = Loads()
    ids, images = build([text(1, 9), ("image", 7), text(2, 6)], loads)
    run(core, [request("a", ids, images)])
    filler, _ = build([text(5, 40)], loads)
    run(core, [request("fill", filler, ())])  # evicts a's pages into the host store
    run(core, [request("b", ids, images)])
    assert core.scheduler.host_hits == 1 and loads.count == {7: 1}
    run(core, [request("fill2", filler, ())])
    _, other = build([text(1, 9), ("image", 8), text(2, 6)], loads)
    outs = run(core, [request("c", ids, other)])
    assert outs["c"][-1].num_cached_tokens <= 8 and loads.count == {7: 1, 8: 1}


def test_speculative_decoding_after_an_image_prefill_is_exact() -> None:
    plain, _, _ = engine()
    spec, _, _ = engine(speculative=SpeculativeConfig(mode="ngram", max_depth=3))
    loads = Loads()
    ids, images = build([text(1, 3), ("image", 7), [5, 6, 7, 5, 6, 7, 5, 6]], loads)
    a = run(plain, [request("a", ids, images, max_tokens=20)])
    b = run(spec, [request("a", ids, images, max_tokens=20)])
    assert tokens_of(a["a"]) == tokens_of(b["a"])
