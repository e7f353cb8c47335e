"""POST /v1/completions: raw prompts (text, token ids, or batches of either), bypassing templates and parsers."""

from __future__ import annotations

from typing import Any

import attrs

from helios.domain.events import FinishCause
from helios.errors import BadRequest, InternalError
from helios.frontends.common import (
    Accumulated,
    EventWriter,
    TokenObservation,
    TokenStops,
    merged,
    new_id,
    now,
    token_stop_reason,
    validate_stops,
    validate_token_stops,
)
from helios.frontends.fields import (
    NATIVE_GENERATION_ROWS,
    PROVIDER_ROWS,
    TOKEN_OBSERVATION_ROWS,
    FieldTable,
    honoured,
    refused,
    screen_fields,
)
from helios.frontends.openai.chat import StreamOptions, decode_sampling
from helios.frontends.openai.logprobs import (
    check_capacity,
    completion_logprobs,
    empty_completion_logprobs,
    extend_completion_logprobs,
    prompt_completion_logprobs,
    prompt_logprobs_json,
    require_prompt_scoring,
    validate_explicit_ids,
    validate_prompt_logprobs,
)
from helios.frontends.wire import NativeGenerationFields, structure
from helios.serving.pipeline import ChildSpec, Service


@attrs.frozen
class CompletionWire(NativeGenerationFields):
    """The honoured fields of `COMPLETION_FIELDS`; ignored and refused ones never reach it."""

    prompt: Any
    logit_bias: Any = None
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    max_tokens: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    add_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_token_timestamps: bool | None = None


_RAW = "raw completions bypass chat templates and output parsers"

COMPLETION_FIELDS: FieldTable = {
    "prompt": honoured("text, token ids, or a batch of either"),
    "best_of": honoured("accepted only when equal to n; ranked sampling is refused"),
    "echo": honoured("prompt echoed before the completion (scored with logprobs)"),
    "logprobs": honoured("alternatives per token (0..20)"),
    "max_tokens": honoured("output limit (default [server] default_max_tokens, bounded by the context left; "
                           "0 only tokenizes or scores)"),
    "n": honoured("choices per prompt (1..128)"),
    "stream": honoured("SSE chunks"),
    "stream_options": honoured("include_usage and the continuous_usage_stats extension"),
    "temperature": honoured("sampling temperature (clamped to the recipe's range)"),
    "top_p": honoured("nucleus filter (clamped to the recipe's range)"),
    "add_special_tokens": honoured("vLLM extension: tokenizer special-token policy for text prompts"),
    "prompt_logprobs": honoured("vLLM extension: prompt-position logprobs (buffered only)"),
    **NATIVE_GENERATION_ROWS,
    **TOKEN_OBSERVATION_ROWS,
    "model": PROVIDER_ROWS["model"],
    "user": PROVIDER_ROWS["user"],
    "suffix": refused("insertion after the completion is not implemented", message="suffix is not supported"),
    "logit_bias": honoured("token id -> bias in [-100, 100], added before penalties and temperature; "
                           "logprobs stay raw (vLLM)"),
    "tools": refused(_RAW, message="tools are not supported on raw completions"),
    "tool_choice": refused(_RAW, message="tool_choice is not supported on raw completions (tools are not)"),
    "thinking_token_budget": refused(_RAW, message="thinking_token_budget is not supported on raw completions"),
}
"""Every top-level Completions field Helios knows (see `helios.frontends.fields`)."""


