"""Loading the model and wiring the engine thread to the serving pipeline (used by the app's lifespan)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from helios.config import ConfigError, HeliosConfig
from helios.domain.model import ModelInfo
from helios.engine.core import EngineConfig, EngineCore, EngineThread
from helios.engine.dp import DataParallelEngine, RankEngine
from helios.engine.kv.layout import CacheLayout, step_tokens
from helios.engine.speculative import SpeculativeConfig
from helios.engine.tp import TensorParallelLeader, WorkerSetup, serve_worker
from helios.models import packing
from helios.models.interface import CausalLM
from helios.models.quant import WeightFormat
from helios.models.tp import TP_ARCHITECTURES, ParallelContext
from helios.models.vision.base import VisionTower
from helios.serving.engine_client import EngineClient
from helios.serving.kv_events import KVEventHub
from helios.serving.pipeline import Service

if TYPE_CHECKING:
    import trio

    from helios.engine.drafter import Drafter
    from helios.engine.mtp import MTPDrafter
    from helios.loaders.checkpoint import Checkpoint, ProgressCallback
    from helios.loaders.tokenizer import Tokenizer
    from helios.models.architecture import LoadableCausalLM
    from helios.recipes import Recipe
    from helios.serving.images import ImageAdmission

log = logging.getLogger("helios.runtime")


CPU_CAPABILITY_ENV = "HELIOS_CPU_CAPABILITY"
CPU_CAPABILITIES = ("avx2", "avx512_bf16", "amx")


def cpu_flags() -> str:
    """The CPU flags that decide Helios's kernels, as benchmarks name them ("unknown" without
    /proc/cpuinfo)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags)


def detect_cpu_capability(cpuinfo: str | None = None) -> str:
    """What this CPU offers bfloat16 matmuls, from the flags in /proc/cpuinfo: "amx" (AMX-BF16),
    "avx512_bf16" (AVX512-BF16), else "avx2" (no native bf16 instructions; also the answer where
    /proc/cpuinfo is missing, and on CPUs that are not x86). torch's own get_cpu_capability() says
    "AVX512" with or without the BF16 extension, so it cannot tell these apart."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "avx2"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx2"


def cpu_capability() -> str:
    """`detect_cpu_capability()`, unless $HELIOS_CPU_CAPABILITY forces one of CPU_CAPABILITIES (so tests
    can check what `dtype = "auto"` does on either kind of machine from any machine)."""
    forced = os.environ.get(CPU_CAPABILITY_ENV, "").strip()
    if not forced:
        return detect_cpu_capability()
    if forced not in CPU_CAPABILITIES:
        raise ValueError(f"{CPU_CAPABILITY_ENV}={forced!r} is not one of {', '.join(CPU_CAPABILITIES)}")
    return forced


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls are fast on this CPU."""
    return cpu_capability() != "avx2"


def choose_dtype(name: str, device: str) -> torch.dtype:
    """The configured dtype; "auto" is bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else
    float32 (torch's bf16 matmuls are slower than fp32 without them)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float16":
        return torch.float16
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}: expected auto, float32, bfloat16 or float16")
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


# `weights = "auto"` on the CPU: the int4 kernel for steps of at most this many rows (decode), a dense
# copy in the activation dtype above it. Crossovers of one pass over the default model's projections
# on one thread (`tests/parity/bench_weight_formats.py linears`, docs/benchmarks.md "Weight
# formats"): with AVX512-BF16, int4 11.7 ms against bf16 16.8 at 8 rows, 17.1 / 18.5 at 12, 20.7 /
# 19.9 at 14; with torch's AVX2 kernels, int4 against fp32 47 / 59 ms at 16 rows, 93 / 90 at 32. AMX
# was not measured; it gets the AVX512-BF16 threshold (its bf16 GEMMs only get faster).
AUTO_DENSE_ABOVE = {"avx2": 24, "avx512_bf16": 12, "amx": 12}
# The dense copy is skipped (int4 only) when it would take more than this share of available memory.
AUTO_DENSE_COPY_MEMORY_SHARE = 0.5
# `weights = "auto"` with K-quant blocks: whether the projections also keep a dense copy in the
# activation dtype for large steps. Not by default: on Qwen2.5-Coder-0.5B Q4_K_M a bfloat16 copy is
# 0.7 GB beside the 0.35 GB of blocks, past issue 26's memory target (file size + KV pool + 600 MB).
AUTO_BLOCKS_DENSE_COPY = False
# ... and without one, steps of more than this many rows dequantize each projection per call into the
# activation dtype and run a dense GEMM. On the 0.5B file's Q5_0 (4864 x 896), Q4_K and Q6_K (896 x 4864)
# projections, one thread of a busy 2-core AVX512-BF16 machine, bfloat16 activations, 8 distinct copies
# of each weight in turn (2026-12-02, the register-tiled kernels): kernel against
# dequantize-then-bf16-GEMM 2.9 / 7.7, 3.3 / 7.9 and 3.4 / 11.8 ms at 16 rows; 5.8 / 4.9, 6.4 / 11.2
# and 8.3 / 10.3 at 32 (a tie); 11.4 / 8.7, 10.8 / 10.1 and 13.9 / 11.0 at 64; 24 / 13, 25 / 17 and
# 29 / 15 at 128; 99 / 33, 97 / 28 and 116 / 34 at 512: the crossover lies between 32 and 64 rows.
AUTO_BLOCKS_UNPACK_ABOVE = 32


@attrs.frozen
class WeightChoice:
    """What `choose_weights` decided: the activation (and KV) dtype, the projections' format, why."""

    dtype: torch.dtype
    format: WeightFormat
    reason: str

    def describe(self) -> str:
        return f"weights {self.format.describe()}, activations {str(self.dtype).removeprefix('torch.')}: {self.reason}"


