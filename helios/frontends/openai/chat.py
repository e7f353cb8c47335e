"""POST /v1/chat/completions: decode the OpenAI (plus vLLM extensions) request into the neutral
conversation model, run it, and encode buffered or streamed chat completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, cast

import attrs

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
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
from helios.domain.logprobs import TokenLogprob
from helios.domain.model import ModelInfo, TokenVocabulary
from helios.domain.sampling import SamplingRequest
from helios.domain.shapes import OMIT, Opt, to_json
from helios.errors import BadRequest, HeliosError
from helios.frontends import common, fields, wire
from helios.frontends.effort import chat_effort_kwargs
from helios.frontends.fields import honoured, ignored, one_of, refused, wire_field
from helios.frontends.openai import logprobs, shapes
from helios.frontends.structured import decode_format, decode_structured_outputs, one_constraint


@attrs.define(kw_only=True)
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# -- the request's shapes (the SDK's ChatCompletionMessageParam and ChatCompletionToolParam) ----------


@attrs.define(kw_only=True)
class TextContent:
    __wire_lenient__: ClassVar[bool] = True  # part extensions (cache_control, ...) are ignored, as vLLM does
    type: Literal["text"]
    text: str

    __wire_build__: ClassVar[Callable[..., TextPart]] = TextPart


@attrs.define(kw_only=True)
class ImageURL:
    __wire_lenient__: ClassVar[bool] = True  # detail: the whole image is always used
    url: str


@attrs.define(kw_only=True)
class ImageContent:
    """An image part: decoded where its message is, which gives it its place (`_parts`)."""

    __wire_lenient__: ClassVar[bool] = True
    type: Literal["image_url"]
    image_url: ImageURL


Content = str | list[Annotated[TextPart | ImageContent, wire.From(TextContent | ImageContent)]] | None


@attrs.define(kw_only=True)
class CallFunction:
    __wire_lenient__: ClassVar[bool] = True
    name: wire.NonEmptyStr
    arguments: wire.JSONObjectText = attrs.field(factory=lambda: wire.JSONObjectText({}))


@attrs.define(kw_only=True)
class ToolCallWire:
    __wire_lenient__: ClassVar[bool] = True  # type: only function calls exist
    function: CallFunction
    id: str | None = None

    @staticmethod
    def __wire_build__(*, function: CallFunction, id: str | None) -> ToolCallPart:
        return ToolCallPart(id or "", function.name, function.arguments)


# A message builds its domain Message where its parts are complete; one holding an image stays a wire
# message (its builder returns None), and `decode_messages` completes it with its index (the image's place).


@attrs.define(kw_only=True)
class PlainMessage:
    role: Literal["system", "developer", "user"]
    content: Content = None
    name: str | None = None

    @staticmethod
    def __wire_build__(*, role: Literal["system", "developer", "user"], content: Content = None,
                       name: str | None) -> Message | None:
        parts = _parts(content, None)
        return None if parts is None else Message(role, parts, name=name)

    def message(self, index: int) -> Message:
        return Message(self.role, _parts(self.content, index) or (), name=self.name)


@attrs.define(kw_only=True)
class AssistantMessage:
    role: Literal["assistant"]
    content: Content = None
    name: str | None = None
    tool_calls: list[Annotated[ToolCallPart, wire.From(ToolCallWire)]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: Any = wire_field(ignored("a prior refusal's text; the turn's content is what the template renders"))
    function_call: Any = wire_field(ignored("a legacy functions-API call; prior calls are read from tool_calls"))
    audio: Any = wire_field(ignored("a prior audio reply's id; Helios generates no audio"))

    @staticmethod
    def __wire_build__(*, content: Content, name: str | None, tool_calls: list[ToolCallPart] | None,
                       reasoning_content: str | None, reasoning: str | None) -> Message | None:
        parts = _parts(content, None)
        return None if parts is None else _assistant(parts, reasoning_content, reasoning, tool_calls, name)

    def message(self, index: int) -> Message:
        return _assistant(_parts(self.content, index) or (), self.reasoning_content, self.reasoning,
                          self.tool_calls, self.name)


def _assistant(parts: tuple[TextPart | ImagePart, ...], reasoning_content: str | None, reasoning: str | None,
               tool_calls: list[ToolCallPart] | None, name: str | None) -> Message:
    """An assistant message: its reasoning (`reasoning_content`, else `reasoning`) first, its calls last."""
    reasoning = reasoning_content if reasoning_content is not None else reasoning
    head = () if reasoning is None else (ReasoningPart(reasoning),)
    return Message("assistant", (*head, *parts, *(tool_calls or ())), name=name)


@attrs.define(kw_only=True)
class ToolMessage:
    role: Literal["tool"]
    tool_call_id: str
    content: Content = None
    name: str | None = None

    @staticmethod
    def __wire_build__(*, tool_call_id: str, content: Content, name: str | None) -> Message | None:
        parts = _parts(content, None)
        return None if parts is None else Message("tool", (ToolResultPart(tool_call_id, parts),), name=name)

    def message(self, index: int) -> Message:
        content = _parts(self.content, index) or ()
        return Message("tool", (ToolResultPart(self.tool_call_id, content),), name=self.name)


ChatMessage = PlainMessage | AssistantMessage | ToolMessage
BuiltMessage = Annotated[Message | PlainMessage | AssistantMessage | ToolMessage, wire.From(ChatMessage)]
"""A chat message as structured: its domain Message, or the wire message where an image needs its place."""


@attrs.define(kw_only=True)
class FunctionDefinition:
    __wire_lenient__: ClassVar[bool] = True
    name: wire.NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})
    strict: Any = wire_field(refused("strict function schemas are not implemented", inert=one_of(False),
                                     message="strict function schemas (strict: true) are not supported"))


@attrs.define(kw_only=True)
class FunctionTool:
    __wire_lenient__: ClassVar[bool] = True
    type: Literal["function"]
    function: FunctionDefinition


@attrs.define(kw_only=True)
class NamedFunction:
    __wire_lenient__: ClassVar[bool] = True
    name: str


@attrs.define(kw_only=True)
class NamedToolChoice:
    type: Literal["function"]
    function: NamedFunction


@attrs.define(kw_only=True)
class ChoiceWire(fields.TokenObservationFields):
    """The honoured fields Chat Completions and Completions add alike to the token observations."""

    stream: bool | None = wire_field(honoured("SSE chunks"))
    stream_options: StreamOptions | None = wire_field(
        honoured("include_usage and the continuous_usage_stats extension"))
    temperature: float | None = wire_field(honoured("sampling temperature (clamped to the recipe's range)"))
    top_p: float | None = wire_field(honoured("nucleus filter (clamped to the recipe's range)"))
    prompt_logprobs: int | None = wire_field(honoured("vLLM extension: prompt-position logprobs (buffered only)"))
    logit_bias: Any = wire_field(honoured("token id -> bias in [-100, 100], added before penalties and "
                                          "temperature; logprobs stay raw (vLLM)"))


@attrs.define(kw_only=True)
class ChatWire(ChoiceWire):
    """The honoured fields of `CHAT_FIELDS`, each with its row; ignored and refused ones never reach it."""

    messages: list[BuiltMessage] = wire_field(
        honoured("the conversation: system, developer, user, assistant and tool messages"), required=True)
    logprobs: bool | None = wire_field(honoured("generation logprobs"))
    top_logprobs: int | None = wire_field(honoured("alternatives per generated token (0..20)"))
    max_tokens: int | None = wire_field(honoured("output limit (deprecated alias of max_completion_tokens)"))
    max_completion_tokens: int | None = wire_field(honoured("output limit, reasoning included"))
    n: int | None = wire_field(honoured("independent choices (1..128)"))
    tools: list[FunctionTool] | None = wire_field(honoured("client-executed function tools (strict schemas refused)"))
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = wire_field(
        honoured("auto, none, required or a named function"))
    parallel_tool_calls: bool | None = wire_field(honoured("false allows at most one call per response"))
    reasoning_effort: Any = wire_field(honoured("effort level, mapped into the template's vocabulary"))
    chat_template_kwargs: dict[str, Any] | None = wire_field(honoured("vLLM extension: chat-template variables"))
    add_generation_prompt: bool | None = wire_field(honoured("vLLM extension: open an assistant turn"))
    continue_final_message: bool | None = wire_field(
        honoured("vLLM extension: continue the final assistant message"))
    thinking_token_budget: int | None = wire_field(honoured(
        "Helios extension: hard cap on reasoning tokens; at the cap the reasoning close token is forced (400 "
        "where the model cannot close it)"))
    response_format: Any = wire_field(honoured(
        "text, json_object or json_schema (strict as OpenAI defines it): the answer is constrained, reasoning "
        "and tool calls stay free"))


CHAT_FIELDS: fields.FieldTable = fields.field_table(
    ChatWire,
    fields.PROVIDER_ROWS,
    store=ignored("store: false is what Helios does anyway; store: true is refused (nothing is kept)", bool,
                  allows=one_of(False), message="store: true is not supported; Helios keeps no completions"),
    verbosity=ignored("a style hint for hosted models; local chat templates have no verbosity control", str,
                      allows=one_of("low", "medium", "high"), message="verbosity must be 'low', 'medium' or 'high'"),
    audio=refused("Helios generates text only; there is no audio output"),
    modalities=refused("Helios generates text only", inert=one_of(["text"])),
    prediction=refused("predicted outputs are not implemented"),
    web_search_options=refused("hosted web search is not available on a local server"),
    functions=refused("the legacy functions API is not implemented; use tools"),
    function_call=refused("the legacy functions API is not implemented; use tool_choice"),
    moderation=refused("moderation of input and output is not available on a local server"),
)
"""Every top-level Chat Completions field Helios knows (see `helios.frontends.fields`)."""


# -- decoding -----------------------------------------------------------------------------------


def _parts(content: Content, index: int | None) -> tuple[TextPart | ImagePart, ...] | None:
    """Message `index`'s content as parts; None where it holds an image and the index is unknown."""
    if content is None:
        return ()
    if type(content) is str:
        return (TextPart(content),)
    parts = cast("list[TextPart | ImageContent]", content)
    if index is None:
        return wire.all_built(parts, (TextPart,))
    return tuple([p if type(p) is TextPart else
                  _image_from_url(cast("ImageContent", p).image_url.url, f"messages[{index}].content[{j}]")
                  for j, p in enumerate(parts)])


