"""Prefix-cache hit rate of a data-parallel server on interleaved agent replays (docs/parallel.md).

Replays ``--conversations`` copies of the recorded agent session (``helios/clients/bench_data/
agent_replay.json``; each copy's system prompt starts with its own nonce, so copies share nothing)
for ``--turns`` turns. Turn k of every copy is sent before turn k + 1 of any, in a shuffled order
(fixed ``--seed``, so two runs send the same sequence), one request at a time, greedy, with
``--max-tokens`` output tokens. Reports the prompt tokens sent, the tokens the server reported
cached (``usage.prompt_tokens_details.cached_tokens``), their ratio (the hit rate), wall time, and
the per-rank counters of ``/metrics?format=json``. Run it once against a server started with
``--routing cache_aware`` and once with ``--routing round_robin``:

    helios serve --data-parallel-size 2 --routing cache_aware --port 8011 &
    python scripts/bench_dp_routing.py --url http://127.0.0.1:8011 --out cache_aware.json
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import time
from typing import Any

import httpx

from helios.clients.bench_cache import load_agent_conversation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smol")
    p.add_argument("--out", default=None, help="write the summary JSON here too")
    args = p.parse_args(argv)

    conversation = load_agent_conversation()
    turns = min(args.turns, conversation.turns)
    nonces = [secrets.token_hex(6) for _ in range(args.conversations)]
    rng = random.Random(args.seed)
    url = args.url.rstrip("/")
    records: list[dict[str, Any]] = []
    with httpx.Client(timeout=600) as client:
        start_metrics = client.get(url + "/metrics?format=json").json()
        t0 = time.perf_counter()
        for turn in range(turns):
            order = list(range(args.conversations))
            rng.shuffle(order)
            for c in order:
                body = {"model": args.model, "messages": conversation.turn_messages(turn, nonces[c]),
                        "tools": conversation.request_tools(), "max_tokens": args.max_tokens, "temperature": 0}
                t = time.perf_counter()
                resp = client.post(url + "/v1/chat/completions", json=body)
                resp.raise_for_status()
                usage = resp.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                records.append({"conversation": c, "turn": turn, "prompt_tokens": usage["prompt_tokens"],
                                "cached_tokens": cached, "seconds": round(time.perf_counter() - t, 3)})
                print(f"turn {turn:2d} conversation {c}: {usage['prompt_tokens']:5d} prompt, {cached:5d} cached",
                      file=sys.stderr)
        wall = time.perf_counter() - t0
        end_metrics = client.get(url + "/metrics?format=json").json()
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    later = [r for r in records if r["turn"] > 0]
    summary = {
        "url": url, "conversations": args.conversations, "turns": turns, "max_tokens": args.max_tokens,
        "seed": args.seed, "requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "later_turns_hit_rate": round(sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)), 4),
        "prefilled_tokens": prompt - cached, "wall_seconds": round(wall, 1),
        "prefill_tokens_metric": end_metrics.get("prefill_tokens", 0) - start_metrics.get("prefill_tokens", 0),
        "ranks": end_metrics.get("data_parallel"), "records": records,
    }
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
