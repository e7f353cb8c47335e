"""Places where the code contradicted api.md, each with the test that would have caught it.

- Streams answer 200 with SSE headers right after validation and enqueue ("Transport and
  admission"), not at the first token; Chat's role chunk still waits for the first generated token.
  A scripted prefill held until the headers arrive stands in for a long prompt on a CPU.
- Completions without max_tokens use the server's default_max_tokens ("default output-token budget
  when a request omits it"), not the legacy 16.
- An image sent to a text-only model is a 400 on every chat protocol, never silently dropped
  (Chat and Messages dropped it; Responses already refused it).
- Anthropic message-level control metadata (output_config, cache_control, ...) is ignored, not a 400.
- Decompression and template/tokenizer work share one bounded frontend pool (there were two).
- The plain recipe's card publishes inclusive numeric `sampling_ranges` ("Sampling defaults and
  ranges"), and enforces exactly them (it published `{"min": 0.0, "max": null}`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.serving.harness import ScriptedServer


@pytest.fixture(scope="module")
def smol(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["smollm2"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_headers_before_a_slow_prefill(smol: ScriptedServer, path: str) -> None:
    """The scripted prefill is held until the test has the response headers: if the headers waited
    for the first token, the prefill would only run after its hold gave up."""
    key = smol.book.add("Hello there.")
    prefill = smol.book.hold(key)
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 16}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"Hi {key}"}]
    else:
        body["prompt"] = f"Hi {key}"
    lines: list[str] = []
    with smol.http() as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        prefill.set()  # the headers are here while the prefill is still held: let it run
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert smol.book.hold_timed_out[key] is False
    assert lines[-1] == "[DONE]"
    if path == "/v1/chat/completions":
        assert '"role": "assistant"' in lines[0] or '"role":"assistant"' in lines[0]


def test_completions_default_output_budget_is_the_servers(smol: ScriptedServer) -> None:
    words = " ".join(f"w{i}" for i in range(30))
    key = smol.book.add(words)
    n = len(smol.book.script(key))
    assert n > 16
    r = smol.openai().completions.create(model="m", prompt=f"Go {key}")
    assert r.usage is not None and r.usage.completion_tokens == n + 1  # the script, then EOS
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.strip() == words


PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def test_images_on_a_text_only_model_are_refused_on_every_chat_protocol(smol: ScriptedServer) -> None:
    import anthropic
    import openai

    key = smol.book.add("I see nothing.")
    before = len(smol.book.prompts_for(key))
    with pytest.raises(openai.BadRequestError) as err:
        smol.openai().chat.completions.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": f"What is this? {key}"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}])
    assert "does not accept image input" in str(err.value)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    for content in (
        [{"type": "text", "text": f"What is this? {key}"}, image],
        [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}, {"type": "text", "text": key}],
    ):
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        if content[0]["type"] == "tool_result":
            messages = [{"role": "user", "content": "look"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "see", "input": {}}]},
                        *messages]
        with pytest.raises(anthropic.BadRequestError) as aerr:
            smol.anthropic().messages.create(model="m", max_tokens=8, messages=messages)  # type: ignore[arg-type]
        assert "does not accept image input" in str(aerr.value)
    with pytest.raises(openai.BadRequestError) as err:
        smol.openai().responses.create(model="m", max_output_tokens=8, input=[{"role": "user", "content": [
            {"type": "input_text", "text": key},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}", "detail": "auto"}]}])
    assert "does not accept image input" in str(err.value)
    assert len(smol.book.prompts_for(key)) == before  # nothing reached the model


def test_message_level_control_metadata_is_ignored_on_messages(smol: ScriptedServer) -> None:
    """api.md: "Message-level control metadata, including output_config.effort, is ignored"."""
    key = smol.book.add("Fine.")
    messages = [{"role": "user", "content": f"How are you? {key}", "output_config": {"effort": "low"},
                 "cache_control": {"type": "ephemeral"}}]
    reply = smol.anthropic().messages.create(model="m", max_tokens=8, messages=messages)  # type: ignore[arg-type]
    assert reply.content[0].text == "Fine."  # type: ignore[union-attr]
    plain = smol.anthropic().messages.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": f"How are you? {key}"}])
    assert plain.usage.input_tokens == reply.usage.input_tokens  # the metadata changed nothing
    import anthropic

    with pytest.raises(anthropic.BadRequestError):  # other unknown message keys stay errors
        smol.anthropic().messages.create(model="m", max_tokens=8, messages=[
            {"role": "user", "content": "x", "colour": "blue"}])  # type: ignore[list-item]


def test_decompression_and_template_work_share_one_pool(smol: ScriptedServer) -> None:
    assert smol.service.limiter is smol.app.frontend_limiter
    assert smol.app.frontend_limiter.total_tokens == smol.app.config.server.frontend_workers


def test_the_plain_cards_sampling_ranges_are_inclusive_numbers_it_enforces(smol: ScriptedServer) -> None:
    """The default model's card published `{"min": 0.0, "max": null}` while the spec says bounds are
    inclusive numbers and null fixes a parameter at its default. Every published bound is now a
    number that contains the default; a request at a bound is served, one past it is a 400."""
    with smol.http() as http:
        card = http.get("/v1/models").json()["data"][0]
    ranges, defaults = card["flare"]["sampling_ranges"], card["flare"]["sampling_defaults"]
    for name, bounds in ranges.items():
        if bounds is None:
            continue
        assert isinstance(bounds["min"], int | float) and isinstance(bounds["max"], int | float), name
        assert bounds["min"] <= defaults[name] <= bounds["max"] or (name == "top_k" and defaults[name] == -1), name
    top = ranges["temperature"]["max"]
    key = smol.book.add("Fine.")
    ok = smol.openai().chat.completions.create(model="m", temperature=top, max_tokens=4,
                                               messages=[{"role": "user", "content": f"Hi {key}"}])
    assert ok.choices[0].message.content
    with smol.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "temperature": top + 0.5, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