def _image_from_url(url: str, where: str) -> ImagePart:
    """A base64 data URL's image; `where` (the content part) is the image's place in later messages."""
    try:
        media, raw = wire.data_url_image(url)
    except wire.Invalid as exc:
        raise BadRequest(f"{where}: {exc.reason}", param=f"{where}.image_url.url") from None
    return ImagePart(media, raw, where)


def decode_messages(messages: list[Message | PlainMessage | AssistantMessage | ToolMessage]) -> tuple[Message, ...]:
    if not messages:
        raise BadRequest("'messages' must contain at least one message", param="messages")
    return tuple([m if type(m) is Message else cast("PlainMessage | AssistantMessage | ToolMessage", m).message(i)
                  for i, m in enumerate(messages)])


def decode_tools(tools: list[FunctionTool] | None,
                 tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None) -> tuple[tuple[Tool, ...], ToolChoice]:
    decoded = tuple(Tool(t.function.name, t.function.description, t.function.parameters) for t in tools or ())
    names = {t.name for t in decoded}
    if isinstance(tool_choice, NamedToolChoice):
        return decoded, common.decide_tool_choice("chat", names, name=tool_choice.function.name)
    return decoded, common.decide_tool_choice("chat", names, tool_choice)


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
        temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, min_p=w.min_p,
        repetition_penalty=w.repetition_penalty, presence_penalty=w.presence_penalty,
        frequency_penalty=w.frequency_penalty, seed=w.seed,
        logit_bias=decode_logit_bias(getattr(w, "logit_bias", None), vocab_size))


