"""POST /v1/chat/completions: decode the OpenAI (plus vLLM extensions) request into the neutral
conversation model, run it, and encode buffered or streamed chat completions."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import attrs

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall, Usage
from helios.domain.generation import (
    Accumulated,
    ChildUpdate,
    GenerationOptions,
    GenerationRequest,
    PreparedPrompt,
    StreamEvent,
    usage_of,
)
from helios.domain.model import ModelInfo, TokenVocabulary
from helios.domain.sampling import SamplingRequest
from helios.errors import BadRequest, HeliosError
from helios.frontends.common import (
    decode_observation,
    new_id,
    now,
    observation_fields,
    thinking_budget,
    token_stop_reason,
    validate_stops,
    validate_token_stops,
)
from helios.frontends.effort import chat_effort_kwargs
from helios.frontends.fields import (
    NATIVE_GENERATION_ROWS,
    PROVIDER_ROWS,
    TOKEN_OBSERVATION_ROWS,
    FieldTable,
    honoured,
    ignored,
    one_of,
    refused,
    screen_fields,
)
from helios.frontends.openai.logprobs import (
    chat_logprobs_content,
    prompt_logprobs_json,
    validate_logprob_options,
    validate_prompt_logprobs,
)
from helios.frontends.structured import decode_response_format, decode_structured_outputs, one_constraint
from helios.frontends.wire import NativeGenerationFields, loads_strict, structure


@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


@attrs.frozen
class ChatWire(NativeGenerationFields):
    """The honoured fields of `CHAT_FIELDS`; ignored and refused ones never reach it."""

    messages: list[Any]
    logit_bias: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    thinking_token_budget: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_token_timestamps: bool | None = None
    response_format: Any = None


CHAT_FIELDS: FieldTable = {
    "messages": honoured("the conversation: system, developer, user, assistant and tool messages"),
    "logprobs": honoured("generation logprobs"),
    "top_logprobs": honoured("alternatives per generated token (0..20)"),
    "max_tokens": honoured("output limit (deprecated alias of max_completion_tokens)"),
    "max_completion_tokens": honoured("output limit, reasoning included"),
    "n": honoured("independent choices (1..128)"),
    "stream": honoured("SSE chunks"),
    "stream_options": honoured("include_usage and the continuous_usage_stats extension"),
    "temperature": honoured("sampling temperature (clamped to the recipe's range)"),
    "top_p": honoured("nucleus filter (clamped to the recipe's range)"),
    "tools": honoured("client-executed function tools (strict schemas refused)"),
    "tool_choice": honoured("auto, none, required or a named function"),
    "parallel_tool_calls": honoured("false allows at most one call per response"),
    "reasoning_effort": honoured("effort level, mapped into the template's vocabulary"),
    "chat_template_kwargs": honoured("vLLM extension: chat-template variables"),
    "add_generation_prompt": honoured("vLLM extension: open an assistant turn"),
    "continue_final_message": honoured("vLLM extension: continue the final assistant message"),
    "thinking_token_budget": honoured("Helios extension: hard cap on reasoning tokens; at the cap the "
                                      "reasoning close token is forced (400 where the model cannot close it)"),
    "prompt_logprobs": honoured("vLLM extension: prompt-position logprobs (buffered only)"),
    **NATIVE_GENERATION_ROWS,
    **TOKEN_OBSERVATION_ROWS,
    **PROVIDER_ROWS,
    "store": ignored("store: false is what Helios does anyway; store: true is refused (nothing is kept)", bool,
                     allows=one_of(False), message="store: true is not supported; Helios keeps no completions"),
    "verbosity": ignored("a style hint for hosted models; local chat templates have no verbosity control", str,
                         allows=one_of("low", "medium", "high"),
                         message="verbosity must be 'low', 'medium' or 'high'"),
    "logit_bias": honoured("token id -> bias in [-100, 100], added before penalties and temperature; "
                           "logprobs stay raw (vLLM)"),
    "response_format": honoured("text, json_object or json_schema (strict as OpenAI defines it): the answer is "
                                "constrained, reasoning and tool calls stay free"),
    "audio": refused("Helios generates text only; there is no audio output"),
    "modalities": refused("Helios generates text only", inert=one_of(["text"])),
    "prediction": refused("predicted outputs are not implemented"),
    "web_search_options": refused("hosted web search is not available on a local server"),
    "functions": refused("the legacy functions API is not implemented; use tools"),
    "function_call": refused("the legacy functions API is not implemented; use tool_choice"),
    "moderation": refused("moderation of input and output is not available on a local server"),
}
"""Every top-level Chat Completions field Helios knows (see `helios.frontends.fields`)."""


# -- decoding -----------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> tuple[Part, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or an array of content parts", param=f"{where}.content")
    parts: list[Part] = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise BadRequest(f"{where}.content[{j}] must be an object with a type", param=f"{where}.content")
        t = p["type"]
        if t == "text":
            if not isinstance(p.get("text"), str):
                raise BadRequest(f"{where}.content[{j}].text must be a string", param=f"{where}.content")
            parts.append(TextPart(p["text"]))
        elif t == "image_url":
            url = (p.get("image_url") or {}).get("url") if isinstance(p.get("image_url"), dict) else None
            parts.append(_image_from_url(url, f"{where}.content[{j}]"))
        else:
            raise BadRequest(f"unsupported content part type '{t}' in {where}", param=f"{where}.content")
    return tuple(parts)


def _image_from_url(url: Any, where: str) -> ImagePart:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(f"{where}: images must be base64 data URLs; remote image downloads are unsupported")
    head, _, data = url.partition(",")
    media = head[5:].split(";")[0]
    if media not in ("image/png", "image/jpeg", "image/webp"):
        raise BadRequest(f"{where}: unsupported image type '{media}'")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise BadRequest(f"{where}: invalid base64 image data") from None
    return ImagePart(media, raw, where)


def decode_messages(messages: list[Any]) -> tuple[Message, ...]:
    if not messages:
        raise BadRequest("'messages' must contain at least one message", param="messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", param="messages")
        role = m.get("role")
        allowed = {"role", "content", "name"}
        if role in ("system", "developer", "user"):
            parts = _text_of(m.get("content"), where)
        elif role == "assistant":
            allowed |= {"tool_calls", "reasoning_content", "reasoning", "refusal", "function_call", "audio"}
            parts = _text_of(m.get("content"), where)
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise BadRequest(f"{where}.reasoning_content must be a string", param="messages")
                parts = (ReasoningPart(reasoning), *parts)
            for k, tc in enumerate(m.get("tool_calls") or []):
                parts = (*parts, _decode_tool_call(tc, f"{where}.tool_calls[{k}]"))
        elif role == "tool":
            allowed |= {"tool_call_id"}
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str):
                raise BadRequest(f"{where}.tool_call_id must be a string", param="messages")
            content = tuple(p for p in _text_of(m.get("content"), where) if isinstance(p, TextPart | ImagePart))
            parts = (ToolResultPart(tcid, content),)
        else:
            raise BadRequest(f"{where}.role must be one of system, developer, user, assistant, tool", param="messages")
        extra = set(m) - allowed
        if extra:
            raise BadRequest(f"unrecognized field(s) in {where}: {', '.join(sorted(extra))}", param="messages")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"{where}.name must be a string", param="messages")
        out.append(Message(role, parts, name=name))
    return tuple(out)


def _decode_tool_call(tc: Any, where: str) -> ToolCallPart:
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        raise BadRequest(f"{where} must be a function tool call", param="messages")
    fn = tc["function"]
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.function.name must be a nonempty string", param="messages")
    if isinstance(args, str):
        try:
            args = loads_strict(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise BadRequest(f"{where}.function.arguments must be a JSON object", param="messages") from None
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object", param="messages")
    return ToolCallPart(str(tc.get("id") or ""), name, args)


def decode_tools(tools: list[Any] | None, tool_choice: Any) -> tuple[tuple[Tool, ...], ToolChoice]:
    decoded: list[Tool] = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise BadRequest(f"tools[{i}] must be a function tool", param="tools")
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}].function.name must be a nonempty string", param="tools")
        if fn.get("strict") is True:
            raise BadRequest("strict function schemas (strict: true) are not supported", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be an object", param="tools")
        desc = fn.get("description")
        decoded.append(Tool(fn["name"], desc if isinstance(desc, str) else None, params))
    names = {t.name for t in decoded}
    if tool_choice is None:
        choice = ToolChoice("auto" if decoded else "none")
    elif tool_choice in ("auto", "none", "required"):
        choice = ToolChoice(tool_choice)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names '{name}', which is not a declared tool", param="tool_choice")
        choice = ToolChoice("named", name)
    else:
        raise BadRequest("tool_choice must be 'auto', 'none', 'required' or a named function", param="tool_choice")
    if choice.mode == "required" and not decoded:
        raise BadRequest("tool_choice 'required' needs at least one declared tool", param="tool_choice")
    return tuple(decoded), choice


MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def decode_logit_bias(raw: Any, vocab_size: int) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's `logit_bias`: token id strings to biases in [-100, 100], ids within the vocabulary."""
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise BadRequest(f"logit_bias key {key!r} is not a token id within the vocabulary (0..{vocab_size - 1})",
                             param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias[{key}] must be a number within [-100, 100]", param="logit_bias")
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


def decode_sampling(w: Any, vocab_size: int = 0) -> SamplingRequest:
    return SamplingRequest(
        temperature=w.temperature,
        top_p=w.top_p,
        top_k=w.top_k,
        min_p=w.min_p,
        repetition_penalty=w.repetition_penalty,
        presence_penalty=w.presence_penalty,
        frequency_penalty=w.frequency_penalty,
        seed=w.seed,
        logit_bias=decode_logit_bias(getattr(w, "logit_bias", None), vocab_size),
    )


# -- decode -------------------------------------------------------------------------------------


@attrs.frozen
class ChatPlan:
    """A decoded Chat Completions request: what to generate, and how to encode it."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool
    continuous_usage: bool
    as_token_ids: bool = False
    """return_tokens_as_token_ids: logprob tokens read ``token_id:<id>``."""

    @property
    def conversation(self) -> ConversationRequest:
        assert self.generation.conversation is not None
        return self.generation.conversation

    @property
    def options(self) -> GenerationOptions:
        return self.generation.options


def decode_chat(obj: dict[str, Any], info: ModelInfo) -> ChatPlan:
    w = structure(screen_fields(obj, CHAT_FIELDS), ChatWire)
    n = 1 if w.n is None else w.n
    if n < 1 or n > 128:
        raise BadRequest("n must be between 1 and 128", param="n")
    stream = bool(w.stream)
    if w.stream_options is not None and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    prompt_k = validate_prompt_logprobs(w.prompt_logprobs, info, stream=stream)
    stops = validate_stops(w.stop)
    token_stops = validate_token_stops(w.stop_token_ids, w.stop_token_sequences, info.vocab_size,
                                       string_stops=stops)
    observe = decode_observation(w.return_token_ids, w.return_token_timestamps)
    budget, budget_param = thinking_budget(w.thinking_token_budget, info.thinking_token_budget)
    num_top, explicit = validate_logprob_options(
        logprobs=w.logprobs, top_logprobs=w.top_logprobs, logprob_token_ids=w.logprob_token_ids, info=info
    )
    tools, choice = decode_tools(w.tools, w.tool_choice)
    if w.continue_final_message and w.add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                         param="continue_final_message")
    max_tokens = w.max_completion_tokens if w.max_completion_tokens is not None else w.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    messages = decode_messages(w.messages)
    conv = ConversationRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=True if w.parallel_tool_calls is None else w.parallel_tool_calls,
        sampling=decode_sampling(w, info.vocab_size),
        add_generation_prompt=not w.continue_final_message if w.add_generation_prompt is None else w.add_generation_prompt,
        continue_final_message=bool(w.continue_final_message),
        chat_template_kwargs={
            **chat_effort_kwargs(w.reasoning_effort, dict(w.chat_template_kwargs or {}), info.recipe,
                                 "reasoning_effort" in obj),
            **(w.chat_template_kwargs or {}),
        },
    )
    options = GenerationOptions(
        n=n,
        max_tokens=max_tokens,
        stop=stops,
        token_stops=token_stops,
        ignore_eos=bool(w.ignore_eos),
        include_stop_str_in_output=bool(w.include_stop_str_in_output),
        skip_special_tokens=True if w.skip_special_tokens is None else w.skip_special_tokens,
        num_top_logprobs=num_top,
        logprob_token_ids=explicit,
        prompt_logprobs=prompt_k,  # every choice shares the prompt: the first one scores it
        observe=observe,
        thinking_token_budget=budget,
        thinking_token_budget_param=budget_param,
        constraint=one_constraint(decode_response_format(w.response_format),
                                  decode_structured_outputs(w.structured_outputs)),
    )
    generation = GenerationRequest(
        sampling=conv.sampling, options=options, conversation=conv,
        output_param="max_completion_tokens" if w.max_completion_tokens is not None else "max_tokens",
        id_prefix="chatcmpl",
    )
    so = w.stream_options
    include_usage = bool(so and so.include_usage)
    return ChatPlan(generation, stream, include_usage, include_usage and bool(so and so.continuous_usage_stats),
                    bool(w.return_tokens_as_token_ids))


# -- encode -------------------------------------------------------------------------------------


def _finish_reason(finish: Finish | None, has_calls: bool) -> str:
    """Spec, "Conversation and tool semantics": the output limit wins; parsed calls that complete an
    answer the user did not stop (neither a string nor a token stop) report tool_calls."""
    if finish is None:
        return "stop"
    if finish.cause is FinishCause.LENGTH:
        return "length"
    if has_calls and finish.cause not in (FinishCause.STOP_STRING, FinishCause.STOP_TOKEN):
        return "tool_calls"
    return "stop"


def usage_json(usage: Usage, *, details: bool = True) -> dict[str, Any]:
    """OpenAI usage (Chat and Completions); Completions reports no completion details."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.image_tokens:  # image requests: the image feature tokens already in prompt_tokens
        out["prompt_tokens_details"]["multimodal_tokens"] = {"image": usage.image_tokens}
    if details:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


def _tool_call_json(tc: ToolCall, index: int) -> dict[str, Any]:
    return {"id": tc.id, "type": "function", "index": index, "function": {"name": tc.name, "arguments": tc.arguments}}


class ChatEncoder:
    """Chat Completions: screened child updates → `chat.completion.chunk` events, or one
    `chat.completion` body (the same accumulation).

    Each choice's first chunk carries the assistant role; a run of events becomes deltas (adjacent
    text or reasoning joined, each tool call its own); logprobs and token ids ride on an update's
    first chunk. With token observations every choice chunk carries the `token_ids` (and
    `token_timestamps`) it adds, the stream's first chunk the top-level `prompt_token_ids`, and,
    without a separate usage chunk (include_usage), the terminal chunk the final usage (spec,
    "Reasoning, sampling, and usage")."""

    def __init__(self, plan: ChatPlan, prompts: Sequence[PreparedPrompt], *, model: str,
                 vocab: TokenVocabulary) -> None:
        self.plan = plan
        self.prompts = tuple(prompts)
        self.model = model
        self.vocab = vocab
        self.id = new_id("chatcmpl")
        self.created = now()
        n = plan.options.n
        self.accs = [Accumulated() for _ in range(n)]
        self._started = [False] * n
        self._tool_index = [0] * n
        self._prompt_ids_pending = plan.options.observe.ids
        self._num_finished = 0

    @property
    def done(self) -> bool:
        return self._num_finished == len(self.accs)

    def start(self) -> list[StreamEvent]:
        return []  # the role chunk waits for a choice's first token

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        acc = self.accs[index]
        acc.add(u)
        out: list[StreamEvent] = []
        observe = self.plan.options.observe
        if not self._started[index] and (u.token_ids or u.events):
            self._started[index] = True
            out.append(self._chunk(index, {"role": "assistant", "content": ""}))
        lp = None
        if self.plan.options.num_top_logprobs is not None and u.logprobs:
            lp = {"content": chat_logprobs_content(u.logprobs, self.vocab, self.plan.as_token_ids)}
        tokens: tuple[Any, Any] = (u.token_ids, u.token_timestamps) if observe.ids else ((), ())
        for delta in self._deltas(index, u.events):
            out.append(self._chunk(index, delta, logprobs=lp, tokens=tokens))
            lp, tokens = None, ((), ())
        if lp is not None:
            out.append(self._chunk(index, {"content": ""}, logprobs=lp, tokens=tokens))
            tokens = ((), ())
        if tokens[0] and u.finish is None:  # ids whose text is held back or has no text
            out.append(self._chunk(index, {}, tokens=tokens))
            tokens = ((), ())
        if u.finish is not None:  # the finish chunk takes the ids not sent yet
            self._num_finished += 1
            out.append(self._chunk(
                index, {}, _finish_reason(u.finish, bool(acc.tool_calls)), tokens=tokens,
                stop_reason=token_stop_reason(u.finish, acc.token_ids, self.plan.options.token_stops),
                terminal=self.done))
        return out

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.plan.include_usage:
            out.append(StreamEvent({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                    "model": self.model, "choices": [], "usage": self._usage()}))
        out.append(StreamEvent("[DONE]"))
        return out

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        """What passed the rules went out; the stream ends in an error object, without [DONE]."""
        return [StreamEvent({"error": error.to_openai()["error"]})]

    def body(self) -> dict[str, Any]:
        opts = self.plan.options
        choices = []
        for i, acc in enumerate(self.accs):
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": acc.text if (acc.text or not acc.tool_calls) else None}
            if acc.reasoning:
                msg["reasoning_content"] = acc.reasoning
                msg["reasoning"] = acc.reasoning
            if acc.tool_calls:
                msg["tool_calls"] = [
                    {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
                    for tc in acc.tool_calls
                ]
            lp = None
            if opts.num_top_logprobs is not None:
                lp = {"content": chat_logprobs_content(acc.logprobs, self.vocab, self.plan.as_token_ids)}
            choices.append({
                "index": i,
                "message": msg,
                "logprobs": lp,
                "finish_reason": _finish_reason(acc.finish, bool(acc.tool_calls)),
                "stop_reason": token_stop_reason(acc.finish, acc.token_ids, opts.token_stops),
                **observation_fields(opts.observe, acc.token_ids, acc.token_timestamps),
            })
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "prompt_logprobs": prompt_logprobs_json(self.accs[0].prompt_logprobs or [], opts.prompt_logprobs,
                                                    self.vocab) if opts.prompt_logprobs is not None else None,
        }
        if opts.observe.ids:
            body["prompt_token_ids"] = list(self.prompts[0].token_ids)
        return body

    # -- helpers --------------------------------------------------------------------------------
    def _usage(self) -> dict[str, Any]:
        return usage_json(usage_of(self.prompts, self.accs, self.plan.options.n))

    def _chunk(self, i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               stop_reason: Any = None, tokens: tuple[Any, Any] = ((), ()), terminal: bool = False) -> StreamEvent:
        observe = self.plan.options.observe
        choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice.update(observation_fields(observe, *tokens))
        c: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [choice]}
        if self._prompt_ids_pending:
            self._prompt_ids_pending = False
            c["prompt_token_ids"] = list(self.prompts[0].token_ids)
        if self.plan.continuous_usage or (terminal and observe.ids and not self.plan.include_usage):
            c["usage"] = self._usage()
        return StreamEvent(c)

    def _deltas(self, i: int, events: Sequence[OutputEvent]) -> list[dict[str, Any]]:
        """Chunk deltas for a run of events: adjacent text or reasoning joined, each call its own."""
        deltas: list[dict[str, Any]] = []
        last: str | None = None
        for e in events:
            if isinstance(e, ToolCall):
                deltas.append({"tool_calls": [_tool_call_json(e, self._tool_index[i])]})
                self._tool_index[i] += 1
                last = None
            elif isinstance(e, TextDelta | ReasoningDelta) and e.text:
                kind = "content" if isinstance(e, TextDelta) else "reasoning"
                if last == kind:
                    for key in ("content",) if kind == "content" else ("reasoning_content", "reasoning"):
                        deltas[-1][key] += e.text
                elif kind == "content":
                    deltas.append({"content": e.text})
                else:
                    deltas.append({"reasoning_content": e.text, "reasoning": e.text})
                last = kind
        return deltas
