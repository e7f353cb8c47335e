"""Benchmark client for any OpenAI-compatible streaming server (Helios, llama-server, vLLM, ...).

Drives N concurrent streaming requests against ``/v1/completions`` or ``/v1/chat/completions`` and
reports output throughput, time to first token and inter-token latency. Every prompt starts with a
random nonce so no prefix cache can hit, and EOS is suppressed (``ignore_eos`` plus ``min_tokens``)
so every stream yields exactly ``max_tokens`` tokens; ``short_streams`` in the result counts the
streams where the server did not honour that.

Before measuring, a few one-token probes (a) find which optional request fields the server accepts
(a 400/422 drops ``stream_options.continuous_usage_stats``, then ``min_tokens``, then
``stream_options``), (b) calibrate the filler length so the prompt is about ``prompt_tokens`` tokens
long by the server's own usage count, and (c) a short round at full concurrency warms the server up.

Run ``python -m helios.clients.bench --url http://127.0.0.1:8000 --streams 1,8`` (``helios bench`` once
hooked into the CLI). ``--baseline-url`` runs the same workload against a second server, level by
level and never concurrently, and adds target/baseline ratios (machines are noisy: compare ratios).

``--workload shared-prefix | agent-replay | restart`` runs the prefix-cache workloads of
:mod:`helios.clients.bench_cache` instead, which share prefixes on purpose; ``--workload editing`` runs
:mod:`helios.clients.bench_edit` (one stream repeats a ~1,100-token source file with a few edits: the case
prompt-lookup speculation is for).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import trio

from helios.clients import bench_cache, bench_edit
from helios.clients.hog import cpu_hogs
from helios.clients.stream import (
    ENDPOINTS,
    BenchError,
    Endpoint,
    StreamRecord,
    _Target,
    base_url,
    discover_model,
)

# "throughput" is this module's workload; the others are bench_cache's prefix-cache workloads.
WORKLOADS: tuple[str, ...] = ("throughput", *bench_cache.CACHE_WORKLOADS)
# Presets of the throughput workload (issue 11's targets): (prompt tokens, output tokens, stream levels).
# Flags given on the command line override them.
THROUGHPUT_PRESETS: dict[str, tuple[int, int, list[int]]] = {
    "long-context": (4000, 256, [1, 8]),  # decode over a ~4,000-token history
    "ttfb": (512, 1, [1]),  # time to first byte of a 512-token prompt
}

_WARMUP_TOKENS = 8
_ERROR_SAMPLES = 5


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms_stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values) * 1e3, 3),
        "p99": round(percentile(values, 99) * 1e3, 3),
        "mean": round(statistics.fmean(values) * 1e3, 3),
        "min": round(min(values) * 1e3, 3),
        "max": round(max(values) * 1e3, 3),
    }






async def run_bench(
    url: str,
    *,
    streams: int,
    max_tokens: int = 256,
    prompt_tokens: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    endpoint: Endpoint = "completions",
    requests_per_stream: int = 1,
    timeout: float = 600,
    warmup: bool = True,
    seed: int = 0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``streams`` concurrent workers, each sending ``requests_per_stream`` streaming requests
    one after another, and return the measurements as a JSON-ready dict. Runs under trio.

    Raises BenchError when the server cannot be reached for model discovery or arguments are bad;
    request failures during the run are counted in ``errors`` instead.
    """
    import httpx

    if streams < 1 or max_tokens < 1 or requests_per_stream < 1:
        raise BenchError("streams, max_tokens and requests_per_stream must be at least 1")
    if prompt_tokens is not None and prompt_tokens < 1:
        raise BenchError("prompt_tokens must be at least 1")
    if endpoint not in ENDPOINTS:
        raise BenchError(f"endpoint must be one of {ENDPOINTS}, not {endpoint!r}")
    base = base_url(url)
    pool = streams + 4
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    http_timeout = httpx.Timeout(timeout, connect=min(timeout, 30.0))
    # trust_env=False: benchmark the server directly, never through an environment proxy.
    async with httpx.AsyncClient(limits=limits, timeout=http_timeout, trust_env=False) as client:
        if model is None:
            model = await discover_model(client, base, api_key)
        target = _Target(client, base, model, api_key, endpoint, timeout, seed, extra_body)
        setup = await target.prepare(prompt_tokens)
        if warmup:
            async with trio.open_nursery() as nursery:
                for _ in range(streams):
                    nursery.start_soon(
                        target.request, setup.filler_words, min(max_tokens, _WARMUP_TOKENS), setup.features
                    )

        records: list[StreamRecord] = []

        async def worker() -> None:
            for _ in range(requests_per_stream):
                records.append(await target.request(setup.filler_words, max_tokens, setup.features))

        t_start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(worker)
        t_stop = time.perf_counter()

    result = summarize(records, max_tokens=max_tokens, wall=t_stop - t_start)
    result = {
        "url": base,
        "endpoint": endpoint,
        "model": model,
        "streams": streams,
        "requests_per_stream": requests_per_stream,
        "max_tokens": max_tokens,
        "prompt_tokens_target": prompt_tokens,
        "prompt_filler_words": setup.filler_words,
        "dropped_fields": setup.dropped,
        **result,
    }
    return result