def decode_stream(stream: bool | None, options: StreamOptions | None) -> tuple[bool, bool, bool]:
    """Chat Completions and Completions `stream` and `stream_options` → (stream, include_usage,
    continuous_usage)."""
    if options is not None and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    include_usage = bool(options and options.include_usage)
    return bool(stream), include_usage, include_usage and bool(options and options.continuous_usage_stats)


def output_options(w: fields.NativeGenerationFields, vocab_size: int) -> dict[str, Any]:
    """The `GenerationOptions` fields the native extensions decode alike (Chat Completions, Completions
    and Responses): the string and token stops, the output switches and, where the protocol takes them
    (`TokenObservationFields`), the token observations."""
    stops = common.validate_stops(w.stop)
    options = {"stop": stops, "ignore_eos": bool(w.ignore_eos), "min_tokens": common.validate_min_tokens(w.min_tokens),
               "token_stops": common.validate_token_stops(w.stop_token_ids, w.stop_token_sequences,
                                                          vocab_size, string_stops=stops),
               "include_stop_str_in_output": bool(w.include_stop_str_in_output),
               "skip_special_tokens": w.skip_special_tokens is not False}
    if isinstance(w, fields.TokenObservationFields):
        options["observe"] = common.decode_observation(w.return_token_ids, w.return_token_timestamps)
    return options


