"""`helios serve | models | bench | top`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from helios.config import WEIGHT_FORMATS

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess as SpawnProcess

    from hypercorn.config import Config as HyperConfig

    from helios.app import HeliosApp
    from helios.config import HeliosConfig

log = logging.getLogger("helios")


KEEP_ALIVE_SECONDS = 75
"""How long hypercorn keeps an idle connection open. Above every common client pool's expiry
(httpx and the OpenAI and Anthropic SDKs: 5 s; Node's undici: 4 s), so a pooled client always drops
an idle connection before the server closes it. hypercorn's own default, 5 s, equals httpx's: a
request sent as the server closes that connection dies with a ReadError or "Server disconnected"
(docs/operations.md, Transport)."""


STARTUP_SECONDS = 3600.0
"""How long hypercorn waits for the lifespan startup (the model load) before it gives up."""


def hypercorn_config(cfg: HeliosConfig) -> HyperConfig:
    """`helios serve`'s hypercorn configuration (the test servers use it too)."""
    from hypercorn.config import Config as HyperConfig

    hc = HyperConfig()
    hc.bind = [f"{cfg.server.host}:{cfg.server.port}"]
    hc.accesslog = None  # the app writes its own access log (helios.access), with token counts
    hc.keep_alive_timeout = KEEP_ALIVE_SECONDS
    # The model loads in the lifespan's startup: hypercorn's 60 s default would kill a server whose
    # load takes longer (a first start that packs a large GGUF, a busy laptop, a slow disk).
    hc.startup_timeout = STARTUP_SECONDS
    # The app drains on the signal (below) before hypercorn stops accepting; hypercorn's own grace
    # then covers what is left (non-generation requests), and its lifespan timeout the engine stop.
    grace = cfg.server.shutdown_grace_seconds
    hc.graceful_timeout = grace
    hc.shutdown_timeout = grace + 60
    return hc


def _serve(args: argparse.Namespace) -> int:
    from helios.config import ConfigError, load_config, read_api_key_file

    try:
        overrides: dict[str, dict[str, object]] = {"server": {"host": args.host, "port": args.port}, "model": {}}
        if args.model:
            overrides["model"]["path"] = args.model
        if args.dtype:
            overrides["model"]["dtype"] = args.dtype
        if args.weights:
            overrides["model"]["weights"] = args.weights
        if args.api_key_file:
            overrides["server"]["api_key"] = read_api_key_file(args.api_key_file)
        overrides["server"]["log_level"] = args.log_level
        if args.no_access_log:
            overrides["server"]["access_log"] = False
        if args.shutdown_grace is not None:
            overrides["server"]["shutdown_grace_seconds"] = args.shutdown_grace
        overrides["parallel"] = {"data_parallel_size": args.data_parallel_size,
                                 "data_parallel_mode": args.data_parallel_mode,
                                 "data_parallel_rank": args.data_parallel_rank, "routing": args.routing,
                                 "kv_events": True if args.kv_events else None,
                                 "tensor_parallel_size": args.tensor_parallel_size,
                                 "expert_parallel": True if args.expert_parallel else None}
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"helios: {exc}", file=sys.stderr)
        return 2
    if cfg.model.path:  # a catalog name: fetched now (with a progress bar), before the server starts
        from helios.loaders import catalog

        try:
            entry = catalog.lookup(cfg.model.path)
            if entry is not None:
                catalog.ensure_entry(entry)
        except catalog.UnknownModel as exc:
            print(f"helios: {exc}", file=sys.stderr)
            return 2
        except (OSError, RuntimeError) as exc:
            print(f"helios: cannot fetch {cfg.model.path}: {exc}", file=sys.stderr)
            return 1
    logging.getLogger().setLevel(cfg.server.log_level.upper())
    from helios.runtime import launched_by_torchrun, parallel_world, run_parallel_worker

    workers: list[SpawnProcess] = []
    try:
        world = parallel_world(cfg)
        if world > 1 and launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            return run_parallel_worker(cfg)  # torchrun: rank 0 serves, the others run their shards
        if world > 1 and not launched_by_torchrun():
            cfg, workers = _start_ranks(cfg, world)
    except ConfigError as exc:
        print(f"helios: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve_http(cfg)
    finally:
        _stop_ranks(workers)


def _start_ranks(cfg: HeliosConfig, world: int) -> tuple[HeliosConfig, list[SpawnProcess]]:
    """`helios serve` with tensor_parallel_size > 1 outside torchrun: ranks 1 .. world - 1 as
    spawned processes on this machine (this process is rank 0), meeting on a free port."""
    import socket

    import attrs
    import torch.multiprocessing as mp

    port = cfg.parallel.master_port
    if not port:
        with socket.socket() as sock:
            sock.bind((cfg.parallel.master_addr, 0))
            port = sock.getsockname()[1]
    cfg = attrs.evolve(cfg, parallel=attrs.evolve(cfg.parallel, tensor_parallel_size=world, master_port=port))
    context = mp.get_context("spawn")
    workers: list[SpawnProcess] = []
    for rank in range(1, world):
        proc = context.Process(target=_parallel_worker, args=(cfg, rank), name=f"helios-rank-{rank}", daemon=True)
        proc.start()
        workers.append(proc)
    log.info("tensor parallel: started ranks 1..%d (tcp://%s:%d)", world - 1, cfg.parallel.master_addr, port)
    return cfg, workers


def _parallel_worker(cfg: HeliosConfig, rank: int) -> None:
    """A spawned rank's entry point (`_start_ranks`)."""
    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from helios.runtime import run_parallel_worker

    try:
        run_parallel_worker(cfg, rank)
    except ValueError as exc:  # a model this size cannot shard (rank 0 reports the same at start-up)
        log.error("tensor-parallel rank %d: %s", rank, exc)
        raise SystemExit(1) from None


def _stop_ranks(workers: list[SpawnProcess]) -> None:
    """After serving: the spawned ranks end when rank 0 stops them (its engine's shutdown); one that
    has not ended within 10 s is killed (workers ignore SIGINT and SIGTERM)."""
    for proc in workers:
        proc.join(10)
        if proc.is_alive():
            log.warning("tensor parallel: %s did not stop; killing it", proc.name)
            proc.kill()
            proc.join(5)


def _serve_http(cfg: HeliosConfig) -> int:
    import trio
    from hypercorn.trio import serve

    from helios.app import HeliosApp

    app = HeliosApp(cfg)
    hc = hypercorn_config(cfg)
    print(f"Helios serving on http://{cfg.server.host}:{cfg.server.port}", file=sys.stderr)
    from hypercorn.utils import LifespanFailureError

    failed = False
    died: list[str] = []
    try:
        trio.run(partial(serve, app, hc, shutdown_trigger=partial(_shutdown_trigger, app, died)))  # type: ignore[arg-type]
    except* LifespanFailureError:
        failed = True  # the app logged why, in one line for a model it cannot serve
    if died:
        return ENGINE_DIED_STATUS
    return 1 if failed else 0


ENGINE_DIED_STATUS = 70  # EX_SOFTWARE: the engine thread died; a supervisor should restart the process


def _models(args: argparse.Namespace) -> int:
    """`helios models`: the catalog (name, size, whether it is cached, its path), then what the
    model cache holds."""
    from helios.loaders import catalog

    cache = catalog.default_cache_dir()
    rows = [("NAME", "SIZE", "CACHED", "PATH")]
    for entry in catalog.ENTRIES:
        name = entry.name + (" (default)" if entry.name == catalog.DEFAULT_NAME else "")
        cached = "yes" if catalog.cached_path(entry, cache) is not None else "no"
        rows.append((name, _size(entry.size), cached, str(cache / entry.file_name)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[3]]).rstrip())
    print()
    by_file = {e.file_name: e for e in catalog.ENTRIES}
    items = sorted(cache.iterdir()) if cache.is_dir() else []
    total = 0
    lines = []
    for item in items:
        size = _tree_size(item)
        total += size
        found = by_file.get(item.name)
        if item.is_dir() and item.name == "packed":
            what = "packed-weight cache"
        elif item.name.startswith(".") and (item.name.endswith(".partial") or item.name.startswith(".download-")):
            what = "a download in progress or interrupted"
        elif found is not None:
            what = found.name if catalog.cached_path(found, cache) is not None else f"{found.name} (wrong size)"
        else:
            what = "not in the catalog"
        lines.append((item.name + ("/" if item.is_dir() else ""), _size(size), what))
    print(f"cache {cache}: " + (f"{len(items)} entries, {_size(total)}" if items else "empty"))
    width = max((len(n) for n, _, _ in lines), default=0)
    for name, shown, what in lines:
        print(f"  {name.ljust(width)}  {shown:>9}  {what}")
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


