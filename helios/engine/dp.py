"""Data parallelism: N engine processes behind one engine handle.

`DataParallelEngine` is what the serving side's `EngineClient` drives (``healthy``, ``submit``,
``abort``, ``stats``), like the one-process `core.EngineThread`, so nothing above it changes. Each
rank is a process of the ``spawn`` context running `serve_rank`: it builds its own `EngineCore`
(the composition root's builder, from the same configuration, with a share of the cores), runs it
on an `EngineThread`, and talks to the front over one `multiprocessing` pipe:

    front -> rank:  Add(EngineRequest) | Abort(ids) | Shutdown()        (pickled records)
    rank -> front:  ("ready", fingerprint, page_size, pid) once, then
                    ("kv", [KVEvent])        a step's KV events, before that step's outputs
                    ("out", [RequestOutput]) a step's outputs
                    ("stats", EngineStats, problem)  every STATS_INTERVAL_S
                    ("died", message)        its engine thread died (it exits after)

In the front, one writer thread per rank pickles and sends (the trio loop only appends to a queue)
and one reader thread per rank receives: outputs go to the sink (`EngineClient.sink`), KV events
update that rank's mirror of cached chain hashes (`kv.events.CachedBlocks`) and go to an optional
listener (the `/v1/kv_events` stream). Since a rank sends a step's KV events before its outputs, a
conversation's next turn, sent after the client saw the previous one finish, is routed with that
turn's pages in the mirror.

Routing (`Router`): ``cache_aware`` hashes the prompt's full pages with the prefix cache's own chain
hash (`kv.manager.chain_hashes`, the rank's fingerprint) and scores each live rank by its cached
prefix in tokens minus ``load_weight_tokens`` per request it has in flight; when no rank holds at
least ``cache_threshold`` of the prompt, the least loaded rank takes it (fewest in flight, then
fewest cached pages, then in turn), so new conversations spread. ``round_robin`` takes live ranks in
turn. Children of one request with the same prompt (n > 1: one prompt tuple) go to one rank.

Failure: a rank whose pipe ends (its process died or was killed) is down: every child routed to it
gets an ERROR output (`FailureKind.ENGINE`), so each protocol ends it in its own error shape; the
other ranks keep serving, and `problem()` (what `/health` reads) names the rank until it is back.
With ``restart`` the rank is started again (its cache empty); with every rank down, ``healthy`` is
False (new requests get 503) and ``is_alive()`` False.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import attrs

from helios.domain.events import FailureKind
from helios.engine.core import EngineCore, EngineThread
from helios.engine.kv.events import AllBlocksCleared, CachedBlocks, KVEvent
from helios.engine.kv.manager import chain_hashes
from helios.engine.records import (
    Abort,
    Add,
    EngineFinish,
    EngineRequest,
    EngineStats,
    InboxItem,
    RankStats,
    RequestOutput,
    Shutdown,
)

log = logging.getLogger("helios.engine.dp")

STATS_INTERVAL_S = 0.25
READY_TIMEOUT_S = 600.0  # a rank loads the model (a cold packed-weight cache converts it)

Sink = Callable[[list[RequestOutput]], None]
KVListener = Callable[[int, list[KVEvent]], None]


@attrs.frozen
class RankEngine:
    """What the composition root's builder gives a rank process: its core and how to run it."""

    core: EngineCore
    threads: int | None
    adapt_threads: bool = False
    stall_seconds: float = 60.0


# -- the rank process ---------------------------------------------------------------------------

