"""Structured output on the serving side: grammars compiled before admission, the JSON prompt
instruction, the envelope of a model family, and custom-tool input validation.

Compilation (spec: "Grammar compilation uses the same bounded llguidance compiler as structured
output"): every answer constraint and every custom tool grammar is compiled by `GrammarCompiler`
in one bounded pool (`max_workers` threads, a trio CapacityLimiter) under a time limit, before the
request is admitted. An invalid schema, regex or grammar is a 400 naming the request field and
quoting llguidance's message; nothing reaches the engine. Compiled grammars are cached (LRU) under
their canonical form: the constraint kind plus the JSON of its spec with sorted keys, so two
requests with the same schema written in another key order share one compilation. Each request's
engine state runs a deep copy of the cached matcher (llguidance shares the compiled grammar).

Where the spec is silent this follows vLLM: ``json_object`` is any JSON object; a ``choice`` answer
is exactly one of the strings; a ``grammar`` is Lark in llguidance's dialect (GBNF, recognised by its
``::=`` rules, is converted first, as llguidance's own converter does); non-strict JSON schemas
compile leniently (unknown keywords ignored) and strict ones (OpenAI's ``strict: true``) must be in
OpenAI's strict subset.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import llguidance
import trio

from helios.domain.conversation import ConversationRequest, Message, TextPart, Tool, ToolGrammar
from helios.domain.generation import OutputConstraint
from helios.errors import BadRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    # The engine's grammar records live beside its torch bitmask code: imported where they are
    # built, so importing the serving path (and the ASGI app) imports no torch.
    from helios.engine.structured import Envelope, GrammarConstraint, GrammarVocab

COMPILE_TIME_LIMIT_S = 10.0
CACHE_SIZE = 256
# Single-token tool envelopes by parser family (open, close): the engine's gate lets calls through
# while the answer is constrained. Families not listed (or whose tags the tokenizer splits) have
# no free tool envelope under a constraint.
TOOL_TAGS: dict[str, tuple[str, str]] = {
    "qwen3": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "function_tags": ("<tool_call>", "</tool_call>"),
    "mimo": ("<tool_call>", "</tool_call>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "think_hermes": ("<tool_call>", "</tool_call>"),
    "qwen2_5": ("<tool_call>", "</tool_call>"),
    "glm": ("<tool_call>", "</tool_call>"),
    "nemotron_v2": ("<TOOLCALL>", "</TOOLCALL>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "gemma4": ("<|tool_call>", "<tool_call|>"),
}
# Parser limits for every compiled grammar: llguidance's defaults, with terse errors (the default
# verbose errors quote parser state, which a client does not need).
_LIMITS = dict(verbose_errors=False)
# JSON answers: whitespace between tokens is at most one newline and 16 spaces or tabs (pretty-
# printed JSON fits; unbounded runs let a small model spend its whole output limit on blank lines:
# a property test hit its limit with 20 characters of any whitespace per gap).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"\n?[ \t]{0,16}"}


class GrammarCompiler:
    """The one bounded llguidance compiler of a model (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, max_workers: int = 2, time_limit_s: float = COMPILE_TIME_LIMIT_S,
                 cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._vocab: GrammarVocab | None = None
        self._vocab_lock = threading.Lock()
        self.limiter = trio.CapacityLimiter(max_workers)
        self.time_limit_s = time_limit_s
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self.num_compiled = 0
        self.num_cache_hits = 0

    @property
    def vocab(self) -> GrammarVocab:
        """The tokenizer as llguidance sees it (built on first use, in a worker thread)."""
        with self._vocab_lock:
            if self._vocab is None:
                from helios.engine.structured import GrammarVocab

                self._vocab = GrammarVocab(self._tokenizer)
            return self._vocab

    async def compile(self, grammar: str, key: str, param: str, where: str | None = None, *,
                      json_slices: bool = False) -> Any:
        """The compiled matcher template of an llguidance grammar; BadRequest naming `param` (and
        `where`, the message's subject, default `param`) when it does not compile or compilation
        exceeds the time limit."""
        where = where or param
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return cached

        def work() -> tuple[Any, bool]:
            vocab = self.vocab
            tokenizer = vocab.json_tokenizer if json_slices else vocab.ll_tokenizer
            m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**_LIMITS))
            return m, bool(vocab.missing_bytes) and not m.is_error() and _forces_unproducible(m)

        with trio.move_on_after(self.time_limit_s) as scope:
            try:
                matcher, unproducible = await trio.to_thread.run_sync(work, limiter=self.limiter,
                                                                      abandon_on_cancel=True)
            except _MALFORMED as exc:  # text llguidance cannot take (a lone surrogate): the client's
                raise BadRequest(f"{where}: invalid grammar: {type(exc).__name__}: {exc}", param=param) from None
        if scope.cancelled_caught:
            raise BadRequest(f"{where}: the grammar did not compile within {self.time_limit_s:g} s", param=param)
        if matcher.is_error():
            raise BadRequest(f"{where}: invalid grammar: {_first_line(matcher.get_error())}", param=param)
        if unproducible:
            from helios.engine.structured import UNPRODUCIBLE_MESSAGE

            raise BadRequest(f"{where}: {UNPRODUCIBLE_MESSAGE}", param=param)
        self.num_compiled += 1
        self._cache[key] = matcher
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return matcher

    async def constraint(self, c: OutputConstraint, envelope: Envelope | None = None) -> GrammarConstraint:
        """The compiled answer constraint of ``c`` (``envelope``: its free reasoning and tool
        envelopes, none by default)."""
        from helios.engine.structured import Envelope, GrammarConstraint

        try:
            grammar = answer_grammar(c)
            key = canonical_key(c)
        except _MALFORMED as exc:  # e.g. JSON text nested past the recursion limit, lone surrogates
            raise BadRequest(f"{c.param}: invalid {c.kind}: {type(exc).__name__}: {exc}", param=c.param) from None
        matcher = await self.compile(grammar, key, c.param, json_slices=c.is_json)
        return GrammarConstraint(matcher, self.vocab, envelope if envelope is not None else Envelope(), description=f"{c.param} ({c.kind})", grammar=grammar,
                                 json_slices=c.is_json)

    async def tool_validator(self, tool: Tool, param: str = "tools") -> Callable[[str], str | None]:
        """A validator of a custom tool's completed input: None when the input matches the tool's
        grammar exactly, else why not."""
        assert tool.grammar is not None
        where = f"{param}: custom tool '{tool.name}' format"
        try:
            grammar = tool_grammar(tool.grammar, param)
        except _MALFORMED as exc:
            raise BadRequest(f"{where}: invalid grammar: {type(exc).__name__}: {exc}", param=param) from None
        matcher = await self.compile(grammar, f"tool:{tool.grammar.syntax}:{tool.grammar.definition}", param, where)
        vocab = self.vocab
        syntax = tool.grammar.syntax

        def validate(text: str) -> str | None:
            m = matcher.deep_copy()
            tokens = vocab.ll_tokenizer.tokenize_bytes(text.encode("utf-8"))
            accepted = m.validate_tokens(tokens)
            if accepted == len(tokens) and m.consume_tokens(tokens) and m.is_accepting():
                return None
            return (f"the model's input for custom tool '{tool.name}' does not match its {syntax} grammar"
                    + ("" if accepted == len(tokens) else f" (it fails at byte {_byte_offset(vocab, tokens, accepted)})"))

        return validate


