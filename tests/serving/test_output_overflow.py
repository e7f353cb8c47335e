"""An explicit output limit beyond the context the prompt leaves is cut to what is left
(`[server] max_tokens_overflow = "clamp"`, the default): coding clients ask for 32,000 output
tokens whatever the model's context (OpenCode, Claude Code). Each protocol then ends the answer at
the context's end with its own length reason. The "reject" rule (vLLM's 400) is tested on the live
`limited` server (tests/server/test_client_compat.py).
"""

from __future__ import annotations

import pytest

from tests.serving.harness import MAX_MODEL_LEN, ScriptedServer


@pytest.fixture(scope="module")
def smol(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["smollm2"]


def _near_the_end(smol: ScriptedServer) -> tuple[str, str, int]:
    """A script longer than the room its prompt leaves, the prompt, and that room in tokens."""
    key = smol.book.add(" ".join(f"w{i}" for i in range(300)))
    prompt = f"{key} " + "pad " * (MAX_MODEL_LEN - 200)
    probe = smol.openai().chat.completions.create(model="m", max_tokens=1,
                                                  messages=[{"role": "user", "content": prompt}])
    assert probe.usage is not None
    room = MAX_MODEL_LEN - probe.usage.prompt_tokens
    assert 0 < room < len(smol.book.script(key)), room
    return key, prompt, room


def test_chat_output_limit_is_cut_to_the_context_left(smol: ScriptedServer) -> None:
    _, prompt, room = _near_the_end(smol)
    r = smol.openai().chat.completions.create(model="m", max_tokens=32000,
                                              messages=[{"role": "user", "content": prompt}])
    assert r.usage is not None and r.usage.completion_tokens == room
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN
    assert r.choices[0].finish_reason == "length"


def test_messages_and_responses_cut_it_alike(smol: ScriptedServer) -> None:
    _, prompt, room = _near_the_end(smol)
    m = smol.anthropic().messages.create(model="m", max_tokens=32000, messages=[{"role": "user", "content": prompt}])
    assert m.usage.output_tokens == room and m.stop_reason == "max_tokens"
    r = smol.openai().responses.create(model="m", max_output_tokens=32000, input=prompt)
    assert r.usage is not None and r.usage.output_tokens == room
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"


def test_a_limit_that_fits_is_kept(smol: ScriptedServer) -> None:
    _, prompt, room = _near_the_end(smol)
    r = smol.openai().chat.completions.create(model="m", max_tokens=room - 3,
                                              messages=[{"role": "user", "content": prompt}])
    assert r.usage is not None and r.usage.completion_tokens == room - 3


def test_a_prompt_without_room_is_still_refused(smol: ScriptedServer) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        smol.openai().chat.completions.create(model="m", max_tokens=32000,
                                              messages=[{"role": "user", "content": "pad " * MAX_MODEL_LEN}])
    body = exc.value.body
    assert isinstance(body, dict) and body.get("error", body)["code"] == "context_length_exceeded"
