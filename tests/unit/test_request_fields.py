"""Per-protocol request-field tables (helios/frontends/fields.py): every row does what its kind says,
every field the installed SDKs declare is classified, and real coding clients' bodies decode."""

from __future__ import annotations

import typing
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs
import pytest

from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.domain.shapes import to_json
from helios.errors import BadRequest
from helios.frontends.anthropic import messages
from helios.frontends.fields import NATIVE_GENERATION_ROWS, FieldTable, Kind, rows
from helios.frontends.openai import chat, completions, responses, responses_encoder
from helios.frontends.wire import NativeGenerationFields

INFO = ModelInfo(
    model_id="org/model", aliases=("smol",), created=0, max_model_len=8192, vocab_size=1000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
USER = [{"role": "user", "content": "Hi"}]


@attrs.frozen
class Protocol:
    table: FieldTable
    wire: type
    base: dict[str, Any]
    decode: Callable[[dict[str, Any]], Any]


PROTOCOLS: dict[str, Protocol] = {
    "chat": Protocol(chat.CHAT_FIELDS, chat.ChatWire, {"messages": USER},
                     lambda o: chat.decode_chat(o, INFO)),
    "completions": Protocol(completions.COMPLETION_FIELDS, completions.CompletionWire, {"prompt": "Hi"},
                            lambda o: completions.decode_completion(o, INFO)),
    "responses": Protocol(responses.RESPONSES_FIELDS, responses.ResponsesWire, {"input": "Hi"},
                          lambda o: responses.decode_responses(o, INFO)),
    "messages": Protocol(messages.MESSAGES_FIELDS, messages.MessagesWire, {"max_tokens": 16, "messages": USER},
                         lambda o: messages.decode_request(o, INFO)),
    "count_tokens": Protocol(messages.COUNT_TOKENS_FIELDS, messages.CountTokensWire, {"messages": USER},
                             lambda o: messages.decode_count_tokens(o, INFO)),
}


def decode(protocol: str, **fields: Any) -> Any:
    p = PROTOCOLS[protocol]
    return p.decode({**p.base, **fields})


def params(kind: Kind) -> list[Any]:
    return [pytest.param(proto, name, id=f"{proto}-{name}")
            for proto, p in PROTOCOLS.items() for name in rows(p.table, kind)]


# -- the tables against the installed SDKs ----------------------------------------------------------


def _sdk_fields(module: ModuleType, prefix: str) -> set[str]:
    """Every key of the module's request TypedDicts named prefix* (Base, Streaming, NonStreaming)."""
    keys: set[str] = set()
    for name in dir(module):
        td = getattr(module, name)
        if name.startswith(prefix) and isinstance(td, type) and hasattr(td, "__required_keys__"):  # TypedDict
            for cls in td.__mro__:
                keys |= set(getattr(cls, "__annotations__", {}))
            keys |= set(typing.get_type_hints(td))
    return keys


def sdk_fields(protocol: str) -> set[str]:
    import anthropic.types.beta.message_count_tokens_params as beta_count
    import anthropic.types.beta.message_create_params as beta_create
    import anthropic.types.message_count_tokens_params as count
    import anthropic.types.message_create_params as create
    import openai.types.chat.completion_create_params as chat_params
    import openai.types.completion_create_params as completion_params
    import openai.types.responses.response_create_params as response_params

    sources: dict[str, list[tuple[ModuleType, str]]] = {
        "chat": [(chat_params, "CompletionCreateParams")],
        "completions": [(completion_params, "CompletionCreateParams")],
        "responses": [(response_params, "ResponseCreateParams")],
        "messages": [(create, "MessageCreateParams"), (beta_create, "MessageCreateParams")],
        "count_tokens": [(count, "MessageCountTokensParams"), (beta_count, "MessageCountTokensParams")],
    }
    return set().union(*(_sdk_fields(m, prefix) for m, prefix in sources[protocol]))


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_every_sdk_field_is_classified(protocol: str) -> None:
    fields = sdk_fields(protocol)
    assert len(fields) > 10  # the SDK modules were found
    missing = sorted(fields - set(PROTOCOLS[protocol].table))
    assert not missing, (f"{protocol}: the SDK declares {missing}; classify each as honoured, ignored or refused "
                         "in the protocol's field table")


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_the_wire_class_declares_exactly_the_honoured_rows(protocol: str) -> None:
    p = PROTOCOLS[protocol]
    assert {f.name for f in attrs.fields(p.wire)} == set(rows(p.table, "honoured"))


def test_native_generation_rows_match_the_shared_wire_fields() -> None:
    assert set(NATIVE_GENERATION_ROWS) == {f.name for f in attrs.fields(NativeGenerationFields)}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_rows_have_a_one_line_reason(protocol: str) -> None:
    for name, row in PROTOCOLS[protocol].table.items():
        assert row.reason.strip() and "\n" not in row.reason, name


def test_count_tokens_accepts_no_generation_fields() -> None:
    for name in ("max_tokens", "stream", "stop_sequences", "temperature", "metadata"):
        assert name not in messages.COUNT_TOKENS_FIELDS
        with pytest.raises(BadRequest, match="unrecognized"):
            decode("count_tokens", **{name: 1})


# -- honoured rows: accepted with a representative value (behaviour has its own tests) ------------------

HONOURED: dict[str, dict[str, Any]] = {
    # Shared by several protocols; a protocol-specific entry below wins.
    "temperature": {"temperature": 0.7}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 20},
    "min_p": {"min_p": 0.05}, "repetition_penalty": {"repetition_penalty": 1.05},
    "presence_penalty": {"presence_penalty": 0.5}, "frequency_penalty": {"frequency_penalty": 0.5},
    "seed": {"seed": 7}, "stop": {"stop": ["END"]}, "stop_token_ids": {"stop_token_ids": [5]},
    "stop_token_sequences": {"stop_token_sequences": [[5, 6], [7]]},
    "return_token_ids": {"return_token_ids": True}, "return_token_timestamps": {"return_token_timestamps": True},
    "ignore_eos": {"ignore_eos": False}, "min_tokens": {"min_tokens": 2}, "skip_special_tokens": {"skip_special_tokens": False},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True},
    "stream": {"stream": True}, "n": {"n": 2}, "max_tokens": {"max_tokens": 8},
    "thinking_token_budget": {"thinking_token_budget": 512},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "structured_outputs": {"structured_outputs": {"regex": "[a-z]+"}},
    "response_format": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "p", "schema": {"type": "object"}}}},
}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
HONOURED_BY_PROTOCOL: dict[str, dict[str, dict[str, Any]]] = {
    "chat": {
        "logit_bias": {"logit_bias": {"7": 5}},
        "messages": {"messages": [{"role": "system", "content": "S"}, *USER]},
        "logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
        "logprob_token_ids": {"logprobs": True, "logprob_token_ids": [1, 2]},
        "max_completion_tokens": {"max_completion_tokens": 8},
        "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
        "tools": {"tools": [FUNCTION]}, "tool_choice": {"tools": [FUNCTION], "tool_choice": "required"},
        "reasoning_effort": {"reasoning_effort": "low"},
        "add_generation_prompt": {"add_generation_prompt": True},
        "continue_final_message": {"messages": [*USER, {"role": "assistant", "content": "Hel"}],
                                   "continue_final_message": True, "add_generation_prompt": False},
    },
    "completions": {
        "prompt": {"prompt": ["a", "b"]}, "best_of": {"n": 2, "best_of": 2}, "echo": {"echo": True},
        "logprobs": {"logprobs": 2}, "logprob_token_ids": {"logprobs": 1, "logprob_token_ids": [3]},
        "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
        "add_special_tokens": {"add_special_tokens": False},
        "logit_bias": {"logit_bias": {"7": -100, "8": 2.5}},
    },
    "responses": {
        "input": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
        "instructions": {"instructions": "Be brief."},
        "tools": {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        "tool_choice": {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}},
        "max_output_tokens": {"max_output_tokens": 8},
        "top_logprobs": {"include": [responses.LOGPROBS_INCLUDE], "top_logprobs": 2},
        "logprob_token_ids": {"include": [responses.LOGPROBS_INCLUDE], "logprob_token_ids": [4]},
        "reasoning": {"reasoning": {"effort": "high", "summary": "auto"}},
        "text": {"text": {"format": {"type": "text"}, "verbosity": "low"}},
        "include": {"include": [responses.LOGPROBS_INCLUDE, "reasoning.encrypted_content"]},
    },
    "messages": {
        "messages": {"messages": [*USER, {"role": "assistant", "content": "He"}]},
        "system": {"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]},
        "tools": {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        "tool_choice": {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"}},
        "thinking": {"thinking": {"type": "adaptive", "display": "omitted"}},
        "output_config": {"output_config": {"effort": "high"}},
        "max_tokens": {"max_tokens": 8}, "stop_sequences": {"stop_sequences": ["END"]},
    },
}
HONOURED_BY_PROTOCOL["count_tokens"] = HONOURED_BY_PROTOCOL["messages"]


@pytest.mark.parametrize("protocol, name", params("honoured"))
def test_honoured_row_is_accepted(protocol: str, name: str) -> None:
    sample = HONOURED_BY_PROTOCOL[protocol].get(name) or HONOURED.get(name)
    assert sample is not None, f"add a representative {protocol} value for honoured field {name}"
    assert name in sample
    decode(protocol, **sample)


# -- ignored rows: accepted, and the plan is the plan without them ------------------------------------

IGNORED: dict[str, Any] = {
    "model": "gpt-5.5-codex", "user": "u-1", "metadata": {"user_id": "abc"}, "safety_identifier": "s-1",
    "service_tier": "auto", "prompt_cache_key": "019a-session", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"}, "store": False, "verbosity": "low", "max_tool_calls": 4,
    "stream_options": {"include_obfuscation": False}, "access_programs": {"cyber": "standard"},
    "client_metadata": {"x-codex-installation-id": "abc"}, "image": {"context_compression": "auto"},
    "cache_control": {"type": "ephemeral", "ttl": "5m"}, "speed": "fast",
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "inference_geo": "us", "diagnostics": {"previous_message_id": "msg_1"}, "user_profile_id": "up_1",
    "workspace_id": "wrkspc_1", "betas": ["interleaved-thinking-2025-05-14"],
    "billing_policy": {"type": "billing_policy", "bill_to": "self"}, "fallback_credit_token": "fct_1",
    "fallbacks": "default", "compaction": {"type": "compact"},
    "safeguards": [{"type": "dangerous_tool_use", "classifier_context": {"cwd": "/repo"}}],
}
# Values an ignored row refuses (it is ignored only for some values).
IGNORED_REFUSALS: dict[str, Any] = {
    "store": True, "verbosity": "loud", "image": {"context_compression": "enabled"}, "speed": "warp",
    "cache_control": {"type": "persistent"}, "diagnostics": {"cache_miss": True},
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
}
MESSAGES_SERVICE_TIER_REFUSAL = "priority"


@pytest.mark.parametrize("protocol, name", params("ignored"))
def test_ignored_row_leaves_the_plan_unchanged(protocol: str, name: str) -> None:
    assert name in IGNORED, f"add a representative value for ignored field {name}"
    assert decode(protocol, **{name: IGNORED[name]}) == decode(protocol)
    assert decode(protocol, **{name: None}) == decode(protocol)


@pytest.mark.parametrize("protocol, name", params("ignored"))
def test_ignored_row_checks_its_value(protocol: str, name: str) -> None:
    row = PROTOCOLS[protocol].table[name]
    refusal = MESSAGES_SERVICE_TIER_REFUSAL if (protocol, name) == ("messages", "service_tier") else \
        IGNORED_REFUSALS.get(name)
    if row.allows is not None or row.check is not None:
        assert refusal is not None, f"add a value that {protocol} refuses for {name}"
    if refusal is not None:
        with pytest.raises(BadRequest) as err:
            decode(protocol, **{name: refusal})
        assert name in err.value.message and (err.value.param or "").startswith(name)
    if row.types:
        candidates: tuple[Any, ...] = (5, "x", True, [], {})
        wrong = next(v for v in candidates if not _json_is(v, row.types))
        with pytest.raises(BadRequest, match=f"invalid value for {name}") as err:
            decode(protocol, **{name: wrong})
        assert err.value.param == name


def _json_is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types) or (isinstance(value, int) and float in types)


def test_responses_echo_ignored_fields() -> None:
    plan = decode("responses", metadata={"k": "v"}, user="u", prompt_cache_key="p", safety_identifier="s",
                  max_tool_calls=3, service_tier="priority")
    base = to_json(responses_encoder.response_params(plan, SamplingParams(temperature=1.0, top_p=1.0), "smol"))
    assert base["metadata"] == {"k": "v"} and base["user"] == "u" and base["prompt_cache_key"] == "p"
    assert base["safety_identifier"] == "s" and base["max_tool_calls"] == 3
    assert base["service_tier"] == "default" and base["store"] is False


# -- refused rows: 400 naming the field, param = the field ----------------------------------------------

REFUSED: dict[str, Any] = {
    "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "functions": [{"name": "f"}], "function_call": "auto",
    "moderation": {"model": "omni-moderation-latest"}, "suffix": "end", "tools": [FUNCTION],
    "tool_choice": "auto", "thinking_token_budget": 100, "previous_response_id": "resp_1",
    "conversation": "conv_1", "background": True, "background_options": {"completion_window": "2h"},
    "truncation": "auto", "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}],
    "prompt_logprobs": 1, "container": "container_1",
    "mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}], "thread": {"type": "create"},
    "compaction": {"type": "compact"}, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": False,
    "logprob_token_ids": [1],
}
# Refused rows' values that mean "off" and are accepted as absent.
INERT: dict[str, Any] = {
    "modalities": ["text"], "background": False,
    "truncation": "disabled", "context_management": [], "mcp_servers": [],
}


@pytest.mark.parametrize("protocol, name", params("refused"))
def test_refused_row_is_a_bad_request_naming_the_field(protocol: str, name: str) -> None:
    assert name in REFUSED, f"add a representative value for refused field {name}"
    with pytest.raises(BadRequest) as err:
        decode(protocol, **{name: REFUSED[name]})
    assert name in err.value.message and "not supported" in err.value.message
    assert err.value.param == name and err.value.status == 400


@pytest.mark.parametrize("protocol, name", params("refused"))
def test_refused_row_accepts_null_and_its_inert_values(protocol: str, name: str) -> None:
    row = PROTOCOLS[protocol].table[name]
    if row.refuse_null:  # the field's presence is the error (Messages' logprob options)
        with pytest.raises(BadRequest) as err:
            decode(protocol, **{name: None})
        assert err.value.param == name
    else:
        assert decode(protocol, **{name: None}) == decode(protocol)
    if row.allows is not None:
        assert decode(protocol, **{name: INERT[name]}) == decode(protocol)


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_unknown_fields_stay_unrecognized(protocol: str) -> None:
    with pytest.raises(BadRequest, match="unrecognized request argument\\(s\\): no_such_field") as err:
        decode(protocol, no_such_field=1)
    assert err.value.param == "no_such_field"


def test_structured_output_formats_decode_into_one_constraint() -> None:
    plan = decode("messages", output_config={"effort": "low", "format": {"type": "json_schema", "schema": {}}})
    c = plan.generation.options.constraint
    assert c is not None and c.kind == "json_schema" and c.param == "output_config.format"
    with pytest.raises(BadRequest) as err:
        decode("messages", output_config={"format": {"type": "json_schema"}})
    assert err.value.param == "output_config.format"
    plan = decode("responses", text={"format": {"type": "json_schema", "name": "p", "strict": True,
                                                "schema": {"type": "object"}}})
    c = plan.generation.options.constraint
    assert c is not None and c.kind == "json_schema" and c.strict and c.param == "text.format"
    assert plan.text_config["format"]["name"] == "p"  # echoed on the Response object
    plan = decode("chat", response_format={"type": "json_object"})
    assert plan.generation.options.constraint.kind == "json_object"
    plan = decode("completions", structured_outputs={"choice": ["yes", "no"]})
    assert plan.generation.options.constraint.spec == ("yes", "no")
    with pytest.raises(BadRequest) as err:
        decode("chat", response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert err.value.param == "structured_outputs"
    with pytest.raises(BadRequest) as err:
        decode("chat", structured_outputs={"regex": "a", "choice": ["a"]})
    assert err.value.param == "structured_outputs"


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search"])
def test_hosted_responses_tools_say_how_to_avoid_them(kind: str) -> None:
    with pytest.raises(BadRequest) as err:
        decode("responses", tools=[{"type": kind}])
    assert f"'{kind}'" in err.value.message and err.value.param == "tools"
    if kind.startswith("web_search"):
        assert 'Codex `web_search = "disabled"`' in err.value.message
    else:
        assert "disable" in err.value.message


# -- real clients' bodies ---------------------------------------------------------------------------------


def codex_body() -> dict[str, Any]:
    """POST /v1/responses as Codex 0.171 sends it (web search disabled)."""
    return {
        "model": "gpt-5.5-codex",
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions instructions>sandboxed</permissions instructions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>cwd=/repo</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]},
        ],
        "tools": [
            {"type": "function", "name": "shell_command", "description": "Runs a shell command.", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                             "workdir": {"type": "string"}},
                            "required": ["command"], "additionalProperties": False}},
            {"type": "namespace", "name": "mcp__docs", "description": "Docs server tools.", "tools": [
                {"type": "function", "name": "search", "description": "Search the docs.",
                 "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a2b3c-session",
        "client_metadata": {"x-codex-installation-id": "c0ffee", "x-codex-turn-metadata": "{}"},
    }


def test_codex_body_decodes() -> None:
    plan = responses.decode_responses(codex_body(), INFO)
    assert plan.stream and plan.summary == "auto" and plan.conversation.parallel_tool_calls
    assert [m.role for m in plan.conversation.messages] == ["system", "developer", "user", "user"]
    assert [t.name for t in plan.conversation.tools] == ["shell_command", "mcp__docs__search"]
    assert plan.echo == {"prompt_cache_key": "019a2b3c-session"}
    bare = {k: v for k, v in codex_body().items()
            if k not in ("model", "store", "prompt_cache_key", "client_metadata")}
    assert responses.decode_responses(bare, INFO) == plan


def test_codex_web_search_is_refused_with_advice() -> None:
    body = codex_body()
    body["tools"] = [*body["tools"], {"type": "web_search", "external_web_access": False}]
    with pytest.raises(BadRequest, match='web_search = "disabled"'):
        responses.decode_responses(body, INFO)


def claude_code_body() -> dict[str, Any]:
    """POST /v1/messages?beta=true as Claude Code 2.1.296 sends it."""
    return {
        "model": "claude-opus-4-5",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.296"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>context</system-reminder>"},
            {"type": "text", "text": "Fix the failing test.", "cache_control": {"type": "ephemeral"}},
        ]}],
        "tools": [
            {"name": "Bash", "description": "Run a command.", "input_schema": {
                "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
                "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}},
            {"name": "Read", "description": "Read a file.", "input_schema": {
                "type": "object", "properties": {"file_path": {"type": "string"}}},
             "cache_control": {"type": "ephemeral"}},
        ],
        "metadata": {"user_id": "user_abc_account_def_session_123"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "safeguards": [{"type": "dangerous_tool_use", "classifier_context": {"cwd": "/repo", "mode": "default"}}],
        "output_config": {"effort": "high"},
    }


def test_claude_code_body_decodes() -> None:
    plan = messages.decode_request(claude_code_body(), INFO)
    assert plan.stream and plan.hide_thinking and plan.effort == "high" and plan.max_tokens == 32000
    assert [t.name for t in plan.conversation.tools] == ["Bash", "Read"]
    bare = {k: v for k, v in claude_code_body().items()
            if k not in ("model", "metadata", "context_management", "safeguards")}
    assert messages.decode_request(bare, INFO) == plan


def test_claude_code_count_tokens_and_title_requests() -> None:
    body = claude_code_body()
    count = {k: v for k, v in body.items()
             if k in ("model", "system", "messages", "tools", "thinking", "context_management", "safeguards",
                      "output_config")}
    messages.decode_count_tokens(count, INFO)
    title = {"model": "claude-haiku-4-5", "max_tokens": 512, "messages": USER,
             "system": [{"type": "text", "text": "Generate a title."}], "metadata": body["metadata"],
             "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    plan = messages.decode_request(title, INFO)  # Claude Code's title request: a JSON answer
    assert plan.generation.options.constraint.spec == {"type": "object"}


def test_logit_bias_is_validated_and_reaches_the_sampling_request() -> None:
    plan = decode("chat", logit_bias={"7": -100, "3": 1.5})
    assert plan.conversation.sampling.logit_bias == ((3, 1.5), (7, -100.0))
    assert decode("chat", logit_bias={}).conversation.sampling.logit_bias is None
    for bad in ({"x": 1}, {"-1": 1}, {"99999999": 1}, {"7": 101}, {"7": True}, {"7": "1"}, [1]):
        with pytest.raises(BadRequest) as err:
            decode("chat", logit_bias=bad)
        assert err.value.param == "logit_bias"
