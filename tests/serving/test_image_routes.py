"""Images on every route of a text-only model, over real HTTP (the scripted-model server): each route
rejects an image with a 400 that names the model and says it is text-only, and nothing reaches the
model; the card, /api/show and /metrics report no image input.

(The routes on a vision model: tests/serving/test_image_routes_vision.py.)"""

from __future__ import annotations

import base64
import gzip
import io
import json
from typing import Any

import pytest
from PIL import Image

from tests.serving.harness import ScriptedServer


@pytest.fixture(scope="module")
def smol(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["smollm2"]


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


PNG = _png()
URL = f"data:image/png;base64,{PNG}"
IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}


def text_only(smol: ScriptedServer) -> str:
    return f"model {smol.service.info.public_id} does not accept image input (it is text-only)"


def bodies(key: str) -> list[tuple[str, dict[str, Any]]]:
    ask = f"What is this? {key}"
    return [
        ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": ask}, {"type": "image_url", "image_url": {"url": URL}}]}]}),
        ("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "see", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": URL}}]}]}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": ask}, IMAGE_BLOCK]}]}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "see", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE_BLOCK]}]}]}),
        ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": ask}, {"type": "input_image", "image_url": URL, "detail": "auto"}]}]}),
        ("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": [
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": "c1", "name": "see", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1",
             "output": [{"type": "input_image", "image_url": URL}]}]}),
    ]


def test_every_chat_route_rejects_images_naming_the_model(smol: ScriptedServer) -> None:
    key = smol.book.add("I see nothing.")
    before = len(smol.book.prompts_for(key))
    with smol.http() as http:
        for path, body in bodies(key):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["message"] == text_only(smol), (path, err)
            assert err["type"] == "invalid_request_error"
    assert len(smol.book.prompts_for(key)) == before  # nothing reached the model


SYSTEMONE = {"model": "m", "state": {"photo": "img"},
             "questions": {"q": {"type": "noul", "instructions": "Is img a receipt?"}},
             "assets": {"img": {"type": "image", "format": "png", "data_base64": PNG}}}
DANGER = {"TypeSafe-Danger-Zone-Images": "true"}


def _multipart(boundary: str = "b0und") -> tuple[bytes, dict[str, str]]:
    request = {**SYSTEMONE, "assets": {"img": {"part": "photo"}}}
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"request\"\r\n"
            "Content-Type: application/json\r\n\r\n").encode() + json.dumps(request).encode() + (
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"photo\"; filename=\"p.png\"\r\n"
        "Content-Type: image/png\r\n\r\n").encode() + base64.b64decode(PNG) + f"\r\n--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


def test_systemone_assets_on_a_text_only_model(smol: ScriptedServer) -> None:
    with smol.http() as http:
        r = http.post("/v1/systemone", json=SYSTEMONE)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "image assets require the TypeSafe-Danger-Zone-Images: true header"
        r = http.post("/v1/systemone", json=SYSTEMONE, headers=DANGER)
        assert r.status_code == 400 and r.json()["error"]["message"] == text_only(smol)
        body, headers = _multipart()
        r = http.post("/v1/systemone", content=body, headers={**headers, **DANGER})
        assert r.status_code == 400 and r.json()["error"]["message"] == text_only(smol), r.text
        r = http.post("/v1/systemone", content=gzip.compress(body),
                      headers={**headers, **DANGER, "content-encoding": "gzip"})
        assert r.status_code == 415, r.text
        # /v1/decisions is text-only on every model
        r = http.post("/v1/decisions", content=body, headers={**headers, **DANGER})
        assert r.status_code == 400 and "text-only route" in r.json()["error"]["message"]


def test_cards_and_metrics_report_no_image_input(smol: ScriptedServer) -> None:
    with smol.http() as http:
        flare = http.get("/v1/models").json()["data"][0]["flare"]
        assert flare["input_modalities"] == ["text"] and flare["output_modalities"] == ["text"]
        for field in ("max_images_per_prompt", "max_image_tokens_per_prompt", "image_feature_window_tokens",
                      "max_image_tokens_per_image", "max_image_pixels", "max_image_bytes"):
            assert flare[field] == 0
        show = http.post("/api/show", json={"model": smol.service.info.public_id}).json()
        assert "vision" not in show["capabilities"]
        assert not any("image" in k for k in show["model_info"])
        snap = http.get("/metrics", params={"format": "json"}).json()
        assert snap["input_decoded_images_total"] == 0 and snap["input_prepared_cache_bytes"] == 0
        assert "flare_input_" not in http.get("/metrics").text
