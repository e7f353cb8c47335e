"""Item counts each route accepts, checked at the edge right after the JSON body is parsed and
before it is decoded, admitted, lowered or tokenized (docs/operations.md, "Request limits").

The counts that make a request expensive before the context check can see it are the collections
that the decoder, the chat template and the tokenizer walk: messages and input items, the content
parts of each, tool calls, tools, and token-id arrays. Each is bounded here; a body over a bound is
a 400 naming the field. Other counts are bounded where the spec defines them, in each protocol's
decoder (string stops: 4; token stops: 16 of at most 64 ids; logprob_token_ids: 128; decision
questions: 64), which runs before admission too. Nesting and text validity are checked once for
every JSON document (`wire.loads_strict`), after these counts.
"""

from __future__ import annotations

from helios.frontends.wire import CountLimit

MAX_MESSAGES = 10_000
"""Messages (Chat Completions, Messages, count_tokens) or input items (Responses) per request."""
MAX_PARTS = 1_000
"""Content parts (or tool calls) per message or input item, and blocks in a tool result or system array."""
MAX_TOOLS = 512
"""Declared tools per request."""
MAX_TOKEN_IDS = 1 << 20
"""Elements of a Completions `prompt` array: token ids, or prompts of a batch (a batch is further
bounded by the admission slots it needs, checked before tokenization)."""


def _conversation(items: str, *parts: str) -> tuple[CountLimit, ...]:
    """A conversation route's limits: its array of `items` (messages or input items), the arrays of
    `parts` in each item, then the tools; a parent array before its children (`check_counts`)."""
    return (CountLimit(items, MAX_MESSAGES), *(CountLimit(f"{items}[].{part}", MAX_PARTS) for part in parts),
            CountLimit("tools", MAX_TOOLS))


CHAT = _conversation("messages", "content", "tool_calls")
COMPLETIONS = (CountLimit("prompt", MAX_TOKEN_IDS),)
RESPONSES = _conversation("input", "content", "output")
MESSAGES = (CountLimit("system", MAX_PARTS), *_conversation("messages", "content", "content[].content"))
