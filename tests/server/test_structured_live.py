"""Structured output through the real SDKs against a live server with the default model: each
protocol's own field yields an answer that parses and validates (`jsonschema`), buffered and
streamed. Run against any server with FLARE_API_TEST_URL."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
ASK = "Name a city and its country as JSON."


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_chat_response_format_json_schema(server: LiveServer, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": ASK}], "max_tokens": 96, "seed": 7,
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "place", "schema": CITY, "strict": True}}}
    client = server.openai()
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content or ""
    jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_responses_text_format_json_schema(server: LiveServer, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "m", "input": ASK, "max_output_tokens": 96,
                          "text": {"format": {"type": "json_schema", "name": "place", "schema": CITY, "strict": True}}}
    client = server.openai()
    if stream:
        text = "".join(e.delta for e in client.responses.create(stream=True, **kw)
                       if e.type == "response.output_text.delta")
    else:
        r = client.responses.create(**kw)
        text = r.output_text
        assert r.text.format.type == "json_schema"  # the format is echoed
    jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_messages_output_config_format(server: LiveServer, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": ASK}], "max_tokens": 96,
                          "extra_body": {"output_config": {"format": {"type": "json_schema", "schema": CITY}}}}
    client = server.anthropic()
    if stream:
        text = "".join(e.delta.text for e in client.messages.create(stream=True, **kw)
                       if e.type == "content_block_delta" and e.delta.type == "text_delta")
    else:
        text = "".join(b.text for b in client.messages.create(**kw).content if b.type == "text")
    jsonschema.validate(json.loads(text), CITY)


def test_completions_structured_outputs_regex_and_choice(server: LiveServer) -> None:
    client = server.openai()
    r = client.completions.create(model="m", prompt="The year the war ended:", max_tokens=8, seed=3,
                                  extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})
    assert re.fullmatch("(19|20)[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model="m", prompt="Is the sky blue? Answer:", max_tokens=4, seed=3,
                                  extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert r.choices[0].text in (" yes", " no")


ASTRAL = "\U00040000"  # UTF-8 F1 80 80 80: the default model's vocabulary has no token with 0xF1


def test_a_grammar_needing_text_the_model_cannot_give_is_a_400(server: LiveServer) -> None:
    """Refused before generation where the forced start needs it (the param named); after a choice,
    the buffered request is a 400 in each protocol's shape and a stream ends in its error event."""
    import anthropic
    import openai

    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="Hi", max_tokens=4, extra_body={"structured_outputs": {"regex": ASTRAL}})
    assert info.value.status_code == 400 and "cannot generate" in info.value.message
    assert info.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
    late = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a" + ASTRAL, "b" + ASTRAL]}}}
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                          "response_format": late}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw)
    assert "cannot generate" in info.value.message
    with pytest.raises(openai.APIError) as streamed:
        for _ in client.chat.completions.create(stream=True, **kw):
            pass
    assert "cannot generate" in streamed.value.message
    with pytest.raises(anthropic.BadRequestError) as ant:
        server.anthropic().messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"enum": ["a" + ASTRAL, "b" + ASTRAL]}}}})
    assert ant.value.status_code == 400 and "cannot generate" in str(ant.value)
