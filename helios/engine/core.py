"""The engine step loop. Runs in its own thread; talks to the async side only through the inbox
(Add / Abort / Shutdown records, thread-safe queue) and the outbox (RequestOutput lists) plus one
`wake()` callback after each step that produced output.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import attrs
import torch

from helios.domain.events import FailureKind
from helios.engine.attention import TorchPagedBackend
from helios.engine.drafter import Drafter
from helios.engine.images import ImageEncoder
from helios.engine.kv.checkpoints import Checkpoints
from helios.engine.kv.coordinator import KVCacheCoordinator, KVManager, group_key
from helios.engine.kv.events import KVEvent
from helios.engine.kv.host_store import HostStore
from helios.engine.kv.layout import CacheLayout, step_tokens
from helios.engine.kv.manager import KVCacheManager
from helios.engine.mtp import MTPDrafter
from helios.engine.records import (
    Abort,
    Add,
    CheckpointStats,
    EngineFinish,
    EngineRequest,
    EngineStats,
    Histogram,
    HostCacheStats,
    InboxItem,
    RequestOutput,
    Shutdown,
)
from helios.engine.runner import ModelRunner
from helios.engine.sampling import Sampler
from helios.engine.scheduler import Scheduler, StateRollback
from helios.engine.speculative import SpeculativeConfig
from helios.engine.threads import ThreadGovernor, ThreadStats
from helios.models.interface import CausalLM

log = logging.getLogger("helios.engine")

# Bounds of the host-store lookup histograms (tokens; nanoseconds: 10 µs .. 100 s).
HOST_TOKEN_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)
HOST_NS_BUCKETS = tuple(float(10**e) for e in range(4, 12))

@attrs.frozen
class EngineConfig:
    page_size: int = 16
    num_pages: int = 4096
    max_active: int = 64
    prefill_chunk_size: int = 512
    max_model_len: int = 8192
    prefix_caching: bool = True
    """Reuse full KV pages of earlier requests (hash chains; see kv/manager.py)."""
    fingerprint: bytes = b""
    """The model and KV layout, part of every chain hash and of host-store record keys."""
    host_memory_bytes: int = 0
    """DRAM budget of the host store behind the prefix cache (0 with no disk: no host store)."""
    disk_dir: str | None = None
    disk_bytes: int = 0
    speculative: SpeculativeConfig = SpeculativeConfig()
    """Exact speculative decoding (engine/speculative.py); off by default."""
    checkpoint_slots: int = 16
    """State snapshots a layout with recurrent layers keeps for its prefix cache (rows of every
    recurrent layer's state, besides the running requests' slots; `kv/checkpoints.py`)."""
    checkpoint_work_fraction: float = 0.1
    """The share of the engine's step time that checkpoint captures may add (predicted)."""
    kv_prefault: bool = False
    """Touch the whole KV pool at start (`KVCache.prefault`) instead of page by page as used."""
    kv_dtype: str = "auto"
    """How full-attention and sliding-window K/V rows are kept (`kv.layout.KV_DTYPES`): "auto" in
    the cache dtype, "int8" as codes with a bfloat16 scale per row (`attention.KVCache`)."""
    token_vocab_size: int | None = None
    """The ids the tokenizer knows (None: all of the model's). A checkpoint may pad its embedding rows
    past the tokenizer's vocabulary; the padding ids are never sampled or offered as logprobs."""


