"""Probes for docs/operations.md, "Request limits and hostile input" (issue 17), against a running server.

    python scripts/probe_hostile.py freeze http://127.0.0.1:8000 --mb 30
        /health latency and the token gaps of two running streams while an over-context prompt of
        about that many MB is tokenized (and, first, the same figures with no large prompt).
    python scripts/probe_hostile.py memory http://127.0.0.1:8000 WORKER_PID --messages 1000000 --concurrent 3
        the server's peak RSS while that many concurrent Chat bodies with that many one-character
        messages are answered (WORKER_PID: the hypercorn worker process, whose /proc status is read).

Auth is not sent: run them against a server without a key.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def freeze(url: str, mb: float) -> None:
    stop = threading.Event()
    health: list[float] = []
    gaps: list[float] = []

    def poll() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/health")
                health.append(time.perf_counter() - t)
                time.sleep(0.02)

    def stream() -> None:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            last = time.perf_counter()
            for line in r.iter_lines():
                if stop.is_set():
                    break
                if line.startswith("data:"):
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

    threads = [threading.Thread(target=poll), *(threading.Thread(target=stream) for _ in range(2))]
    for t in threads:
        t.start()
    time.sleep(2)
    h0, g0 = len(health), len(gaps)
    time.sleep(6)
    print(f"baseline (6 s): /health max {max(health[h0:]) * 1000:.0f} ms; stream gaps max "
          f"{max(gaps[g0:], default=0) * 1000:.0f} ms over {len(gaps) - g0} tokens")
    h0, g0 = len(health), len(gaps)
    text = "hello world " * int(mb * 1024 * 1024 / 12)
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1}, timeout=600)
    elapsed = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    during, gaps_during = health[h0:], gaps[g0:]
    print(f"{mb:g} MB prompt: {r.status_code} in {elapsed:.1f} s: {r.text[:120]}")
    print(f"/health during: {len(during)} answers, max {max(during) * 1000:.0f} ms, "
          f"median {sorted(during)[len(during) // 2] * 1000:.0f} ms")
    print(f"stream gaps during: {len(gaps_during)} tokens, max {max(gaps_during, default=0) * 1000:.0f} ms")


def memory(url: str, pid: int, messages: int, concurrent: int) -> None:
    def rss() -> tuple[float, float]:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * messages, "max_tokens": 1},
                      separators=(",", ":")).encode()
    before = rss()
    print(f"body {len(body) / 1e6:.1f} MB; server RSS {before[0]:.0f} MB (peak so far {before[1]:.0f} MB)")
    peak = [before[0]]
    stop = threading.Event()
    results: list[tuple[int, str]] = []

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss()[0])
            time.sleep(0.05)

    def send() -> None:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=900)
        results.append((r.status_code, r.text[:100]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    senders = [threading.Thread(target=send) for _ in range(concurrent)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    stop.set()
    watcher.join()
    print(f"{concurrent} requests answered in {time.perf_counter() - start:.1f} s: {results}")
    print(f"server RSS peak {max(peak[0], rss()[1]):.0f} MB (sampled {peak[0]:.0f} MB); now {rss()[0]:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    f = sub.add_parser("freeze")
    f.add_argument("url")
    f.add_argument("--mb", type=float, default=30)
    m = sub.add_parser("memory")
    m.add_argument("url")
    m.add_argument("pid", type=int)
    m.add_argument("--messages", type=int, default=1_000_000)
    m.add_argument("--concurrent", type=int, default=3)
    args = parser.parse_args()
    if args.probe == "freeze":
        freeze(args.url.rstrip("/"), args.mb)
    else:
        memory(args.url.rstrip("/"), args.pid, args.messages, args.concurrent)


if __name__ == "__main__":
    main()
