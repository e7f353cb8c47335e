"""`nox -s bench`: start Helios on a port, run `helios bench` against it, print JSON, stop it.

Runs the issue's standard workload: 1, 8 and 32 concurrent streams of 256 output tokens, then the
time to first byte of a 512-token prompt (`--workload ttfb`), then long-context decode (a ~4,000-token
prompt and 256 tokens at 1 and 8 streams, `--workload long-context`; `--no-long-context` skips it).
`--baseline-url URL` measures a peer server side by side.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m helios.clients.benchserve")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--model", default=None, help="model path for Helios (default model when omitted)")
    p.add_argument("--baseline-url", default=None)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--no-long-context", action="store_true")
    args = p.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "helios.cli", "serve", "--port", str(args.port)]
    if args.model:
        cmd.append(args.model)
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                print("helios exited before becoming healthy", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        from helios.clients.bench import main as bench

        base = ["--url", url, "--json"]
        if args.baseline_url:
            base += ["--baseline-url", args.baseline_url]
        rc = bench([*base, "--streams", args.streams, "--max-tokens", str(args.max_tokens)])
        rc |= bench([*base, "--workload", "ttfb", "--prompt-tokens", str(args.prompt_tokens)])
        if not args.no_long_context:
            rc |= bench([*base, "--workload", "long-context"])
        return rc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":

    raise SystemExit(main())