# -- decode -------------------------------------------------------------------------------------


@attrs.frozen
class StreamPlan:
    """A decoded Chat Completions or Completions request: what to generate, and how to encode it."""

    generation: GenerationRequest
    stream: bool
    include_usage: bool
    continuous_usage: bool
    as_token_ids: bool
    """return_tokens_as_token_ids: logprob tokens read ``token_id:<id>``."""

    @property
    def options(self) -> GenerationOptions:
        return self.generation.options


@attrs.frozen
class ChatPlan(StreamPlan):
    @property
    def conversation(self) -> ConversationRequest:
        assert self.generation.conversation is not None
        return self.generation.conversation


def decode_chat(obj: dict[str, Any], info: ModelInfo) -> ChatPlan:
    w = wire.structure(fields.screen_fields(obj, CHAT_FIELDS), ChatWire)
    n = 1 if w.n is None else w.n
    if not 1 <= n <= 128:
        raise BadRequest("n must be between 1 and 128", param="n")
    streaming = decode_stream(w.stream, w.stream_options)
    prompt_k = logprobs.validate_prompt_logprobs(w.prompt_logprobs, info, stream=streaming[0])
    output = output_options(w, info.vocab_size)
    budget, budget_param = common.thinking_budget(w.thinking_token_budget, info.thinking_token_budget)
    num_top, explicit = logprobs.validate_logprob_options(logprobs=w.logprobs, top_logprobs=w.top_logprobs,
                                                          logprob_token_ids=w.logprob_token_ids, info=info)
    tools, choice = decode_tools(w.tools, w.tool_choice)
    if w.continue_final_message and w.add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                         param="continue_final_message")
    max_tokens = w.max_completion_tokens if w.max_completion_tokens is not None else w.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    template_kwargs = w.chat_template_kwargs or {}
    conv = ConversationRequest(
        messages=decode_messages(w.messages), tools=tools, tool_choice=choice,
        parallel_tool_calls=True if w.parallel_tool_calls is None else w.parallel_tool_calls,
        sampling=decode_sampling(w, info.vocab_size),
        add_generation_prompt=not w.continue_final_message if w.add_generation_prompt is None else w.add_generation_prompt,
        continue_final_message=bool(w.continue_final_message),
        chat_template_kwargs={**chat_effort_kwargs(w.reasoning_effort, dict(template_kwargs), info.recipe,
                                                   "reasoning_effort" in obj), **template_kwargs})
    options = GenerationOptions(
        n=n, max_tokens=max_tokens, num_top_logprobs=num_top, logprob_token_ids=explicit,
        prompt_logprobs=prompt_k,  # every choice shares the prompt: the first one scores it
        thinking_token_budget=budget, thinking_token_budget_param=budget_param,
        constraint=one_constraint(decode_format(w.response_format, "response_format", nested=True),
                                  decode_structured_outputs(w.structured_outputs)), **output)
    generation = GenerationRequest(
        sampling=conv.sampling, options=options, conversation=conv,
        output_param="max_completion_tokens" if w.max_completion_tokens is not None else "max_tokens",
        id_prefix="chatcmpl",
    )
    return ChatPlan(generation, *streaming, bool(w.return_tokens_as_token_ids))


# -- encode -------------------------------------------------------------------------------------


def _finish_reason(finish: Finish | None, has_calls: bool) -> str:
    """Spec, "Conversation and tool semantics": the output limit wins; parsed calls that complete an
    answer the user did not stop (neither a string nor a token stop) report tool_calls."""
    if finish is not None and finish.cause is FinishCause.LENGTH:
        return "length"
    if has_calls and finish is not None and finish.cause not in (FinishCause.STOP_STRING,
                                                                   FinishCause.STOP_TOKEN):
        return "tool_calls"
    return "stop"


