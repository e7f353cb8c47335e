"""Measure the weight formats on this machine (a script, not a test; docs/benchmarks.md, "Weight formats").

    .venv/bin/python tests/parity/bench_weight_formats.py linears [--rows 1 2 4 8 16 32 64 128 512]
    .venv/bin/python tests/parity/bench_weight_formats.py step [--formats auto float32 ...] -- --streams 1 32 --steps 40
    .venv/bin/python tests/parity/bench_weight_formats.py load [--formats ...]

``linears``: the default model's 30 layers of projections (qkv, o, gate_up, down; about 106 M
weights, well beyond the last-level cache as in a real step), built in each format from the GGUF, one
pass over all of them at each row count; the best of several passes (min, which filters out other
processes' interference), on one thread and on all. Also the float32 output projection.

``step``: runs scripts/profile_step.py unchanged (read-only) once per format, with the model it
builds swapped for one in that format (and the KV cache in that format's activation dtype).

``load``: seconds to open the default model and build it in each format, without and with the
packed-weight cache (a fresh temporary cache directory: one miss that writes it, then one hit).

``serve``: seconds from launching ``helios serve [--model NAME]`` (``--command``, default this
checkout's) to the first answer of a greedy chat request of ``--max-tokens`` tokens, posted every 0.1 s
until one answers, and the "Loaded ... in N s" line it printed; ``--runs`` times.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helios.loaders.default_model import ensure_default_model
from helios.models.llama import PROJECTIONS, LlamaForCausalLM
from helios.models.quant import Int4Linear, Int8Linear
from helios.runtime import choose_weights, cpu_flags, detect_cpu_capability, load_model

FORMATS = ("auto", "float32", "bfloat16", "int4", "int8")
ROOT = Path(__file__).resolve().parents[2]


def best_ms(fn: Callable[[], Any], seconds: float) -> float:
    fn()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def linears(args: argparse.Namespace) -> None:
    path = str(ensure_default_model())
    print(f"CPU flags: {cpu_flags()}; detected {detect_cpu_capability()}; torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()})")
    formats = [f for f in args.formats if f != "auto"] or ["float32", "bfloat16", "int4", "int8"]
    models = {}
    for name in formats:
        loaded = load_model(path, weights=name)
        # No dense copy: the kernel itself at every row count.
        models[name] = (loaded.model, loaded.choice.dtype)
    head = models[formats[0]][0]
    head_w = head._lm_head_fp32 if head._lm_head_fp32 is not None else head.lm_head
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): ms for one pass over the 120 projections (min of {args.seconds:.1f} s)")
        print("rows  " + "".join(f"{name:>10s}" for name in formats) + "   lm_head fp32")
        for rows in args.rows:
            cells = []
            for name in formats:
                model, dtype = models[name]
                mods = [getattr(layer, attr) for layer in model.layers for attr in PROJECTIONS]
                xs = {m: torch.randn(rows, _in_features(m)).to(dtype) for m in mods}

                def run(mods: list[torch.nn.Module] = mods, xs: dict[Any, torch.Tensor] = xs) -> None:
                    with torch.inference_mode():
                        for m in mods:
                            m(xs[m])

                cells.append(best_ms(run, args.seconds))
            h = torch.randn(rows, head_w.shape[1])
            head_ms = best_ms(lambda h=h: torch.nn.functional.linear(h, head_w), args.seconds)
            print(f"{rows:<6d}" + "".join(f"{c:10.2f}" for c in cells) + f"   {head_ms:10.2f}")


def _in_features(module: torch.nn.Module) -> int:
    if isinstance(module, Int4Linear):
        return int(module.packed.shape[1]) * 2
    if isinstance(module, Int8Linear):
        return int(module.weight.shape[1])
    return int(module.weight.shape[1])  # type: ignore[union-attr]


def step(args: argparse.Namespace) -> None:
    for name in args.formats:
        _profile_step(name, args.rest)


def _profile_step(name: str, rest: list[str]) -> None:
    import helios.loaders.checkpoint as checkpoint_module

    script = ROOT / "scripts" / "profile_step.py"
    namespace = runpy.run_path(str(script), run_name="profile_step")
    real_load = checkpoint_module.load_checkpoint
    # profile_step calls choose_dtype before load_checkpoint: open the checkpoint first.
    ckpt = real_load(str(ensure_default_model()), torch.float32)
    choice = choose_weights(name, "auto", "cpu", int4_codes=ckpt.int4_codes, projection_params=0)

    def load_checkpoint(path: Any, dtype: Any = torch.float32, progress: Any = None) -> Any:
        return ckpt

    def choose_dtype(_name: str, device: str) -> torch.dtype:
        print(f"== weights={name}: {choice.describe()}")
        return choice.dtype

    class Model(LlamaForCausalLM):
        def __init__(self, config: Any, dtype: torch.dtype, device: Any = "cpu", **kw: Any) -> None:
            super().__init__(config, dtype, device, weights=choice.format, **kw)

        def load_weights(self, tensors: Any) -> None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                super().load_weights(ckpt.weights)
            finally:
                torch.set_num_threads(threads)

    script_globals = namespace["main"].__globals__  # run_path returns a copy of them
    script_globals["load_checkpoint"] = load_checkpoint
    script_globals["choose_dtype"] = choose_dtype
    script_globals["LlamaForCausalLM"] = Model
    sys.argv = [str(script), *rest]
    namespace["main"]()
    sys.stdout.flush()


def load(args: argparse.Namespace) -> None:
    path = str(ensure_default_model())
    for name in args.formats:
        t0 = time.perf_counter()
        load_model(path, weights=name)
        plain = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as cache:
            t0 = time.perf_counter()
            load_model(path, weights=name, cache_dir=cache)
            miss = time.perf_counter() - t0
            t0 = time.perf_counter()
            load_model(path, weights=name, cache_dir=cache)
            hit = time.perf_counter() - t0
        print(f"weights={name:9s} load_model: no cache {plain:.2f} s, cache miss (writes it) {miss:.2f} s, "
              f"cache hit {hit:.2f} s")


def serve(args: argparse.Namespace) -> None:
    import json
    import os
    import signal
    import subprocess
    import urllib.request

    body = json.dumps({"model": args.model or "smol",
                       "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": args.max_tokens, "temperature": 0}).encode()
    model_args = [args.model] if args.model else []
    for run in range(args.runs):
        port = 8931 + run
        log_path = Path(tempfile.gettempdir()) / f"helios-first-answer-{os.getpid()}.log"
        t0 = time.perf_counter()
        with log_path.open("w") as log_file:
            proc = subprocess.Popen([*args.command.split(), "serve", *model_args, "--port", str(port),
                                     "--no-access-log"],
                                    stdout=subprocess.DEVNULL, stderr=log_file)
        answer = None
        try:
            while answer is None and time.perf_counter() - t0 < 120 and proc.poll() is None:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=30) as response:
                        answer = json.load(response)["choices"][0]["message"]["content"]
                except OSError:
                    time.sleep(0.1)
            elapsed = time.perf_counter() - t0
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        loaded = next((line.strip() for line in log_path.read_text().splitlines() if line.startswith("Loaded")), "")
        print(f"first answer after {elapsed:.2f} s: {answer!r}; {loaded[:60]}")


def main() -> None:
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        rest = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["linears", "step", "load", "serve"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--command", default=f"{sys.executable} -m helios.cli")
    ap.add_argument("--model", default="", help="serve: the model `helios serve` takes (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=16, help="serve: the chat request's max_tokens")
    args = ap.parse_args(argv)
    args.rest = rest
    {"linears": linears, "step": step, "load": load, "serve": serve}[args.what](args)


if __name__ == "__main__":
    main()