def _forces_unproducible(matcher: Any) -> bool:
    """Whether the grammar's forced start needs bytes the vocabulary lacks (`GrammarVocab.missing_bytes`:
    tokenizing them raises, which fails the matcher). Probed on a copy; a grammar that reaches such
    text only after a choice fails there instead (the request then ends with a grammar failure)."""
    probe = matcher.deep_copy()
    probe.compute_ff_tokens()
    return bool(probe.is_error())


def answer_grammar(c: OutputConstraint) -> str:
    """The llguidance grammar of an answer constraint; BadRequest for a malformed spec."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if c.kind == "json_schema":
        schema = c.spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise BadRequest(f"{c.param}: the JSON schema is not valid JSON: {exc}", param=c.param) from None
        if not isinstance(schema, dict):
            raise BadRequest(f"{c.param}: the JSON schema must be an object", param=c.param)
        if c.strict:
            problem = strict_schema_problem(schema)
            if problem is not None:
                raise BadRequest(f"{c.param}: invalid schema for strict mode: {problem}", param=c.param)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={**_JSON_OPTIONS, "lenient": not c.strict})  # type: ignore[typeddict-item]
        except ValueError as exc:
            raise BadRequest(f"{c.param}: invalid JSON schema: {exc}", param=c.param) from None
    if c.kind == "regex":
        if not isinstance(c.spec, str):
            raise BadRequest(f"{c.param}: the regex must be a string", param=c.param)
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "grammar":
        if not isinstance(c.spec, str) or not c.spec.strip():
            raise BadRequest(f"{c.param}: the grammar must be a nonempty string", param=c.param)
        return _lark(c.spec, c.param)
    if c.kind == "choice":
        if not isinstance(c.spec, list | tuple) or not c.spec or not all(isinstance(x, str) for x in c.spec):
            raise BadRequest(f"{c.param}: choice must be a nonempty array of strings", param=c.param)
        alternatives = " | ".join(json.dumps(x) for x in dict.fromkeys(c.spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    raise BadRequest(f"{c.param}: unknown constraint kind '{c.kind}'", param=c.param)


def tool_grammar(g: ToolGrammar, param: str) -> str:
    if g.syntax == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.definition)
    return _lark(g.definition, param)


def canonical_key(c: OutputConstraint) -> str:
    """The cache key: kind, strictness and the spec's JSON with sorted keys."""
    spec = c.spec
    if c.kind == "json_schema" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            pass
    return f"{c.kind}:{int(c.strict)}:" + json.dumps(spec, sort_keys=True, separators=(",", ":"))


