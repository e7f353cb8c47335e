"""Images end to end over real HTTP (issue 16): Chat, Messages and Responses against a real Helios
server (`runtime.build_runtime`) on a tiny random Idefics3 checkpoint (tests/serving/tiny_vlm.py).

What is checked on every route: an image changes the answer (another image, other logits; the same
image, the same answer), the same image twice hits the prefix cache over its whole span without
running the encoder again, usage counts the profile's image tokens, and budget and format rejections
reach the client as 400s in the route's own error shape. On Chat also: chunked prefill with chunks
that split an image gives one chunk's logits (fp32), prompt scores are null at image positions,
appending an image keeps the earlier turn cached, and a prompt that does not fit the context or
whose text carries the image marker is rejected."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from helios.config import VisionSection
from tests.serving.tiny_vlm import VisionServer, b64, build_checkpoint, hf_processor, png, serving_config

transformers = pytest.importorskip("transformers")

ROUTES = ("chat", "messages", "responses")
_unique = itertools.count()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[VisionServer]:
    srv = VisionServer(serving_config(checkpoint)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chunked(checkpoint: Path) -> Iterator[VisionServer]:
    """Prefill chunks of 7 tokens: every image's span (16 tokens per tile) is split, mid-tile."""
    srv = VisionServer(serving_config(checkpoint, chunk=7)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight(checkpoint: Path) -> Iterator[VisionServer]:
    """Tight image limits and a short context."""
    limits = VisionSection(max_images_per_prompt=2, max_image_tokens_per_prompt=200, max_image_tokens_per_image=120,
                           max_image_bytes=60_000)
    srv = VisionServer(serving_config(checkpoint, vision=limits, max_model_len=256)).start()
    yield srv
    srv.stop()


# -- requests per route -------------------------------------------------------------------------------

def image_block(route: str, data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    if route == "chat":
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{b64(data)}"}}
    if route == "messages":
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}
    return {"type": "input_image", "image_url": f"data:{media_type};base64,{b64(data)}"}


def text_block(route: str, text: str) -> dict[str, Any]:
    return {"type": "input_text" if route == "responses" else "text", "text": text}


def user(route: str, text: str, *images: bytes) -> dict[str, Any]:
    return {"role": "user", "content": [text_block(route, text), *(image_block(route, i) for i in images)]}


def post(srv: VisionServer, route: str, messages: list[dict[str, Any]], *, max_tokens: int = 4,
         logprobs: bool = False, **extra: Any) -> Any:
    if route == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
        if logprobs:
            body.update(logprobs=True, top_logprobs=5)
    elif route == "messages":
        path = "/v1/messages"
        body = {"messages": messages, "max_tokens": max_tokens}
    else:
        path = "/v1/responses"
        body = {"input": messages, "max_output_tokens": max_tokens}
        if logprobs:
            body.update(top_logprobs=5, include=["message.output_text.logprobs"])
    body.update(model="vlm", temperature=0.0, **extra)
    with srv.http() as c:
        return c.post(path, json=body)


def ok(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def answer(route: str, body: dict[str, Any]) -> str:
    if route == "chat":
        return str(body["choices"][0]["message"]["content"])
    if route == "messages":
        return "".join(b.get("text", "") for b in body["content"])
    return "".join(p.get("text", "") for item in body["output"] if item["type"] == "message"
                   for p in item["content"])


def first_top(route: str, body: dict[str, Any]) -> dict[str, float]:
    """The first generated token's top alternatives: token text -> logprob."""
    if route == "chat":
        entry = body["choices"][0]["logprobs"]["content"][0]
    else:
        part = next(p for item in body["output"] if item["type"] == "message" for p in item["content"])
        entry = part["logprobs"][0]
    return {t["token"]: t["logprob"] for t in entry["top_logprobs"]}


def cached(route: str, body: dict[str, Any]) -> int:
    usage = body["usage"]
    if route == "chat":
        return int(usage["prompt_tokens_details"]["cached_tokens"])
    if route == "messages":
        return int(usage["cache_read_input_tokens"])
    return int(usage["input_tokens_details"]["cached_tokens"])


def prompt_tokens(route: str, body: dict[str, Any]) -> int:
    usage = body["usage"]
    if route == "chat":
        return int(usage["prompt_tokens"])
    if route == "messages":
        return int(usage["input_tokens"]) + int(usage["cache_read_input_tokens"])
    return int(usage["input_tokens"])


def error_message(route: str, response: Any) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    if route == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def fresh(text: str = "What is in this picture") -> str:
    """Text no earlier request began with (so no test reuses another's cached prefix)."""
    return f"[{next(_unique)}] {text}?"


# -- every route ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_an_image_changes_the_answer(server: VisionServer, route: str) -> None:
    text = fresh()
    a, b = png(40, 30, seed=1), png(40, 30, seed=2)
    first = ok(post(server, route, [user(route, text, a)], max_tokens=8, logprobs=route != "messages"))
    other = ok(post(server, route, [user(route, text, b)], max_tokens=8, logprobs=route != "messages"))
    again = ok(post(server, route, [user(route, text, a)], max_tokens=8, logprobs=route != "messages"))
    assert answer(route, first) == answer(route, again)
    if route == "messages":  # Messages has no logprobs: the greedy answers differ
        assert answer(route, first) != answer(route, other)
        return
    top_a, top_b, top_again = first_top(route, first), first_top(route, other), first_top(route, again)
    assert top_a != top_b
    assert top_a.keys() == top_again.keys()
    for token, logprob in top_a.items():
        assert top_again[token] == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("route", ROUTES)
def test_the_same_image_twice_hits_the_prefix_cache_without_the_encoder(server: VisionServer, route: str) -> None:
    image = png(56, 40, seed=10 + ROUTES.index(route))
    messages = [user(route, fresh("Describe"), image), user(route, "in one word")]
    encoded = server.core.runner.images.encoded
    first = ok(post(server, route, messages))
    assert server.core.runner.images.encoded == encoded + 1
    assert cached(route, first) <= 16  # the template's first page at most: the fresh text differs after it
    second = ok(post(server, route, messages))
    assert server.core.runner.images.encoded == encoded + 1  # neither loaded nor encoded again
    total = prompt_tokens(route, second)
    # Every full page is reused but the last one the final token needs: the image's whole span
    # (followed by the second message) is cached.
    assert cached(route, second) >= total - 16
    assert answer(route, first) == answer(route, second)


@pytest.mark.parametrize("route", ROUTES)
def test_usage_counts_the_profiles_image_tokens(server: VisionServer, route: str) -> None:
    sizes = [(40, 30), (20, 90)]
    costs = [server.tower.profile.cost(w, h).tokens for w, h in sizes]
    body = ok(post(server, route, [user(route, fresh(), *(png(w, h, seed=30 + i) for i, (w, h) in enumerate(sizes)))]))
    if route == "chat":
        assert body["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": sum(costs)}
    # Framing tokens count in the prompt only: it is longer than the image tokens and the text.
    assert prompt_tokens(route, body) > sum(costs)
    assert server.app.service is not None and server.app.service.images is not None


@pytest.mark.parametrize("route", ROUTES)
def test_budget_and_format_rejections_reach_the_client(tight: VisionServer, route: str) -> None:
    """B's messages (serving/images.py) reach the client unchanged, in the route's error shape."""
    where = "input" if route == "responses" else "messages"
    profile = tight.tower.profile
    small, wide = png(96, 20, seed=40), png(33, 20, seed=43)
    assert profile.cost(96, 20).tokens == 64 and profile.cost(33, 20).tokens == 112
    three = [user(route, fresh(), small, small, small)]
    assert error_message(route, post(tight, route, three)) == "the request has 3 images; max_images_per_prompt is 2"
    big = profile.cost(60, 60)
    assert big.tokens > 120
    assert error_message(route, post(tight, route, [user(route, fresh(), png(60, 60, seed=41))])) == (
        f"image 1 (at {where}[0].content[1]) of 60x60 pixels costs {big.tokens} image tokens ({big.patches} patches); "
        "max_image_tokens_per_image is 120")
    assert error_message(route, post(tight, route, [user(route, fresh(), wide, wide)])) == (
        f"the request's 2 images cost 224 image tokens (patches: 448 + 448 = 896), over max_image_tokens_per_prompt "
        f"200; image 2 (at {where}[0].content[2]), 33x20 pixels and 112 tokens, is the first that crossed it")
    corrupt = png(20, 20, seed=42)[:-40]
    msg = error_message(route, post(tight, route, [user(route, fresh(), corrupt)]))
    assert msg.startswith(f"image 1 (at {where}[0].content[1]) is corrupt or truncated PNG data")
    gif = b"GIF89a" + b"\x00" * 32
    msg = error_message(route, post(tight, route, [user(route, fresh(), gif)]))
    assert msg.startswith(f"image 1 (at {where}[0].content[1]) is image/gif data; images must be PNG, JPEG or static WebP")
    # A prompt that does not fit the context with its image is rejected, never truncated.
    assert post(tight, route, [user(route, "x" * 150, small)], max_tokens=8).status_code == 400
    assert tight.core.runner.images.encoded == 0  # nothing of these reached the engine


# -- Chat: numerics, prompt scores, conversation reuse, prompt checks ----------------------------------------

def test_chunked_prefill_splitting_images_gives_one_chunks_logits(server: VisionServer, chunked: VisionServer) -> None:
    text = fresh()
    messages = [user("chat", text, png(40, 30, seed=50), png(25, 60, seed=51)), user("chat", "and now?")]
    whole = ok(post(server, "chat", messages, max_tokens=3, logprobs=True, prompt_logprobs=2))
    split = ok(post(chunked, "chat", messages, max_tokens=3, logprobs=True, prompt_logprobs=2))
    assert answer("chat", whole) == answer("chat", split)
    for a, b in zip(whole["choices"][0]["logprobs"]["content"], split["choices"][0]["logprobs"]["content"],
                    strict=True):
        assert a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    scores_a, scores_b = whole["prompt_logprobs"], split["prompt_logprobs"]
    assert len(scores_a) == len(scores_b) == whole["usage"]["prompt_tokens"]
    nulls = [i for i, s in enumerate(scores_a) if s is None]
    # Position 0 and every image placeholder position have no score.
    assert len(nulls) == 1 + whole["usage"]["prompt_tokens_details"]["multimodal_tokens"]["image"]
    assert nulls == [i for i, s in enumerate(scores_b) if s is None]
    for a, b in zip(scores_a, scores_b, strict=True):
        if a is not None:
            for token_id, entry in a.items():
                assert b[token_id]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)


def test_appending_an_image_keeps_the_earlier_turn_cached(server: VisionServer) -> None:
    text = fresh("Here is a picture")
    first_turn = [user("chat", text, png(40, 30, seed=60))]
    first = ok(post(server, "chat", first_turn, max_tokens=2))
    encoded = server.core.runner.images.encoded
    follow = [*first_turn, {"role": "assistant", "content": answer("chat", first)},
              user("chat", "And this one", png(30, 40, seed=61))]
    second = ok(post(server, "chat", follow, max_tokens=2))
    assert server.core.runner.images.encoded == encoded + 1  # only the appended image is encoded
    assert cached("chat", second) >= first["usage"]["prompt_tokens"] - 16


def test_the_image_marker_in_text_is_rejected(server: VisionServer) -> None:
    response = post(server, "chat", [user("chat", "look: <image> here", png(20, 20, seed=70))])
    msg = error_message("chat", response)
    assert "image markers (<image>)" in msg
    response = post(server, "chat", [{"role": "user", "content": "only text, but <image> in it"}])
    assert error_message("chat", response).startswith("the rendered prompt has 1 image markers (<image>) for 0 images")


@pytest.mark.parametrize("prompt", ["a raw <image> prompt", [5, 6, 7]])
def test_a_raw_prompt_with_the_image_token_is_rejected(server: VisionServer, prompt: Any) -> None:
    if isinstance(prompt, list):
        prompt = [*prompt, server.tower.image_token_id]
    with server.http() as c:
        response = c.post("/v1/completions", json={"model": "vlm", "prompt": prompt, "max_tokens": 1})
    assert error_message("completions", response) == (
        "the prompt contains the image placeholder token <image>, which only an image can fill; raw prompts take "
        "no images")
    with server.http() as c:
        fine = c.post("/v1/completions", json={"model": "vlm", "prompt": "a raw prompt", "max_tokens": 1})
    assert fine.status_code == 200, fine.text


def test_an_image_in_a_system_message_is_rejected_not_dropped(server: VisionServer) -> None:
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}, image_block("chat", png(20, 20, 1))]}
    response = post(server, "chat", [system, {"role": "user", "content": fresh()}])
    assert error_message("chat", response) == (
        "images in system or developer messages cannot be presented to the model (this request has 1); send them "
        "in a user message")