def summarize(records: Sequence[StreamRecord], *, max_tokens: int, wall: float) -> dict[str, Any]:
    """Aggregate stream records; ``wall`` runs from the first request sent to the last stream done."""
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    samples: list[str] = []
    for r in failed:
        if r.error is not None and r.error not in samples:
            samples.append(r.error)
        if len(samples) >= _ERROR_SAMPLES:
            break
    output_tokens = sum(r.output_tokens for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [x for r in ok for x in r.inter_token_latencies()]
    rates = [x for r in ok if (x := r.decode_rate()) is not None]
    prompts = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(failed),
        "error_samples": samples,
        "short_streams": sum(1 for r in ok if r.output_tokens < max_tokens),
        "wall_s": round(wall, 4),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall, 3) if wall > 0 else None,
        "prompt_tokens": (
            {"mean": round(statistics.fmean(prompts), 1), "min": min(prompts), "max": max(prompts)}
            if prompts
            else None
        ),
        "ttft_ms": _ms_stats(ttfts),
        "itl_ms": _ms_stats(itls),
        "decode_tok_s_per_stream": (
            {
                "median": round(statistics.median(rates), 3),
                "min": round(min(rates), 3),
                "max": round(max(rates), 3),
            }
            if rates
            else None
        ),
        "usage_reported": bool(ok) and all(r.usage_completion_tokens is not None for r in ok),
        "continuous_usage": bool(ok) and all(r.continuous_usage for r in ok),
    }


# --------------------------------------------------------------------------------------------- CLI

_RATIO_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output_tok_s", ("output_tok_s",)),
    ("ttft_median", ("ttft_ms", "median")),
    ("ttft_p99", ("ttft_ms", "p99")),
    ("itl_median", ("itl_ms", "median")),
    ("itl_p99", ("itl_ms", "p99")),
)


def _dig(result: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, int | float) else None


