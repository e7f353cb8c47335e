"""Token stops and token observations through the real SDKs and HTTP, on the scripted model.

- `stop_token_sequences` ends the output at the token that completes a sequence, with finish
  "stop" (Responses: completed), the whole matched sequence withheld from the text and held text
  released when the output turns away from a sequence (helios/serving/output.py).
- `return_token_ids` returns the prompt's ids and each choice's generated ids (the terminating EOS or
  stop token included: as many as usage.completion_tokens), streamed chunk by chunk with the prompt
  ids on the first chunk (Completions: each choice's first chunk).
- `return_token_timestamps` adds `token_timestamps`, parallel and non-decreasing.
- Streams with token ids and no separate usage chunk carry the final usage on their terminal chunk.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.serving.harness import EOS_TEXT, ScriptedServer, encode_script, pieces

STOP_TEXT = "<<STOP>>"


@pytest.fixture(scope="module")
def smol(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["smollm2"]


def _eos(server: ScriptedServer) -> int:
    eos = server.tok.token_to_id(EOS_TEXT)
    assert eos is not None
    return eos


def _chat(server: ScriptedServer, key: str, *, stream: bool, **extra: Any) -> Any:
    body: dict[str, Any] = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": f"Go {key}"}]}
    so = extra.pop("stream_options", None)
    if stream:
        body["stream"] = True
        if so is not None:
            body["stream_options"] = so
    result = server.openai().chat.completions.create(extra_body=extra, **body)
    return list(result) if stream else result


def _completion(server: ScriptedServer, key: str, *, stream: bool, **extra: Any) -> Any:
    body: dict[str, Any] = {"model": "m", "max_tokens": 200, "prompt": f"Go {key}"}
    for name in ("n", "stream_options"):
        if name in extra:
            body[name] = extra.pop(name)
    if stream:
        body["stream"] = True
    result = server.openai().completions.create(extra_body=extra, **body)
    return list(result) if stream else result


def _extra(obj: Any, name: str) -> Any:
    """A field the SDK's models do not declare (kept as an extra attribute)."""
    return (obj.model_extra or {}).get(name)


