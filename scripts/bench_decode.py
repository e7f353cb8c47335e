"""Request decode cost per protocol: parse (JSON, counts, document check) + validate (the protocol's
decoder) of one large request, as the route does it before admission.

    PYTHONPATH=. .venv/bin/python scripts/bench_decode.py [--rounds 7] [--iters 50] [--protocol chat ...] [--clock cpu]

Each body is a 100-message conversation with 16 tools, 10 small base64 images (about 2 KB each),
assistant turns with reasoning and tool calls, and their tool results. Reports per protocol the
median (and the minimum, steadier on a shared machine) over rounds of the mean time per request
(µs), parse and validate separately, and the body size. No model is loaded: the decoders read only `ModelInfo`.
`--clock cpu` times the process's CPU time instead of wall time: steadier where other jobs share the
cores (a descheduled process is not charged), though caches and sibling hyperthreads still are.
To compare commits, run this script against each tree (``git archive <commit> | tar -x -C DIR``,
then ``PYTHONPATH=DIR``), alternating, and compare minima.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from helios.domain.model import ModelInfo
from helios.frontends import limits
from helios.frontends.anthropic import messages
from helios.frontends.openai import chat, responses
from helios.frontends.wire import CountLimit, parse_json_object

INFO = ModelInfo(
    model_id="org/model", aliases=("m",), created=0, max_model_len=32768, vocab_size=50_000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
NUM_MESSAGES = 100
NUM_TOOLS = 16
NUM_IMAGES = 10
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8).decode()  # decoded, not inspected


def _schema(i: int) -> dict[str, Any]:
    return {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string", "description": f"file {i}"},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "mode": {"type": "string", "enum": ["read", "write", "append"]}}}


def _args(i: int) -> str:
    return json.dumps({"path": f"src/file_{i}.py", "lines": [1, 2, 3], "mode": "read"})


def chat_body() -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding assistant."}]
    images = 0
    while len(msgs) < NUM_MESSAGES:
        i = len(msgs)
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"Step {i}: look at this and fix the bug. " * 4}]
        if images < NUM_IMAGES:
            parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}})
            images += 1
        msgs.append({"role": "user", "content": parts})
        msgs.append({"role": "assistant", "content": None, "reasoning_content": "Reading the file first.",
                     "tool_calls": [{"id": f"call_{i}", "type": "function",
                                     "function": {"name": f"tool_{i % NUM_TOOLS}", "arguments": _args(i)}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f():\n    return {i}\n" * 5})
    msgs = msgs[:NUM_MESSAGES]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.",
                                               "parameters": _schema(i)}} for i in range(NUM_TOOLS)]
    return {"model": "m", "messages": msgs, "tools": tools, "tool_choice": "auto", "max_tokens": 256,
            "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}


def messages_body() -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    images = 0
    while len(msgs) < NUM_MESSAGES:
        i = len(msgs)
        content: list[dict[str, Any]] = []
        if msgs:  # answer the previous tool call
            content.append({"type": "tool_result", "tool_use_id": f"toolu_{i - 1}",
                            "content": [{"type": "text", "text": f"def f():\n    return {i}\n" * 5}]})
        content.append({"type": "text", "text": f"Step {i}: look at this and fix the bug. " * 4})
        if images < NUM_IMAGES:
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}})
            images += 1
        msgs.append({"role": "user", "content": content})
        msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": "Reading the file first."},
            {"type": "tool_use", "id": f"toolu_{i + 1}", "name": f"tool_{i % NUM_TOOLS}",
             "input": json.loads(_args(i))}]})
    msgs = [*msgs[:NUM_MESSAGES - 1], {"role": "user", "content": "Continue."}]
    tools = [{"name": f"tool_{i}", "description": f"Tool number {i}.", "input_schema": _schema(i)}
             for i in range(NUM_TOOLS)]
    return {"model": "m", "system": "You are a careful coding assistant.", "messages": msgs, "tools": tools,
            "tool_choice": {"type": "auto"}, "max_tokens": 256, "temperature": 0.7, "stream": True}


def responses_body() -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    images = 0
    while len(items) < NUM_MESSAGES:
        i = len(items)
        content: list[dict[str, Any]] = [{"type": "input_text", "text": f"Step {i}: look at this. " * 4}]
        if images < NUM_IMAGES:
            content.append({"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"})
            images += 1
        items.append({"type": "message", "role": "user", "content": content})
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": f"tool_{i % NUM_TOOLS}",
                      "arguments": _args(i)})
        items.append({"type": "function_call_output", "call_id": f"call_{i}",
                      "output": f"def f():\n    return {i}\n" * 5})
    tools = [{"type": "function", "name": f"tool_{i}", "description": f"Tool number {i}.",
              "parameters": _schema(i)} for i in range(NUM_TOOLS)]
    return {"model": "m", "instructions": "You are a careful coding assistant.", "input": items[:NUM_MESSAGES],
            "tools": tools, "tool_choice": "auto", "max_output_tokens": 256, "temperature": 0.7, "stream": True}


PROTOCOLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[CountLimit, ...], Callable[[dict[str, Any]], Any]]] = {
    "chat": (chat_body, limits.CHAT, lambda o: chat.decode_chat(o, INFO)),
    "messages": (messages_body, limits.MESSAGES, lambda o: messages.decode_request(o, INFO)),
    "responses": (responses_body, limits.RESPONSES, lambda o: responses.decode_responses(o, INFO)),
}


def measure(name: str, rounds: int, iters: int, clock: Callable[[], float] = time.perf_counter) -> None:
    make, route_limits, decode = PROTOCOLS[name]
    body = json.dumps(make()).encode()
    decode(parse_json_object(body, route_limits))  # warm up (and check it decodes)
    parse_us: list[float] = []
    validate_us: list[float] = []
    for _ in range(rounds):
        t_parse = t_validate = 0.0
        for _ in range(iters):
            t0 = clock()
            obj = parse_json_object(body, route_limits)
            t1 = clock()
            decode(obj)
            t2 = clock()
            t_parse += t1 - t0
            t_validate += t2 - t1
        parse_us.append(t_parse / iters * 1e6)
        validate_us.append(t_validate / iters * 1e6)
    p, v = statistics.median(parse_us), statistics.median(validate_us)
    print(f"{name:10s} body {len(body) / 1024:6.1f} KiB  parse {p:5.0f} µs (min {min(parse_us):5.0f})  "
          f"validate {v:5.0f} µs (min {min(validate_us):5.0f})  (median of {rounds} rounds x {iters})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--protocol", action="append", choices=list(PROTOCOLS))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for name in args.protocol or list(PROTOCOLS):
        measure(name, args.rounds, args.iters, clock)


if __name__ == "__main__":
    main()
