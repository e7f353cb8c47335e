"""A generation as the protocol side sees it: the options a request decodes into, the updates each
child produces, what accumulates from them, and the usage they add up to.

Every protocol's `decode()` yields a `GenerationRequest`; the serving path prepares it once
(`Service.prepare`) and drives it once (`helios.serving.drive`); every protocol's encoder consumes
`ChildUpdate` records and renders `Usage`. No torch, no trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from helios.domain.conversation import ConversationRequest
from helios.domain.events import Finish, OutputEvent, ReasoningDelta, TextDelta, ToolCall, Usage
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.domain.sampling import SamplingRequest
from helios.domain.shapes import to_json


@attrs.frozen
class TokenStops:
    """A request's validated token stops: `stop_token_ids` (one-token stops) and the native
    `stop_token_sequences` extension (stops of 1..64 tokens), at most 16 in all."""

    ids: tuple[int, ...] = ()
    sequences: tuple[tuple[int, ...], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ids or self.sequences)


@attrs.frozen
class TokenObservation:
    """Which per-token observations a request asked for.

    ``ids`` (vLLM's ``return_token_ids``): the prompt's ids and each choice's generated token ids
    (every generated token, the terminating EOS or stop token included, so their number is the
    choice's completion tokens). ``timestamps`` (Helios's ``return_token_timestamps``): per
    generated token, seconds from the request's HTTP admission to the engine's commit of that token
    (server side, monotonic clock, microsecond resolution; tokens committed in one engine step share
    one time). Timestamps imply the ids they are parallel to."""

    ids: bool = False
    timestamps: bool = False


@attrs.frozen
class OutputConstraint:
    """A structured-output constraint on the final answer (spec, "Reasoning, sampling, and usage").

    ``kind``: ``json_schema`` (``spec`` the schema object), ``json_object`` (any JSON object),
    ``regex`` (``spec`` the pattern), ``grammar`` (``spec`` a Lark grammar in llguidance's
    dialect; GBNF with ``::=`` rules is converted), ``choice`` (``spec`` a list of strings; the
    answer is exactly one of them). ``param`` is the request field it came from, for errors.
    ``strict``: OpenAI's ``json_schema.strict``: the schema must follow OpenAI's strict subset
    (every object closed with ``additionalProperties: false``, every property required); without it
    unknown keywords are ignored (lenient compilation)."""

    kind: Literal["json_schema", "json_object", "regex", "grammar", "choice"]
    spec: Any = None
    param: str = "response_format"
    strict: bool = False
    name: str | None = None
    """The schema's name (OpenAI ``json_schema.name``), for the prompt instruction."""

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")


@attrs.frozen
class GenerationOptions:
    """What to generate and what to report, per child, whatever the protocol called the fields."""

    n: int = 1
    """Choices per prompt (children = prompts x n)."""
    max_tokens: int | None = None
    """The requested output limit; None: the server's default_max_tokens, within the context."""
    stop: tuple[str, ...] = ()
    token_stops: TokenStops = TokenStops()
    ignore_eos: bool = False
    min_tokens: int = 0
    """No end before this many generated tokens (vLLM's min_tokens): EOS and the token stops are
    masked from the draws until then, and neither they nor a string stop end the output."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_top_logprobs: int | None = None
    """None: no generation logprobs; 0..20 alternatives per generated token."""
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None
    """None: no prompt scores; else alternatives per prompt position the engine scores."""
    score_every_choice: bool = False
    """False: only the first choice of each prompt scores it (the others share its scores)."""
    observe: TokenObservation = TokenObservation()
    thinking_token_budget: int | None = None
    """A hard cap on generated reasoning tokens (chat protocols; see serving/reasoning_budget.py)."""
    thinking_token_budget_param: str | None = None
    """The request field that gave the budget explicitly, named by the 400 when the model's
    reasoning format cannot honour it; None: an advisory budget (Messages ``thinking.budget_tokens``,
    the server default), dropped on such formats."""
    constraint: OutputConstraint | None = None
    """Structured output: the final answer follows this constraint (token masks in the engine)."""


@attrs.frozen
class GenerationRequest:
    """What a protocol's `decode()` hands the serving path: a conversation (chat protocols) or raw
    prompts (Completions: text, or token ids), sampling as requested, and the options."""

    sampling: SamplingRequest
    options: GenerationOptions = GenerationOptions()
    conversation: ConversationRequest | None = None
    prompts: tuple[str | tuple[int, ...], ...] = ()
    add_special_tokens: bool = True
    """Raw text prompts: let the tokenizer add its special tokens (BOS)."""
    submit: bool = True
    """False: prepare (tokenize, validate) but generate nothing (Completions max_tokens 0 without
    prompt scoring)."""
    input_param: str = "messages"
    output_param: str = "max_tokens"
    stop_param: str = "stop"
    """The wire name of the string stops (Messages: stop_sequences)."""
    """The wire names of the prompt and the output limit, for errors that point at them."""
    id_prefix: str = "req"


@attrs.frozen
class PreparedPrompt:
    """One prompt as submitted: its token ids and its text (the rendered chat prompt, the raw
    prompt, or the decoded ids)."""

    token_ids: tuple[int, ...]
    text: str
    image_tokens: int = 0
    """Image feature tokens among ``token_ids`` (the admitted images' costs; framing excluded)."""


@attrs.define
class ChildUpdate:
    events: list[OutputEvent]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish: Finish | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    abort_engine: bool = False  # a string stop ended it: the engine child must be aborted
    num_reasoning_tokens: int = 0  # cumulative tokens the parser published as reasoning
    logprob_offsets: tuple[int, ...] = ()
    """Per `logprobs` entry: the Unicode characters the detokenizer had released before that token,
    counted from the start of the completion (a token inside a multi-token character gets the
    character's start)."""
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    """Prompt positions scored in this update, in order (position 0 is None)."""
    token_timestamps: tuple[float, ...] = ()
    """Per `token_ids` entry (when the processor has an `origin`): seconds from the origin (the
    request's admission) to the engine's commit of that token (`RequestOutput.produced_at`); tokens
    committed in one engine step share their time."""


@attrs.define
class Accumulated:
    """The ordered output of one child: what buffered responses encode."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    token_timestamps: list[float] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    logprob_offsets: list[int] = attrs.field(factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None  # prompt scores in position order, when requested
    finish: Finish | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_reasoning_tokens: int = 0

    def add(self, u: ChildUpdate) -> None:
        for e in u.events:
            if isinstance(e, TextDelta):
                self.text += e.text
            elif isinstance(e, ReasoningDelta):
                self.reasoning += e.text
            elif isinstance(e, ToolCall):
                self.tool_calls.append(e)
        self.token_ids.extend(u.token_ids)
        self.token_timestamps.extend(u.token_timestamps)
        if u.logprobs:
            self.logprobs.extend(u.logprobs)
            self.logprob_offsets.extend(u.logprob_offsets)
        if u.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(u.prompt_logprobs)
        self.add_counts(u)

    def add_counts(self, u: ChildUpdate) -> None:
        """Only the token counts and the finish (what usage is built from)."""
        self.num_reasoning_tokens = u.num_reasoning_tokens
        self.num_prompt_tokens = u.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = u.num_output_tokens
        self.num_cached_tokens = u.num_cached_tokens or self.num_cached_tokens
        if u.finish is not None:
            self.finish = u.finish


def usage_of(prompts: Sequence[PreparedPrompt], children: Sequence[Accumulated], n: int) -> Usage:
    """The usage of one request: each prompt counts once however many choices share it (its
    cached tokens as its first choice reports them); every choice's output and reasoning count."""
    cached = sum(children[k * n].num_cached_tokens for k in range(len(prompts)) if k * n < len(children))
    return Usage(
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        completion_tokens=sum(c.num_output_tokens for c in children),
        cached_tokens=cached,
        reasoning_tokens=sum(c.num_reasoning_tokens for c in children),
        image_tokens=sum(p.image_tokens for p in prompts),
    )


@attrs.frozen
class StreamEvent:
    """One server-sent event an encoder produces: its `payload` (a declared shape, see
    `helios.domain.shapes`; a JSON object; or raw text such as `[DONE]`) and an optional event name
    (Messages and Responses name theirs). `data` is what the wire carries: the payload's JSON value,
    written by the one serializer when the event is sent (a buffered response never writes its events)."""

    payload: Any
    event: str | None = None

    @property
    def data(self) -> dict[str, Any] | str:
        p = self.payload
        return p if p.__class__ is str or p.__class__ is dict else to_json(p)  # type: ignore[no-any-return]