# -- stop_token_sequences ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stop_case(smol: ScriptedServer) -> tuple[str, list[int], list[int], str]:
    """A script that passes a proper prefix of the stop sequence, then completes it, then goes on:
    (key, stop ids, ids up to and including the stop, the text the client must see)."""
    tok = smol.tok
    stop_ids = pieces(tok, STOP_TEXT)
    assert len(stop_ids) > 2
    head = encode_script(tok, ["The answer is", pieces(tok, "<<ST"), "ill 42."])
    tail = encode_script(tok, [" Never shown."])
    key = smol.book.add(head, stop_ids, tail)
    return key, stop_ids, head + stop_ids, "The answer is<<STill 42."


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_chat_sequence_stop(smol: ScriptedServer, stop_case: tuple[str, list[int], list[int], str],
                            stream: bool) -> None:
    key, stop_ids, generated, text = stop_case
    r = _chat(smol, key, stream=stream, stop_token_sequences=[stop_ids, [7, 8, 9]], return_token_ids=True,
              stream_options={"include_usage": True})
    if stream:
        content = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        finishes = [c.choices[0] for c in r if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1
        finish, stop_reason = finishes[0].finish_reason, _extra(finishes[0], "stop_reason")
        ids = [t for c in r if c.choices for t in (_extra(c.choices[0], "token_ids") or [])]
        usage = r[-1].usage
        assert STOP_TEXT[:3] not in content.replace("<<STill", "")  # no piece of the stop was ever sent
    else:
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        stop_reason, ids, usage = _extra(r.choices[0], "stop_reason"), _extra(r.choices[0], "token_ids"), r.usage
    assert content == text and finish == "stop"
    assert stop_reason == stop_ids  # the matched sequence
    assert ids == generated and usage.completion_tokens == len(generated)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_completions_sequence_stop(smol: ScriptedServer, stop_case: tuple[str, list[int], list[int], str],
                                   stream: bool) -> None:
    key, stop_ids, generated, text = stop_case
    r = _completion(smol, key, stream=stream, stop_token_sequences=[stop_ids], logprobs=0,
                    stream_options={"include_usage": True} if stream else None)
    if stream:
        got = "".join(c.choices[0].text for c in r if c.choices)
        finish = [c.choices[0].finish_reason for c in r if c.choices and c.choices[0].finish_reason]
        tokens = [t for c in r if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        usage = r[-1].usage
    else:
        got, finish = r.choices[0].text, [r.choices[0].finish_reason]
        tokens, usage = r.choices[0].logprobs.tokens, r.usage
    assert got == text and finish == ["stop"]
    assert usage.completion_tokens == len(generated)
    # Logprob entries: every generated token but the terminating one (the sequence's last).
    assert len(tokens) == len(generated) - 1


def test_responses_sequence_stop(smol: ScriptedServer, stop_case: tuple[str, list[int], list[int], str]) -> None:
    key, stop_ids, generated, text = stop_case
    r = smol.openai().responses.create(model="m", input=f"Go {key}", max_output_tokens=200,
                                       extra_body={"stop_token_sequences": [stop_ids]})
    assert r.status == "completed" and r.output_text == text
    assert r.usage is not None and r.usage.output_tokens == len(generated)


def test_string_and_token_stops_cannot_combine(smol: ScriptedServer) -> None:
    import openai

    key = smol.book.add("Nothing.")
    before = len(smol.book.prompts_for(key))
    for create, body in (
        (smol.openai().chat.completions.create, {"messages": [{"role": "user", "content": key}]}),
        (smol.openai().completions.create, {"prompt": key}),
    ):
        with pytest.raises(openai.BadRequestError, match="cannot be combined"):
            create(model="m", max_tokens=4, stop=["x"], extra_body={"stop_token_sequences": [[1, 2]]}, **body)
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            create(model="m", max_tokens=4, extra_body={"stop_token_sequences": [[1, smol.tok.vocab_size]]}, **body)
        with pytest.raises(openai.BadRequestError, match="at most 16"):
            create(model="m", max_tokens=4, extra_body={"stop_token_sequences": [[1, 2]] * 17}, **body)
    assert len(smol.book.prompts_for(key)) == before


# -- return_token_ids / return_token_timestamps -----------------------------------------------------------


@pytest.fixture(scope="module")
def reply(smol: ScriptedServer) -> tuple[str, list[int]]:
    key = smol.book.add("Tokens, one by one, with timestamps.")
    return key, [*smol.book.script(key), _eos(smol)]


def _check_timestamps(stamps: list[float], ids: list[int]) -> None:
    assert len(stamps) == len(ids)
    assert all(isinstance(t, float) and 0 <= t < 60 for t in stamps)
    assert stamps == sorted(stamps)


def test_chat_buffered_token_ids_and_timestamps(smol: ScriptedServer, reply: tuple[str, list[int]]) -> None:
    key, generated = reply
    r = _chat(smol, key, stream=False, return_token_timestamps=True)  # implies the ids
    ids = _extra(r.choices[0], "token_ids")
    assert ids == generated and len(ids) == r.usage.completion_tokens
    assert _extra(r, "prompt_token_ids") == list(smol.book.prompts_for(key)[-1])
    assert len(_extra(r, "prompt_token_ids")) == r.usage.prompt_tokens
    _check_timestamps(_extra(r.choices[0], "token_timestamps"), ids)
    plain = _chat(smol, key, stream=False)
    assert "token_ids" not in (plain.choices[0].model_extra or {}) and "prompt_token_ids" not in plain.model_extra


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_token_ids(smol: ScriptedServer, reply: tuple[str, list[int]], include_usage: bool) -> None:
    key, generated = reply
    chunks = _chat(smol, key, stream=True, return_token_ids=True, return_token_timestamps=True,
                   stream_options={"include_usage": True} if include_usage else None)
    with_choices = [c for c in chunks if c.choices]
    assert _extra(chunks[0], "prompt_token_ids") == list(smol.book.prompts_for(key)[-1])
    assert all(_extra(c, "prompt_token_ids") is None for c in chunks[1:])
    ids = [t for c in with_choices for t in _extra(c.choices[0], "token_ids")]
    stamps = [t for c in with_choices for t in _extra(c.choices[0], "token_timestamps")]
    assert ids == generated
    _check_timestamps(stamps, ids)
    terminal = with_choices[-1]
    assert terminal.choices[0].finish_reason == "stop"
    if include_usage:
        assert terminal.usage is None and chunks[-1].usage is not None and not chunks[-1].choices
        usage = chunks[-1].usage
    else:
        assert chunks[-1] is terminal and terminal.usage is not None  # usage on the terminal chunk
        usage = terminal.usage
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens_details.cached_tokens is not None
    assert usage.completion_tokens_details.reasoning_tokens == 0
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == smol.tok.decode(generated[:-1])


def test_chat_stream_without_observations_is_unchanged(smol: ScriptedServer, reply: tuple[str, list[int]]) -> None:
    key, _ = reply
    chunks = _chat(smol, key, stream=True)
    assert all(c.usage is None and "prompt_token_ids" not in (c.model_extra or {}) for c in chunks)
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)


def test_completions_buffered_token_ids(smol: ScriptedServer, reply: tuple[str, list[int]]) -> None:
    key, generated = reply
    r = _completion(smol, key, stream=False, n=2, return_token_ids=True, return_token_timestamps=True)
    prompt = list(smol.book.prompts_for(key)[-1])
    assert len(r.choices) == 2
    for choice in r.choices:
        assert _extra(choice, "prompt_token_ids") == prompt
        assert _extra(choice, "token_ids") == generated
        _check_timestamps(_extra(choice, "token_timestamps"), generated)
    assert r.usage.completion_tokens == 2 * len(generated)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completions_stream_token_ids(smol: ScriptedServer, reply: tuple[str, list[int]], include_usage: bool) -> None:
    key, generated = reply
    chunks = _completion(smol, key, stream=True, n=2, return_token_ids=True, return_token_timestamps=True,
                         stream_options={"include_usage": True} if include_usage else None)
    prompt = list(smol.book.prompts_for(key)[-1])
    with_choices = [c for c in chunks if c.choices]
    for index in (0, 1):
        mine = [c.choices[0] for c in with_choices if c.choices[0].index == index]
        assert _extra(mine[0], "prompt_token_ids") == prompt
        assert all(_extra(c, "prompt_token_ids") is None for c in mine[1:])
        ids = [t for c in mine for t in _extra(c, "token_ids")]
        assert ids == generated
        _check_timestamps([t for c in mine for t in _extra(c, "token_timestamps")], ids)
        assert "".join(c.text for c in mine) == smol.tok.decode(generated[:-1])
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1
    if include_usage:
        assert not with_usage[0].choices and with_usage[0] is chunks[-1]
    else:
        assert with_usage[0] is with_choices[-1] and with_usage[0].choices[0].finish_reason == "stop"
    assert with_usage[0].usage.completion_tokens == 2 * len(generated)


def test_held_reasoning_delimiter_keeps_its_token_gate(qwen3: ScriptedServer) -> None:
    """A stop sequence that starts with the single-token `</think>` holds that token's text back; when
    the output turns away, the text is fed to the reasoning parser with the token's id, so the
    token-gated delimiter still closes reasoning (it would be plain text without its id)."""
    from tests.serving.harness import Writer

    tok = qwen3.tok
    close = tok.token_to_id("</think>")
    never = tok.encode("zebra", add_special_tokens=False)
    key = qwen3.book.add(Writer("qwen3").think("Let me see."), "The answer.")
    for stream in (False, True):
        r = _chat(qwen3, key, stream=stream, stop_token_sequences=[[close, *never]], return_token_ids=True)
        if stream:
            content = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            reasoning = "".join(_extra(c.choices[0].delta, "reasoning_content") or "" for c in r if c.choices)
            ids = [t for c in r if c.choices for t in _extra(c.choices[0], "token_ids")]
            usage = r[-1].usage
        else:
            content, reasoning = r.choices[0].message.content, _extra(r.choices[0].message, "reasoning_content")
            ids, usage = _extra(r.choices[0], "token_ids"), r.usage
        assert (reasoning, content) == ("Let me see.", "The answer.")
        assert ids == [*qwen3.book.script(key), _eos(qwen3)] and usage.completion_tokens == len(ids)
        assert usage.completion_tokens_details.reasoning_tokens > 0