async def _shutdown_trigger(app: HeliosApp, died: list[str]) -> None:
    """hypercorn's shutdown trigger for `helios serve`: on SIGTERM or SIGINT (Ctrl-C), or when the
    engine thread dies (its requests have then failed in their protocols' error shapes and /health
    is 503), drain the app while the server still accepts connections (new generation requests and
    /health get 503), then return, which makes hypercorn stop accepting and shut down. A second
    signal ends the grace period at once (the remaining requests are aborted). An engine death is
    appended to ``died``: the process then exits with `ENGINE_DIED_STATUS`."""
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as first:

            async def on_signal() -> None:
                async for signum in signals:
                    log.info("shutdown: %s received", signal.Signals(signum).name)
                    break
                first.cancel_scope.cancel()

            async def on_engine_death() -> None:
                while (why := app.engine_failure()) is None:
                    await trio.sleep(0.25)
                died.append(why)
                log.critical("shutdown: %s; draining, then exiting with status %d", why, ENGINE_DIED_STATUS)
                first.cancel_scope.cancel()

            first.start_soon(on_signal)
            first.start_soon(on_engine_death)

        async def abort_on_second_signal() -> None:
            async for signum in signals:
                log.warning("shutdown: second %s received; aborting in-flight requests now",
                            signal.Signals(signum).name)
                app.abort_now()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_on_second_signal)
            await app.drain()
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="helios", description="Helios LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model (default: SmolLM2-135M-Instruct)")
    s.add_argument("model", nargs="?",
                   help="a GGUF file, a Hugging Face model directory or a catalog name (see `helios models`)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--config", default=None, help="TOML configuration file (default: $HELIOS_CONFIG)")
    s.add_argument("--api-key-file", default=None, help="file holding the serving key (overrides [server] api_key)")
    s.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--weights", default=None, choices=list(WEIGHT_FORMATS),
                   help="how the projections are stored and multiplied ([model] weights; default auto)")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="log level (overrides [server] log_level; default info)")
    s.add_argument("--no-access-log", action="store_true",
                   help="no per-request access log lines (overrides [server] access_log)")
    s.add_argument("--shutdown-grace", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM/Ctrl-C, how long in-flight requests may finish before they are aborted "
                        "(overrides [server] shutdown_grace_seconds; default 30)")
    s.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="engine processes (ranks) behind this server, or the deployment's ranks in external "
                        "mode (overrides [parallel] data_parallel_size; default 1)")
    s.add_argument("--data-parallel-mode", default=None, choices=["internal", "external"],
                   help="internal: this server runs and routes between the ranks; external: it is one rank, "
                        "an outside router routes ([parallel] data_parallel_mode; default internal)")
    s.add_argument("--data-parallel-rank", type=int, default=None, metavar="R",
                   help="external mode: this server's rank, named in its KV events ([parallel] data_parallel_rank)")
    s.add_argument("--routing", default=None, choices=["cache_aware", "round_robin"],
                   help="internal mode's routing between ranks ([parallel] routing; default cache_aware)")
    s.add_argument("--kv-events", action="store_true",
                   help="publish KV events at GET /v1/kv_events ([parallel] kv_events)")
    s.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="shard the model over N ranks on this machine (overrides [parallel] tensor_parallel_size; "
                        "under torchrun, WORLD_SIZE)")
    s.add_argument("--expert-parallel", action="store_true",
                   help="split a mixture-of-experts model's experts across the tensor-parallel ranks "
                        "(overrides [parallel] expert_parallel)")
    sub.add_parser("models", help="list the model catalog (name, size, cached, path) and the model cache")
    sub.add_parser("bench", help="benchmark an OpenAI-compatible server", add_help=False)
    sub.add_parser("top", help="live terminal dashboard of a server's /metrics", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        from helios.clients.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "top":
        from helios.clients.top import main as top_main

        return top_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "models":
        return _models(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
