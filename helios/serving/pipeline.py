"""The serving pipeline that every frontend calls: prompt preparation, admission, generation.

Frontends (sans-IO protocol code) hand over domain records and get ChildUpdate streams back; they
never see the engine. Chat templates render and prompts tokenize in a bounded worker pool (a small
request's, without images, on the calling event loop: `prepare`'s ``inline``).

Images (a vision-language model: `ImagePrompting`; docs/vision.md "Engine integration"): the
template renders each presented image as the profile's marker (``<image>``); the images are admitted
(`serving.images.ImageAdmission`: validation, decoding, costs and budgets), the k-th marker becomes
the k-th image's `ImageCost.prompt_text`, the prompt is tokenized, and the k-th image owns the next
``cost.tokens`` placeholder tokens (`lowering.image_spans`). A count that does not pair up is a 400,
never a silent mismatch; the prompt with its images must fit the context like any other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import attrs
import trio

from helios.domain.conversation import ConversationRequest, ImagePart, ToolResultPart
from helios.domain.generation import ChildUpdate, GenerationOptions, GenerationRequest, PreparedPrompt
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams, SamplingRequest
from helios.engine.records import EngineRequest, ImageInput, ReasoningBudget, RequestOutput
from helios.errors import BadRequest, ContextLengthExceeded
from helios.loaders.tokenizer import PromptTooLong, Tokenizer
from helios.obs import access
from helios.parsers import OutputParser
from helios.serving.engine_client import EngineClient
from helios.serving.lowering import LoweredPrompt, LoweringError, expand_image_markers, image_spans
from helios.serving.output import OutputProcessor
from helios.serving.structured import GrammarCompiler, ToolValidators, with_json_instruction

if TYPE_CHECKING:
    from PIL import Image

    from helios.engine.structured import Envelope, GrammarConstraint
    from helios.loaders.chat_template import ChatTemplate
    from helios.models.vision.base import PreparedImage
    from helios.serving.images import ImageAdmission


@attrs.frozen
class ImagePrompting:
    """A vision-language model's side of prompt preparation."""

    admission: ImageAdmission
    """Validation, costs, budgets and host caches (``serving/images.py``)."""
    image_token: str
    """The marker the template renders per image, and the placeholder token's text."""
    image_token_id: int
    prepare: Callable[[Image.Image], PreparedImage]
    """The vision tower's ``prepare``: decoded image -> the input its ``encode`` takes."""


@attrs.frozen
class RenderedPrompt:
    """A conversation rendered and tokenized: the prompt text (images expanded), its ids, and its
    images as the engine takes them."""

    text: str
    token_ids: list[int]
    images: tuple[ImageInput, ...] = ()
    image_tokens: int = 0
    """Image feature tokens among ``token_ids`` (usage's ``multimodal_tokens.image``)."""


@attrs.frozen
class Prepared:
    """A request ready to submit: its prompts as tokenized and its children's engine requests
    (prompts x n, in order; child i generates for prompt i // n)."""

    request: GenerationRequest
    prompts: tuple[PreparedPrompt, ...]
    children: tuple[EngineRequest, ...]
    """What the engine runs, one request per child, built here once (`Service.engine_request`)."""
    tool_validators: ToolValidators = attrs.field(factory=dict)
    """Custom tools with a grammar: name -> validator of a completed call's input."""
    parser_factory: Callable[[], OutputParser] | None = None
    """The model family's output parser, one per child (None: plain text)."""

    @property
    def n(self) -> int:
        return self.request.options.n


