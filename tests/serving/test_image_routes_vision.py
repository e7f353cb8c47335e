"""Image input on a vision model over real HTTP, beyond test_images_e2e.py: the card, /api/show and
/metrics report the vision capability, the limits and the flare_input_* counters; System One image
assets (base64 and multipart) are scored with the images; the Responses route's file_id and remote
images and a declared type that the bytes contradict are 400s naming the image.

The server is the real build_runtime on a tiny random Idefics3 checkpoint (tests/serving/tiny_vlm.py).
Its byte-level tokenizer spells Yes/No in several tokens, so System One questions here are choice and
score questions (single-letter labels)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving.tiny_vlm import VisionServer, b64, build_checkpoint, png, serving_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VisionServer]:
    checkpoint: Path = build_checkpoint(tmp_path_factory.mktemp("tiny-vlm-routes"))
    srv = VisionServer(serving_config(checkpoint)).start()
    yield srv
    srv.stop()


LIMITS = ("max_images_per_prompt", "max_image_tokens_per_prompt", "image_feature_window_tokens",
          "max_image_tokens_per_image", "max_image_pixels", "max_image_bytes")


def test_card_and_show_report_vision_and_limits(server: VisionServer) -> None:
    assert server.app.service is not None
    info = server.app.service.info
    with server.http() as http:
        flare = http.get("/v1/models").json()["data"][0]["flare"]
        assert flare["input_modalities"] == ["text", "image"] and flare["output_modalities"] == ["text"]
        assert {k: flare[k] for k in LIMITS} == info.vision.card_fields()
        assert all(flare[k] > 0 for k in LIMITS)
        assert flare["max_image_tokens_per_image"] <= flare["image_feature_window_tokens"]
        assert flare["max_image_tokens_per_prompt"] < info.max_model_len
        show = http.post("/api/show", json={"model": "vlm"}).json()
        assert "vision" in show["capabilities"]
        assert {k: show["model_info"][f"flare.{k}"] for k in LIMITS} == info.vision.card_fields()


def test_input_metrics_count_decodes_and_cache_hits(server: VisionServer) -> None:
    image = png(24, 24, seed=900)
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "metrics?"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(image)}"}}]}]}
    with server.http() as http:
        before = http.get("/metrics", params={"format": "json"}).json()
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        after = http.get("/metrics", params={"format": "json"}).json()
        text = http.get("/metrics").text
    assert after["input_decoded_images_total"] - before["input_decoded_images_total"] == 1  # validated once
    assert after["input_source_cache_hits_total"] - before["input_source_cache_hits_total"] >= 1
    assert after["input_decoded_cache_bytes"] > 0
    assert "# TYPE flare_input_decoded_images_total counter" in text
    assert "flare_input_prepared_cache_bytes " in text


def test_responses_image_sources_and_declared_types(server: VisionServer) -> None:
    image = png(20, 20, seed=901)
    cases = [
        ({"type": "input_image", "file_id": "file-1"},
         "input[0].content[1]: file_id images are unsupported (there is no file store); send the image as a "
         "base64 data URL in image_url"),
        ({"type": "input_image", "image_url": "https://example.com/cat.png"},
         "input[0].content[1]: images must be base64 data URLs; remote image downloads are unsupported"),
        ({"type": "input_image", "image_url": f"data:image/jpeg;base64,{b64(image)}"},
         "image 1 (at input[0].content[1]) is declared image/jpeg but its data is PNG (image/png)"),
    ]
    with server.http() as http:
        for part, message in cases:
            r = http.post("/v1/responses", json={"model": "m", "max_output_tokens": 2, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "look"}, part]}]})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == message


DANGER = {"TypeSafe-Danger-Zone-Images": "true"}


def _systemone(assets: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "state": {"photo": "photo1", "note": "compare photo1 with photo2"},
            "questions": {
                "which": {"type": "choice", "instructions": "Which photo is brighter?",
                          "criteria": {"first": "photo1", "second": "photo2"}},
                "level": {"type": "score", "instructions": "How noisy is photo2?",
                          "criteria": ["clean", "like photo1", "noisy"]}},
            "assets": assets}


def _multipart(request: dict[str, Any], parts: dict[str, bytes], boundary: str = "vlmB0undary") -> tuple[bytes, dict[str, str]]:
    out = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"request\"\r\n"
           "Content-Type: application/json\r\n\r\n").encode() + json.dumps(request).encode() + b"\r\n"
    for name, data in parts.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}.png\"\r\n"
                "Content-Type: image/png\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), {"content-type": f"multipart/form-data; boundary={boundary}", **DANGER}


def test_systemone_assets_are_scored_with_the_images(server: VisionServer) -> None:
    one, two, other = png(30, 20, seed=910), png(20, 30, seed=911), png(20, 30, seed=912)
    with server.http() as http:
        r = http.post("/v1/systemone", json=_systemone({"photo1": {"format": "png", "data_base64": b64(one)},
                                                         "photo2": {"data_base64": b64(two)}}), headers=DANGER)
        assert r.status_code == 200, r.text
        base = r.json()
        assert set(base["answers"]) == {"which", "level"}
        assert base["answers"]["level"]["legend"] == {"0": "clean", "1": "like photo1", "2": "noisy"}
        assert sum(base["answers"]["which"]["probabilities"].values()) == pytest.approx(1.0)
        # The image tokens are in the prompt: far more input than the text alone.
        per_image = server.tower.profile.cost(30, 20).tokens
        assert base["usage"]["input_tokens"] > 2 * per_image
        # multipart: the same request with the images as parts answers the same
        body, headers = _multipart(_systemone({"photo1": {"part": "a"}, "photo2": {"part": "b"}}), {"a": one, "b": two})
        r = http.post("/v1/systemone", content=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["answers"] == base["answers"]
        # another second image changes the scores
        r = http.post("/v1/systemone", json=_systemone({"photo1": {"data_base64": b64(one)},
                                                         "photo2": {"data_base64": b64(other)}}), headers=DANGER)
        assert r.status_code == 200 and r.json()["answers"] != base["answers"]
        # unused assets, and the image limits apply to assets too
        r = http.post("/v1/systemone", json=_systemone({"photo1": {"data_base64": b64(one)},
                                                         "photo2": {"data_base64": b64(two)},
                                                         "photo3": {"data_base64": b64(two)}}), headers=DANGER)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("asset 'photo3' is not referenced by the state, instructions or "
                                                "criteria; unused assets are rejected")
        corrupt = one[:-40]
        r = http.post("/v1/systemone", json=_systemone({"photo1": {"data_base64": b64(corrupt)},
                                                         "photo2": {"data_base64": b64(two)}}), headers=DANGER)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("image 1 (at assets.photo1) is corrupt or truncated PNG data")