def usage_shape(usage: Usage, *, details: bool = True) -> shapes.CompletionUsage:
    """OpenAI usage (Chat and Completions); Completions reports no completion details. Image requests
    report the image feature tokens already in prompt_tokens."""
    return shapes.CompletionUsage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        prompt_tokens_details=shapes.PromptTokensDetails(
            cached_tokens=usage.cached_tokens,
            multimodal_tokens=shapes.ModalityTokens(image=usage.image_tokens) if usage.image_tokens else OMIT),
        completion_tokens_details=shapes.CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens)
        if details else OMIT)


Tokens = tuple[Sequence[int], Sequence[float]]
"""A chunk's generated token ids and their timestamps (empty where the chunk adds none)."""
NO_TOKENS: Tokens = ((), ())
P = TypeVar("P", bound=StreamPlan)


class ChoiceEncoder(Generic[P]):
    """What the Chat Completions and Completions encoders share: one accumulation per choice, the
    usage, and the stream's chunks and end. A chunk carries the usage with continuous usage stats,
    and the terminal chunk the final usage where token ids are observed without a separate usage
    chunk (include_usage)."""

    chunk_shape: ClassVar[Callable[..., shapes.ChatCompletionChunk | shapes.Completion]]
    usage_details: ClassVar[bool] = True

    def __init__(self, plan: P, prompts: Sequence[PreparedPrompt], *, model: str,
                 vocab: TokenVocabulary) -> None:
        self.plan = plan
        self.prompts = tuple(prompts)
        self.model = model
        self.vocab = vocab
        self.id = common.new_id(plan.generation.id_prefix)
        self.created = common.now()
        self.accs = [Accumulated() for _ in range(len(self.prompts) * plan.options.n)]  # i: prompt i // n
        self._num_finished = 0

    @property
    def done(self) -> bool:
        return self._num_finished == len(self.accs)

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.plan.include_usage:
            usage = self.chunk_shape(id=self.id, created=self.created, model=self.model, choices=[],
                                     usage=self._usage())
            out.append(StreamEvent(usage))
        out.append(StreamEvent("[DONE]"))
        return out

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        """What passed the rules went out; the stream ends in an error object, without [DONE]."""
        return [StreamEvent({"error": error.to_openai()["error"]})]

    def _tokens(self, u: ChildUpdate) -> Tokens:
        return (u.token_ids, u.token_timestamps) if self.plan.options.observe.ids else NO_TOKENS

    def _stop_reason(self, i: int) -> str | int | list[int] | None:
        acc = self.accs[i]
        return common.token_stop_reason(acc.finish, acc.token_ids, self.plan.options.token_stops)

    def _usage(self) -> shapes.CompletionUsage:
        return usage_shape(usage_of(self.prompts, self.accs, self.plan.options.n), details=self.usage_details)

    def _event(self, chunk: shapes.ChatCompletionChunk | shapes.Completion,
               finish: str | None) -> StreamEvent:
        """A choice's chunk, with the usage where it is due."""
        plan = self.plan
        if plan.continuous_usage or (finish is not None and self.done and plan.options.observe.ids
                                     and not plan.include_usage):
            chunk.usage = self._usage()
        return StreamEvent(chunk)