class ChildStream:
    """Async iterator of ChildUpdate for one child; aborts its engine child on a string stop."""

    def __init__(self, rid: str, recv: trio.MemoryReceiveChannel[RequestOutput], proc: OutputProcessor,
                 client: EngineClient, stats: access.RequestStats | None = None,
                 prompt_key: tuple[int, int] = (0, 0)) -> None:
        self.request_id = rid
        self._recv = recv
        self.proc = proc
        self._client = client
        self.nursery: trio.Nursery | None = None  # generate()'s, for `merged` pumps (several children)
        self._stats = stats  # the HTTP request's access-log record, told about every engine output
        self._prompt_key = prompt_key

    def __aiter__(self) -> ChildStream:
        return self

    async def __anext__(self) -> ChildUpdate:
        if self.proc.finished is not None:
            raise StopAsyncIteration
        try:
            out = await self._recv.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        update = self.proc.process(out)
        if self._stats is not None:
            self._stats.observe(self._prompt_key, self.request_id, update.num_prompt_tokens,
                                update.num_output_tokens, bool(out.new_token_ids))
            self._stats.observe_update(out, update)  # engine failures, first offered text (metrics)
        if update.abort_engine:
            self._client.abort_one(self.request_id)
        return update


async def merged(streams: Sequence[ChildStream]) -> AsyncIterator[tuple[int, ChildUpdate]]:
    """Interleave several children's updates in arrival order, tagged with the child index.

    A caller may stop iterating at any point (break, return, raise): the pump tasks live in the
    nursery `Service.generate` opened for these streams, which cancels them when its block exits.
    (A nursery inside this generator would be abandoned at its `yield` by such an exit, which trio
    reports as nursery misnesting and which ends the whole event loop.)"""
    if len(streams) == 1:
        async for u in streams[0]:
            yield 0, u
        return
    nursery = streams[0].nursery
    if nursery is None:
        raise RuntimeError("merged() needs the streams of one Service.generate() block")
    send, recv = trio.open_memory_channel[tuple[int, ChildUpdate]](0)
    for i, s in enumerate(streams):
        nursery.start_soon(_pump, i, s, send.clone())
    send.close()
    async for item in recv:
        yield item


async def _pump(i: int, stream: ChildStream, send: trio.MemorySendChannel[tuple[int, ChildUpdate]]) -> None:
    async with send:
        async for u in stream:
            await send.send((i, u))


