"""The scripted agent model (agent_model.py) through the real HTTP stack, without the clients.

Each protocol's client shape plays the whole task: Chat Completions with OpenCode's tool names,
Responses with Codex's freeform `apply_patch` (a Lark grammar: the completed patch is validated
before the call is emitted) and `exec_command`, Messages with Claude Code's `Read`/`Edit`/`Bash`.
The history is resent each turn, as the clients do; from the second turn on each request must
report cached prompt tokens (the prefix cache is on, and the model reads its context back from the
paged KV cache, so a wrong reused page would derail the script). tests/server/test_coding_clients.py
runs the real clients against the same model.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.serving.agent_model import ANSWER, PATCH, TASK, TEST_COMMAND, AgentTask, agent_server
from tests.serving.harness import FAMILIES, TEMPLATES, ScriptedServer
from tests.serving.test_constrained_answers import APPLY_PATCH

WORKDIR = "project"  # the client-side working directory the scripted calls name (never opened here)
SYSTEM = "You are a coding agent. Use the tools to inspect, edit and test the project. " * 40


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[ScriptedServer, AgentTask]]:
    if TEMPLATES is None:
        pytest.skip("shared/fixtures/chat_templates not found (shared/ lies beside the repository)")
    task = AgentTask("qwen3", WORKDIR)
    server = agent_server(FAMILIES["qwen3"], task).start()
    yield server, task
    server.stop()


def _function(name: str, *params: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}}


def _chat(server: ScriptedServer) -> tuple[list[tuple[str, dict[str, Any]]], str, list[tuple[int, int]]]:
    client = server.openai()
    tools = [_function("read", "filePath"), _function("edit", "filePath", "oldString", "newString"),
             _function("bash", "command", "description")]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    calls, usage = [], []
    for _ in range(6):
        r = client.chat.completions.create(model="scripted", messages=messages, tools=tools, max_tokens=256)
        details = r.usage.prompt_tokens_details
        usage.append((r.usage.prompt_tokens, details.cached_tokens if details else 0))
        message = r.choices[0].message
        if not message.tool_calls:
            return calls, message.content or "", usage
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            calls.append((call.function.name, json.loads(call.function.arguments)))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name}: done"})
    raise AssertionError(f"no answer after {calls}")


def _responses(server: ScriptedServer) -> tuple[list[tuple[str, dict[str, Any]]], str, list[tuple[int, int]]]:
    client = server.openai()
    tools = [{"type": "function", "name": "exec_command", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
        "required": ["cmd"]}}, APPLY_PATCH]
    items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    calls, usage = [], []
    for _ in range(6):
        r = client.responses.create(model="scripted", instructions=SYSTEM, input=items, tools=tools,
                                    max_output_tokens=256, stream=True)
        final = next(e.response for e in r if e.type == "response.completed")
        usage.append((final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens))
        made = [o for o in final.output if o.type in ("function_call", "custom_tool_call")]
        if not made:
            return calls, final.output_text, usage
        for o in made:
            items.append(o.model_dump(exclude_none=True))
            if o.type == "custom_tool_call":
                calls.append((o.name, {"input": o.input}))
                items.append({"type": "custom_tool_call_output", "call_id": o.call_id, "output": "Success."})
            else:
                calls.append((o.name, json.loads(o.arguments)))
                items.append({"type": "function_call_output", "call_id": o.call_id, "output": "exit 0"})
    raise AssertionError(f"no answer after {calls}")


def _messages(server: ScriptedServer) -> tuple[list[tuple[str, dict[str, Any]]], str, list[tuple[int, int]]]:
    client = server.anthropic()

    def tool(name: str, *params: str) -> dict[str, Any]:
        return {"name": name, "description": f"The {name} tool.", "input_schema": {
            "type": "object", "properties": {p: {"type": "string"} for p in params}, "required": list(params)}}

    tools = [tool("Read", "file_path"), tool("Edit", "file_path", "old_string", "new_string"),
             tool("Bash", "command", "description")]
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    calls, usage = [], []
    for _ in range(6):
        r = client.messages.create(model="scripted", system=SYSTEM, messages=messages, tools=tools, max_tokens=256)
        u = r.usage
        usage.append((u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0),
                      u.cache_read_input_tokens or 0))
        uses = [b for b in r.content if b.type == "tool_use"]
        if not uses:
            return calls, "".join(b.text for b in r.content if b.type == "text"), usage
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"{b.name}: done"} for b in uses]})
        calls += [(b.name, dict(b.input)) for b in uses]
    raise AssertionError(f"no answer after {calls}")


PATH = f"{WORKDIR}/calc.py"
EXPECTED = {
    "opencode": (_chat, [("read", {"filePath": PATH}),
                         ("edit", {"filePath": PATH, "oldString": "return a - b", "newString": "return a + b"}),
                         ("bash", {"command": TEST_COMMAND, "description": "Run the tests"})]),
    "codex": (_responses, [("exec_command", {"cmd": "cat calc.py", "workdir": WORKDIR}),
                           ("apply_patch", {"input": PATCH}),
                           ("exec_command", {"cmd": TEST_COMMAND, "workdir": WORKDIR})]),
    "claude": (_messages, [("Read", {"file_path": PATH}),
                           ("Edit", {"file_path": PATH, "old_string": "return a - b", "new_string": "return a + b"}),
                           ("Bash", {"command": TEST_COMMAND, "description": "Run the tests"})]),
}


@pytest.mark.parametrize("client", list(EXPECTED))
def test_agent_model_plays_the_task_with_prefix_reuse(agent: tuple[ScriptedServer, AgentTask], client: str) -> None:
    server, task = agent
    run, expected = EXPECTED[client]
    first = len(task.decisions)
    calls, answer, usage = run(server)
    assert calls == expected
    assert answer == ANSWER
    assert [(d.client, d.step) for d in task.decisions[first:]] == [(client, step) for step in range(4)]
    assert len(usage) == 4
    for (prev_prompt, _), (prompt, cached) in itertools.pairwise(usage):
        # The history grows by the call and its result; everything before is reused.
        assert prompt > prev_prompt and cached >= prev_prompt * 9 // 10, usage


def test_agent_model_answers_other_prompts_with_the_default_reply(agent: tuple[ScriptedServer, AgentTask]) -> None:
    server, task = agent
    r = server.openai().chat.completions.create(model="scripted", max_tokens=16, messages=[
        {"role": "user", "content": "Write a 5-10 word title for: " + TASK}])
    assert r.choices[0].message.content == "OK." and task.decisions[-1].client is None


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_anthropic_sdk_tool_runner_plays_the_task(agent: tuple[ScriptedServer, AgentTask], stream: bool) -> None:
    """The real SDK's `tool_runner` (anthropic 2.15) first sends `thread: {"type": "create"}` under
    the message-threads beta; Helios's 400 carries `error.details.error_code:
    "thread_unsupported_request"`, on which the runner goes on unthreaded and plays the whole task."""
    import anthropic
    import httpx2
    from anthropic import beta_tool

    server, _task = agent
    sent: list[dict[str, Any]] = []
    statuses: list[int] = []

    def on_request(request: httpx2.Request) -> None:
        if request.url.path == "/v1/messages":
            sent.append(json.loads(request.content))

    def on_response(response: httpx2.Response) -> None:
        if response.request.url.path == "/v1/messages":
            statuses.append(response.status_code)

    http = httpx2.Client(timeout=60, event_hooks={"request": [on_request], "response": [on_response]})
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, http_client=http)
    calls: list[tuple[str, dict[str, Any]]] = []

    @beta_tool(name="Read")
    def read(file_path: str) -> str:
        """The Read tool."""
        calls.append(("Read", {"file_path": file_path}))
        return "Read: done"

    @beta_tool(name="Edit")
    def edit(file_path: str, old_string: str, new_string: str) -> str:
        """The Edit tool."""
        calls.append(("Edit", {"file_path": file_path, "old_string": old_string, "new_string": new_string}))
        return "Edit: done"

    @beta_tool(name="Bash")
    def bash(command: str, description: str) -> str:
        """The Bash tool."""
        calls.append(("Bash", {"command": command, "description": description}))
        return "Bash: done"

    runner = client.beta.messages.tool_runner(model="scripted", max_tokens=256, system=SYSTEM, tools=[read, edit, bash],
                                              messages=[{"role": "user", "content": TASK}], stream=stream)
    final = runner.until_done()
    http.close()
    assert calls == EXPECTED["claude"][1]
    assert "".join(b.text for b in final.content if b.type == "text") == ANSWER
    # The first request asked for a thread and was refused with the typed code; every later one went unthreaded.
    assert sent[0].get("thread") == {"type": "create"} and statuses[0] == 400
    assert all("thread" not in body for body in sent[1:]) and statuses[1:] == [200] * 4, statuses