@attrs.frozen
class CompletionPlan:
    wire: CompletionWire
    prompts: list[str | list[int]]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stops: tuple[str, ...]
    token_stops: TokenStops
    logprobs: int | None
    logprob_token_ids: tuple[int, ...] | None
    prompt_logprobs: int | None = None
    """Alternatives in choices[i].prompt_logprobs (explicit, or inferred from echo + logprobs)."""
    observe: TokenObservation = TokenObservation()
    """return_token_ids / return_token_timestamps: per choice prompt_token_ids (the choice's own
    prompt, on its first chunk in a stream) and the generated token_ids / token_timestamps. Unlike
    vLLM, echo does not prepend the prompt ids to token_ids nor drop the echoed text: token_ids are
    the generated tokens only, as many as the choice's completion tokens."""

    @property
    def echo_logprobs(self) -> bool:
        """echo with integer logprobs: prompt entries lead the Completions arrays."""
        return bool(self.wire.echo) and self.logprobs is not None

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None

    @property
    def engine_prompt_k(self) -> int | None:
        """Alternatives the engine scores per prompt position: enough for the field and the arrays."""
        if not self.scores_prompt:
            return None
        return max(self.prompt_logprobs or 0, self.logprobs or 0 if self.echo_logprobs else 0)

    @property
    def submits(self) -> bool:
        """max_tokens 0 submits only to score the prompt; otherwise it only tokenizes (and echoes)."""
        return self.wire.max_tokens != 0 or self.scores_prompt


