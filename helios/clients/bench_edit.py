"""``helios bench --workload editing``: one stream edits a ~1,100-token source file; ``--workload
code-writing``: one stream writes a new module from a short request.

The prompt is fixed (``bench_data/edit_source.txt`` and the instruction below): a Python module and
three small edits; the answer repeats the whole file with them (greedy, so every run of one model
gives the same text). Most of the answer is a copy of the prompt, which is what prompt-lookup
(n-gram) speculation drafts from: the workload compares a server with speculation against one
without (``--baseline-url``), or against llama-server with its own lookup decoding.

Each round sends the same chat request, streamed, and records time to first token, output tokens
and the decode rate (tokens after the first content chunk / time from the first to the last one).
A server with ``/metrics?format=json`` (Helios) also reports the round's speculative counters
(drafts offered and accepted, verification rounds; DEPTH = drafts / rounds). Rounds after the first
hit the prefix cache on servers that have one: the decode rate is what the workload compares.

The code-writing workload sends a short request for new code (``CODE_WRITING_TASK``, greedy, the
same rounds and records): little of the answer is in the prompt, so prompt lookup has few guesses
and a draft model (``[speculative] draft_model``) does the drafting.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helios.clients.stream import (
    StreamRecord,
    _headers,
    base_url,
    discover_model,
    merge_extra_body,
    stream_once,
)

if TYPE_CHECKING:
    import httpx

EDIT_SOURCE_FILE = Path(__file__).with_name("bench_data") / "edit_source.txt"
DEFAULT_MAX_TOKENS = 1400
DEFAULT_ROUNDS = 2
SYSTEM = "You are a careful code editor. Answer with the complete edited file only, with no explanation."
INSTRUCTION = (
    "Make these three changes to the Python file below and output the whole file:\n"
    "1. Rename the constant REORDER_MARGIN to SAFETY_MARGIN everywhere.\n"
    "2. Change MAX_BATCH from 500 to 250.\n"
    "3. In `report`, write \"total stock value\" instead of \"total value\".\n\n"
)
CODE_WRITING_SYSTEM = "You are a helpful coding assistant. Answer with Python code only."
CODE_WRITING_TASK = (
    "Write a Python module `inventory.py` with a dataclass `Item` (name, quantity, unit_price), a class "
    "`Inventory` with methods add, remove, total_value and low_stock(threshold), a function that loads "
    "an inventory from a CSV file, and a `main` that prints a report. Add type hints and docstrings."
)
CODE_WRITING_MAX_TOKENS = 512
WORKLOADS = ("editing", "code-writing")
SPECULATIVE_KEYS = ("verification_drafts", "verification_rounds", "accepted_drafts", "draft_rounds", "verify_steps")


def load_source(path: Path = EDIT_SOURCE_FILE) -> str:
    return path.read_text()


def edit_messages(source: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{INSTRUCTION}```python\n{source}```"}]


def code_writing_messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": CODE_WRITING_SYSTEM}, {"role": "user", "content": CODE_WRITING_TASK}]


def workload_messages(workload: str) -> list[dict[str, str]]:
    """The chat messages of a round of ``workload`` (one of WORKLOADS)."""
    if workload == "code-writing":
        return code_writing_messages()
    if workload == "editing":
        return edit_messages(load_source())
    raise ValueError(f"unknown single-stream workload {workload!r}: expected one of {', '.join(WORKLOADS)}")


def edit_body(model: str, source: str, max_tokens: int, *, usage: bool = True,
              extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The editing round's request: greedy, streamed, EOS allowed (the answer ends with the file)."""
    return chat_body(model, edit_messages(source), max_tokens, usage=usage, extra_body=extra_body)


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, *, usage: bool = True,
              extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A round's request: ``messages``, greedy, streamed, EOS allowed."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return merge_extra_body(body, extra_body)