def choose_weights(weights: str, dtype: str, device: str, *, int4_codes: bool,
                   projection_params: int = 0, block_codes: bool = False) -> WeightChoice:
    """The configured `[model] weights` and `dtype` -> `WeightChoice`.

    Explicit formats: "float32" / "bfloat16" are dense projections (activations in the same dtype
    unless `dtype` says otherwise); "int4" / "int8" quantize every projection (int4 keeps Q4_0/Q4_1
    codes as they are and quantizes the rest; int8 re-quantizes per row), with activations in
    `choose_dtype(dtype)`. Both quantized kernels are CPU-only.

    "auto": dense in `dtype` when `dtype` is set explicitly (the previous meaning of `--dtype`), and
    on CUDA; dense in `choose_dtype("auto")` for checkpoints without Q4_0/Q4_1 codes (``int4_codes``:
    re-quantizing would change the checkpoint's weights); else int4 for steps of up to
    `AUTO_DENSE_ABOVE[capability]` rows with a dense copy in the activation dtype for larger steps
    (dropped when that copy of ``projection_params`` weights would take more than half of the
    available memory). An "amx" capability
    counts only where the kernel grants AMX tile state (`amx_tile_granted`), else it is AVX512-BF16.

    "auto" for checkpoints with K-quant / Q5_0 / Q5_1 projection blocks (``block_codes``) where
    Helios's CPU kernels are available: every GGUF block kept as it is (``keep_blocks``: projections
    as `kquant.KQuantLinear`, Q8_0 ones too, Q4_0/Q4_1 as int4; the token embedding looked up from
    its blocks; the head multiplied from its blocks or Q8_0 codes, float32 logits), activations in
    `choose_dtype("auto")`, and no dense copy (`AUTO_BLOCKS_DENSE_COPY`)."""
    if weights not in ("auto", "float32", "bfloat16", "int8", "int4"):
        raise ValueError(f"unknown weights {weights!r}: expected auto, float32, bfloat16, int8 or int4")
    on_cuda = device.startswith("cuda")
    if weights in ("float32", "bfloat16"):
        stored = torch.float32 if weights == "float32" else torch.bfloat16
        act = stored if dtype == "auto" else choose_dtype(dtype, device)
        return WeightChoice(act, WeightFormat("dense", stored), f"weights = {weights} configured")
    if weights in ("int4", "int8"):
        if on_cuda:
            raise ValueError(f"weights = {weights} runs on the CPU only (device {device}); use auto, bfloat16 or float32")
        if not quantized_kernel_works(weights):
            raise ValueError(f"weights = {weights}: torch's {weights} weight-only matmul does not work in this build")
        return WeightChoice(choose_dtype(dtype, device), WeightFormat(weights), f"weights = {weights} configured")
    if dtype != "auto":
        act = choose_dtype(dtype, device)
        return WeightChoice(act, WeightFormat("dense", act), f"dtype = {dtype} configured")
    act = choose_dtype("auto", device)
    if on_cuda:
        return WeightChoice(act, WeightFormat("dense", act), "CUDA: dense bfloat16")
    capability, note = effective_cpu_capability()
    if block_codes and _cpu_kernels_available():
        dense = AUTO_BLOCKS_DENSE_COPY
        fmt = WeightFormat("int4", dense_dtype=act if dense else None,
                           dense_above=AUTO_DENSE_ABOVE[capability] if dense else 0, requantize=False,
                           keep_blocks=True, unpack_above=None if dense else AUTO_BLOCKS_UNPACK_ABOVE)
        why = ("dense copy for large steps" if dense else
               "no resident dense copy (it would double the weights' memory)")
        return WeightChoice(act, fmt, f"{capability}{note}; keeps the checkpoint's GGUF blocks, {why}")
    if not int4_codes:
        return WeightChoice(act, WeightFormat("dense", act),
                            f"{capability}{note}; the checkpoint has no Q4_0/Q4_1 blocks to keep, and "
                            "re-quantizing would change its weights")
    if not quantized_kernel_works("int4"):
        return WeightChoice(act, WeightFormat("dense", act), f"{capability}{note}; torch's int4 kernel does not work here")
    act = torch.float32 if capability == "avx2" else torch.bfloat16
    above = AUTO_DENSE_ABOVE[capability]
    dense_name = str(act).removeprefix("torch.")
    available = _available_memory()
    dense_copy_bytes = projection_params * act.itemsize
    if available is not None and dense_copy_bytes > AUTO_DENSE_COPY_MEMORY_SHARE * available:
        return WeightChoice(act, WeightFormat("int4", requantize=False),
                            f"{capability}{note}; keeps the checkpoint's 4-bit codes; no dense {dense_name} copy "
                            f"for large steps ({dense_copy_bytes / 2**30:.1f} GiB of {available / 2**30:.1f} GiB available)")
    return WeightChoice(act, WeightFormat("int4", dense_dtype=act, dense_above=above, requantize=False),
                        f"{capability}{note}; keeps the checkpoint's 4-bit codes (int4 leads at decode sizes), "
                        f"dense {dense_name} GEMMs lead above {above} rows")


def effective_cpu_capability() -> tuple[str, str]:
    """`cpu_capability()`, with "amx" downgraded to "avx512_bf16" where the kernel does not grant AMX
    tile state (then oneDNN is also capped below AMX, unless ONEDNN_MAX_CPU_ISA is set). Returns the
    capability and a note for the log ("" when nothing changed)."""
    capability = cpu_capability()
    if capability != "amx" or amx_tile_granted():
        return capability, ""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    return "avx512_bf16", " (AMX advertised but the kernel does not grant tile state: not used)"