def strict_schema_problem(schema: Any, path: str = "#") -> str | None:
    """Why a schema is outside OpenAI's strict subset (None when it is inside): every object lists
    ``additionalProperties: false`` and requires all of its properties."""
    if isinstance(schema, dict):
        types = schema.get("type")
        is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema
        if is_object:
            if schema.get("additionalProperties", True) is not False:
                return f"{path}: 'additionalProperties' is required to be supplied and to be false"
            props = schema.get("properties") or {}
            missing = [k for k in props if k not in (schema.get("required") or [])]
            if missing:
                return f"{path}: 'required' is required to include every property; missing '{missing[0]}'"
        for key in ("properties", "$defs", "definitions", "patternProperties"):
            sub = schema.get(key)
            if isinstance(sub, dict):
                for name, value in sub.items():
                    problem = strict_schema_problem(value, f"{path}/{key}/{name}")
                    if problem:
                        return problem
        for key in ("items", "not", "additionalItems", "contains"):
            if isinstance(schema.get(key), dict):
                problem = strict_schema_problem(schema[key], f"{path}/{key}")
                if problem:
                    return problem
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = schema.get(key)
            if isinstance(sub, list):
                for i, value in enumerate(sub):
                    problem = strict_schema_problem(value, f"{path}/{key}/{i}")
                    if problem:
                        return problem
    return None


def json_instruction(c: OutputConstraint) -> str:
    """The JSON-only instruction for the system prompt (spec: "the schema and a JSON-only
    formatting instruction are included in the system prompt")."""
    if c.kind == "json_object":
        return "Respond only with a single JSON object, with no other text."
    schema = c.spec if isinstance(c.spec, str) else json.dumps(c.spec, ensure_ascii=False)
    named = f" named {c.name}" if c.name else ""
    return ("Respond only with a single JSON value, with no other text, that matches this JSON schema"
            f"{named}:\n{schema}")


def with_json_instruction(conv: ConversationRequest, c: OutputConstraint) -> ConversationRequest:
    """The conversation with the JSON instruction added to its leading system message (a new one
    when it has none)."""
    text = json_instruction(c)
    messages = list(conv.messages)
    if messages and messages[0].role == "system":
        first = messages[0]
        messages[0] = attrs.evolve(first, parts=(*first.parts, TextPart(text)))
    else:
        messages.insert(0, Message("system", (TextPart(text),)))
    return attrs.evolve(conv, messages=tuple(messages))


def family_envelope(family: str | None, reasoning: tuple[tuple[str, ...], tuple[str, ...]] | None,
                    token_id: Callable[[str], int | None], *, starts_in_reasoning: bool,
                    tool_call_ends_reasoning: bool, tools_enabled: bool) -> Envelope:
    """The engine's gate for a family: its reasoning and tool delimiters as single token ids."""
    from helios.engine.structured import Envelope

    r_open = r_close = None
    if reasoning is not None:
        opens, closes = reasoning
        r_open = token_id(opens[0]) if opens else None
        r_close = token_id(closes[0]) if closes else None
    t_open = t_close = None
    tags = TOOL_TAGS.get(family or "")
    if tools_enabled and tags is not None:
        t_open, t_close = token_id(tags[0]), token_id(tags[1])
        if t_open is None or t_close is None:
            t_open = t_close = None
    if r_close is None:
        r_open = None
        starts_in_reasoning = False
    return Envelope(reasoning_open=r_open, reasoning_close=r_close, tool_open=t_open, tool_close=t_close,
                    starts_in_reasoning=starts_in_reasoning, tool_call_ends_reasoning=tool_call_ends_reasoning)


ToolValidators = Mapping[str, Callable[[str], str | None]]

# What malformed client text can raise on its way into llguidance (besides its own error state).
_MALFORMED = (ValueError, TypeError, UnicodeError, RecursionError, OverflowError)


# -- private helpers ------------------------------------------------------------------------------


def _lark(text: str, param: str) -> str:
    if "::=" in text:  # GBNF (llama.cpp, vLLM's xgrammar grammars): llguidance's converter
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions on malformed input
            raise BadRequest(f"{param}: invalid GBNF grammar: {exc}", param=param) from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def _first_line(message: str) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return "; ".join(lines[:3]) if lines else "invalid grammar"


def _byte_offset(vocab: GrammarVocab, tokens: list[int], accepted: int) -> int:
    return len(vocab.ll_tokenizer.decode_bytes(tokens[:accepted]))
