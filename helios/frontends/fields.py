"""Per-protocol tables of top-level request fields: honoured, ignored or refused.

Every protocol frontend declares one `FieldTable`, a mapping from each top-level request field it
knows to a `FieldPolicy` row of one of three kinds. Honoured rows live in the wire class itself, in
each field's metadata (`wire_field`), and `field_table` joins them with the protocol's ignored and
refused rows; nested wire classes declare their ignored and refused keys the same way, and the
converter screens them (`helios.frontends.wire`).

- **honoured**: Helios implements it. The field stays in the body, the protocol's wire class
  structures it (strict types) and the decoder applies it. The wire class declares exactly the
  honoured rows, each with its row.
- **ignored**: accepted and dropped before structuring, because it means nothing on a local server
  (billing, storage, provider-side caching and routing, client hints). The row's reason says why
  dropping is safe. A row may accept only some values (``store: false`` but not ``store: true``):
  other values are refused with the row's message.
- **refused**: the API defines it, Helios does not implement it, and ignoring it would silently
  change the result. Any value other than an inert one (null, or the row's explicit off values such
  as ``background: false``) is an HTTP 400 naming the field, with ``param`` set to the field.

A field in no table stays an unknown key: the wire class forbids it and the client gets
"unrecognized request argument(s): X". tests/unit/test_request_fields.py checks every table
against the installed SDKs' request TypedDicts, so a new SDK field fails until it is classified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import NoneType
from typing import Any, Literal

import attrs

from helios.errors import BadRequest

Kind = Literal["honoured", "ignored", "refused"]

JSON_KINDS: dict[type, tuple[str, str]] = {
    NoneType: ("null", "null"), bool: ("boolean", "a boolean"), int: ("integer", "an integer"),
    float: ("number", "a number"), str: ("string", "a string"), list: ("array", "an array"),
    dict: ("object", "an object"),
}
"""Each JSON kind by the Python type json.loads makes of it (bool first: it is an int too): its name,
and its name in a sentence."""


@attrs.frozen
class FieldPolicy:
    """One row of a protocol's field table."""

    kind: Kind
    reason: str
    """One line: what Helios does with it (honoured), why dropping it is safe (ignored), or what it
    would need that Helios lacks (refused)."""
    types: tuple[type, ...] = ()
    """Ignored rows: the JSON types a non-null value must have (empty: any)."""
    allows: Callable[[Any], bool] | None = None
    """Ignored rows: the non-null values that are dropped (others are refused with `message`).
    Refused rows: the non-null values that are inert and dropped as if absent."""
    message: str | None = None
    """The 400 message for a refused value; ``{value!r}`` is filled in. Default: names the field and
    says it is not supported, followed by the reason."""
    check: Callable[[Any], None] | None = None
    """Ignored rows: a validator that raises its own BadRequest (nested shapes with precise params)."""
    refuse_null: bool = False
    """Refused rows: an explicit null is refused too (the field's presence is the error)."""
    details: Mapping[str, Any] | None = None
    """Refused rows: the 400's Anthropic ``error.details`` (a typed ``error_code`` a client's
    fallback keys on)."""

    def screen(self, name: str, value: Any) -> bool:
        """Whether the field stays in the body for the wire class; BadRequest for a refused value."""
        if self.kind == "honoured":
            return True
        if self.kind == "refused":
            if (value is None and not self.refuse_null) or (self.allows is not None and self.allows(value)):
                return False
            raise self._refusal(name, value)
        if value is None:
            return False
        kind = next((t for t in JSON_KINDS if isinstance(value, t)), type(value))  # a str subclass is a str
        if self.types and kind not in self.types and not (kind is int and float in self.types):  # 1 is a number
            expected = " or ".join(JSON_KINDS[t][1] for t in self.types)
            raise BadRequest(f"invalid value for {name}: expected {expected}, got {kind.__name__}", param=name)
        if self.check is not None:
            self.check(value)
        if self.allows is not None and not self.allows(value):
            raise self._refusal(name, value)
        return False

    def _refusal(self, name: str, value: Any) -> BadRequest:
        message = self.message.format(value=value) if self.message is not None else f"{name} is not supported: {self.reason}"
        return BadRequest(message, param=name, details=None if self.details is None else dict(self.details))


FieldTable = Mapping[str, FieldPolicy]


def honoured(reason: str) -> FieldPolicy:
    return FieldPolicy("honoured", reason)


def ignored(reason: str, *types: type, allows: Callable[[Any], bool] | None = None, message: str | None = None,
            check: Callable[[Any], None] | None = None) -> FieldPolicy:
    return FieldPolicy("ignored", reason, types=types, allows=allows, message=message, check=check)


def refused(reason: str, *, inert: Callable[[Any], bool] | None = None, message: str | None = None,
            refuse_null: bool = False, details: Mapping[str, Any] | None = None) -> FieldPolicy:
    return FieldPolicy("refused", reason, allows=inert, message=message, refuse_null=refuse_null, details=details)


def one_of(*values: Any) -> Callable[[Any], bool]:
    """A predicate for exact JSON values (``False`` does not match ``0``)."""
    return lambda v: any(type(v) is type(x) and v == x for x in values)