class Service:
    def __init__(
        self,
        *,
        info: ModelInfo,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate | None,
        engine: EngineClient,
        resolve_sampling: Callable[[SamplingRequest], SamplingParams],
        lower: Callable[[ConversationRequest], str | LoweredPrompt],
        eos_token_ids: Sequence[int],
        limiter: trio.CapacityLimiter | None = None,
        parser_factory: Callable[..., Callable[[], OutputParser] | None] | None = None,
        reasoning_budget: Callable[[ConversationRequest, str, int, str | None], ReasoningBudget | None] | None = None,
        envelope_factory: Callable[[ConversationRequest, str], Envelope] | None = None,
        compiler: GrammarCompiler | None = None,
        vision: ImagePrompting | None = None,
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.engine = engine
        self._resolve_sampling = resolve_sampling
        self._lower = lower
        self.eos_token_ids = frozenset(eos_token_ids)
        # Template rendering and tokenization run on the app's bounded frontend pool, the one that
        # also decompresses request bodies (api.md: "Decompression and frontend processing share
        # the bounded frontend worker pool"); a Service built alone gets a pool of its own.
        self.limiter = limiter if limiter is not None else trio.CapacityLimiter(2)
        self.started = time.time()
        self._parser_factory = parser_factory
        self._reasoning_budget = reasoning_budget
        self._envelope_factory = envelope_factory
        self.compiler = compiler if compiler is not None else GrammarCompiler(tokenizer)
        self._token_bytes: dict[int, bytes] = {}
        self.vision = vision
        """The image side of a vision-language model (None: text only)."""
        self.images: ImageAdmission | None = vision.admission if vision is not None else None
        """The image admission and its host caches (the metrics read its store's counters)."""

    def parser_factory(self, conv: ConversationRequest, prompt: str,
                       structured: bool = False) -> Callable[[], OutputParser] | None:
        """The model family's reasoning/tool parser for this conversation (None: plain text);
        ``structured``: an output constraint is active (the parser's structured-output mode)."""
        if self._parser_factory is None:
            return None
        return self._parser_factory(conv, prompt, structured) if structured else self._parser_factory(conv, prompt)

    def token_bytes(self, token_id: int) -> bytes:
        b = self._token_bytes.get(token_id)
        if b is None:
            b = self._token_bytes[token_id] = bytes(self.tokenizer.token_bytes(token_id))
        return b

    # -- preparation ------------------------------------------------------------------------
    async def render_chat(self, conv: ConversationRequest, max_tokens: int | None = None) -> tuple[str, list[int]]:
        """The rendered prompt and its ids; over `max_tokens` tokens, PromptTooLong (`Tokenizer.encode`)."""
        rendered = await self.render(conv, max_tokens)
        return rendered.text, rendered.token_ids

    async def render(self, conv: ConversationRequest, max_tokens: int | None = None,
                     param: str = "messages", *, inline: bool = False) -> RenderedPrompt:
        """Render and tokenize a conversation, its images admitted and expanded (module docstring).

        Blocking work (the template, image admission with its decoding, the tokenizer) runs on the
        frontend pool; with ``inline`` (a small request body) and no image, on the calling thread.
        ``param``: the request field image errors name."""
        has_images = _has_images(conv)
        if not self.info.has_vision and has_images:
            # An image must never be dropped silently: a text-only model cannot see it.
            raise BadRequest(f"model {self.info.public_id} does not accept image input (it is text-only)",
                             param=param)
        vision = self.vision

        def work() -> RenderedPrompt:
            lowered = self._lower(conv)
            text, parts = (lowered, ()) if isinstance(lowered, str) else (lowered.text, lowered.images)
            if vision is None:
                return RenderedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False, max_tokens=max_tokens))
            if len(parts) != _count_images(conv):
                raise BadRequest("images in system or developer messages cannot be presented to the model (this "
                                 f"request has {_count_images(conv) - len(parts)}); send them in a user message",
                                 param=param)
            admitted = vision.admission.admit(parts, param=param) if parts else None
            costs = admitted.costs if admitted is not None else ()
            try:
                text = expand_image_markers(text, vision.image_token, [c.prompt_text for c in costs])
                ids = self.tokenizer.encode(text, add_special_tokens=False, max_tokens=max_tokens)
                spans = image_spans(ids, vision.image_token_id, [c.tokens for c in costs], vision.image_token)
            except LoweringError as exc:
                raise BadRequest(str(exc), param=param) from None
            if admitted is None:
                return RenderedPrompt(text, ids)
            store = vision.admission.store
            profile = vision.admission.profile
            settings = profile.settings_key if profile is not None else ""
            inputs = tuple(
                ImageInput(offset, length, image.cost.tokens, image.identity,
                           store.prepared_loader(image, settings, vision.prepare))
                for (offset, length), image in zip(spans, admitted.images, strict=True))
            return RenderedPrompt(text, ids, inputs, admitted.tokens)

        if inline and not has_images:
            return work()
        return await trio.to_thread.run_sync(work, limiter=self.limiter)

    async def tokenize(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None, *,
                       inline: bool = False) -> list[int]:
        """``text``'s ids, tokenized on the frontend pool (``inline``: on the calling thread)."""

        def work() -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, max_tokens=max_tokens)

        return work() if inline else await trio.to_thread.run_sync(work, limiter=self.limiter)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def resolve_sampling(self, req: SamplingRequest, choice_index: int = 0) -> SamplingParams:
        try:
            params = self._resolve_sampling(req)
        except (ValueError, TypeError) as exc:  # a recipe's SamplingParameterError names its field
            raise BadRequest(str(exc), param=getattr(exc, "parameter", None)) from None
        if params.seed is not None and choice_index:
            params = attrs.evolve(params, seed=params.seed + choice_index)
        return params

    def output_budget(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        *,
        input_param: str = "messages",
        output_param: str = "max_tokens",
    ) -> int:
        """Validate the prompt against the context and resolve the output limit.

        A prompt that leaves no room raises ContextLengthExceeded, which each protocol words as its
        own API does; `input_param` and `output_param` are the request fields it names. An explicit
        limit beyond the context left is cut to what is left (`ModelInfo.clamp_max_tokens`, the
        default, as llama.cpp's server does), or raises it too (vLLM's rule, ``[server]
        max_tokens_overflow = "reject"``). ``[server] max_output_tokens`` caps every limit first.
        """
        limit = self.info.max_model_len
        if num_prompt_tokens >= limit and not (max_tokens == 0 and num_prompt_tokens <= limit):
            raise ContextLengthExceeded(
                prompt_tokens=num_prompt_tokens, limit=limit, max_tokens=max_tokens or None, prompt_alone=True,
                input_param=input_param, output_param=output_param,
            )
        remaining = limit - num_prompt_tokens
        cap = self.info.max_output_tokens
        if max_tokens is None:
            return min(self.info.default_max_tokens, remaining, *([cap] if cap else []))
        if cap and max_tokens > cap:
            max_tokens = cap
        if max_tokens > remaining:
            if self.info.clamp_max_tokens:
                return remaining
            raise ContextLengthExceeded(
                prompt_tokens=num_prompt_tokens, limit=limit, max_tokens=max_tokens,
                input_param=input_param, output_param=output_param,
            )
        return max_tokens

    async def prepare(self, req: GenerationRequest, *, inline: bool = False) -> Prepared:
        """Every protocol's one preparation: render the conversation (chat protocols) or tokenize the
        raw prompts (Completions), validate each prompt against the context and resolve its output
        limit, resolve sampling per choice (a seeded request's choice i uses seed + i), and pick the
        model family's output parser. ``inline``: the request is small (its body under
        `http.context.INLINE_BODY_BYTES`), so rendering and tokenizing run on the calling thread
        instead of the frontend pool (grammars still compile there)."""
        opts = req.options
        parser_factory = None
        prompts: list[PreparedPrompt] = []
        images: tuple[ImageInput, ...] = ()
        markers: tuple[int, ...] = ()
        reasoning_budget = None
        constraint = opts.constraint
        compiled: GrammarConstraint | None = None
        validators: dict[str, Callable[[str], str | None]] = {}
        conv = req.conversation
        if opts.max_tokens is not None and opts.min_tokens > opts.max_tokens:
            raise BadRequest(f"min_tokens ({opts.min_tokens}) must be less than or equal to {req.output_param} "
                             f"({opts.max_tokens})", param="min_tokens")
        if constraint is not None:
            _check_constraint_conflicts(req)
            # Compiled first (a 400 before any rendering); the envelope comes with the prompt.
            compiled = await self.compiler.constraint(constraint)
        if conv is not None:
            if constraint is not None and constraint.is_json:
                conv = with_json_instruction(conv, constraint)
            for tool in conv.tools:
                if tool.grammar is not None:  # compiled before admission: a bad grammar is a 400
                    validators[tool.name] = await self.compiler.tool_validator(tool)
            try:  # an over-context prompt is counted, never turned into millions of ids (nor truncated)
                rendered = await self.render(conv, max_tokens=self.info.max_model_len, param=req.input_param,
                                             inline=inline)
            except PromptTooLong as exc:
                self._over_context(exc.num_tokens, req)
            text, ids, images = rendered.text, rendered.token_ids, rendered.images
            prompts.append(PreparedPrompt(tuple(ids), text, image_tokens=rendered.image_tokens))
            parser_factory = self.parser_factory(conv, text, structured=constraint is not None)
            if opts.thinking_token_budget is not None and self._reasoning_budget is not None:
                # The rendered prompt says where the output starts (spec: thinking_token_budget).
                reasoning_budget = self._reasoning_budget(conv, text, opts.thinking_token_budget,
                                                          opts.thinking_token_budget_param)
            if compiled is not None and self._envelope_factory is not None:
                compiled = attrs.evolve(compiled, envelope=self._envelope_factory(conv, text))
            if conv.cache_breakpoints:
                markers = await self._breakpoint_tokens(text, len(ids), conv.cache_breakpoints)
        else:
            for p in req.prompts:
                if isinstance(p, str):
                    try:
                        ids = await self.tokenize(p, add_special_tokens=req.add_special_tokens,
                                                  max_tokens=self.info.max_model_len, inline=inline)
                    except PromptTooLong as exc:
                        self._over_context(exc.num_tokens, req)
                    if not ids:
                        if not self.info.has_bos:
                            raise BadRequest("empty text prompts need a model with a BOS token", param=req.input_param)
                        raise BadRequest("the prompt is empty", param=req.input_param)
                    prompts.append(PreparedPrompt(tuple(ids), p))
                else:
                    prompts.append(PreparedPrompt(tuple(p), self.decode(p)))
            if self.vision is not None:
                token = self.vision.image_token_id
                if any(token in prompt.token_ids for prompt in prompts):
                    # Only an image's features may fill a placeholder (transformers' processor refuses
                    # the token without an image too); raw prompts take no images.
                    raise BadRequest(f"the prompt contains the image placeholder token {self.vision.image_token}, "
                                     "which only an image can fill; raw prompts take no images",
                                     param=req.input_param)
        sampling = [self.resolve_sampling(req.sampling, i) for i in range(opts.n)]
        children: list[EngineRequest] = []
        for prompt in prompts:
            budget = self.output_budget(len(prompt.token_ids), opts.max_tokens,
                                        input_param=req.input_param, output_param=req.output_param)
            if not req.submit:
                continue
            for i in range(opts.n):
                children.append(self.engine_request(
                    prompt.token_ids, sampling[i], budget, opts, prefix=req.id_prefix,
                    prompt_logprobs=opts.prompt_logprobs if opts.score_every_choice or i == 0 else None,
                    marker_tokens=markers, reasoning_budget=reasoning_budget, constraint=compiled, images=images,
                ))
        return Prepared(req, tuple(prompts), tuple(children), validators, parser_factory)

    def engine_request(
        self,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        max_tokens: int,
        options: GenerationOptions,
        *,
        prefix: str,
        prompt_logprobs: int | None = None,
        marker_tokens: tuple[int, ...] = (),
        reasoning_budget: ReasoningBudget | None = None,
        constraint: GrammarConstraint | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> EngineRequest:
        """One engine child under a new request id (``prefix``-n): the prompt, its resolved sampling
        and output limit, and the engine's share of the request's options (token stops, EOS,
        logprobs). ``prompt_logprobs``: this child's prompt scoring (None when another choice of its
        prompt scores it); ``marker_tokens``: prompt tokens up to each of the client's
        prefix-checkpoint markers (the last one's pages are retained); ``reasoning_budget``: the
        reasoning cut (`thinking_token_budget`); ``constraint``: the compiled answer constraint with
        this prompt's envelope; ``images``: the prompt's admitted
        images with their placeholder spans."""
        stops = options.token_stops
        return EngineRequest(
            request_id=self.engine.new_request_id(prefix),
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=frozenset(stops.ids).union(s[0] for s in stops.sequences if len(s) == 1),
            stop_token_sequences=tuple(s for s in stops.sequences if len(s) > 1),
            ignore_eos=options.ignore_eos,
            min_tokens=options.min_tokens,
            num_top_logprobs=options.num_top_logprobs,
            logprob_token_ids=options.logprob_token_ids,
            prompt_logprobs=prompt_logprobs,
            marker_tokens=marker_tokens,
            reasoning_budget=reasoning_budget,
            constraint=constraint,
            images=images,
        )

    async def _breakpoint_tokens(self, prompt: str, num_tokens: int,
                                 breakpoints: Sequence[str]) -> tuple[int, ...]:
        """Tokens of the rendered prompt up to the end of each marked block found in it (each
        searched after the previous one), ascending and distinct; () when none is found."""
        ends: list[int] = []
        at = 0
        for text in breakpoints:
            found = prompt.find(text, at)
            if found >= 0:
                at = found + len(text)
                ends.append(at)
        out: list[int] = []
        for end in ends:
            n = min(len(await self.tokenize(prompt[:end], add_special_tokens=False)), num_tokens)
            if n and (not out or n > out[-1]):
                out.append(n)
        return tuple(out)

    async def count_prompt_tokens(self, conv: ConversationRequest) -> int:
        """The tokens of the exact prompt a generation request with this conversation would submit
        (counted only: the ids are never built)."""
        try:
            _, ids = await self.render_chat(conv, max_tokens=0)
        except PromptTooLong as exc:
            return exc.num_tokens
        return len(ids)

    def _over_context(self, num_tokens: int, req: GenerationRequest) -> NoReturn:
        """The protocol's context error for a prompt the tokenizer counted past the context."""
        self.output_budget(num_tokens, req.options.max_tokens, input_param=req.input_param,
                           output_param=req.output_param)
        raise AssertionError(f"a prompt of {num_tokens} tokens passed the context check")

    # -- generation -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def generate(self, children: Sequence[EngineRequest], options: GenerationOptions,
                       parser_factory: Callable[[], OutputParser] | None = None) -> AsyncIterator[list[ChildStream]]:
        """Submit the children (`Prepared.children`, or `engine_request`s) and stream their updates:
        each child's outputs through its own `OutputProcessor` (the request's string stops, token
        stops and detokenizer options; a parser from ``parser_factory``)."""
        stats = access.current()
        generation = stats.new_generation() if stats is not None else 0
        # Token timestamps count from the request's HTTP admission (from here without one).
        origin = stats.admitted if stats is not None and stats.admitted is not None else time.perf_counter()
        prompt_groups: dict[tuple[int, ...], int] = {}  # children of one prompt count it once
        async with self.engine.open_children(children) as receivers:
            streams = []
            for child, recv in zip(children, receivers, strict=True):
                proc = OutputProcessor(
                    self.tokenizer.incremental_detokenizer(skip_special_tokens=options.skip_special_tokens),
                    stop=options.stop,
                    include_stop_str_in_output=options.include_stop_str_in_output,
                    parser=parser_factory() if parser_factory else None,
                    stop_token_sequences=(*((i,) for i in options.token_stops.ids), *options.token_stops.sequences),
                    origin=origin,
                    min_tokens=options.min_tokens,
                )
                key = (generation, prompt_groups.setdefault(child.prompt_token_ids, len(prompt_groups)))
                streams.append(ChildStream(child.request_id, recv, proc, self.engine, stats, key))
            if len(streams) == 1:
                yield streams
                return
            try:
                async with trio.open_nursery() as nursery:
                    for stream in streams:
                        stream.nursery = nursery
                    try:
                        yield streams
                    finally:
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # The caller's own exception (or one pump's) surfaces as itself, not wrapped.
                leaves = exception_leaves(group)
                if len(leaves) == 1:
                    raise leaves[0] from None
                raise