def test_count_tokens_counts_the_expanded_prompt(server: VisionServer) -> None:
    messages = [user("messages", fresh(), png(40, 30, seed=85))]
    with server.http() as c:
        counted = c.post("/v1/messages/count_tokens", json={"model": "vlm", "messages": messages})
    assert counted.status_code == 200, counted.text
    body = ok(post(server, "messages", messages, max_tokens=1))
    assert counted.json()["input_tokens"] == prompt_tokens("messages", body)


def test_a_prompt_over_the_context_with_its_images_is_a_context_error(tight: VisionServer) -> None:
    response = post(tight, "chat", [user("chat", "x" * 150, png(96, 20, seed=80))], max_tokens=8)
    msg = error_message("chat", response)
    assert "context" in msg and "256" in msg


def test_the_served_prompt_and_logits_match_transformers(server: VisionServer, checkpoint: Path) -> None:
    """The whole path (template marker, expansion, spans, admission, preparation, encode, injection)
    against transformers' processor and Idefics3ForConditionalGeneration on the same checkpoint."""
    text = fresh("Compare")
    images = [png(40, 30, seed=90), png(25, 60, seed=91)]
    body = ok(post(server, "chat", [user("chat", text, *images)], max_tokens=1, logprobs=True,
                   return_tokens_as_token_ids=True))
    processor = hf_processor()
    pil = [Image.open(io.BytesIO(i)) for i in images]
    rendered = f"<|im_start|>user\n{text}<image><image><end_of_utterance>\n<|im_start|>assistant\n"
    inputs = processor(text=rendered, images=pil, return_tensors="pt")
    assert body["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(checkpoint, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(**inputs).logits[0, -1].double(), dim=-1)
    top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [int(t["token"].removeprefix("token_id:")) for t in top] == torch.topk(reference, 5).indices.tolist()
    for t in top:
        assert t["logprob"] == pytest.approx(float(reference[int(t["token"].removeprefix("token_id:"))]), abs=1e-4)


def test_speculative_decoding_and_structured_output_after_an_image(server: VisionServer, checkpoint: Path) -> None:
    messages = [user("chat", fresh("Repeat abcabcabcabc"), png(40, 30, seed=95))]
    plain = ok(post(server, "chat", messages, max_tokens=24))
    spec_server = VisionServer(serving_config(checkpoint, speculative="ngram")).start()
    try:
        spec = ok(post(spec_server, "chat", messages, max_tokens=24))
    finally:
        spec_server.stop()
    assert answer("chat", spec) == answer("chat", plain)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    body = ok(post(server, "chat", [user("chat", fresh("Is it red"), png(40, 30, seed=96))], max_tokens=48,
                   response_format=fmt))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(answer("chat", body))["ok"], bool)