def serve_rank(conn: Connection, rank: int, build: Callable[[], RankEngine]) -> None:
    """A rank process's body: build the engine, say ready, then apply the front's records until a
    Shutdown (or the front's end of the pipe closes); exits 1 when its engine thread died."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    # The front decides when a rank stops (a Shutdown record, or its end of the pipe closing): a
    # Ctrl-C or a service manager's SIGTERM to the whole process group must not kill the ranks
    # while the front drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            with contextlib.suppress(OSError, EOFError):  # the front is gone: nothing to tell
                conn.send(msg)

    try:
        spec = build()
    except BaseException as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    core = spec.core
    thread = EngineThread(core, lambda outs: send(("out", outs)), threads=spec.threads,
                          adapt_threads=spec.adapt_threads, kv_events=lambda events: send(("kv", events)))
    send(("ready", core.hash_fingerprint, core.event_pool.page_size, os.getpid()))
    thread.start()
    last = 0.0
    while True:
        if conn.poll(STATS_INTERVAL_S):
            try:
                item: InboxItem = conn.recv()
            except (EOFError, OSError):
                item = Shutdown()  # the front closed its end: stop
            except Exception as exc:  # a record that does not unpickle here (its request id is unknown):
                # die as a rank does, so the front fails what this rank held instead of waiting on it.
                send(("died", f"a record from the front could not be read: {type(exc).__name__}: {exc}"))
                raise SystemExit(1) from None
            if isinstance(item, Add):
                thread.submit(item.request)
            elif isinstance(item, Abort):
                thread.abort(item.request_ids)
            elif isinstance(item, Shutdown):
                thread.shutdown()
                send(("stats", thread.stats(), None))
                return
        if not thread.is_alive():
            send(("died", thread.error or "the engine thread stopped"))
            raise SystemExit(1)
        now = time.monotonic()
        if now - last >= STATS_INTERVAL_S:
            last = now
            send(("stats", thread.stats(), thread.problem(spec.stall_seconds)))


# -- routing --------------------------------------------------------------------------------------

@attrs.frozen
class Candidate:
    """A live rank as the router sees it."""

    rank: int
    cached: CachedBlocks
    in_flight: int


@attrs.frozen
class Choice:
    rank: int
    hit_tokens: int
    """The chosen rank's cached prefix of the prompt (full pages, in tokens)."""


class Router:
    def __init__(self, policy: str, *, page_size: int, fingerprint: bytes, load_weight_tokens: int = 512,
                 cache_threshold: float = 0.25) -> None:
        if policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.load_weight_tokens = load_weight_tokens
        self.cache_threshold = cache_threshold
        self._turn = itertools.count()

    def cached_pages(self, token_ids: Sequence[int], candidates: Sequence[Candidate]) -> list[int]:
        """Each candidate's cached prefix of the prompt, in full pages (never the prompt's last
        token, as the manager's lookup): hashes are computed page by page and stop at the first
        page no candidate holds."""
        limit = (len(token_ids) - 1) // self.page_size
        hits = [0] * len(candidates)
        matching = list(range(len(candidates)))
        parent: int | None = None
        for page in range(limit):
            if not matching:
                break
            h = chain_hashes(token_ids, 1, page_size=self.page_size, fingerprint=self.fingerprint,
                             parent=parent, start_page=page)[0]
            still = []
            for i in matching:
                if h in candidates[i].cached:
                    hits[i] = page + 1
                    still.append(i)
            matching, parent = still, h
        return hits

    def choose(self, token_ids: Sequence[int], candidates: Sequence[Candidate]) -> Choice:
        if not candidates:
            raise ValueError("no rank to route to")
        turn = next(self._turn)
        n = len(candidates)
        order = [(turn + k) % n for k in range(n)]  # ties go in turn
        hits = self.cached_pages(token_ids, candidates)
        ps = self.page_size
        if self.policy == "round_robin":
            i = order[0]
            return Choice(candidates[i].rank, hits[i] * ps)
        best = max(hits)
        if best > 0 and best * ps >= self.cache_threshold * len(token_ids):
            def score(i: int) -> tuple[float, int]:
                c = candidates[i]
                return (hits[i] * ps - self.load_weight_tokens * c.in_flight, -c.in_flight)
            i = max(order, key=score)
        else:
            i = min(order, key=lambda i: (candidates[i].in_flight, len(candidates[i].cached)))
        return Choice(candidates[i].rank, hits[i] * ps)