class EngineCore:
    """Owns the model, the KV cache, the scheduler and the sampler. Not thread-safe: one thread runs it."""

    def __init__(self, model: CausalLM, cfg: EngineConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu", *, vision: ImageEncoder | None = None,
                 drafter: Drafter | MTPDrafter | None = None) -> None:
        """The cache follows ``model.cache_specs()``: layers with equal specs form a group
        (`kv/layout.py`), each paged group ``cfg.num_pages`` pages, each recurrent group one state
        slot per running request. ``dtype``: the cache's. ``vision``: the vision tower of a
        vision-language model (None: text only); the runner encodes requests' images with it
        (`engine/images.py`). ``drafter``: the learned drafter of the speculating requests, a draft
        model (`engine/drafter.py`) or the checkpoint's MTP layer (`engine/mtp.py`, which the runner
        hands the target's hidden states); it needs speculation on."""
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.layout = layout = CacheLayout.from_specs(model.cache_specs())
        caching = cfg.prefix_caching
        # A recurrent layout's prefix cache needs state snapshots: rows after the running requests'
        # slots; speculating, one backup row per slot after those (`scheduler.StateRollback`).
        num_snapshots = max(0, cfg.checkpoint_slots) if layout.has_recurrent and caching else 0
        num_backups = cfg.max_active if layout.has_recurrent and cfg.speculative.enabled else 0
        if drafter is not None and not cfg.speculative.enabled:
            raise ValueError("a draft model drafts for speculative decoding: it needs speculative mode ngram or "
                             "adaptive")
        self.drafter = drafter
        # Row-window pools (DeepSeek V4's raw rows) hold the running requests' windows and the
        # step's chunks only: sized by these (`kv.layout.window_pool_pages`).
        self.step_tokens = steps = step_tokens(cfg.prefill_chunk_size, cfg.max_active,
                                               cfg.speculative.max_depth if cfg.speculative.enabled else 0)
        self.attention = TorchPagedBackend.for_layout(
            layout, cfg.num_pages, cfg.page_size, dtype, self.device,
            num_state_slots=cfg.max_active + num_snapshots + num_backups, kv_dtype=cfg.kv_dtype,
            max_active=cfg.max_active, step_tokens=steps)
        self.kv = self.attention.kv
        if cfg.kv_prefault:
            self.kv.prefault()
        fingerprint = _layout_fingerprint(cfg, layout, dtype)
        # No host store for a layout with compressed or row-window groups: a page's records would
        # not cover every group (placeholders), nor would a restore reach a lazy pool's pages.
        self.host_store = None if layout.has_partial_tables else _host_store(cfg, fingerprint, caching)
        host = self.host_store
        self.kv_manager: KVManager
        self.checkpoints: Checkpoints | None = None
        host_has: Callable[[int], bool] | None = None
        restore: Callable[[int, int], bool] | None = None
        if layout.is_single_full:
            self.kv_manager = KVCacheManager(
                cfg.num_pages, cfg.page_size, enable_caching=caching, fingerprint=fingerprint,
                on_evict=(lambda h, page: host.put(h, self.attention.read_page(page))) if host is not None else None)
            if host is not None:
                host_has, restore = host.contains, self._restore
        else:
            coordinator = KVCacheCoordinator(
                layout, cfg.num_pages, cfg.page_size, enable_caching=caching, fingerprint=fingerprint,
                num_state_slots=cfg.max_active, num_snapshots=num_snapshots, max_active=cfg.max_active,
                step_tokens=steps,
                on_evict=(lambda g, h, page: host.put(group_key(h, g), self.attention.read_page(page, g)))
                if host is not None else None)
            self.kv_manager = coordinator
            if host is not None:
                groups = range(len(layout.paged_groups))
                host_has = lambda h: all(host.contains(group_key(h, g)) for g in groups)  # noqa: E731
                restore = self._restore_groups
            if coordinator.snapshots is not None:
                state_group = len(layout.paged_groups)  # the first recurrent group: the snapshot's key
                self.checkpoints = Checkpoints(
                    coordinator.snapshots, base=cfg.max_active, state_bytes=self.kv.state_bytes(),
                    work_fraction=cfg.checkpoint_work_fraction, copy=self.kv.copy_state, read=self.kv.read_state,
                    write=self.kv.write_state, key=lambda h: group_key(h, state_group),
                    slot_of=coordinator.state_slot,
                    host_put=host.put if host is not None else None, host_get=host.get if host is not None else None,
                    host_has=host.contains if host is not None else None)
                coordinator.has_snapshot = self.checkpoints.available
                if host_has is not None:
                    coordinator.host_has_page = host_has
        self._ns_per_token: float | None = None
        self._decode_weight_bytes: int | None = None  # the model's, asked once (`stats`)
        self._missing_tokens = Histogram(HOST_TOKEN_BUCKETS)
        self._transfer_ns = Histogram(HOST_NS_BUCKETS)
        self._prefill_ns = Histogram(HOST_NS_BUCKETS)
        self.scheduler = Scheduler(
            self.kv_manager, max_active=cfg.max_active, prefill_chunk_size=cfg.prefill_chunk_size,
            max_model_len=cfg.max_model_len,
            host_has=host_has, restore=restore,
            speculative=cfg.speculative,
            checkpoints=self.checkpoints,
            draft_proposer=drafter.proposer if drafter is not None else None,
            rollback=self._state_rollback(cfg.max_active + num_snapshots) if num_backups else None)
        vocab = model.vocab_size
        self.sampler = Sampler(min(vocab, cfg.token_vocab_size or vocab), device=self.device)
        self.runner = ModelRunner(model, self.attention, self.kv_manager, self.sampler, self.device,
                                  max_rows=cfg.max_active, max_model_len=cfg.max_model_len, vision=vision)
        if isinstance(drafter, MTPDrafter):
            self.runner.hidden_sink = drafter.capture
        # Work for the engine's own thread between steps, each run before every step until it returns
        # True (`runtime.LoadedModel.finish_huge_pages`: the model's weights swapped to their copy).
        self.between_steps: list[Callable[[], bool]] = []

    def _state_rollback(self, backup_base: int) -> StateRollback:
        """Speculation's state copies: slot s is backed up in row ``backup_base + s``."""
        slot_of = cast(KVCacheCoordinator, self.kv_manager).state_slot
        copy = self.kv.copy_state
        return StateRollback(save=lambda rid: copy(slot_of(rid), backup_base + slot_of(rid)),
                             restore=lambda rid: copy(backup_base + slot_of(rid), slot_of(rid)))

    # -- KV events ---------------------------------------------------------------------------
    @property
    def event_pool(self) -> KVCacheManager:
        """The page pool whose prefix cache the KV events describe: the only one, or a
        coordinator's primary group (every group registers the same chain hashes)."""
        kv = self.kv_manager
        return kv.primary if isinstance(kv, KVCacheCoordinator) else cast(KVCacheManager, kv)

    def enable_kv_events(self) -> None:
        """Collect KV events from now on (`kv/events.py`); `take_kv_events` empties the list."""
        pool = self.event_pool
        pool.medium = "GPU" if self.device.type == "cuda" else "CPU"
        if pool.events is None:
            pool.events = []

    def take_kv_events(self) -> list[KVEvent]:
        pool = self.event_pool
        events = pool.events
        if not events:
            return []
        pool.events = []
        return events

    @property
    def hash_fingerprint(self) -> bytes:
        """The fingerprint in every chain hash of the event pool (a router recomputes hashes with it)."""
        return self.event_pool.fingerprint

    # -- inbox handling ---------------------------------------------------------------------
    def add(self, request: EngineRequest) -> None:
        self.scheduler.add(request, Sampler.make_generator(request.sampling.seed))

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        return [RequestOutput(s.request_id, (), finish=EngineFinish.ABORTED) for s in self.scheduler.abort(request_ids)]

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule → execute → update: the whole algorithm (see scheduler.py's docstring)."""
        self.run_between_steps()
        sched = self.scheduler.schedule()
        t0 = time.perf_counter_ns()
        result = self.runner.execute(sched)
        step_ns = time.perf_counter_ns() - t0
        if self.host_store is not None:
            self._account_host_lookups(sched.num_tokens, step_ns)
        if self.checkpoints is not None and sched.chunks:
            self.checkpoints.observe_step(step_ns, all(c.decode_round for c in sched.chunks))
        return self.scheduler.update(sched, result)

    def run_between_steps(self) -> None:
        """`between_steps`' tasks, once each (the engine thread's loop also runs them while idle)."""
        if self.between_steps:
            self.between_steps = [task for task in self.between_steps if not task()]

    def _account_host_lookups(self, num_tokens: int, step_ns: int) -> None:
        """Fold this step's host-store lookups into the histograms; prefill time per token is an
        exponential average over steps that ran tokens (its first value is the first step's)."""
        if num_tokens:
            per_token = step_ns / num_tokens
            self._ns_per_token = per_token if self._ns_per_token is None else 0.9 * self._ns_per_token + 0.1 * per_token
        for missing, transfer_ns in self.scheduler.host_lookups:
            self._missing_tokens.observe(missing)
            self._transfer_ns.observe(transfer_ns)
            self._prefill_ns.observe(missing * (self._ns_per_token or 0.0))
        self.scheduler.host_lookups.clear()

    def stats(self, threads: ThreadStats | None = None) -> EngineStats:
        """``threads``: the engine thread's team (`EngineThread` passes its governor's)."""
        return EngineStats(
            active=len(self.scheduler.running),
            pending=len(self.scheduler.waiting),
            free_pages=self.kv_manager.num_free,
            total_pages=self.kv_manager.num_pages,
            page_tokens=self.kv_manager.page_size,
            prefill_tokens=self.scheduler.prefill_tokens,
            generated_tokens=self.scheduler.generated_tokens,
            decode_weight_bytes=self._weight_bytes(),
            prefix_caching=self.kv_manager.enable_caching,
            reused_tokens=self.scheduler.reused_tokens,
            cached_pages=self.kv_manager.num_cached,
            host=None if self.host_store is None else self._host_stats(),
            reasoning_budget_cuts=self.scheduler.reasoning_budget_cuts,
            speculative_mode=self.scheduler.speculative.mode,
            history_drafts=self.scheduler.history is not None,
            speculative=self.scheduler.spec_stats.snapshot(),
            threads=threads,
            checkpoints=None if self.checkpoints is None else self._checkpoint_stats(self.checkpoints),
            learned_drafter=self.drafter is not None,
            draft_steps=self.drafter.forward_tokens if self.drafter is not None else 0,
        )

    def _checkpoint_stats(self, checkpoints: Checkpoints) -> CheckpointStats:
        counters = checkpoints.counters
        return CheckpointStats(
            captures=dict(counters.captures), skips=dict(counters.skips), extra_work_ns=counters.extra_work_ns,
            anchor_reservations=self.scheduler.anchor_reservations, restores=counters.restores,
            host_restores=counters.host_restores, snapshots=checkpoints.pool.num_registered,
            slots=checkpoints.pool.num_rows)

    def close(self) -> None:
        """The engine thread's exit: with a disk tier, copy every cached page out to the host store
        and write the DRAM tier to disk, so a restart with the same disk store finds them."""
        host = self.host_store
        if host is None:
            return
        if host.dir is not None:
            if self.checkpoints is not None:
                self.checkpoints.copy_out()
            kv = self.kv_manager
            pools = kv.groups if isinstance(kv, KVCacheCoordinator) else [cast(KVCacheManager, kv)]
            for g, pool in enumerate(pools):
                for page, block_hash in enumerate(pool.block_hash):
                    if block_hash is not None and not host.contains(group_key(block_hash, g)):
                        host.put(group_key(block_hash, g), self.attention.read_page(page, g))
        host.close(persist=True)

    def _restore(self, block_hash: int, page: int) -> bool:
        assert self.host_store is not None
        data = self.host_store.get(block_hash)
        return data is not None and self.attention.write_page(page, data)

    def _restore_groups(self, block_hash: int, page: int) -> bool:
        """A host restore into the page of every paged group the last allocation gave (``page``:
        group 0's): each group's record of the page, or False."""
        assert self.host_store is not None and isinstance(self.kv_manager, KVCacheCoordinator)
        pages = next(t for t in self.kv_manager.last_new if t[0] == page)
        for g, p in enumerate(pages):
            data = self.host_store.get(group_key(block_hash, g))
            if data is None or not self.attention.write_page(p, data, g):
                return False
        return True

    def _host_stats(self) -> HostCacheStats:
        assert self.host_store is not None
        st = self.host_store.stats
        return HostCacheStats(
            hits=self.scheduler.host_hits, reused_tokens=self.scheduler.host_reused_tokens,
            memory_records=st.memory_records, disk_records=st.disk_records, parked_records=st.parked,
            bytes_out=st.bytes_out, bytes_in=st.bytes_in, held=dict(st.held), dropped=dict(st.dropped),
            skipped=st.skipped, missing_tokens=self._missing_tokens.snapshot(),
            transfer_ns=self._transfer_ns.snapshot(), prefill_ns=self._prefill_ns.snapshot())

    def _weight_bytes(self) -> int:
        cached = self._decode_weight_bytes
        if cached is None:
            cached = self._decode_weight_bytes = self.model.decode_weight_bytes()
        return cached


def _layout_fingerprint(cfg: EngineConfig, layout: CacheLayout, dtype: torch.dtype) -> bytes:
    """The model fingerprint plus everything that shapes a page's bytes (every group's spec and
    layers, the dtype and KV dtype, the page size, the backend): two engines share cached pages (and
    host-store records) only when all of it matches."""
    text = f"{layout.describe(dtype, cfg.kv_dtype)}:{cfg.page_size}:torch_paged".encode()
    return hashlib.blake2b(cfg.fingerprint + b"|" + text, digest_size=16).digest()


def _host_store(cfg: EngineConfig, fingerprint: bytes, caching: bool) -> HostStore | None:
    if not caching or (cfg.host_memory_bytes <= 0 and not (cfg.disk_dir and cfg.disk_bytes > 0)):
        return None
    return HostStore(fingerprint, memory_bytes=cfg.host_memory_bytes, disk_dir=Path(cfg.disk_dir) if cfg.disk_dir else None,
                     disk_bytes=cfg.disk_bytes)


class EngineThread:
    """Runs an EngineCore in a daemon thread. `submit`/`abort` are thread-safe; outputs go to `sink`.

    `sink(outputs)` is called from the engine thread after every step with output; it must not
    raise and must be cheap (the async side wakes up and drains its own queue).
    """

    def __init__(self, core: EngineCore, sink: Callable[[list[RequestOutput]], None], *,
                 threads: int | None = None, adapt_threads: bool = False,
                 governor: ThreadGovernor | None = None,
                 kv_events: Callable[[list[KVEvent]], None] | None = None) -> None:
        """``threads``: the torch (OpenMP) threads this thread's steps use, set on the thread itself
        when it starts (None: leave torch's setting); with ``adapt_threads`` the team shrinks
        while other processes take cores and grows back when they leave (`threads.ThreadGovernor`,
        or the ``governor`` given). The process should run no multi-thread torch work on other
        threads: see `runtime.build_runtime`. ``kv_events``: called on the engine thread with the KV
        events of each step that had any (`kv/events.py`), before that step's outputs go to
        ``sink``, so a reader of both in order sees a request's pages before its finish."""
        if governor is None and threads:
            governor = ThreadGovernor(threads, adaptive=adapt_threads, set_threads=torch.set_num_threads)
        self.governor = governor
        self.core = core
        self._sink = sink
        self._kv_events = kv_events
        if kv_events is not None:
            core.enable_kv_events()
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="helios-engine", daemon=True)
        self.healthy = True
        self.error: str | None = None
        self._stats = core.stats(threads=None if governor is None else governor.snapshot())
        # time.monotonic() when the loop last made progress (an iteration began, or the inbox
        # wait ended). Stale while not idle (waiting for work): one step or inbox batch has been
        # running that long, so the engine is wedged while it has work.
        self.heartbeat = time.monotonic()
        self._idle = False

    def start(self) -> None:
        self.heartbeat = time.monotonic()
        self._thread.start()

    def problem(self, stall_seconds: float, now: float | None = None) -> str | None:
        """Why the engine cannot serve (None while it can): its thread has died or stopped, it
        failed, or it has made no step progress for `stall_seconds` while it has work."""
        if not self._thread.is_alive():
            return f"the engine thread is not running: {self.error}" if self.error else "the engine thread is not running"
        if not self.healthy:
            return self.error or "the engine reported a failure"
        stalled = (time.monotonic() if now is None else now) - self.heartbeat
        if stalled > stall_seconds and not self._idle:
            return f"the engine has made no step progress for {stalled:.1f} s while it has work (wedged)"
        return None

    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(Add(request))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._inbox.put(Abort(tuple(request_ids)))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        """Whether the engine thread is still running (after `shutdown`, False once it has stopped)."""
        return self._thread.is_alive()

    def _drain(self, block: bool) -> bool:
        """Apply inbox records; returns False on Shutdown."""
        outputs: list[RequestOutput] = []
        self._idle = block  # waiting for work is not a stall
        try:
            item: InboxItem | None = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        finally:
            self._idle = False
            self.heartbeat = time.monotonic()
        while item is not None:
            if isinstance(item, Shutdown):
                return False
            if isinstance(item, Add):
                self.core.add(item.request)
            elif isinstance(item, Abort):
                outputs.extend(self.core.abort(item.request_ids))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        if outputs:
            self._sink(outputs)
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread dies: say so, and fail what it held
            self.healthy = False
            self.error = f"the engine thread died: {type(exc).__name__}: {exc}"
            log.critical("%s", self.error, exc_info=True)
            try:
                self._fail_all(self.error)
                self._fail_inbox(self.error)
            except BaseException:
                log.exception("failing the engine's requests after its death failed")
        finally:
            self.core.close()

    def _fail_inbox(self, message: str) -> None:
        """Requests submitted but never taken in: they fail too (nothing will ever run them)."""
        outs = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Add):
                outs.append(RequestOutput(item.request.request_id, (), finish=EngineFinish.ERROR, error=message,
                                          failure=FailureKind.ENGINE))
        if outs:
            self._sink(outs)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        governor = self.governor
        if governor is not None:
            governor.start()
        running = True
        while running:
            self.heartbeat = time.monotonic()
            try:
                waits = not self.core.scheduler.has_work
                if governor is not None and waits:
                    governor.tick(busy=False)  # a busy window ends where the engine starts to wait
                running = self._drain(block=waits)
                if not running:
                    break
                threads = None
                if governor is not None:
                    governor.tick(busy=self.core.scheduler.has_work)
                    threads = governor.snapshot()
                if not self.core.scheduler.has_work:
                    self.core.run_between_steps()
                    self._stats = self.core.stats(threads=threads)
                    continue
                t0 = time.perf_counter()
                outputs = self.core.step()
                self._stats = self.core.stats(threads=threads)
                if self._kv_events is not None:
                    events = self.core.take_kv_events()
                    if events:
                        self._kv_events(events)
                if outputs:
                    self._sink(outputs)
                log.debug("step %.1f ms, %d outputs", (time.perf_counter() - t0) * 1e3, len(outputs))
            except Exception as exc:  # the engine must report, not die silently
                log.exception("engine step failed")
                self._fail_all(f"engine failure: {exc}")
        self._fail_all("engine shut down")

    def _fail_all(self, message: str) -> None:
        sched = self.core.scheduler
        seqs = list(sched.running) + list(sched.waiting)
        outs = []
        for s in seqs:
            sched.finish(s)
            outs.append(RequestOutput(s.request_id, (), finish=EngineFinish.ERROR, error=message,
                                      failure=FailureKind.ENGINE))
        if outs:
            self._sink(outs)