def _prompts(p: Any, vocab: int) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif is_ids(p) and p:
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(is_ids(x) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise BadRequest(
            "prompt must be a string, an array of strings, a nonempty token-id array, or an array of token-id arrays",
            param="prompt",
        )
    for x in prompts:
        if isinstance(x, list):
            if not x:
                raise BadRequest("token-id prompts must not be empty", param="prompt")
            bad = [t for t in x if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    return prompts


def decode_completion(obj: dict[str, Any], svc: Service) -> CompletionPlan:
    w = structure(screen_fields(obj, COMPLETION_FIELDS), CompletionWire)
    n = 1 if w.n is None else w.n
    if not 1 <= n <= 128:
        raise BadRequest("n must be between 1 and 128", param="n")
    if w.best_of is not None and w.best_of != n:
        raise BadRequest("best_of must equal n; ranked sampling is not supported", param="best_of")
    stream = bool(w.stream)
    if w.stream_options is not None and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    prompt_k = validate_prompt_logprobs(w.prompt_logprobs, svc.info, stream=stream)
    if w.logprobs is not None:
        if not 0 <= w.logprobs <= 20:
            raise BadRequest("logprobs must be between 0 and 20", param="logprobs")
        check_capacity(w.logprobs, svc.info, param="logprobs")
        if w.echo:
            require_prompt_scoring(svc.info, param="echo")
            if prompt_k is None:
                prompt_k = w.logprobs
    explicit = validate_explicit_ids(w.logprob_token_ids, svc.info)
    if explicit and w.logprobs is None:
        raise BadRequest("logprob_token_ids requires logprobs", param="logprob_token_ids")
    if w.max_tokens is not None and w.max_tokens < 0:
        raise BadRequest("max_tokens must not be negative", param="max_tokens")
    stops = validate_stops(w.stop)
    token_stops = validate_token_stops(w.stop_token_ids, w.stop_token_sequences, svc.info.vocab_size,
                                       string_stops=stops)
    observe = TokenObservation.decode(w.return_token_ids, w.return_token_timestamps)
    so = w.stream_options
    include_usage = bool(so and so.include_usage)
    return CompletionPlan(w, _prompts(w.prompt, svc.info.vocab_size), n, stream, include_usage,
                          include_usage and bool(so and so.continuous_usage_stats), stops, token_stops, w.logprobs,
                          explicit, prompt_k, observe)


@attrs.frozen
class PreparedPrompt:
    ids: tuple[int, ...]
    echo_text: str


async def prepare_completion(plan: CompletionPlan, svc: Service) -> tuple[list[PreparedPrompt], list[ChildSpec]]:
    w = plan.wire
    add_special = True if w.add_special_tokens is None else w.add_special_tokens
    prepared: list[PreparedPrompt] = []
    for p in plan.prompts:
        if isinstance(p, str):
            ids = await svc.tokenize(p, add_special_tokens=add_special)
            if not ids:
                if not svc.info.has_bos:
                    raise BadRequest("empty text prompts need a model with a BOS token", param="prompt")
                raise BadRequest("the prompt is empty", param="prompt")
            prepared.append(PreparedPrompt(tuple(ids), p))
        else:
            prepared.append(PreparedPrompt(tuple(p), svc.decode(p)))
    specs: list[ChildSpec] = []
    for pp in prepared:
        budget = svc.output_budget(
            len(pp.ids), w.max_tokens, input_param="prompt"
        )
        for i in range(plan.n):
            # Buffered choices of one prompt share its scores: only the first child computes them.
            scores = plan.stream or i == 0
            specs.append(ChildSpec(
                prompt_token_ids=pp.ids,
                sampling=svc.resolve_sampling(decode_sampling(w, svc.info.vocab_size), i),
                max_tokens=budget,
                stop=plan.stops,
                stop_token_ids=plan.token_stops.ids,
                stop_token_sequences=plan.token_stops.sequences,
                ignore_eos=bool(w.ignore_eos),
                include_stop_str_in_output=bool(w.include_stop_str_in_output),
                skip_special_tokens=True if w.skip_special_tokens is None else w.skip_special_tokens,
                num_top_logprobs=plan.logprobs,
                logprob_token_ids=plan.logprob_token_ids,
                prompt_logprobs=plan.engine_prompt_k if scores else None,
            ))
    return prepared, specs


def _finish_reason(acc: Accumulated) -> str:
    if acc.finish is not None and acc.finish.cause is FinishCause.LENGTH:
        return "length"
    return "stop"


def _usage(prepared: list[PreparedPrompt], accs: list[Accumulated], n: int) -> dict[str, Any]:
    prompt = sum(len(p.ids) for p in prepared)
    completion = sum(a.num_output_tokens for a in accs)
    cached = sum(accs[k * n].num_cached_tokens for k in range(len(prepared))) if accs else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def run_completion_buffered(plan: CompletionPlan, prepared: list[PreparedPrompt], specs: list[ChildSpec],
                                  svc: Service) -> dict[str, Any]:
    accs = [Accumulated() for _ in specs]
    if plan.submits:
        async with svc.generate(specs, prefix="cmpl") as streams:
            async for i, u in merged(streams):
                accs[i].add(u)
    w = plan.wire
    as_ids = w.return_tokens_as_token_ids
    choices = []
    for i, acc in enumerate(accs):
        if acc.finish is not None and acc.finish.cause is FinishCause.ERROR:
            raise InternalError(acc.finish.error or "generation failed")
        pp = prepared[i // plan.n]
        echo = pp.echo_text if w.echo else ""
        scores = accs[i - i % plan.n].prompt_logprobs or [] if plan.scores_prompt else []
        lp = None
        if plan.logprobs is not None:
            lp = empty_completion_logprobs()
            if plan.echo_logprobs:
                extend_completion_logprobs(lp, prompt_completion_logprobs(pp.ids, scores, plan.logprobs, svc, as_ids)[0])
            extend_completion_logprobs(lp, completion_logprobs(acc.logprobs, acc.logprob_offsets, svc, as_ids,
                                                               bool(plan.logprob_token_ids), len(echo)))
        choices.append({
            "index": i,
            "text": echo + acc.text,
            "logprobs": lp,
            "finish_reason": "length" if w.max_tokens == 0 else _finish_reason(acc),
            "stop_reason": token_stop_reason(acc.finish, acc.token_ids, plan.token_stops),
            "prompt_logprobs": prompt_logprobs_json(scores, plan.prompt_logprobs or 0, svc)
            if plan.scores_prompt else None,
            **({"prompt_token_ids": list(pp.ids)} if plan.observe.ids else {}),
            **plan.observe.choice_fields(acc.token_ids, acc.token_timestamps),
        })
    return {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": svc.info.public_id,
            "choices": choices, "usage": _usage(prepared, accs, plan.n)}


async def run_completion_stream(plan: CompletionPlan, prepared: list[PreparedPrompt], specs: list[ChildSpec],
                                svc: Service, out: EventWriter) -> None:
    """Streams choices; with echo + logprobs each completed prompt chunk is one logprob frame (the
    first carries the echoed text), before the generated entries.

    With token observations (`CompletionPlan.observe`) each choice's first chunk carries its
    `prompt_token_ids`, every chunk the `token_ids` (and `token_timestamps`) it adds, and, without a
    separate usage chunk (include_usage), the terminal chunk the final usage."""
    cid, created, model = new_id("cmpl"), now(), svc.info.public_id
    w = plan.wire
    as_ids = w.return_tokens_as_token_ids
    observe = plan.observe
    accs = [Accumulated() for _ in specs]
    echo_sent = [False] * len(specs)
    prompt_pos = [0] * len(specs)  # prompt positions already framed
    prompt_off = [0] * len(specs)  # their characters (decoded token strings)
    prompt_ids_pending = [observe.ids] * len(specs)
    num_finished = 0

    def chunk(i: int, text: str, finish: str | None = None, logprobs: Any = None,
              stop_reason: Any = None, tokens: tuple[Any, Any] = ((), ())) -> dict[str, Any]:
        nonlocal num_finished
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                  "stop_reason": stop_reason}
        if prompt_ids_pending[i]:
            prompt_ids_pending[i] = False
            choice["prompt_token_ids"] = list(prepared[i // plan.n].ids)
        choice.update(observe.choice_fields(*tokens))
        c: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [choice]}
        num_finished += finish is not None
        if plan.continuous_usage or (observe.ids and not plan.include_usage and num_finished == len(specs)
                                     and finish is not None):
            c["usage"] = _usage(prepared, accs, plan.n)
        return c

    def echo_text(i: int) -> str:
        return prepared[i // plan.n].echo_text if w.echo else ""

    if w.echo and not plan.echo_logprobs:
        for i in range(len(specs)):
            echo_sent[i] = True
            await out.event(chunk(i, echo_text(i)))
    if not plan.submits:
        for i in range(len(specs)):
            await out.event(chunk(i, "", "length"))
    else:
        async with svc.generate(specs, prefix="cmpl") as streams:
            await out.start()  # 200 and SSE headers after enqueue, keepalives during prefill
            async for i, u in merged(streams):
                accs[i].add(u)
                if u.finish is not None and u.finish.cause is FinishCause.ERROR:
                    await out.event({"error": InternalError(u.finish.error or "generation failed").to_openai()["error"]})
                    return
                if plan.echo_logprobs and u.prompt_logprobs:
                    assert plan.logprobs is not None
                    block, prompt_off[i] = prompt_completion_logprobs(
                        prepared[i // plan.n].ids, u.prompt_logprobs, plan.logprobs, svc, as_ids,
                        start_offset=prompt_off[i], first_position=prompt_pos[i])
                    prompt_pos[i] += len(u.prompt_logprobs)
                    await out.event(chunk(i, "" if echo_sent[i] else echo_text(i), logprobs=block))
                    echo_sent[i] = True
                if not echo_sent[i]:
                    echo_sent[i] = True
                    if echo_text(i):
                        await out.event(chunk(i, echo_text(i)))
                text = "".join(getattr(e, "text", "") for e in u.events)
                lp = None
                if plan.logprobs is not None and u.logprobs:
                    lp = completion_logprobs(list(u.logprobs), u.logprob_offsets, svc, as_ids,
                                             bool(plan.logprob_token_ids), len(echo_text(i)))
                tokens: tuple[Any, Any] = (u.token_ids, u.token_timestamps) if observe.ids else ((), ())
                if text or lp is not None or (tokens[0] and u.finish is None):
                    await out.event(chunk(i, text, logprobs=lp, tokens=tokens))
                    tokens = ((), ())
                if u.finish is not None:  # it takes the ids not sent yet (a terminating token's)
                    reason = "length" if w.max_tokens == 0 else _finish_reason(accs[i])
                    await out.event(chunk(i, "", reason, tokens=tokens,
                                          stop_reason=token_stop_reason(u.finish, accs[i].token_ids, plan.token_stops)))
    if plan.include_usage:
        await out.event({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                         "usage": _usage(prepared, accs, plan.n)})
    await out.done_marker()
