"""Builds the Service from a loaded runtime: template lowering, recipe sampling, family parsers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helios.domain.conversation import ConversationRequest
from helios.domain.sampling import SamplingParams, SamplingRequest
from helios.errors import BadRequest
from helios.loaders.chat_template import ChatTemplate, ChatTemplateError
from helios.serving.lowering import LoweringError, lower_conversation
from helios.serving.output import OutputParser
from helios.serving.pipeline import Service


def make_service(rt: Any) -> Service:
    from helios.parsers import family_delimiters, make_output_parser, prompt_starts_in_reasoning
    from helios.recipes import resolve_sampling

    tok = rt.tokenizer
    template = ChatTemplate(rt.template) if rt.template else None
    recipe = rt.recipe

    def lower(conv: ConversationRequest) -> str:
        if template is None:
            raise BadRequest("this model has no chat template; use /v1/completions")
        try:
            return lower_conversation(conv, template, bos_token=tok.bos_token or "",
                                      eos_token=tok.eos_token or "").text
        except (LoweringError, ChatTemplateError) as exc:
            raise BadRequest(f"chat template error: {exc}") from None

    def sampling(req: SamplingRequest) -> SamplingParams:
        return resolve_sampling(recipe, req)

    family = recipe.output_parser
    delimiter_ids: dict[str, int] = {}
    for text in family_delimiters(family):
        tid = tok.token_to_id(text)
        if tid is not None:
            delimiter_ids[text] = tid

    def parsers(conv: ConversationRequest, prompt: str) -> Callable[[], OutputParser] | None:
        if family == "plain":
            return None
        schemas = {t.name: t.parameters for t in conv.tools}
        starts = prompt_starts_in_reasoning(family, prompt)
        parse_tools = conv.tool_choice.mode != "none"
        return lambda: make_output_parser(family, tools=schemas, delimiter_token_ids=delimiter_ids,
                                          starts_in_reasoning=starts, parse_tools=parse_tools)

    return Service(
        info=rt.info,
        tokenizer=tok,
        chat_template=template,
        engine=rt.client,
        resolve_sampling=sampling,
        lower=lower,
        eos_token_ids=rt.eos_token_ids,
        workers=rt.cfg.server.frontend_workers,
        parser_factory=parsers,
    )
