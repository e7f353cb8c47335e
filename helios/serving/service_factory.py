"""Builds the Service from a loaded runtime: template lowering, recipe sampling, family parsers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import attrs
import trio

from helios.domain.conversation import ConversationRequest, Message, TextPart
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams, SamplingRequest
from helios.engine.records import ReasoningBudget
from helios.errors import BadRequest
from helios.loaders.chat_template import ChatTemplate, ChatTemplateError
from helios.loaders.tokenizer import Tokenizer
from helios.parsers import OutputParser
from helios.serving.engine_client import EngineClient
from helios.serving.lowering import LoweredPrompt, LoweringError, lower_conversation
from helios.serving.pipeline import ImagePrompting, Service
from helios.serving.reasoning_budget import ReasoningBudgets
from helios.serving.structured import family_envelope

if TYPE_CHECKING:
    from helios.engine.structured import Envelope
    from helios.models.vision.base import VisionTower
    from helios.recipes.base import Recipe
    from helios.serving.images import ImageAdmission

# Parser families whose tool syntax is Hermes JSON `<tool_call>` blocks, the syntax of the tool
# prompt Helios writes itself (lowering rule 8); `plain` has no tool syntax and gains that one.
TEXT_TOOL_FAMILIES = {"plain": "hermes", "hermes": "hermes", "think_hermes": "think_hermes", "qwen3": "qwen3"}


class ServedModel(Protocol):
    """What the Service is built from (`helios.runtime.Runtime`, the composition root's): the loaded
    model's tokenizer, chat template source, recipe and description, the engine client, and a
    vision-language model's tower and image admission (None for a text model)."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def template(self) -> str | None: ...
    @property
    def recipe(self) -> Recipe: ...
    @property
    def info(self) -> ModelInfo: ...
    @property
    def client(self) -> EngineClient: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...
    @property
    def vision(self) -> VisionTower | None: ...
    @property
    def admission(self) -> ImageAdmission | None: ...


@attrs.frozen
class ToolSupport:
    """How this model takes tools: its template presents them (`native`), Helios writes the tool
    prompt itself (`text`, lowering rule 8), or not at all (`None`: requests with tools get 400)."""

    mode: Literal["native", "text"] | None
    parser_family: str
    reason: str = ""


def tool_support(template: ChatTemplate | None, family: str) -> ToolSupport:
    from helios.parsers import get_family

    has_syntax = get_family(family).tools is not None
    if template is None:
        return ToolSupport(None, family, "it has no chat template")
    if template.supports_tools():
        if has_syntax:
            return ToolSupport("native", family)
        return ToolSupport(
            None, family,
            "its chat template presents tools, but its tool-call syntax is not one Helios can parse "
            "(name a recipe with [model] recipe)",
        )
    if family in TEXT_TOOL_FAMILIES:
        return ToolSupport("text", TEXT_TOOL_FAMILIES[family])
    return ToolSupport(
        None, family, f"its chat template cannot present tools and its {family} tool syntax has no written prompt"
    )


def make_service(rt: ServedModel, limiter: trio.CapacityLimiter | None = None) -> Service:
    from helios.parsers import family_delimiters, get_family, make_output_parser, prompt_starts_in_reasoning
    from helios.recipes import resolve_sampling

    tok = rt.tokenizer
    template = ChatTemplate(rt.template) if rt.template else None
    recipe = rt.recipe
    tools = tool_support(template, recipe.output_parser)
    info = attrs.evolve(rt.info, has_tools=tools.mode is not None)

    def lower(conv: ConversationRequest) -> LoweredPrompt:
        if template is None:
            raise BadRequest("this model has no chat template; use /v1/completions")
        if conv.tools and conv.tool_choice.mode != "none" and tools.mode is None:
            raise BadRequest(f"model {info.public_id} does not support tools: {tools.reason}", param="tools")
        try:
            return lower_conversation(conv, template, bos_token=tok.bos_token or "",
                                      eos_token=tok.eos_token or "", text_tools=tools.mode == "text")
        except (LoweringError, ChatTemplateError) as exc:
            raise BadRequest(f"chat template error: {exc}") from None

    def sampling(req: SamplingRequest) -> SamplingParams:
        return resolve_sampling(recipe, req)

    def delimiters(family: str) -> dict[str, int]:
        ids = {text: tok.token_to_id(text) for text in family_delimiters(family)}
        return {text: tid for text, tid in ids.items() if tid is not None}

    delimiter_ids = {f: delimiters(f) for f in {recipe.output_parser, tools.parser_family}}

    def parsers(conv: ConversationRequest, prompt: str, structured: bool = False) -> Callable[[], OutputParser] | None:
        # Text tools parse calls only when the request presented tools: a model never told of
        # any writes `<tool_call>` as text.
        family = tools.parser_family if conv.tools else recipe.output_parser
        if family == "plain":
            return None
        schemas = {t.name: t.parameters for t in conv.tools}
        starts = prompt_starts_in_reasoning(family, prompt)
        parse_tools = conv.tool_choice.mode != "none"
        return lambda: make_output_parser(family, tools=schemas, delimiter_token_ids=delimiter_ids[family],
                                          starts_in_reasoning=starts, parse_tools=parse_tools,
                                          structured_output=structured)

    budgets = ReasoningBudgets(tok.token_to_id)

    def reasoning_budget(conv: ConversationRequest, prompt: str, budget: int,
                         param: str | None) -> ReasoningBudget | None:
        family = tools.parser_family if conv.tools else recipe.output_parser
        return budgets.for_request(family, prompt, budget, param)

    if info.thinking_token_budget is not None:
        # Start-up refuses a default the model cannot honour (spec: [server] thinking_token_budget),
        # judged on the prompt a plain conversation renders to.
        if template is None:
            raise ValueError("[server] thinking_token_budget: this model has no chat template")
        plain = ConversationRequest(messages=(Message("user", (TextPart("Hello"),)),))
        budgets.check_default(recipe.output_parser, lower(plain).text)

    def single_token(text: str) -> int | None:
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def envelope(conv: ConversationRequest, prompt: str) -> Envelope:
        """The free reasoning and tool envelopes around a constrained answer (engine/structured.py)."""
        family = tools.parser_family if conv.tools else recipe.output_parser
        spec = get_family(family)
        reasoning = spec.reasoning
        gated = (reasoning.open, reasoning.close) if reasoning is not None and reasoning.gated else None
        return family_envelope(family, gated, single_token,
                               starts_in_reasoning=prompt_starts_in_reasoning(family, prompt),
                               tool_call_ends_reasoning=spec.tool_call_ends_reasoning,
                               tools_enabled=bool(conv.tools) and conv.tool_choice.mode != "none")

    # A vision-language model: its tower (prepare, the placeholder token) and the image admission.
    tower = rt.vision
    admission = rt.admission
    vision = None
    if tower is not None and admission is not None:
        vision = ImagePrompting(admission, tower.profile.image_token, tower.image_token_id, tower.prepare)

    return Service(
        info=info,
        tokenizer=tok,
        chat_template=template,
        engine=rt.client,
        resolve_sampling=sampling,
        lower=lower,
        eos_token_ids=rt.eos_token_ids,
        limiter=limiter,
        parser_factory=parsers,
        reasoning_budget=reasoning_budget,
        envelope_factory=envelope,
        vision=vision,
    )