class ChatEncoder(ChoiceEncoder[ChatPlan]):
    """Chat Completions: screened child updates → `chat.completion.chunk` events, or one
    `chat.completion` body (the same accumulation).

    Each choice's first chunk carries the assistant role; a run of events becomes deltas (adjacent
    text or reasoning joined, each tool call its own); logprobs and token ids ride on an update's
    first chunk. With token observations every choice chunk carries the `token_ids` (and
    `token_timestamps`) it adds, the stream's first chunk the top-level `prompt_token_ids`, and,
    without a separate usage chunk (include_usage), the terminal chunk the final usage (spec,
    "Reasoning, sampling, and usage")."""

    chunk_shape = shapes.ChatCompletionChunk

    def __init__(self, plan: ChatPlan, prompts: Sequence[PreparedPrompt], *, model: str,
                 vocab: TokenVocabulary, sampling: object = None) -> None:
        super().__init__(plan, prompts, model=model, vocab=vocab)
        self._started = [False] * len(self.accs)
        self._tool_index = [0] * len(self.accs)
        self._prompt_ids_pending = plan.options.observe.ids

    def start(self) -> list[StreamEvent]:
        return []  # the role chunk waits for a choice's first token

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        acc = self.accs[index]
        acc.add(u)
        out: list[StreamEvent] = []
        if not self._started[index] and (u.token_ids or u.events):
            self._started[index] = True
            out.append(self._chunk(index, shapes.Delta(role="assistant", content="")))
        lp = self._logprobs(u.logprobs) if u.logprobs else None
        tokens = self._tokens(u)
        deltas = self._deltas(index, u.events)
        if not deltas and lp is not None:
            deltas.append(shapes.Delta(content=""))
        elif not deltas and tokens[0] and u.finish is None:  # ids whose text is held back or has no text
            deltas.append(shapes.Delta())
        for delta in deltas:
            out.append(self._chunk(index, delta, logprobs=lp, tokens=tokens))
            lp, tokens = None, NO_TOKENS
        if u.finish is not None:  # the finish chunk takes the ids not sent yet
            self._num_finished += 1
            out.append(self._chunk(index, shapes.Delta(), _finish_reason(u.finish, bool(acc.tool_calls)),
                                   tokens=tokens))
        return out

    def body(self) -> dict[str, Any]:
        opts = self.plan.options
        choices = []
        for i, acc in enumerate(self.accs):
            msg = shapes.ChatCompletionMessage(
                content=acc.text if (acc.text or not acc.tool_calls) else None,
                reasoning_content=acc.reasoning or OMIT, reasoning=acc.reasoning or OMIT,
                tool_calls=[_tool_call(c) for c in acc.tool_calls] or OMIT)
            choices.append(shapes.ChatChoice(
                index=i, message=msg, logprobs=self._logprobs(acc.logprobs), stop_reason=self._stop_reason(i),
                finish_reason=_finish_reason(acc.finish, bool(acc.tool_calls)),
                **common.observation_fields(opts.observe, acc.token_ids, acc.token_timestamps)))
        return to_json(shapes.ChatCompletion(  # type: ignore[no-any-return]
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self._usage(),
            prompt_logprobs=None if opts.prompt_logprobs is None else
            logprobs.prompt_scores(self.accs[0].prompt_logprobs or [], opts.prompt_logprobs, self.vocab),
            prompt_token_ids=self.prompts[0].token_ids if opts.observe.ids else OMIT))

    # -- helpers --------------------------------------------------------------------------------
    def _logprobs(self, records: Sequence[TokenLogprob]) -> shapes.ChoiceLogprobs | None:
        if self.plan.options.num_top_logprobs is None:
            return None
        entries = logprobs.chat_logprobs(records, self.vocab, self.plan.as_token_ids)
        return shapes.ChoiceLogprobs(content=entries)

    def _chunk(self, i: int, delta: shapes.Delta, finish: str | None = None,
               logprobs: shapes.ChoiceLogprobs | None = None, tokens: Tokens = NO_TOKENS) -> StreamEvent:
        observe = self.plan.options.observe
        choice = shapes.ChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish,
                                    stop_reason=self._stop_reason(i) if finish is not None else OMIT,
                                    token_ids=tokens[0] if observe.ids else OMIT,
                                    token_timestamps=tokens[1] if observe.timestamps else OMIT)
        c = shapes.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        if self._prompt_ids_pending:
            self._prompt_ids_pending = False
            c.prompt_token_ids = self.prompts[0].token_ids
        return self._event(c, finish)

    def _deltas(self, i: int, events: Sequence[OutputEvent]) -> list[shapes.Delta]:
        """Chunk deltas for a run of events: adjacent text or reasoning joined (empty text skipped),
        each call its own."""
        deltas: list[shapes.Delta] = []
        last: type | None = None  # the kind of text the last delta holds
        for e in events:
            if isinstance(e, ToolCall):
                deltas.append(shapes.Delta(tool_calls=[_tool_call(e, self._tool_index[i])]))
                self._tool_index[i] += 1
                last = None
            elif isinstance(e, TextDelta | ReasoningDelta) and e.text:
                text = e.text
                if last is type(e):  # joined: the run's delta again, longer
                    d = deltas.pop()
                    text = cast(str, d.content if last is TextDelta else d.reasoning) + text
                deltas.append(shapes.Delta(content=text) if type(e) is TextDelta else
                              shapes.Delta(reasoning_content=text, reasoning=text))
                last = type(e)
        return deltas


def _tool_call(call: ToolCall, index: Opt[int] = OMIT) -> shapes.ToolCall:
    function = shapes.Function(name=call.name, arguments=call.arguments)
    return shapes.ToolCall(id=call.id, index=index, function=function)