@functools.cache
def amx_tile_granted() -> bool:
    """Whether this process may use AMX tiles: Linux needs ARCH_REQ_XCOMP_PERM for XTILEDATA before
    the first tile instruction (without it the instruction faults), and some virtual machines
    advertise AMX in /proc/cpuinfo but refuse the request. Asks once, then reads the permitted set."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    sys_arch_prctl, arch_get_xcomp_perm, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1022, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0:
            return False
        permitted = ctypes.c_uint64(0)
        if libc.syscall(sys_arch_prctl, arch_get_xcomp_perm, ctypes.byref(permitted)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return bool(permitted.value & (1 << xfeature_xtiledata))


@functools.cache
def quantized_kernel_works(kind: str) -> bool:
    """A short probe: torch's int4 / int8 weight-only matmul exists in this build and agrees with a
    dense matmul of the same dequantized weights on a small random problem."""
    from helios.models.quant import Int4Linear, Int8Linear, quantize_int4

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(3, 128, generator=generator)
    try:
        with torch.no_grad():
            if kind == "int4":
                q = quantize_int4(weight)
                got = Int4Linear.pack(q)(x)
                reference = x @ q.dequantize().t()
            else:
                layer = Int8Linear.quantize(weight)
                got = layer(x)
                reference = x @ (layer.weight.float() * layer.scales.float()[:, None]).t()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("%s weight-only matmul unavailable: %s", kind, exc)
        return False
    scale = float(reference.abs().max())
    return bool(torch.allclose(got, reference, rtol=0.0, atol=0.05 * scale))


def _cpu_kernels_available() -> bool:
    from helios.models import cpu_kernels

    return cpu_kernels.available()


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_last_progress: list[tuple[str, int]] = [("", -1)]


def _progress(stage: str, fraction: float) -> None:
    """Loading progress on stderr: one line per stage, redrawn in 5% steps."""
    step = int(fraction * 20)
    if (stage, step) == _last_progress[0]:
        return
    _last_progress[0] = (stage, step)
    end = "\n" if step >= 20 else ""
    print(f"\r  loading {stage:<12s} [{'#' * step:<20s}] {fraction * 100:5.1f}%", end=end, file=sys.stderr, flush=True)


class Runtime:
    """The loaded model, its engine thread and the Service the frontends use."""

    def __init__(self, cfg: HeliosConfig, core: EngineCore, info: ModelInfo, tokenizer: Tokenizer,
                 template: str | None, recipe: Recipe, eos_token_ids: tuple[int, ...], *,
                 vision: VisionTower | None = None, admission: ImageAdmission | None = None,
                 leader: TensorParallelLeader | None = None) -> None:
        """``vision``: a vision-language model's tower (the engine encodes with it, the Service prepares
        with it); ``admission``: the server's `serving.images.ImageAdmission` (its limits are on
        ``info.vision``); ``leader``: tensor parallelism's rank 0 model (`stop` ends the workers)."""
        self.cfg = cfg
        self.leader = leader
        self.vision = vision
        self.admission = admission
        self.core = core
        self.info = info
        self.tokenizer = tokenizer
        self.template = template
        self.recipe = recipe
        self.eos_token_ids = eos_token_ids
        self.client = EngineClient(max_in_flight=cfg.engine.max_active + cfg.server.model_queue_size)
        # GET /v1/kv_events ([parallel] kv_events): this engine's KV events, named by its rank.
        self.kv_events = KVEventHub(cfg.parallel.data_parallel_rank) if cfg.parallel.kv_events else None
        hub = self.kv_events
        # An external-mode rank shares its machine with the deployment's other ranks (by default).
        par = cfg.parallel
        shares = par.data_parallel_size if par.data_parallel_mode == "external" else 1
        self.thread = EngineThread(core, self.client.sink,
                                   threads=cfg.model.threads or (max(1, _usable_cores() // shares) if leader is None
                                                                  else _rank_threads(leader.ctx)),
                                   adapt_threads=cfg.model.adapt_threads,
                                   kv_events=(lambda events: hub.publish(None, events)) if hub is not None else None)

    def start(self, trio_token: trio.lowlevel.TrioToken, limiter: trio.CapacityLimiter | None = None) -> Service:
        """Start the engine thread; the Service renders and tokenizes on `limiter` (the app's pool).
        The Service is built first: its start-up checks (a `[server] thinking_token_budget` the
        model cannot honour) refuse to start before the engine thread runs."""
        from helios.serving.service_factory import make_service

        service = make_service(self, limiter)
        if self.kv_events is not None:
            self.kv_events.attach(trio_token)
        self.client.attach(self.thread, trio_token)
        self.thread.start()
        return service

    def stop(self) -> None:
        self.thread.shutdown()
        if self.leader is not None and not self.thread.is_alive():  # no step of it is still broadcasting
            try:
                self.leader.stop_workers()
            except RuntimeError as exc:  # a worker already gone (its connection closed)
                log.warning("tensor parallel: stopping the workers failed: %s", exc)

    def page_counts(self) -> tuple[int, int] | None:
        """(free, total) KV pages once the engine thread has stopped (the shutdown log line)."""
        if self.thread.is_alive():
            return None
        kv = self.core.kv_manager
        return kv.num_free, kv.num_pages


class DataParallelRuntime:
    """`[parallel] data_parallel_size` engine processes behind this server (`engine/dp.py`): the
    front holds the tokenizer, template and recipe (the checkpoint's header, not its weights) and
    the `DataParallelEngine`, which the `EngineClient` drives as it drives one engine thread."""

    def __init__(self, cfg: HeliosConfig, engine: DataParallelEngine, info: ModelInfo, tokenizer: Tokenizer,
                 template: str | None, recipe: Recipe, eos_token_ids: tuple[int, ...], *,
                 admission: ImageAdmission | None = None, kv_events: KVEventHub | None = None) -> None:
        self.cfg = cfg
        self.thread = engine  # what /health, the drain and `helios serve` read as "the engine"
        self.core = None
        self.info = info
        self.tokenizer = tokenizer
        self.template = template
        self.recipe = recipe
        self.eos_token_ids = eos_token_ids
        self.vision: VisionTower | None = None
        self.admission = admission
        self.kv_events = kv_events
        size = cfg.parallel.data_parallel_size
        self.client = EngineClient(max_in_flight=size * cfg.engine.max_active + cfg.server.model_queue_size)

    def start(self, trio_token: trio.lowlevel.TrioToken, limiter: trio.CapacityLimiter | None = None) -> Service:
        from helios.serving.service_factory import make_service

        service = make_service(self, limiter)
        if self.kv_events is not None:
            self.kv_events.attach(trio_token)
        self.client.attach(self.thread, trio_token)
        self.thread.attach(self.client.sink)
        return service

    def stop(self) -> None:
        self.thread.shutdown()

    def page_counts(self) -> tuple[int, int] | None:
        return self.thread.page_counts()


def model_aliases(configured: Sequence[str], *, default_model: bool, catalog_name: str = "") -> tuple[str, ...]:
    """The configured aliases in order; the default model also answers to its short names, and a
    catalog model to its catalog name (after those). The first one is the id /v1/models reports, so
    the default model stays `smol` and another catalog model is reported by its catalog name."""
    from helios.loaders.default_model import DEFAULT_MODEL_ALIASES

    aliases = [a for a in configured if a]
    extra = [*(DEFAULT_MODEL_ALIASES if default_model else ()), *([catalog_name] if catalog_name else [])]
    aliases += [a for a in extra if a not in aliases]
    return tuple(aliases)


def generation_defaults(
    checkpoint: Mapping[str, Any], configured: Mapping[str, Any], *, default_model: bool
) -> dict[str, Any]:
    """The checkpoint's generation_config, then the default model's card settings, then the
    operator's `[model] generation_config`; later ones win."""
    from helios.loaders.default_model import DEFAULT_MODEL_GENERATION_CONFIG

    return {**checkpoint, **(DEFAULT_MODEL_GENERATION_CONFIG if default_model else {}), **configured}


def resolve_model(spec: str) -> tuple[str, str]:
    """``[model] path`` (or `helios serve MODEL`) as (the file or folder to load, its catalog name):
    empty means the default model; a catalog name is fetched into the cache the first time; an
    existing path is loaded as it is, and a catalog model's cached file keeps its catalog name.
    Anything else raises `catalog.UnknownModel`, listing the known names."""
    from helios.loaders import catalog

    entry = catalog.lookup(spec) if spec else catalog.DEFAULT_ENTRY
    if entry is None:
        found = catalog.entry_for_file(spec)
        return spec, found.name if found is not None else ""
    return str(catalog.ensure_entry(entry)), entry.name


def _log_huge_pages(moved: int) -> None:
    if moved:
        log.info("GGUF blocks on transparent huge pages: %.1f MiB", moved / 2**20)


def _idle_then(work: Callable[[], None]) -> None:
    """``work`` on this thread at the idle scheduling class where Linux has it (``SCHED_IDLE``: it runs
    only when a core would otherwise idle, so requests served meanwhile are not slowed). Measured for
    the huge-page copy (2026-12-05, the AMX VM, where faulting 1 GB of huge pages in costs a fresh
    process about 3 s of CPU): Qwen2.5-Coder-1.5B's first answer came 6.5-6.7 s after launch with the
    copy at the normal class, 3.6 s at the idle one; switched to the normal class 5 s after the load,
    the copy took the next 15 s of an 8-stream benchmark and halved its throughput meanwhile. At the
    idle class under uninterrupted load it waits (the blocks stay on their 4 KiB pages until then)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    work()


@attrs.frozen(eq=False)
class LoadedModel:
    checkpoint: Checkpoint
    model: LoadableCausalLM  # built by the checkpoint's registry entry
    choice: WeightChoice
    cache_key: str = ""  # the packed-weight cache entry's key ("" without a cache)
    vision: VisionTower | None = None  # a vision-language checkpoint's image encoder, else None
    # with ``defer_huge_pages``: the blocks' move onto huge pages, copying on its own thread; the
    # engine calls `finish_huge_pages` between steps (None: nothing to move, or moved at load)
    huge_pages: packing.HugePageMove | None = None
    release_pages: Callable[[], None] | None = None

    def finish_huge_pages(self) -> bool:
        """Between engine steps: once the copy is done, point the modules at it and release the
        originals' file pages; True when nothing is left to do."""
        move = self.huge_pages
        if move is None or move.done:
            return True
        if not move.ready.is_set():
            return False
        moved = move.swap()
        if self.release_pages is not None:
            self.release_pages()
        _log_huge_pages(moved)
        return True


# glibc's mallopt parameters: allocations up to this size come from the heap (not a fresh mmap), and freed
# memory at the heap's top is returned to the system only past the trim threshold.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_KEEP_BYTES = 256 << 20
HEAP_TRIM_BYTES = 128 << 20


def keep_large_buffers() -> bool:
    """Keep large freed buffers in the heap for the next call (glibc only; False elsewhere). A k-quant
    model's prefill without a resident dense copy dequantizes every projection per chunk into a fresh
    dense tensor (the 1.5B: 2.6 GB of them per 512-token chunk); by default glibc maps each such buffer
    fresh and unmaps it on free, so every call faulted its pages in again: the 1.5B's 512-token prefill
    took 1.98-2.31 s against 1.65-1.66 s with buffers up to `HEAP_KEEP_BYTES` from the heap and up to
    `HEAP_TRIM_BYTES` kept free at its top (AMD Zen 5, 2 threads, 2026-12-06, `scripts/profile_prefill.py
    --model <1.5B file> --tokens 512 --runs 3`, alternated twice, the same parameters set through glibc's
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_; 1.71 s with this function; the default model's
    prefill, which allocates no such buffers, 158.9 against 159.8-163.1 ms). The cost: the largest such
    buffers stay resident after a prefill."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_BYTES))


def load_model(path: str | Path, *, weights: str = "auto", dtype: str = "auto", device: str = "cpu",
               cache_dir: str | Path | None = None, progress: ProgressCallback | None = None,
               parallel: ParallelContext | None = None, mla_cache: str = "latent",
               defer_huge_pages: bool = False) -> LoadedModel:
    """Open a checkpoint, decide its weight format (`choose_weights`, logged) and build the model
    through the checkpoint's registry entry (`helios.models.registry`: config -> module -> weights).

    With ``cache_dir``, the built weights come from the packed-weight cache there when a verified
    entry exists for this checkpoint, format and dtype (`helios.loaders.weight_cache`), and a new
    entry is written after building them otherwise; a GGUF file's parsed header is kept there too
    (`helios.loaders.gguf_reader`). The conversion (unpacking GGUF blocks, packing
    int4, dense copies) runs on one thread: it is a few hundred small elementwise kernels, which
    OpenMP's fork/join only slows down (badly so when other processes hold the other cores).

    ``parallel``: build this tensor-parallel rank's shard (`helios.models.tp`: the families of
    `TP_ARCHITECTURES`, dense weight formats; no packed-weight cache, no Q8_0 head codes).

    ``mla_cache``: `BuildOptions.mla_cache` ("expanded" for DeepSeek-V3 checkpoints only)."""
    from helios.loaders.checkpoint import load_checkpoint
    from helios.loaders.weight_cache import PackedWeightCache, cache_key
    from helios.models import cpu_kernels
    from helios.models.architecture import BuildOptions

    ckpt = load_checkpoint(path, torch.float32, progress=progress, header_cache=cache_dir)
    choice = choose_weights(weights, dtype, device, int4_codes=ckpt.int4_codes,
                            projection_params=ckpt.config.projection_params(), block_codes=ckpt.block_codes)
    log.info("%s", choice.describe())
    if parallel is not None and ckpt.architecture.name not in TP_ARCHITECTURES:
        raise ValueError(f"tensor parallelism is built for {', '.join(TP_ARCHITECTURES)}; this checkpoint is "
                         f"{ckpt.architecture.name}")
    if mla_cache != "latent" and ckpt.architecture.name != "deepseek_v3":
        raise ValueError(f"mla_cache = {mla_cache!r} is built for deepseek_v3 checkpoints; this one is "
                         f"{ckpt.architecture.name}")
    q8_head = device == "cpu" and cpu_kernels.available() and parallel is None
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=choice.dtype, device=device,
                                                              weights=choice.format, q8_head=q8_head,
                                                              parallel=parallel, mla_cache=mla_cache))
    if parallel is not None:
        cache_dir = None  # the cache's entries are whole models
        log.info("tensor-parallel rank %d/%d%s", parallel.rank, parallel.world_size,
                 ", experts split across the ranks" if parallel.expert_parallel else "")
    cache = PackedWeightCache(cache_dir) if cache_dir is not None and device == "cpu" else None
    tag = choice.format.cache_tag() + ("+q8head" if q8_head else "")
    key = cache_key(path, tag, choice.dtype) if cache is not None else ""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hit = cache.load(key) if cache is not None else None
        if hit is not None:
            try:
                model.load_packed_state(hit.state, hit.kinds)
                log.info("weights from the packed-weight cache %s", hit.path)
            except (ValueError, KeyError, RuntimeError) as exc:
                log.warning("packed-weight cache entry %s does not fit this model (%s); rebuilding", hit.path, exc)
                hit.path.unlink(missing_ok=True)
                hit = None
        if hit is None:
            model.load_weights(ckpt.weights)
            if cache is not None:
                state, kinds = model.packed_state()
                stored = cache.store(key, state, kinds)
                if stored is not None:
                    log.info("packed weights cached in %s", stored)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    log.info("kept: %s", kept_weights(model))
    if device == "cpu":
        packed = model.pack_cpu_weights()
        log.info("CPU-packed weights (oneDNN GEMMs, bfloat16 Q8_0 head): %d tensors", packed)
    deferred: packing.HugePageMove | None = None
    if device == "cpu" and defer_huge_pages:
        deferred = packing.HugePageMove(model)
        deferred = deferred if deferred.total else None
    elif device == "cpu":
        _log_huge_pages(packing.blocks_into_huge_pages(model))
    if ckpt.release_pages is not None:
        ckpt.release_pages()  # the file's pages the build copied (those still in use fault back in)
    if deferred is not None:
        # not a daemon: the interpreter waits for the copy at exit (a torch copy cut off there aborts)
        threading.Thread(target=_idle_then, args=(deferred.copy,), name="helios-huge-pages").start()
    if device == "cpu" and not q8_head:
        log.info("logits: %s output projection (Helios's CPU kernels: %s)", model.head_format,
                 cpu_kernels.unavailable_reason())
    elif model.head_bf16_rows is not None:
        log.info("logits: %s output projection (bfloat16 pair dot products from %d rows%s)", model.head_format,
                 model.head_bf16_rows, f", its exact weights on AMX tiles from {packing.Q8_EXACT_AMX_ROWS}"
                 if model.head_format == "q8_0" and cpu_kernels.kquant_tiles_active()
                 and cpu_kernels.kquant_tiles_backend() == "amx" else "")
    else:
        log.info("logits: %s output projection", model.head_format)
    vision = None
    if ckpt.vision is not None:
        from helios.models.vision.registry import load_vision_tower

        v = ckpt.vision
        # The tower is dense in the activation dtype (no quantized format): its features replace
        # token embeddings of that dtype.
        vision = load_vision_tower(v.family, v.config, v.preprocessor, v.processor, v.tensors,
                                   dtype=choice.dtype, device=device)
        log.info("vision: %s tower, %s", v.family, vision.profile.settings_key)
    if device == "cpu" and choice.format.keep_blocks and choice.format.unpack_above is not None:
        keep_large_buffers()  # after the build, whose own large temporaries go back to the system
    return LoadedModel(ckpt, model, choice, key, vision, huge_pages=deferred,
                       release_pages=ckpt.release_pages if deferred is not None else None)


def kept_weights(model: Any) -> str:
    """What the loaded model holds its weights as: projections per module kind (with the GGUF block
    types of `kquant.KQuantLinear` ones), and the embedding's and head's form where the model says."""
    from collections import Counter

    from helios.models import cpu_kernels
    from helios.models.kquant import KQuantLinear
    from helios.models.quant import DenseLinear, Int4Linear, Int8Linear

    kinds: Counter[str] = Counter()
    blocks: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, KQuantLinear):
            kinds["kquant"] += 1
            blocks.update(cpu_kernels.KQUANT_NAMES[t] for t in module.types)
            if module.dense is not None:
                kinds["kquant dense copies"] += 1
        elif isinstance(module, Int4Linear):
            kinds["int4"] += 1
        elif isinstance(module, Int8Linear):
            kinds["int8"] += 1
        elif isinstance(module, DenseLinear):
            kinds[f"dense {str(module.weight.dtype).removeprefix('torch.')}"] += 1
    text = "projections " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    if blocks:
        text += " (block segments: " + ", ".join(f"{n} {k}" for k, n in sorted(blocks.items())) + ")"
    embed = getattr(model, "embed_format", None)
    head = getattr(model, "head_format", None)
    if embed:
        text += f"; embedding {embed}"
    if head:
        text += f"; head {head}"
    return text


def model_fingerprint(path: str | Path, weights: str) -> bytes:
    """What identifies the weights a KV page was computed with: the checkpoint's files (resolved
    path, size and modification time of each) and how they were loaded (format, dtype). Part of every
    prefix-cache chain hash, so the disk store never serves another model's pages."""
    root = Path(path).expanduser().resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    h = hashlib.blake2b(weights.encode(), digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.digest()


def _usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def load_drafter(cfg: HeliosConfig, tokenizer: Tokenizer, *, num_pages: int, max_model_len: int,
                 cache_dir: Path | None) -> Drafter:
    """``[speculative] draft_model`` (a catalog name or a path, as ``[model] path``) loaded with the
    target's weights and dtype settings, as the engine's `Drafter`: its own pool of ``num_pages``
    pages (the target's, plus one per request slot for the lookahead), drafting within the
    target's context and its own. Refused (`ConfigError`) when its tokenizer maps ids to other
    tokens than the target's."""
    from helios.config import ConfigError
    from helios.engine.drafter import Drafter
    from helios.loaders import catalog

    spec = cfg.speculative.draft_model
    try:
        path, _name = resolve_model(spec)
    except catalog.UnknownModel as exc:
        raise ConfigError(f"speculative.draft_model: {exc}") from None
    print(f"Loading the draft model {path}", file=sys.stderr)
    loaded = load_model(path, weights=cfg.model.weights, dtype=cfg.model.dtype, device=cfg.model.device,
                        cache_dir=cache_dir, progress=_progress)
    ckpt = loaded.checkpoint
    difference = tokenizer.vocabulary_difference(ckpt.tokenizer)
    if difference is not None:
        raise ConfigError(f"speculative.draft_model {spec!r} ({ckpt.model_id}) cannot draft for this model: its "
                          f"tokenizer differs ({difference}); a draft model must share the target's vocabulary")
    page = cfg.engine.page_size
    drafter = Drafter(loaded.model, loaded.choice.dtype, cfg.model.device, num_pages=num_pages, page_size=page,
                      max_active=cfg.engine.max_active,
                      max_model_len=min(max_model_len, ckpt.config.max_position_embeddings),
                      prefill_chunk_size=cfg.engine.prefill_chunk_size, prefix_caching=cfg.cache.prefix_caching,
                      fingerprint=model_fingerprint(path, loaded.choice.describe()),
                      token_vocab_size=tokenizer.vocab_size, kv_prefault=cfg.engine.kv_prefault,
                      vocab_prefix=draft_vocab_prefix(cfg.speculative.draft_vocab, tokenizer))
    layout = drafter.attention.layout
    log.info("draft model %s: %s; its KV pool %d pages (%.2f GiB); drafts ranked over %s", ckpt.model_id,
             loaded.choice.describe(), num_pages, layout.bytes_per_token(loaded.choice.dtype) * page * num_pages / 2**30,
             f"token ids 0-{drafter.vocab_prefix - 1}" if drafter.vocab_prefix else "the whole vocabulary")
    return drafter


def draft_vocab_prefix(configured: int, tokenizer: Tokenizer) -> int:
    """The token ids a draft model ranks its drafts over (`Drafter`'s ``vocab_prefix``; 0: all):
    ``[speculative] draft_vocab`` for a byte-level BPE vocabulary, whose ids follow the order its
    merges were learned (most frequent first), else 0: a SentencePiece vocabulary orders its pieces
    otherwise (Gemma 3's: a third of the tokens of Helios's Python source have ids past 65,536)."""
    return configured if tokenizer.byte_encoding == "byte_level" else 0


def has_mtp(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint carries multi-token-prediction layers Helios can draft with (a model
    folder or GGUF file of a `models.mtp.MTP_ARCHITECTURES` family whose tensors include an MTP
    module: a GGUF file's ``blk.{N}.nextn.*`` tensors)."""
    from helios.models.mtp import MTP_ARCHITECTURES, mtp_layers

    num_layers = getattr(ckpt.config, "num_layers", None)
    return (ckpt.architecture.name in MTP_ARCHITECTURES and num_layers is not None
            and mtp_layers(num_layers, ckpt.weights) > 0)


def mtp_file(cfg: HeliosConfig, target: Checkpoint) -> Checkpoint | None:
    """``[speculative] draft_model`` when it is an MTP-only file of the target's model (llama.cpp's
    ``--mtp`` conversion: a GGUF file of the target's `models.mtp.MTP_ARCHITECTURES` family holding
    its MTP modules and the shared embedding, head and output norm, no decoder): its checkpoint
    (the header read, the weights not yet); None for any other model (a draft model). An MTP-only
    file of another family or shape is refused (`ConfigError`)."""
    from helios.loaders import catalog
    from helios.loaders.checkpoint import load_checkpoint
    from helios.models.mtp import MTP_ARCHITECTURES, mtp_only

    spec = cfg.speculative.draft_model
    try:
        path, _name = resolve_model(spec)
    except catalog.UnknownModel as exc:
        raise ConfigError(f"speculative.draft_model: {exc}") from None
    ckpt = load_checkpoint(path, torch.float32)
    num_layers = getattr(ckpt.config, "num_layers", None)
    if (ckpt.architecture.name not in MTP_ARCHITECTURES or num_layers is None
            or not mtp_only(num_layers, ckpt.weights)):
        return None
    shape = ("num_layers", "hidden_size", "vocab_size")
    if ckpt.architecture.name != target.architecture.name or any(
            getattr(ckpt.config, field) != getattr(target.config, field, None) for field in shape):
        raise ConfigError(f"speculative.draft_model {spec!r} holds MTP layers of a {ckpt.architecture.name} model "
                          f"({', '.join(f'{f} {getattr(ckpt.config, f)}' for f in shape)}), not of this "
                          f"{target.architecture.name} model "
                          f"({', '.join(f'{f} {getattr(target.config, f, None)}' for f in shape)})")
    return ckpt


def load_mtp_drafter(cfg: HeliosConfig, loaded: LoadedModel, *, num_pages: int, max_model_len: int,
                     fingerprint: bytes, source: Checkpoint | None = None) -> MTPDrafter | None:
    """The first MTP layer over the loaded target, as the engine's `MTPDrafter` (its own pool of
    ``num_pages`` pages of the one layer): the checkpoint's own, or ``source``'s (an MTP-only file
    of the same model, `mtp_file`). The checkpoint's own: None when it has none, or when its layer
    does not load (a warning says why: the server runs without it). ``source``'s: one that does not
    load is refused (`ConfigError`: it was asked for)."""
    from helios.engine.mtp import MTPDrafter
    from helios.models.mtp import load_mtp

    ckpt = loaded.checkpoint
    if source is None and not has_mtp(ckpt):
        return None
    try:
        predictor = load_mtp(loaded.model, ckpt.architecture, (source or ckpt).weights)
    except ValueError as exc:
        if source is not None:
            raise ConfigError(f"speculative.draft_model {cfg.speculative.draft_model!r}: its MTP layer does not "
                              f"load: {exc}") from None
        log.warning("the checkpoint's MTP layer is not used: %s", exc)
        return None
    page = cfg.engine.page_size
    drafter = MTPDrafter(predictor, loaded.choice.dtype, cfg.model.device, num_pages=num_pages, page_size=page,
                         max_active=cfg.engine.max_active, max_model_len=max_model_len,
                         prefix_caching=cfg.cache.prefix_caching, fingerprint=fingerprint,
                         token_vocab_size=ckpt.tokenizer.vocab_size, kv_prefault=cfg.engine.kv_prefault)
    layout = drafter.attention.layout
    log.info("MTP layer%s drafts (%s); its KV pool %d pages (%.2f GiB)",
             "" if source is None else f" of {source.source_path}", kept_weights(predictor), num_pages,
             layout.bytes_per_token(loaded.choice.dtype) * page * num_pages / 2**30)
    return drafter


PARALLEL_TIMEOUT = datetime.timedelta(days=365)
"""The process group's collective timeout. A worker waits in a broadcast for rank 0's next step for
as long as the server is idle, which the default (30 minutes) would end; a rank that dies closes
its connections, which fails the others' collectives at once."""


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (env://) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parallel_world(cfg: HeliosConfig) -> int:
    """How many tensor-parallel ranks: ``[parallel] tensor_parallel_size``, or torchrun's WORLD_SIZE
    (both set: they must agree)."""
    size = cfg.parallel.tensor_parallel_size
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if size not in (1, world):
            raise ConfigError(f"parallel.tensor_parallel_size = {size}, but torchrun started {world} processes "
                              "(WORLD_SIZE); they must agree")
        return world
    return size


def join_parallel(cfg: HeliosConfig, rank: int | None = None) -> ParallelContext | None:
    """This process's place in ``[parallel]`` (None: one rank). Under torchrun the rank and the
    rendezvous come from the environment (env://); otherwise ``rank`` (0 for the serving process)
    and tcp://``master_addr``:``master_port``. The process group is created here (or found, when
    it already is). Backend: gloo on the CPU, NCCL on CUDA (``[parallel] backend`` to choose)."""
    world = parallel_world(cfg)
    if world == 1:
        return None
    device = cfg.model.device
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if launched_by_torchrun():
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        init = "env://"
    else:
        if rank is None or not cfg.parallel.master_port:
            raise ConfigError("tensor parallelism without torchrun needs the rank and parallel.master_port "
                              "(helios serve sets them when it starts the ranks)")
        local = rank
        init = f"tcp://{cfg.parallel.master_addr}:{cfg.parallel.master_port}"
    rank_device = torch.device("cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        rank_device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=PARALLEL_TIMEOUT)
    return ParallelContext(rank, world, None, cfg.parallel.expert_parallel, rank_device)


def _rank_threads(ctx: ParallelContext) -> int:
    """A rank's share of this machine's cores (the ranks launched together here split them)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)) if launched_by_torchrun() else ctx.world_size
    return max(1, _usable_cores() // max(1, local_world))


def run_parallel_worker(cfg: HeliosConfig, rank: int | None = None) -> int:
    """A tensor-parallel worker (a rank other than 0): join the group, load this rank's shard of
    ``[model] path`` as rank 0 loads its own, and run its forward passes until rank 0 stops
    (`engine.tp.serve_worker`). Returns the exit status (0)."""
    import signal

    from helios.models import cpu_kernels

    ctx = join_parallel(cfg, rank)
    if ctx is None or ctx.rank == 0:
        raise ConfigError("run_parallel_worker runs the ranks other than 0 of a tensor-parallel group")
    # Ctrl-C reaches every process of the terminal's group, and torchrun passes SIGTERM to every rank:
    # a worker keeps serving rank 0's steps while rank 0 drains, and ends when rank 0 stops it (or
    # its connections to rank 0 close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(cfg.model.threads or _rank_threads(ctx))
    cpu_kernels.set_enabled(cfg.model.cpu_kernels)
    path, _name = resolve_model(cfg.model.path)
    try:
        loaded = load_model(path, weights=cfg.model.weights, dtype=cfg.model.dtype, device=cfg.model.device,
                            parallel=ctx, mla_cache=cfg.model.mla_cache)
        forwards = serve_worker(loaded.model, ctx, loaded.choice.dtype,
                                ctx.device if ctx.device.type == "cuda" else torch.device(cfg.model.device))
        log.info("tensor-parallel rank %d stopped after %d forward passes", ctx.rank, forwards)
    finally:
        dist.destroy_process_group()
    return 0


def build_runtime(cfg: HeliosConfig) -> Runtime:
    """The model loaded into this process, its engine thread (not started) and what the Service needs."""
    from helios.loaders.catalog import default_cache_dir

    # Everything torch does on this (the main) thread stays on one OpenMP thread; the engine thread
    # sets `[model] threads` for itself when it starts (EngineThread). A multi-thread OpenMP team
    # here would stay alive beside the engine's, and once libgomp manages more threads than there
    # are CPUs it stops spinning and wakes its workers through futexes at every parallel region:
    # torch's int4 matmul then took 41-52 us per call on the engine thread instead of 15 us, and a
    # 1-stream decode step 13.4 ms instead of 7.1 (docs/benchmarks.md).
    torch.set_num_threads(1)
    path, catalog_name = resolve_model(cfg.model.path)
    device = cfg.model.device
    t0 = time.perf_counter()
    print(f"Loading {path} ({device})", file=sys.stderr)
    cache_dir = default_cache_dir() / "packed" if cfg.model.weight_cache else None
    from helios.models import cpu_kernels

    cpu_kernels.set_enabled(cfg.model.cpu_kernels)
    parallel = join_parallel(cfg, 0)
    if parallel is not None and cfg.cache.disk_dir:
        raise ConfigError("cache.disk_dir: the host store copies rank 0's KV pages only, which tensor parallelism "
                          "splits across the ranks; leave disk_dir empty with parallel.tensor_parallel_size > 1")
    loaded = load_model(path, weights=cfg.model.weights, dtype=cfg.model.dtype, device=device, cache_dir=cache_dir,
                        progress=_progress, parallel=parallel, mla_cache=cfg.model.mla_cache, defer_huge_pages=True)
    ckpt, dtype = loaded.checkpoint, loaded.choice.dtype
    model: CausalLM = loaded.model
    leader: TensorParallelLeader | None = None
    if parallel is not None:
        model = leader = TensorParallelLeader(loaded.model, parallel)
    print(f"Loaded {ckpt.model_id} in {time.perf_counter() - t0:.1f} s: {loaded.choice.describe()}", file=sys.stderr)

    mc = ckpt.config
    max_model_len = _max_model_len(cfg, mc.max_position_embeddings)
    page = cfg.engine.page_size
    num_pages = cfg.engine.kv_pages
    if num_pages == 0:
        # Recurrent layers' per-request states (their checkpoints' snapshots, and speculation's
        # backup rows) come out of the same budget as the pages.
        layout = CacheLayout.from_specs(model.cache_specs())
        states = cfg.engine.max_active + (cfg.cache.checkpoint_slots if cfg.cache.prefix_caching else 0)
        if cfg.speculative.mode != "off":
            states += cfg.engine.max_active
        steps = step_tokens(cfg.engine.prefill_chunk_size, cfg.engine.max_active,
                            cfg.speculative.max_depth if cfg.speculative.mode != "off" else 0)
        num_pages = layout.pages_for(cfg.engine.kv_memory_gib * 2**30, page, dtype, cfg.engine.kv_dtype,
                                     max_active=cfg.engine.max_active, states=states, step_tokens=steps)
        windows = layout.bounded_bytes(page, dtype, cfg.engine.kv_dtype, max_active=cfg.engine.max_active,
                                       step_tokens=steps)
        if windows:
            log.info("row windows (raw compressor rows) for %d running requests: %.2f GiB of the KV budget",
                     cfg.engine.max_active, windows / 2**30)
            if windows >= cfg.engine.kv_memory_gib * 2**30:
                log.warning("engine.kv_memory_gib (%.2f) does not cover the row windows of engine.max_active = %d "
                            "requests (%.2f GiB): the pool is sized for max_model_len only",
                            cfg.engine.kv_memory_gib, cfg.engine.max_active, windows / 2**30)
    num_pages = max(num_pages, -(-max_model_len // page) + 1)
    ecfg = EngineConfig(page_size=page, num_pages=num_pages, max_active=cfg.engine.max_active,
                        prefill_chunk_size=cfg.engine.prefill_chunk_size, max_model_len=max_model_len,
                        prefix_caching=cfg.cache.prefix_caching,
                        fingerprint=model_fingerprint(path, loaded.choice.describe()),
                        # Tensor parallel: no host store (it would copy and restore rank 0's pages only).
                        host_memory_bytes=int(cfg.cache.host_memory_gib * 2**30) if parallel is None else 0,
                        disk_dir=os.path.expanduser(cfg.cache.disk_dir) if cfg.cache.disk_dir else None,
                        disk_bytes=int(cfg.cache.disk_gib * 2**30),
                        checkpoint_slots=cfg.cache.checkpoint_slots,
                        checkpoint_work_fraction=cfg.cache.checkpoint_work_fraction,
                        speculative=SpeculativeConfig(mode=cfg.speculative.mode, max_depth=cfg.speculative.max_depth,
                                                      history=cfg.speculative.history),
                        kv_prefault=cfg.engine.kv_prefault, kv_dtype=cfg.engine.kv_dtype,
                        token_vocab_size=ckpt.tokenizer.vocab_size)
    drafter: Drafter | MTPDrafter | None = None
    companion = mtp_file(cfg, ckpt) if cfg.speculative.draft_model else None
    if companion is not None:
        drafter = load_mtp_drafter(cfg, loaded, num_pages=num_pages + cfg.engine.max_active,
                                   max_model_len=max_model_len, fingerprint=ecfg.fingerprint, source=companion)
    elif cfg.speculative.draft_model:
        drafter = load_drafter(cfg, ckpt.tokenizer, num_pages=num_pages + cfg.engine.max_active,
                               max_model_len=max_model_len, cache_dir=cache_dir)
    elif cfg.speculative.mode != "off" and cfg.speculative.mtp and parallel is None:
        drafter = load_mtp_drafter(cfg, loaded, num_pages=num_pages + cfg.engine.max_active,
                                   max_model_len=max_model_len, fingerprint=ecfg.fingerprint)
    core = EngineCore(model, ecfg, dtype, device, vision=loaded.vision, drafter=drafter)
    core.between_steps.append(loaded.finish_huge_pages)
    if leader is not None:
        if cfg.cache.host_memory_gib:
            log.info("tensor parallel: the prefix cache's host store is off (cache.host_memory_gib is ignored)")
        leader.start_workers(WorkerSetup(num_pages=num_pages, page_size=page, kv_dtype=cfg.engine.kv_dtype,
                                         num_state_slots=cfg.engine.max_active, max_active=cfg.engine.max_active,
                                         step_tokens=core.step_tokens))
    learned = None if drafter is None else ("draft" if companion is None and cfg.speculative.draft_model else "mtp")
    info, recipe, eos, admission = _describe(cfg, ckpt, catalog_name, max_model_len, learned=learned,
                                             speculative_mode=core.scheduler.speculative.mode,
                                             vision=loaded.vision)
    return Runtime(cfg, core, info, ckpt.tokenizer, ckpt.chat_template, recipe, eos, vision=loaded.vision,
                   admission=admission, leader=leader)


def _learned_kind(cfg: HeliosConfig, ckpt: Checkpoint) -> str | None:
    """The learned drafter a rank will load, by the headers (`domain.model.ModelInfo`'s kinds):
    "draft" (a draft model), "mtp" (an MTP-only ``draft_model`` file or the checkpoint's own MTP
    layer) or None."""
    if cfg.speculative.draft_model:
        return "draft" if mtp_file(cfg, ckpt) is None else "mtp"
    return "mtp" if cfg.speculative.mode != "off" and cfg.speculative.mtp and has_mtp(ckpt) else None


def _max_model_len(cfg: HeliosConfig, max_position_embeddings: int) -> int:
    if cfg.model.max_model_len == 0:
        return max_position_embeddings
    return cfg.model.max_model_len


def _describe(cfg: HeliosConfig, ckpt: Checkpoint, catalog_name: str, max_model_len: int, *, learned: str | None,
              speculative_mode: str, vision: VisionTower | None) -> tuple[ModelInfo, Recipe, tuple[int, ...], ImageAdmission]:
    """What the serving side knows of the model: its `ModelInfo`, recipe, EOS ids and image admission
    (from the checkpoint's header and configuration; no weights)."""
    from helios.loaders.catalog import DEFAULT_NAME
    from helios.recipes import detect_parser_family, detect_recipe, get_recipe, plain_recipe

    mc = ckpt.config
    name = cfg.model.recipe or detect_recipe(ckpt.model_id, mc.arch, ckpt.chat_template)
    is_default = catalog_name == DEFAULT_NAME
    generation_config = generation_defaults(ckpt.generation_config, cfg.model.generation_config, default_model=is_default)
    if name == "plain":
        recipe = plain_recipe(generation_config, output_parser=detect_parser_family(ckpt.chat_template))
    else:
        recipe = get_recipe(name, generation_config=generation_config)
    log.info("recipe %s, output parser %s", recipe.name, recipe.output_parser)
    tok = ckpt.tokenizer
    eos = tuple(tok.eos_token_ids)
    info = ModelInfo(
        model_id=ckpt.model_id,
        aliases=model_aliases(cfg.server.aliases, default_model=is_default, catalog_name=catalog_name),
        created=int(time.time()),
        max_model_len=max_model_len,
        vocab_size=mc.vocab_size,
        default_max_tokens=cfg.server.default_max_tokens,
        max_concurrency=cfg.engine.max_active,
        prefill_chunk_size=cfg.engine.prefill_chunk_size,
        max_top_logprobs=cfg.server.max_top_logprobs,
        prompt_logprobs=cfg.server.prompt_logprobs,
        sampling_defaults=recipe.sampling_defaults_json(),
        sampling_ranges=recipe.sampling_ranges_json(),
        recipe=recipe.name,
        has_bos=tok.bos_token_id is not None,
        thinking_token_budget=cfg.server.thinking_token_budget,
        clamp_max_tokens=cfg.server.max_tokens_overflow == "clamp",
        max_output_tokens=cfg.server.max_output_tokens,
        has_reasoning=recipe.reasoning_parser is not None or recipe.output_parser not in ("plain", "hermes", "qwen2_5"),
        speculative_mode=speculative_mode,
        speculative_max_depth=cfg.speculative.max_depth if speculative_mode != "off" else 0,
        speculative_history=speculative_mode != "off" and cfg.speculative.history,
        speculative_learned=learned,
        has_vision=vision is not None,
        # has_tools is decided with the chat template, in serving.service_factory.tool_support.
    )
    from helios.serving.images import build_admission

    # Image admission (limits, budgets, host caches; all-zero limits for a text-only model).
    admission = build_admission(cfg.vision, model=info.public_id,
                                profile=vision.profile if vision is not None else None,
                                max_model_len=max_model_len, max_body_bytes=cfg.server.max_body_bytes)
    info = attrs.evolve(info, vision=admission.limits)
    return info, recipe, eos, admission


def build_server_runtime(cfg: HeliosConfig) -> Runtime | DataParallelRuntime:
    """What the app's lifespan builds: one engine thread in this process (`build_runtime`), or, with
    `[parallel] data_parallel_size` > 1 in internal mode, that many engine processes
    (`build_data_parallel_runtime`). External mode serves one engine here, its KV events named by
    `data_parallel_rank`."""
    if cfg.parallel.data_parallel_size > 1 and cfg.parallel.data_parallel_mode == "internal":
        return build_data_parallel_runtime(cfg)
    return build_runtime(cfg)


def build_rank(cfg: HeliosConfig, rank: int) -> RankEngine:
    """A data-parallel rank's engine, built in its own process (`engine.dp.serve_rank` calls this
    through a `functools.partial`): the whole configuration with one rank and `[model] threads` (0:
    this machine's usable cores divided by the number of ranks, at least one)."""
    size = cfg.parallel.data_parallel_size
    threads = cfg.model.threads or max(1, _usable_cores() // size)
    # Each rank has its own KV pool and host store (the configured sizes, per rank); a disk tier
    # gets one folder per rank, since two stores must never write one directory.
    disk_dir = str(Path(cfg.cache.disk_dir).expanduser() / f"rank-{rank}") if cfg.cache.disk_dir else ""
    one = attrs.evolve(cfg, model=attrs.evolve(cfg.model, threads=threads),
                       cache=attrs.evolve(cfg.cache, disk_dir=disk_dir),
                       parallel=attrs.evolve(cfg.parallel, data_parallel_size=1, data_parallel_mode="internal",
                                             data_parallel_rank=0, kv_events=False))
    runtime = build_runtime(one)
    # Structured-output constraints arrive as their grammars and compile again against this vocabulary.
    from helios.engine.structured import GrammarVocab, set_process_vocab

    set_process_vocab(lambda: GrammarVocab(runtime.tokenizer))
    log.info("data-parallel rank %d of %d: %d intra-op thread(s)", rank, size, threads)
    return RankEngine(runtime.core, threads, cfg.model.adapt_threads, cfg.server.health_stall_seconds)


def build_data_parallel_runtime(cfg: HeliosConfig) -> DataParallelRuntime:
    """`[parallel] data_parallel_size` rank processes, each loading the model and running its own
    engine; this process reads the checkpoint's header only (tokenizer, template, configuration)
    and routes. Vision-language models are refused (their image preparation runs here and their
    image loaders do not cross processes)."""
    from helios.config import ConfigError
    from helios.loaders.catalog import default_cache_dir
    from helios.loaders.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    par = cfg.parallel
    path, catalog_name = resolve_model(cfg.model.path)
    cache_dir = default_cache_dir() / "packed" if cfg.model.weight_cache else None
    ckpt = load_checkpoint(path, torch.float32, header_cache=cache_dir)
    if ckpt.vision is not None:
        raise ConfigError(f"{ckpt.model_id} takes images, which data parallelism does not serve yet: set "
                          "[parallel] data_parallel_size = 1")
    max_model_len = _max_model_len(cfg, ckpt.config.max_position_embeddings)
    info, recipe, eos, admission = _describe(cfg, ckpt, catalog_name, max_model_len,
                                             learned=_learned_kind(cfg, ckpt),
                                             speculative_mode=cfg.speculative.mode, vision=None)
    info = attrs.evolve(info, max_concurrency=par.data_parallel_size * cfg.engine.max_active)
    hub = KVEventHub() if par.kv_events else None
    engine = DataParallelEngine(functools.partial(_rank_builder, cfg), par.data_parallel_size, routing=par.routing,
                                load_weight_tokens=par.load_weight_tokens, cache_threshold=par.cache_threshold,
                                restart=par.restart_ranks, kv_listener=hub.publish if hub is not None else None)
    print(f"Starting {par.data_parallel_size} data-parallel ranks ({par.routing} routing)", file=sys.stderr)
    engine.launch()
    return DataParallelRuntime(cfg, engine, info, ckpt.tokenizer, ckpt.chat_template, recipe, eos,
                               admission=admission, kv_events=hub)


def _rank_builder(cfg: HeliosConfig, rank: int) -> functools.partial[RankEngine]:
    """`DataParallelEngine`'s ``build``: the picklable call a rank process makes."""
    return functools.partial(build_rank, cfg, rank)