# -- the front ------------------------------------------------------------------------------------

@attrs.define(eq=False)
class _Rank:
    index: int
    state: str = "starting"  # starting | live | down | stopped
    process: BaseProcess | None = None
    conn: Connection | None = None
    outbox: queue.SimpleQueue[InboxItem | None] = attrs.field(factory=queue.SimpleQueue)
    cached: CachedBlocks = attrs.field(factory=CachedBlocks)
    in_flight: set[str] = attrs.field(factory=set)
    stats: EngineStats | None = None
    problem: str | None = None
    error: str | None = None
    routed: int = 0
    routed_hit_tokens: int = 0
    restarts: int = 0
    reader: threading.Thread | None = None
    writer: threading.Thread | None = None


# EngineStats counters that a rank restart must not take back (a dead rank's last values are kept).
_COUNTERS = ("prefill_tokens", "generated_tokens", "reused_tokens", "reasoning_budget_cuts", "draft_steps")
_GAUGES = ("active", "pending", "free_pages", "total_pages", "cached_pages")


class DataParallelEngine:
    """N rank processes behind one engine handle (see the module docstring)."""

    def __init__(self, build: Callable[[int], Callable[[], RankEngine]], size: int, *, routing: str = "cache_aware",
                 load_weight_tokens: int = 512, cache_threshold: float = 0.25, restart: bool = True,
                 kv_listener: KVListener | None = None, context: Any = None) -> None:
        """``build(rank)``: a picklable callable the rank process calls to build its engine (the
        composition root's). ``kv_listener(rank, events)``: called on a reader thread with every
        rank's KV events (an `AllBlocksCleared` when a rank goes down or starts)."""
        if size < 1:
            raise ValueError("a data-parallel engine needs at least one rank")
        self._build = build
        self.size = size
        self._policy = (routing, load_weight_tokens, cache_threshold)
        self.router: Router | None = None  # made from the first rank's fingerprint and page size
        self.restart = restart
        self._kv_listener = kv_listener
        self._ctx = context if context is not None else multiprocessing.get_context("spawn")
        self._ranks = [_Rank(i) for i in range(size)]
        self._owner: dict[str, int] = {}  # child request id -> rank
        self._last: tuple[tuple[int, ...], int] | None = None  # (prompt, rank) of the last child routed
        self._lock = threading.Lock()
        self._sink: Sink | None = None
        self._pending: list[list[RequestOutput]] = []  # outputs before a sink was attached
        self._closing = False
        self._retired: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.error: str | None = None  # the latest rank failure, in words
        self._fingerprint: bytes | None = None
        self._page_size = 0

    # -- start and stop -----------------------------------------------------------------------
    def launch(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Start every rank and wait until each is ready (blocking: call it off the event loop).
        A rank that fails to start stops the others and raises RuntimeError with its reason."""
        if multiprocessing.current_process().daemon:
            raise RuntimeError("data parallelism starts rank processes, which a daemonic process may not: run "
                               "`helios serve`, or hypercorn with --workers 0 (its worker processes are daemonic)")
        # Ranks ignore SIGTERM, and multiprocessing's exit handler terminates then joins daemonic
        # children: this handler (atexit runs last-registered first) kills any rank left before it.
        atexit.register(self._kill_ranks)
        for r in self._ranks:
            self._spawn(r)
        try:
            for r in self._ranks:
                self._await_ready(r, timeout)
        except BaseException:
            self.shutdown(timeout=5.0)
            raise
        routing, weight, threshold = self._policy
        assert self._fingerprint is not None
        self.router = Router(routing, page_size=self._page_size, fingerprint=self._fingerprint,
                             load_weight_tokens=weight, cache_threshold=threshold)
        for r in self._ranks:
            self._start_threads(r)

    def _kill_ranks(self) -> None:
        self._closing = True
        for r in self._ranks:
            if r.process is not None and r.process.is_alive():
                r.process.kill()

    def _spawn(self, r: _Rank) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=serve_rank, args=(child, r.index, self._build(r.index)),
                                 name=f"helios-rank-{r.index}", daemon=True)
        proc.start()
        child.close()
        r.process, r.conn, r.state = proc, parent, "starting"
        r.outbox = queue.SimpleQueue()
        r.cached = CachedBlocks()
        r.stats, r.problem = None, None

    def _await_ready(self, r: _Rank, timeout: float) -> None:
        conn, proc = r.conn, r.process
        assert conn is not None and proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    proc.join(5)
                    raise RuntimeError(f"data-parallel rank {r.index} exited while starting "
                                       f"(exit code {proc.exitcode})") from None
                if msg[0] == "failed":
                    raise RuntimeError(f"data-parallel rank {r.index} failed to start: {msg[1]}")
                if msg[0] == "ready":
                    _, fingerprint, page_size, _pid = msg
                    if self._fingerprint is None:
                        self._fingerprint, self._page_size = fingerprint, page_size
                    elif (fingerprint, page_size) != (self._fingerprint, self._page_size):
                        raise RuntimeError(f"data-parallel rank {r.index} hashes its pages differently from rank 0")
                    r.state = "live"
                    log.info("data-parallel rank %d ready (pid %d)", r.index, proc.pid)
                    return
            elif time.monotonic() >= deadline:
                raise RuntimeError(f"data-parallel rank {r.index} was not ready within {timeout:g} s")
            elif not proc.is_alive():
                raise RuntimeError(f"data-parallel rank {r.index} exited while starting (exit code {proc.exitcode})")

    def _start_threads(self, r: _Rank) -> None:
        r.reader = threading.Thread(target=self._read, args=(r, r.conn), name=f"helios-rank-{r.index}-reader",
                                    daemon=True)
        r.writer = threading.Thread(target=self._write, args=(r, r.conn, r.outbox),
                                    name=f"helios-rank-{r.index}-writer", daemon=True)
        r.reader.start()
        r.writer.start()

    def attach(self, sink: Sink) -> None:
        with self._lock:
            self._sink = sink
            pending, self._pending = self._pending, []
        for outs in pending:
            sink(outs)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank: a Shutdown record, then up to ``timeout`` seconds for the processes to
        exit, then SIGKILL for those left."""
        with self._lock:
            self._closing = True
            ranks = list(self._ranks)
        for r in ranks:
            if r.writer is not None and r.writer.is_alive():
                r.outbox.put(Shutdown())
            elif r.conn is not None:  # starting (a launch that failed, a restart): no writer yet
                with contextlib.suppress(OSError, ValueError):
                    r.conn.send(Shutdown())
        deadline = time.monotonic() + timeout
        for r in ranks:
            if r.process is not None:
                r.process.join(max(0.0, deadline - time.monotonic()))
        for r in ranks:
            if r.process is not None and r.process.is_alive():
                log.warning("data-parallel rank %d did not stop within %g s; killing it", r.index, timeout)
                r.process.kill()
                r.process.join(5)
            if r.reader is not None:
                r.reader.join(2)
            r.outbox.put(None)
            r.state = "stopped"
        atexit.unregister(self._kill_ranks)

    def page_counts(self) -> tuple[int, int] | None:
        """(free, total) KV pages over every rank by their last stats (after `shutdown`, what the
        ranks reported as they stopped); None when a rank never reported."""
        with self._lock:
            stats = [r.stats for r in self._ranks]
        if any(s is None for s in stats):
            return None
        return sum(s.free_pages for s in stats if s is not None), sum(s.total_pages for s in stats if s is not None)

    # -- the engine handle ----------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Some rank can take requests."""
        return any(r.state == "live" for r in self._ranks)

    def problem(self, stall_seconds: float, now: float | None = None) -> str | None:
        """Why this engine is not whole (None while every rank is live and well): `/health` is 503
        while any rank is down, restarting, wedged or failed."""
        issues = []
        for r in self._ranks:
            if r.state != "live":
                why = f": {r.error}" if r.error else ""
                issues.append(f"data-parallel rank {r.index} is {'restarting' if r.state == 'starting' else r.state}{why}")
            elif r.problem is not None:
                issues.append(f"data-parallel rank {r.index}: {r.problem}")
        return "; ".join(issues) if issues else None

    def is_alive(self) -> bool:
        """Some rank runs or is starting again (False once every rank is down for good, or stopped)."""
        return any(r.state in ("live", "starting") for r in self._ranks)

    def submit(self, request: EngineRequest) -> None:
        failed: RequestOutput | None = None
        with self._lock:
            r = self._route(request)
            if r is None:
                failed = RequestOutput(request.request_id, (), finish=EngineFinish.ERROR,
                                       error="no data-parallel rank is running", failure=FailureKind.ENGINE)
            else:
                self._owner[request.request_id] = r.index
                r.in_flight.add(request.request_id)
                r.outbox.put(Add(request))
        if failed is not None:
            self._deliver([failed])

    def _route(self, request: EngineRequest) -> _Rank | None:
        live = [r for r in self._ranks if r.state == "live"]
        if not live:
            return None
        prompt = request.prompt_token_ids
        last = self._last
        if last is not None and last[0] is prompt:
            r = self._ranks[last[1]]
            if r.state == "live":  # a sibling child (n > 1: the Service gives them one prompt tuple)
                r.routed += 1
                return r
        assert self.router is not None
        choice = self.router.choose(prompt, [Candidate(r.index, r.cached, len(r.in_flight)) for r in live])
        r = self._ranks[choice.rank]
        r.routed += 1
        r.routed_hit_tokens += choice.hit_tokens
        self._last = (prompt, r.index)
        return r

    def abort(self, request_ids: Sequence[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                rank = self._owner.get(rid)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(rid)
            for rank, ids in by_rank.items():
                r = self._ranks[rank]
                if r.state == "live":
                    r.outbox.put(Abort(tuple(ids)))

    def rank_of(self, request_id: str) -> int | None:
        """The rank a child in flight was routed to (None once it finished)."""
        with self._lock:
            return self._owner.get(request_id)

    def stats(self) -> EngineStats:
        """The ranks' stats merged: gauges summed over live ranks, counters summed over every rank
        that ever ran (a dead rank's last counts are kept), the feature records (threads, host
        store, speculation, checkpoints) those of the first rank that reported; plus one
        `RankStats` per rank."""
        with self._lock:
            ranks = [(r, r.stats) for r in self._ranks]
            retired = dict(self._retired)
            per_rank = tuple(RankStats(
                rank=r.index, up=r.state == "live", in_flight=len(r.in_flight), routed=r.routed,
                routed_hit_tokens=r.routed_hit_tokens, reused_tokens=s.reused_tokens if s is not None else 0,
                restarts=r.restarts, cached_pages=len(r.cached),
                pid=(r.process.pid or 0) if r.process is not None and r.state == "live" else 0) for r, s in ranks)
        reported = [s for _r, s in ranks if s is not None]
        first = reported[0] if reported else None
        live = [s for r, s in ranks if s is not None and r.state == "live"]
        values: dict[str, Any] = {k: sum(getattr(s, k) for s in live) for k in _GAUGES}
        values.update({k: retired[k] + sum(getattr(s, k) for s in reported) for k in _COUNTERS})
        if first is None:
            return EngineStats(page_tokens=self._page_size, data_parallel=per_rank, **values)
        return attrs.evolve(first, data_parallel=per_rank, **values)

    # -- the pipe threads -----------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            sink = self._sink
            if sink is None:
                self._pending.append(outputs)
                return
        sink(outputs)

    def _write(self, r: _Rank, conn: Connection, outbox: queue.SimpleQueue[InboxItem | None]) -> None:
        """Pickle and send the front's records to one rank; a request that cannot be pickled (a
        compiled grammar, an image loader) fails alone."""
        while True:
            item = outbox.get()
            if item is None:
                return
            try:
                conn.send(item)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                if isinstance(item, Add):
                    rid = item.request.request_id
                    with self._lock:
                        self._owner.pop(rid, None)
                        r.in_flight.discard(rid)
                    self._deliver([RequestOutput(
                        rid, (), finish=EngineFinish.ERROR, failure=FailureKind.ENGINE,
                        error=f"this request cannot be sent to a data-parallel rank ({type(exc).__name__}: {exc}); "
                              "images are not served with data parallelism yet")])
                else:
                    log.exception("data-parallel rank %d: a record could not be sent", r.index)
            except (OSError, EOFError, ValueError):
                return  # the rank is gone; its reader fails what it held
            if isinstance(item, Shutdown):
                return

    def _read(self, r: _Rank, conn: Connection) -> None:
        died: str | None = None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # an unreadable message: the pipe is no longer trustworthy
                died = f"unreadable message from the rank: {type(exc).__name__}: {exc}"
                break
            kind = msg[0]
            if kind == "out":
                outputs: list[RequestOutput] = msg[1]
                with self._lock:
                    for out in outputs:
                        if out.finish is not None:
                            self._owner.pop(out.request_id, None)
                            r.in_flight.discard(out.request_id)
                self._deliver(outputs)
            elif kind == "kv":
                events: list[KVEvent] = msg[1]
                with self._lock:
                    r.cached.apply(events)
                if self._kv_listener is not None:
                    self._kv_listener(r.index, events)
            elif kind == "stats":
                with self._lock:
                    r.stats, r.problem = msg[1], msg[2]
            elif kind == "died":
                died = str(msg[1])
        self._rank_down(r, died)

    def _rank_down(self, r: _Rank, died: str | None) -> None:
        proc = r.process
        if proc is not None:
            proc.join(2)
            if proc.is_alive():  # its pipe is unusable but it runs (an unreadable message): end it
                proc.kill()
                proc.join(5)
        with self._lock:
            if self._closing:
                return
            code = proc.exitcode if proc is not None else None
            how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
            reason = f"{died} ({how})" if died else f"its process ended ({how})"
            r.state, r.error = "down", reason
            self.error = f"data-parallel rank {r.index} died: {reason}"
            lost = sorted(r.in_flight)
            for rid in lost:
                self._owner.pop(rid, None)
            r.in_flight.clear()
            r.cached = CachedBlocks()
            if r.stats is not None:
                for k in _COUNTERS:
                    self._retired[k] += getattr(r.stats, k)
            r.stats, r.problem = None, None
            if self._last is not None and self._last[1] == r.index:
                self._last = None
            restart = self.restart
        r.outbox.put(None)
        log.critical("%s; failing its %d request(s)%s", self.error, len(lost),
                     ", restarting it" if restart else "")
        if lost:
            self._deliver([RequestOutput(rid, (), finish=EngineFinish.ERROR, failure=FailureKind.ENGINE,
                                         error=f"{self.error}; the request was lost") for rid in lost])
        if self._kv_listener is not None:
            self._kv_listener(r.index, [AllBlocksCleared()])
        if restart:
            self._restart(r)

    def _restart(self, r: _Rank) -> None:
        with self._lock:
            if self._closing:
                return
            r.restarts += 1
            self._spawn(r)
        try:
            self._await_ready(r, READY_TIMEOUT_S)
        except RuntimeError as exc:
            with self._lock:
                r.state, r.error = "down", str(exc)
                self.error = str(exc)
            log.critical("%s; the rank stays down", exc)
            if r.process is not None and r.process.is_alive():
                r.process.kill()
            return
        with self._lock:
            if self._closing:
                return
            r.error = None
            self._start_threads(r)
        if self._kv_listener is not None:
            self._kv_listener(r.index, [AllBlocksCleared()])