def ratios(target: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """target / baseline for throughput (higher is better) and latencies (lower is better)."""
    out: dict[str, Any] = {"streams": target.get("streams")}
    for name, path in _RATIO_KEYS:
        t, b = _dig(target, path), _dig(baseline, path)
        out[name] = round(t / b, 3) if t is not None and b else None
    return out


def parse_streams(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--streams wants integers like 1,8,32, not {text!r}") from exc
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"--streams wants positive integers like 1,8,32, not {text!r}")
    return levels


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body wants a JSON object")
    return cast(dict[str, Any], value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``helios bench`` flags, for a subcommand parser."""
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--workload",
        choices=(*WORKLOADS, *bench_edit.WORKLOADS),
        default="throughput",
        help="throughput (default: concurrent streams, no prefix shared); long-context (throughput with a "
        "~4,000-token prompt, 256 tokens, 1 and 8 streams); ttfb (a 512-token prompt, one token, one stream); "
        "shared-prefix (cold vs warm TTFT "
        "of a ~1,500-token shared prefix); agent-replay (a recorded 12-turn agent session, each turn "
        "resending the history); restart (a ~4,000-token prompt cold, then again after a server restart: "
        "run twice with --state-file); editing (one stream repeats a ~1,100-token source file with three "
        "edits, greedy: speculative decoding's case; --rounds, default 2; --max-tokens, default 1400); "
        "code-writing (one stream writes a new ~500-token module from a short request, greedy: a draft "
        "model's case; --rounds, default 2; --max-tokens, default 512)",
    )
    parser.add_argument(
        "--streams",
        type=parse_streams,
        default=None,
        help="comma-separated concurrency levels, run one after another (default 1,8,32; long-context 1,8; "
        "ttfb 1)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request (default 256; shared-prefix 16, agent-replay 32, restart 16)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="approximate prompt length in tokens (default: short task)",
    )
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default=None,
        help="API to drive (default completions; shared-prefix: chat; agent-replay and restart are chat only)",
    )
    parser.add_argument(
        "--requests-per-stream", type=int, default=1, help="sequential requests per concurrent stream"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed sent with every request")
    parser.add_argument(
        "--extra-body",
        type=_parse_json_object,
        default=None,
        help="JSON object merged into every request body; null removes a key, e.g. '{\"min_tokens\": null}'",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the short warm-up round per level")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="shared-prefix rounds (fresh prefix each, default 3), agent replays (default 2), "
        "restart prompts (default 3)",
    )
    parser.add_argument(
        "--agent-format",
        choices=("tools", "text"),
        default="tools",
        help="agent-replay and restart: send OpenAI tools (default), or write tools and calls into the "
        "messages as <tool_call>/<tool_response> text, for servers whose template drops tools",
    )
    parser.add_argument(
        "--replay-file",
        default=None,
        help="agent-replay: replay a coding client's recorded requests (JSON: client, requests of path "
        "and body; tests/server/test_coding_clients.py writes them) on their own routes instead of the "
        "built-in session",
    )
    parser.add_argument(
        "--warm-requests",
        type=int,
        default=4,
        help="shared-prefix: warm requests after each round's cold one (default 4)",
    )
    parser.add_argument(
        "--state-file",
        default="helios-bench-restart.json",
        help="restart: where the cold phase leaves its nonces and TTFTs for the repeat phase",
    )
    parser.add_argument("--baseline-url", default=None, help="second server to run the same workload on")
    parser.add_argument("--baseline-model", default=None, help="model name on the baseline server")
    parser.add_argument("--baseline-api-key", default=None, help="bearer token for --baseline-url")
    parser.add_argument(
        "--hog",
        type=int,
        default=0,
        help="run this many busy-looping processes beside the server for the whole run (CPU contention: a "
        "figure 'with one core taken' is --hog 1); the report names the count",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="helios bench", description="Benchmark an OpenAI-compatible streaming server."
    )
    add_arguments(parser)
    return parser


async def _bench_all(args: argparse.Namespace) -> dict[str, Any]:
    servers: list[tuple[str, str, str | None, str | None]] = [("target", args.url, args.model, args.api_key)]
    if args.baseline_url:
        servers.append(("baseline", args.baseline_url, args.baseline_model, args.baseline_api_key))
    report: dict[str, Any] = {}
    for role, url, _, _ in servers:
        report[role] = {"url": base_url(url), "model": None, "runs": []}
    for level in args.streams:
        # Target then baseline at each level, so both see the machine in about the same state.
        for role, url, model, api_key in servers:
            entry = report[role]
            _progress(f"{role} {entry['url']}: {level} stream(s) x {args.max_tokens} tokens ...")
            result = await run_bench(
                url,
                streams=level,
                max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens,
                model=entry["model"] or model,
                api_key=api_key,
                endpoint=args.endpoint,
                requests_per_stream=args.requests_per_stream,
                timeout=args.timeout,
                warmup=not args.no_warmup,
                seed=args.seed,
                extra_body=args.extra_body,
            )
            entry["model"] = result["model"]
            entry["runs"].append(result)
            _progress(_row(role, result))
    if args.baseline_url:
        report["ratios"] = [
            ratios(t, b) for t, b in zip(report["target"]["runs"], report["baseline"]["runs"], strict=True)
        ]
    return report


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


_HEADER = (
    f"{'server':<9}{'streams':>8}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
    f"{'ITL p50':>9}{'ITL p99':>9}{'prompt':>8}{'errors':>8}"
)


def _row(role: str, result: Mapping[str, Any]) -> str:
    prompt = _dig(result, ("prompt_tokens", "mean"))
    return (
        f"{role:<9}{result['streams']:>8}{_fmt(_dig(result, ('output_tok_s',))):>10}"
        f"{_fmt(_dig(result, ('ttft_ms', 'median'))):>10}{_fmt(_dig(result, ('ttft_ms', 'p99'))):>10}"
        f"{_fmt(_dig(result, ('itl_ms', 'median')), '.2f'):>9}{_fmt(_dig(result, ('itl_ms', 'p99')), '.2f'):>9}"
        f"{_fmt(prompt, '.0f'):>8}{result['errors']:>8}"
    )


def format_table(report: Mapping[str, Any]) -> str:
    """A human-readable table: milliseconds for latencies, ratios as target / baseline."""
    lines = [f"target:   {report['target']['url']} (model {report['target']['model']})"]
    if "baseline" in report:
        lines.append(f"baseline: {report['baseline']['url']} (model {report['baseline']['model']})")
    if report.get("hog"):
        lines.append(f"contention: {report['hog']} busy-looping process(es) ran beside the server(s)")
    lines.append("latencies in ms; ratio = target / baseline (tok/s: higher is better, latency: lower)")
    lines.append(_HEADER)
    baseline_runs = report["baseline"]["runs"] if "baseline" in report else []
    for i, run in enumerate(report["target"]["runs"]):
        lines.append(_row("target", run))
        if i < len(baseline_runs):
            lines.append(_row("baseline", baseline_runs[i]))
            r = report["ratios"][i]
            lines.append(
                f"{'ratio':<9}{'':>8}{_fmt(r['output_tok_s'], '.2f'):>10}{_fmt(r['ttft_median'], '.2f'):>10}"
                f"{_fmt(r['ttft_p99'], '.2f'):>10}{_fmt(r['itl_median'], '.2f'):>9}{_fmt(r['itl_p99'], '.2f'):>9}"
            )
    for role in ("target", "baseline"):
        for run in report.get(role, {}).get("runs", []):
            if run["short_streams"]:
                lines.append(
                    f"warning: {role} at {run['streams']} stream(s): {run['short_streams']} stream(s) "
                    f"ended before {run['max_tokens']} tokens (EOS not suppressed?)"
                )
            for sample in run["error_samples"]:
                lines.append(f"error: {role} at {run['streams']} stream(s): {sample}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``helios bench``: 0 when every request succeeded, 1 on request errors or a failed start."""
    return run_cli(build_parser().parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """Run parsed ``add_arguments`` flags (for a ``helios`` subcommand parser); same codes as main."""
    hogs = getattr(args, "hog", 0)
    if hogs < 0:
        print("helios bench: --hog must be at least 0", file=sys.stderr)
        return 2
    if hogs:
        _progress(f"running {hogs} busy-looping process(es) beside the server for the whole run")
    with cpu_hogs(hogs):
        return _run_cli(args)


def _run_cli(args: argparse.Namespace) -> int:
    if args.workload in bench_edit.WORKLOADS:
        return _run_editing(args)
    preset = THROUGHPUT_PRESETS.get(args.workload)
    if preset is not None:
        prompt_tokens, max_tokens, streams = preset
        args.workload = "throughput"
        args.prompt_tokens = prompt_tokens if args.prompt_tokens is None else args.prompt_tokens
        args.max_tokens = max_tokens if args.max_tokens is None else args.max_tokens
        args.streams = streams if args.streams is None else args.streams
    if args.streams is None:
        args.streams = [1, 8, 32]
    if args.max_tokens is None:
        args.max_tokens = bench_cache.DEFAULT_MAX_TOKENS[args.workload]
    if args.rounds is None:
        args.rounds = bench_cache.DEFAULT_ROUNDS.get(args.workload, 1)
    if args.endpoint is None:
        args.endpoint = "completions" if args.workload == "throughput" else "chat"
    for flag, value in (
        ("--max-tokens", args.max_tokens),
        ("--requests-per-stream", args.requests_per_stream),
        ("--rounds", args.rounds),
        ("--warm-requests", args.warm_requests),
    ):
        if value < 1:
            print(f"helios bench: {flag} must be at least 1", file=sys.stderr)
            return 2
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        print("helios bench: --prompt-tokens must be at least 1", file=sys.stderr)
        return 2
    if args.workload in bench_cache.CACHE_WORKLOADS:
        try:
            cache_report = trio.run(bench_cache.run_workload, args)
        except (BenchError, ValueError, OSError) as exc:
            print(f"helios bench: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        text = json.dumps(cache_report, indent=2) if args.json else bench_cache.format_report(cache_report)
        print(text, flush=True)
        return 1 if bench_cache.count_errors(cache_report) else 0
    try:
        report = trio.run(_bench_all, args)
    except BenchError as exc:
        print(f"helios bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    report["hog"] = getattr(args, "hog", 0)
    print(json.dumps(report, indent=2) if args.json else format_table(report), flush=True)
    errors = sum(
        run["errors"] for role in ("target", "baseline") for run in report.get(role, {}).get("runs", [])
    )
    return 1 if errors else 0


def _run_editing(args: argparse.Namespace) -> int:
    default = bench_edit.CODE_WRITING_MAX_TOKENS if args.workload == "code-writing" else bench_edit.DEFAULT_MAX_TOKENS
    args.max_tokens = default if args.max_tokens is None else args.max_tokens
    args.rounds = bench_edit.DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if args.max_tokens < 1 or args.rounds < 1:
        print("helios bench: --max-tokens and --rounds must be at least 1", file=sys.stderr)
        return 2
    try:
        report = trio.run(bench_edit.run_workload, args)
    except BenchError as exc:
        print(f"helios bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else bench_edit.format_report(report), flush=True)
    return 1 if bench_edit.count_errors(report) else 0


if __name__ == "__main__":
    sys.exit(main())
