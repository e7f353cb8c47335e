"""A decode step as served against the same step compiled by torch.compile (inductor): the evidence
behind not compiling the forward (docs/benchmarks.md, "torch.compile").

    .venv/bin/python scripts/bench_compile.py --streams 1 8 32 [--steps 60] [--weights auto]

Three ways to run an all-decode step of the default model (N streams, 300-token prompts, greedy):
- ``fused``: as `helios serve` runs it: all decoder layers in one `helios::decode_layers` call.
- ``layers``: the layer-by-layer forward (the fused forms removed), with Helios's operators for the
  norms, RoPE, SwiGLU and paged attention.
- ``compiled``: the layer-by-layer forward under ``torch.compile(dynamic=True)``: inductor's C++ for
  everything but the projections and the paged attention (opaque operators here, given fake
  implementations so they trace), the norms, RoPE and SwiGLU in torch ops for inductor to fuse.
Prints ms/step (median) per mode and batch, the first all-decode step of ``compiled`` (the compile,
or its inductor cache hit on a second run), and whether the compiled tokens equal the eager ones.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.loaders.default_model import default_cache_dir, ensure_default_model
from helios.models import cpu_kernels
from helios.models.quant import DenseLinear
from helios.runtime import cpu_flags, load_model


def register_fakes() -> None:
    """Shapes of the operators that stay opaque in the compiled graph (the projections' and attention's)."""
    lib = "helios::"

    @torch.library.register_fake(lib + "write_paged_decode")  # type: ignore[misc]
    def _wpd(q: torch.Tensor, *_: Any) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "paged_decode")  # type: ignore[misc]
    def _pd(q: torch.Tensor, *_: Any) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "q8_linear")  # type: ignore[misc]
    def _q8(x: torch.Tensor, codes: torch.Tensor, _scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)

    @torch.library.register_fake(lib + "q8_linear_bf16")  # type: ignore[misc]
    def _q8b(x: torch.Tensor, _codes: torch.Tensor, _scales: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)


def run(loaded: Any, mode: str, streams: int, steps: int) -> tuple[float, float, list[list[int]]]:
    model = loaded.model
    core = EngineCore(model,
                      EngineConfig(page_size=16, num_pages=3000, max_active=64, prefill_chunk_size=2048,
                                   max_model_len=4096), loaded.choice.dtype)
    for i in range(streams):
        prompt = tuple((7919 * i + 31 * j) % 40000 + 100 for j in range(300))
        core.add(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=steps + 40,
                               ignore_eos=True))
    tokens: dict[str, list[int]] = {}

    def step() -> float:
        t = time.perf_counter()
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return time.perf_counter() - t

    while any(len(tokens.get(f"r{i}", ())) == 0 for i in range(streams)):
        step()  # the prefills
    first = step()  # the first all-decode step: compiles in `compiled` mode
    for _ in range(10):
        step()
    times = [step() for _ in range(steps)]
    return statistics.median(times) * 1e3, first, [tokens[f"r{i}"] for i in range(streams)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--weights", default="auto")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(ensure_default_model(), weights=args.weights, cache_dir=default_cache_dir() / "packed")
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"{loaded.choice.describe()}")
    if not cpu_kernels.available():
        raise SystemExit(f"Helios's CPU kernels are not built: {cpu_kernels.unavailable_reason()}")
    register_fakes()
    model = loaded.model
    layers = list(model.layers)
    fused_forms = [(layer._int4, layer._onednn) for layer in layers]
    eager_forward = model.forward
    compiled_forward = torch.compile(eager_forward, dynamic=True)
    available = cpu_kernels.available

    def in_graph_torch_ops() -> bool:  # while tracing, the norms/RoPE/SwiGLU are torch ops for inductor
        return False if torch.compiler.is_compiling() else available()

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *, embeds: Any = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        if embeds is None and keep is None and getattr(attn, "all_decode", False):
            out: torch.Tensor = compiled_forward(input_ids, positions, attn)
            return out
        return eager_forward(input_ids, positions, attn, embeds=embeds, keep=keep)

    # Inductor cannot lower oneDNN's prepacked linear (without freezing the weights into the graph):
    # in the compiled mode the projections that have a packed copy multiply their plain weight.
    packed = [m for layer in layers for m in layer.modules() if getattr(m, "onednn", None) is not None]
    plain = {id(m): m.onednn.to_dense() for m in packed}
    for streams in args.streams:
        results: dict[str, tuple[float, float, list[list[int]]]] = {}
        failed = ""
        for mode in ("fused", "layers", "compiled"):
            for layer, (int4, onednn) in zip(layers, fused_forms, strict=True):
                layer._int4, layer._onednn = (int4, onednn) if mode == "fused" else (None, None)
            compiled = mode == "compiled"
            model.forward = forward if compiled else eager_forward  # type: ignore[method-assign]
            cpu_kernels.available = in_graph_torch_ops if compiled else available  # type: ignore[assignment]
            saved = [(m, m.onednn, getattr(m, "dense", None)) for m in packed]
            for m in packed if compiled else ():
                if isinstance(m, DenseLinear):
                    m.onednn = None
                else:
                    m.onednn, m.dense = None, plain[id(m)]
            try:
                results[mode] = run(loaded, mode, streams, args.steps)
            except Exception as exc:  # an inductor failure is a result too
                failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            finally:
                cpu_kernels.available = available  # type: ignore[assignment]
                model.forward = eager_forward  # type: ignore[method-assign]
                for m, onednn, dense in saved:
                    m.onednn = onednn
                    if not isinstance(m, DenseLinear):
                        m.dense = dense
        line = ", ".join(f"{mode} {ms:.2f}" for mode, (ms, _, _) in results.items())
        if failed:
            print(f"{streams} stream(s): ms/step {line}; compiled: failed ({failed})")
            continue
        same = results["compiled"][2] == results["layers"][2]
        print(f"{streams} stream(s): ms/step {line}; compiled first decode step {results['compiled'][1]:.1f} s; "
              f"compiled tokens {'equal' if same else 'DIFFER from'} the layer-by-layer ones")


if __name__ == "__main__":
    main()