def _check_constraint_conflicts(req: GenerationRequest) -> None:
    """The combinations the spec refuses with an output constraint (HTTP 400): assistant
    continuation (prefill), custom stops, ignore_eos, min_tokens (a grammar's end allows only EOS)."""
    opts = req.options
    what = f"{opts.constraint.param} (an output constraint)" if opts.constraint is not None else "an output constraint"
    if opts.ignore_eos:
        raise BadRequest(f"ignore_eos cannot be combined with {what}", param="ignore_eos")
    if opts.min_tokens:
        raise BadRequest(f"min_tokens cannot be combined with {what}", param="min_tokens")
    if opts.stop:
        raise BadRequest(f"{req.stop_param} cannot be combined with {what}", param=req.stop_param)
    if opts.token_stops:
        param = "stop_token_ids" if opts.token_stops.ids else "stop_token_sequences"
        raise BadRequest(f"{param} cannot be combined with {what}", param=param)
    conv = req.conversation
    if conv is not None and conv.continue_final_message:
        raise BadRequest(f"assistant continuation (a final assistant message to continue) cannot be combined "
                         f"with {what}", param=req.input_param)


def exception_leaves(group: BaseExceptionGroup) -> list[BaseException]:  # type: ignore[type-arg]
    """The exceptions an exception group holds, nested groups flattened (the HTTP context's too)."""
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(exception_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _has_images(conv: ConversationRequest) -> bool:
    return _count_images(conv) > 0


def _count_images(conv: ConversationRequest) -> int:
    n = 0
    for message in conv.messages:
        for part in message.parts:
            if isinstance(part, ImagePart):
                n += 1
            elif isinstance(part, ToolResultPart):
                n += sum(1 for c in part.content if isinstance(c, ImagePart))
    return n