def summarize_round(rec: StreamRecord, before: Mapping[str, Any] | None,
                    after: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ttft_ms": None if rec.ttft is None else round(rec.ttft * 1e3, 1),
        "output_tokens": rec.output_tokens,
        "decode_tok_s": None if rec.decode_rate() is None else round(rec.decode_rate() or 0.0, 2),
        "wall_s": round(rec.t_end - rec.t_send, 3),
        "finish_reason": rec.finish_reason,
        "error": rec.error,
    }
    if before is not None and after is not None and all(isinstance(after.get(k), int) for k in SPECULATIVE_KEYS):
        delta = {k: int(after[k]) - int(before.get(k, 0)) for k in SPECULATIVE_KEYS}
        rounds = delta["verification_rounds"]
        delta["depth"] = round(delta["verification_drafts"] / rounds, 3) if rounds else None  # type: ignore[assignment]
        out["speculative"] = delta
    return out


def summarize_server(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["decode_tok_s"] for r in rounds if r["decode_tok_s"] is not None and not r["error"]]
    return {"decode_tok_s_median": round(statistics.median(rates), 2) if rates else None,
            "errors": sum(1 for r in rounds if r["error"])}


async def _metrics(client: httpx.AsyncClient, base: str, headers: Mapping[str, str]) -> dict[str, Any] | None:
    import httpx

    try:
        resp = await client.get(f"{base}/metrics", params={"format": "json"}, headers=headers)
        data = resp.json() if resp.status_code == 200 and "json" in resp.headers.get("content-type", "") else None
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) else None


async def _run_server(client: httpx.AsyncClient, url: str, model: str | None, api_key: str | None,
                      args: argparse.Namespace, messages: list[dict[str, str]]) -> dict[str, Any]:
    base = base_url(url)
    model = model or await discover_model(client, base, api_key)
    headers = _headers(api_key)
    chat = f"{base}/v1/chat/completions"
    usage = True
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        before = await _metrics(client, base, headers)
        rec = await stream_once(client, chat, chat_body(model, messages, args.max_tokens, usage=usage,
                                                        extra_body=args.extra_body),
                                headers, "chat", args.timeout)
        if usage and rec.status in (400, 422):  # a server without stream_options: without usage
            usage = False
            rec = await stream_once(client, chat, chat_body(model, messages, args.max_tokens, usage=False,
                                                            extra_body=args.extra_body),
                                    headers, "chat", args.timeout)
        rounds.append(summarize_round(rec, before, await _metrics(client, base, headers)))
    return {"url": base, "model": model, "rounds": rounds, **summarize_server(rounds)}


async def run_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The editing or code-writing workload (``args.workload``) on ``args.url`` and then, never
    concurrently, ``args.baseline_url``."""
    import httpx

    workload = getattr(args, "workload", "editing")
    messages = workload_messages(workload)
    report: dict[str, Any] = {"workload": workload, "max_tokens": args.max_tokens, "rounds": args.rounds}
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        report["target"] = await _run_server(client, args.url, args.model, args.api_key, args, messages)
        if args.baseline_url:
            report["baseline"] = await _run_server(client, args.baseline_url, args.baseline_model,
                                                   args.baseline_api_key, args, messages)
    target = report["target"]["decode_tok_s_median"]
    baseline = report.get("baseline", {}).get("decode_tok_s_median")
    if target and baseline:
        report["decode_ratio"] = round(target / baseline, 3)
    return report


def format_report(report: Mapping[str, Any]) -> str:
    lines = [f"{report['workload']} workload: one stream, {report['rounds']} round(s), "
             f"max_tokens {report['max_tokens']}"]
    for role in ("target", "baseline"):
        server = report.get(role)
        if server is None:
            continue
        lines.append(f"{role}: {server['url']} ({server['model']}): median decode "
                     f"{server['decode_tok_s_median']} tok/s, errors {server['errors']}")
        for i, r in enumerate(server["rounds"]):
            spec = r.get("speculative")
            extra = ""
            if spec:
                extra = (f", drafts {spec['verification_drafts']} accepted {spec['accepted_drafts']} "
                         f"depth {spec['depth']}")
            lines.append(f"  round {i + 1}: ttft {r['ttft_ms']} ms, {r['output_tokens']} tokens, "
                         f"{r['decode_tok_s']} tok/s{extra}" + (f", error: {r['error']}" if r["error"] else ""))
    if "decode_ratio" in report:
        lines.append(f"decode target/baseline: {report['decode_ratio']}")
    return "\n".join(lines)


def count_errors(report: Mapping[str, Any]) -> int:
    return sum(report.get(role, {}).get("errors", 0) for role in ("target", "baseline"))