def screen_fields(obj: dict[str, Any], table: FieldTable) -> dict[str, Any]:
    """The body the wire class structures: honoured and unknown fields kept, ignored fields and inert
    refused values dropped; BadRequest for a refused value or a malformed ignored one."""
    return {name: value for name, value in obj.items() if name not in table or table[name].screen(name, value)}


def rows(table: FieldTable, kind: Kind) -> tuple[str, ...]:
    return tuple(name for name, row in table.items() if row.kind == kind)


POLICY = "helios.policy"
"""The attrs metadata key of a wire field's `FieldPolicy`."""


def wire_field(policy: FieldPolicy, default: Any = None, *, required: bool = False) -> Any:
    """An attrs field carrying its policy row (`honoured`, `ignored` or `refused`)."""
    return attrs.field(default=attrs.NOTHING if required else default, metadata={POLICY: policy})


def policy_rows(cls: type) -> dict[str, FieldPolicy]:
    """The policy rows a wire class declares in its fields' metadata, in field order."""
    return {f.name: f.metadata[POLICY] for f in attrs.fields(cls) if POLICY in f.metadata}


def field_table(wire: type, *others: Mapping[str, FieldPolicy], **rows: FieldPolicy) -> FieldTable:
    """A protocol's table: the rows its wire class declares (the honoured ones), then shared row
    tables and the ignored and refused fields that never reach it."""
    return {name: row for more in (policy_rows(wire), *others, rows) for name, row in more.items()}  # later rows win


# -- fields several OpenAI-style protocols share ------------------------------------------------------


@attrs.define(kw_only=True)
class NativeGenerationFields:
    """Sampling, stop and logprob fields that Chat Completions, Completions and Responses share
    (the OpenAI ones plus vLLM's native extensions); each wire class adds its own."""

    top_k: int | None = wire_field(honoured("vLLM extension: top-k filter (clamped to the recipe's range)"))
    min_p: float | None = wire_field(honoured("vLLM extension: min-p filter (clamped to the recipe's range)"))
    repetition_penalty: float | None = wire_field(
        honoured("vLLM extension: repetition penalty (clamped to the recipe's range)"))
    presence_penalty: float | None = wire_field(honoured("presence penalty (clamped to the recipe's range)"))
    frequency_penalty: float | None = wire_field(honoured("frequency penalty (clamped to the recipe's range)"))
    seed: int | None = wire_field(honoured("per-request sampling seed"))
    stop: Any = wire_field(honoured("string stops: at most 4, 4096 UTF-8 bytes in all"))
    stop_token_ids: Any = wire_field(honoured("vLLM extension: token stops"))
    stop_token_sequences: Any = wire_field(honoured(
        "native extension: multi-token stops (with stop_token_ids at most 16, each at most 64 ids); the "
        "matched sequence's text is withheld"))
    ignore_eos: bool | None = wire_field(honoured("vLLM extension: EOS does not end generation"))
    min_tokens: int | None = wire_field(honoured(
        "vLLM extension: EOS and token stops masked, and no stop matched, before this many output tokens"))
    skip_special_tokens: bool | None = wire_field(honoured("vLLM extension: special tokens kept in text when false"))
    include_stop_str_in_output: bool | None = wire_field(
        honoured("vLLM extension: matched string stop kept in the text"))
    return_tokens_as_token_ids: bool | None = wire_field(
        honoured("vLLM extension: logprob tokens rendered as token:ID"))
    logprob_token_ids: list[int] | None = wire_field(honoured("Helios extension: explicit logprob alternatives"))
    structured_outputs: Any = wire_field(honoured(
        "vLLM extension: constrain the answer to json, regex, choice, grammar (Lark) or json_object"))


NATIVE_GENERATION_ROWS: dict[str, FieldPolicy] = policy_rows(NativeGenerationFields)
"""The rows of `NativeGenerationFields`, which Chat Completions, Completions and Responses share."""


@attrs.define(kw_only=True)
class TokenObservationFields(NativeGenerationFields):
    """The native fields plus the token observations, which Chat Completions and Completions take
    (`common.decode_observation`)."""

    return_token_ids: bool | None = wire_field(
        honoured("vLLM extension: prompt_token_ids and each choice's generated token_ids"))
    return_token_timestamps: bool | None = wire_field(honoured(
        "Helios extension: token_timestamps, seconds from admission to each token's engine commit, parallel to "
        "token_ids (implies them)"))


PROVIDER_ROWS: dict[str, FieldPolicy] = {
    "model": ignored("one model is served: every name reaches it and responses report its own id", str),
    "user": ignored("end-user id for the provider's abuse monitoring; nothing to monitor locally", str),
    "metadata": ignored("key-value tags for the provider's dashboards; nothing is stored", dict),
    "safety_identifier": ignored("end-user id for the provider's safety systems; inert caller metadata", str),
    "service_tier": ignored("one local tier serves every request", str),
    "prompt_cache_key": ignored("provider cache routing hint; local prefix reuse is automatic", str),
    "prompt_cache_retention": ignored("provider cache lifetime; local prefix retention is the server's", str),
    "prompt_cache_options": ignored("provider cache breakpoints and lifetime; local prefix reuse is automatic",
                                    dict),
}
"""OpenAI account, billing and provider-cache fields: meaningful to a hosted API only."""
