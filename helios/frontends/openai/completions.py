"""POST /v1/completions: raw prompts (text, token ids, or batches of either), bypassing templates and parsers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs

from helios.domain.events import Finish, FinishCause, TextDelta
from helios.domain.generation import (
    ChildUpdate,
    GenerationOptions,
    GenerationRequest,
    PreparedPrompt,
    StreamEvent,
)
from helios.domain.model import ModelInfo, TokenVocabulary
from helios.domain.shapes import OMIT, to_json
from helios.errors import BadRequest
from helios.frontends import fields
from helios.frontends.common import observation_fields
from helios.frontends.fields import PROVIDER_ROWS, honoured, refused, wire_field
from helios.frontends.openai import chat, logprobs
from helios.frontends.openai.shapes import Completion, CompletionChoice, CompletionLogprobs
from helios.frontends.structured import decode_structured_outputs
from helios.frontends.wire import structure

Prompt = str | list[str] | list[int] | list[list[int]]
"""Text, token ids, or a batch of either (an array's first element tells which)."""

_RAW = "raw completions bypass chat templates and output parsers"


@attrs.define(kw_only=True)
class CompletionWire(chat.ChoiceWire):
    """The honoured fields of `COMPLETION_FIELDS`, each with its row; ignored and refused ones never reach it."""

    prompt: Prompt = wire_field(honoured("text, token ids, or a batch of either"), required=True)
    best_of: int | None = wire_field(honoured("accepted only when equal to n; ranked sampling is refused"))
    echo: bool | None = wire_field(honoured("prompt echoed before the completion (scored with logprobs)"))
    logprobs: int | None = wire_field(honoured("alternatives per token (0..20)"))
    max_tokens: int | None = wire_field(honoured(
        "output limit (default [server] default_max_tokens, bounded by the context left; 0 only tokenizes or "
        "scores)"))
    n: int | None = wire_field(honoured("choices per prompt (1..128)"))
    add_special_tokens: bool | None = wire_field(
        honoured("vLLM extension: tokenizer special-token policy for text prompts"))


COMPLETION_FIELDS: fields.FieldTable = fields.field_table(
    CompletionWire,
    model=PROVIDER_ROWS["model"],
    user=PROVIDER_ROWS["user"],
    suffix=refused("insertion after the completion is not implemented", message="suffix is not supported"),
    tools=refused(_RAW, message="tools are not supported on raw completions"),
    tool_choice=refused(_RAW, message="tool_choice is not supported on raw completions (tools are not)"),
    thinking_token_budget=refused(_RAW, message="thinking_token_budget is not supported on raw completions"),
)
"""Every top-level Completions field Helios knows (see `helios.frontends.fields`)."""


@attrs.frozen
class CompletionPlan(chat.StreamPlan):
    """A decoded Completions request: what to generate, and how to encode it."""

    echo: bool
    logprobs: int | None
    """The Completions `logprobs` integer: alternatives in the logprob arrays (None: no arrays)."""
    prompt_logprobs: int | None = None
    """Alternatives in choices[i].prompt_logprobs (explicit, or inferred from echo + logprobs)."""
    max_tokens_zero: bool = False

    @property
    def echo_logprobs(self) -> bool:
        """echo with integer logprobs: prompt entries lead the Completions arrays."""
        return self.echo and self.logprobs is not None


def _prompts(p: Prompt, vocab: int) -> tuple[str | tuple[int, ...], ...]:
    """The request's prompts (one, or a batch); token-id prompts nonempty and within the vocabulary."""
    batch = not isinstance(p, str) and not (p and isinstance(p[0], int))
    prompts = cast("list[str | list[int]]", p) if batch else [cast("str | list[int]", p)]
    if not prompts:
        raise BadRequest("prompt must be a string, an array of strings, a nonempty token-id array, or an "
                         "array of token-id arrays", param="prompt")
    for k, x in enumerate(prompts):
        if isinstance(x, list):
            param = f"prompt[{k}]" if batch else "prompt"
            if not x:
                raise BadRequest("token-id prompts must not be empty", param=param)
            bad = [t for t in x if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param=param)
    return tuple(x if isinstance(x, str) else tuple(x) for x in prompts)


def decode_completion(obj: dict[str, Any], info: ModelInfo) -> CompletionPlan:
    """Token observations: per choice `prompt_token_ids` (the choice's own prompt, on its first
    chunk in a stream) and the generated `token_ids` / `token_timestamps`. Unlike vLLM, echo does not
    prepend the prompt ids to token_ids nor drop the echoed text: token_ids are the generated tokens
    only, as many as the choice's completion tokens."""
    w = structure(fields.screen_fields(obj, COMPLETION_FIELDS), CompletionWire)
    n = 1 if w.n is None else w.n
    if not 1 <= n <= 128:
        raise BadRequest("n must be between 1 and 128", param="n")
    if w.best_of is not None and w.best_of != n:
        raise BadRequest("best_of must equal n; ranked sampling is not supported", param="best_of")
    streaming = chat.decode_stream(w.stream, w.stream_options)
    stream = streaming[0]
    prompt_k = logprobs.validate_prompt_logprobs(w.prompt_logprobs, info, stream=stream)
    if w.logprobs is not None:
        if not 0 <= w.logprobs <= 20:
            raise BadRequest("logprobs must be between 0 and 20", param="logprobs")
        logprobs.check_capacity(w.logprobs, info, param="logprobs")
        if w.echo:
            logprobs.require_prompt_scoring(info, param="echo")
            if prompt_k is None:
                prompt_k = w.logprobs
    explicit = logprobs.validate_explicit_ids(w.logprob_token_ids, info)
    if explicit and w.logprobs is None:
        raise BadRequest("logprob_token_ids requires logprobs", param="logprob_token_ids")
    if w.max_tokens is not None and w.max_tokens < 0:
        raise BadRequest("max_tokens must not be negative", param="max_tokens")
    output = chat.output_options(w, info.vocab_size)
    # Alternatives the engine scores per prompt position: enough for the field and the arrays.
    engine_k = None if prompt_k is None else max(prompt_k, (w.logprobs or 0) if w.echo else 0)
    # Buffered choices of one prompt share its scores; streamed ones frame their own.
    options = GenerationOptions(
        n=n, max_tokens=w.max_tokens, num_top_logprobs=w.logprobs, logprob_token_ids=explicit,
        prompt_logprobs=engine_k, score_every_choice=stream,
        constraint=decode_structured_outputs(w.structured_outputs), **output)
    generation = GenerationRequest(
        sampling=chat.decode_sampling(w, info.vocab_size), options=options,
        prompts=_prompts(w.prompt, info.vocab_size),
        add_special_tokens=True if w.add_special_tokens is None else w.add_special_tokens,
        # max_tokens 0 submits only to score the prompt; otherwise it only tokenizes (and echoes).
        submit=w.max_tokens != 0 or prompt_k is not None, input_param="prompt", id_prefix="cmpl")
    return CompletionPlan(generation, *streaming, bool(w.return_tokens_as_token_ids), bool(w.echo),
                          w.logprobs, prompt_k, w.max_tokens == 0)


def _finish_reason(finish: Finish | None, max_tokens_zero: bool) -> str:
    if max_tokens_zero or (finish is not None and finish.cause is FinishCause.LENGTH):
        return "length"
    return "stop"


class CompletionEncoder(chat.ChoiceEncoder[CompletionPlan]):
    """Completions: screened child updates → `text_completion` chunks, or one body.

    Streams choices; with echo + logprobs each completed prompt chunk is one logprob frame (the first
    carries the echoed text), before the generated entries. With token observations each choice's
    first chunk carries its `prompt_token_ids`, every chunk the `token_ids` (and `token_timestamps`) it
    adds, and, without a separate usage chunk (include_usage), the terminal chunk the final usage.
    Choice i answers prompt i // n. A request that submits nothing (max_tokens 0 without prompt
    scoring) ends every choice with `length` after its echo."""

    chunk_shape = Completion
    usage_details = False

    def __init__(self, plan: CompletionPlan, prompts: Sequence[PreparedPrompt], *, model: str,
                 vocab: TokenVocabulary, sampling: object = None) -> None:
        super().__init__(plan, prompts, model=model, vocab=vocab)
        self.n = plan.options.n
        num = len(self.accs)
        self._echo_sent = [False] * num
        self._prompt_pos = [0] * num  # prompt positions already framed
        self._prompt_off = [0] * num  # their characters (decoded token strings)
        self._prompt_ids_pending = [plan.options.observe.ids] * num

    def start(self) -> list[StreamEvent]:
        if not self.plan.echo or self.plan.echo_logprobs:
            return []  # no echo, or each choice's echo rides on its first prompt logprob frame
        self._echo_sent = [True] * len(self.accs)
        return [self._chunk(i, self._echo_text(i)) for i in range(len(self.accs))]

    def feed(self, i: int, u: ChildUpdate) -> list[StreamEvent]:
        plan = self.plan
        self.accs[i].add(u)
        out: list[StreamEvent] = []
        echo = "" if self._echo_sent[i] else self._echo_text(i)
        self._echo_sent[i] = True
        if plan.echo_logprobs and u.prompt_logprobs:
            assert plan.logprobs is not None
            block, self._prompt_off[i] = logprobs.prompt_logprob_arrays(
                self._prompt(i).token_ids, u.prompt_logprobs, plan.logprobs, self.vocab, plan.as_token_ids,
                start_offset=self._prompt_off[i], first_position=self._prompt_pos[i])
            self._prompt_pos[i] += len(u.prompt_logprobs)
            out.append(self._chunk(i, echo, logprobs=block))
        elif echo:
            out.append(self._chunk(i, echo))
        text = "".join(e.text for e in u.events if isinstance(e, TextDelta))
        lp = (logprobs.completion_logprob_arrays(u.logprobs, u.logprob_offsets, self.vocab,
                                                 plan.as_token_ids, bool(plan.options.logprob_token_ids),
                                                 len(self._echo_text(i)))
              if plan.logprobs is not None and u.logprobs else None)
        tokens = self._tokens(u)
        if text or lp is not None or (tokens[0] and u.finish is None):
            out.append(self._chunk(i, text, logprobs=lp, tokens=tokens))
            tokens = chat.NO_TOKENS
        if u.finish is not None:  # it takes the ids not sent yet (a terminating token's)
            self._num_finished += 1
            out.append(self._chunk(i, "", _finish_reason(u.finish, plan.max_tokens_zero), tokens=tokens))
        return out

    def finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if not self.plan.generation.submit:
            for i in range(len(self.accs)):
                self._num_finished += 1
                out.append(self._chunk(i, "", "length"))
        return out + super().finish()

    def body(self) -> dict[str, Any]:
        plan = self.plan
        as_ids = plan.as_token_ids
        scored = plan.prompt_logprobs is not None
        choices = []
        for i, acc in enumerate(self.accs):
            pp = self._prompt(i)
            echo = self._echo_text(i)
            scores = self.accs[i - i % self.n].prompt_logprobs or [] if scored else []
            lp = None
            if plan.logprobs is not None:  # with echo, the echoed prompt's entries lead the arrays
                head = (logprobs.prompt_logprob_arrays(pp.token_ids, scores, plan.logprobs, self.vocab,
                                                       as_ids)[0] if plan.echo_logprobs else None)
                lp = logprobs.completion_logprob_arrays(acc.logprobs, acc.logprob_offsets, self.vocab, as_ids,
                                                        bool(plan.options.logprob_token_ids), len(echo),
                                                        into=head)
            choices.append(CompletionChoice(
                index=i, text=echo + acc.text, logprobs=lp,
                finish_reason=_finish_reason(acc.finish, plan.max_tokens_zero),
                stop_reason=self._stop_reason(i),
                prompt_logprobs=logprobs.prompt_scores(scores, plan.prompt_logprobs or 0, self.vocab)
                if scored else None,
                prompt_token_ids=pp.token_ids if plan.options.observe.ids else OMIT,
                **observation_fields(plan.options.observe, acc.token_ids, acc.token_timestamps)))
        return to_json(Completion(id=self.id, created=self.created, model=self.model,  # type: ignore[no-any-return]
                                  choices=choices, usage=self._usage()))

    # -- helpers --------------------------------------------------------------------------------
    def _prompt(self, i: int) -> PreparedPrompt:
        return self.prompts[i // self.n]

    def _echo_text(self, i: int) -> str:
        return self._prompt(i).text if self.plan.echo else ""

    def _chunk(self, i: int, text: str, finish: str | None = None, logprobs: CompletionLogprobs | None = None,
               tokens: chat.Tokens = chat.NO_TOKENS) -> StreamEvent:
        observe = self.plan.options.observe
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish,
                                  stop_reason=self._stop_reason(i) if finish is not None else None,
                                  token_ids=tokens[0] if observe.ids else OMIT,
                                  token_timestamps=tokens[1] if observe.timestamps else OMIT)
        if self._prompt_ids_pending[i]:
            self._prompt_ids_pending[i] = False
            choice.prompt_token_ids = self._prompt(i).token_ids
        return self._event(Completion(id=self.id, created=self.created, model=self.model, choices=[choice]),
                           finish)
