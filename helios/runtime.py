"""Loading the model and wiring the engine thread to the serving pipeline (used by the app's lifespan)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from helios.config import HeliosConfig
from helios.domain.model import ModelInfo
from helios.engine.attention import KVCache
from helios.engine.core import EngineConfig, EngineCore, EngineThread
from helios.serving.engine_client import EngineClient
from helios.serving.pipeline import Service

log = logging.getLogger("helios.runtime")


CPU_CAPABILITY_ENV = "HELIOS_CPU_CAPABILITY"
CPU_CAPABILITIES = ("avx2", "avx512_bf16", "amx")


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

    def __init__(self, cfg: HeliosConfig, core: EngineCore, info: ModelInfo, tokenizer: Any, template: Any,
                 recipe: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.cfg = cfg
        self.core = core
        self.info = info
        self.tokenizer = tokenizer
        self.template = template
        self.recipe = recipe
        self.eos_token_ids = eos_token_ids
        self.client = EngineClient(max_in_flight=cfg.engine.max_active + cfg.server.model_queue_size)
        self.thread = EngineThread(core, self.client.sink)

    def start(self, trio_token: Any, limiter: Any = None) -> Service:
        """Start the engine thread; the Service renders and tokenizes on `limiter` (the app's pool)."""
        from helios.serving.service_factory import make_service

        self.client.attach(self.thread, trio_token)
        self.thread.start()
        return make_service(self, limiter)

    def stop(self) -> None:
        self.thread.shutdown()


def model_aliases(configured: Sequence[str], *, default_model: bool) -> tuple[str, ...]:
    """The configured aliases in order; the default model also answers to its short names."""
    from helios.loaders.default_model import DEFAULT_MODEL_ALIASES

    aliases = [a for a in configured if a]
    if default_model:
        aliases += [a for a in DEFAULT_MODEL_ALIASES if a not in aliases]
    return tuple(aliases)


def generation_defaults(
    checkpoint: Mapping[str, Any], configured: Mapping[str, Any], *, default_model: bool
) -> dict[str, Any]:
    """The checkpoint's generation_config, then the default model's card settings, then the
    operator's `[model] generation_config`; later ones win."""
    from helios.loaders.default_model import DEFAULT_MODEL_GENERATION_CONFIG

    return {**checkpoint, **(DEFAULT_MODEL_GENERATION_CONFIG if default_model else {}), **configured}


def _is_default(path: str) -> bool:
    from helios.loaders.default_model import GGUF_NAME, GGUF_SIZE

    p = Path(path)
    return p.name == GGUF_NAME and p.is_file() and p.stat().st_size == GGUF_SIZE


def build_runtime(cfg: HeliosConfig) -> Runtime:
    from helios.loaders.checkpoint import load_checkpoint
    from helios.loaders.default_model import ensure_default_model
    from helios.models.llama import LlamaForCausalLM
    from helios.recipes import detect_parser_family, detect_recipe, get_recipe, plain_recipe

    threads = cfg.model.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    default_path = ensure_default_model() if not cfg.model.path else None
    path = cfg.model.path or str(default_path)
    device = cfg.model.device
    dtype = choose_dtype(cfg.model.dtype, device)
    t0 = time.perf_counter()
    print(f"Loading {path} ({dtype}, {device})", file=sys.stderr)
    ckpt = load_checkpoint(path, dtype, progress=_progress)
    model = LlamaForCausalLM(ckpt.config, dtype=dtype, device=device)
    model.load_weights(ckpt.tensors)
    model.eval()
    print(f"Loaded {ckpt.model_id} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    mc = ckpt.config
    max_model_len = cfg.model.max_model_len or mc.max_position_embeddings
    max_model_len = min(max_model_len, mc.max_position_embeddings) if cfg.model.max_model_len == 0 else max_model_len
    page = cfg.engine.page_size
    num_pages = cfg.engine.kv_pages
    if num_pages == 0:
        per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        num_pages = int(cfg.engine.kv_memory_gib * 2**30 // (per_token * page))
    num_pages = max(num_pages, -(-max_model_len // page) + 1)
    ecfg = EngineConfig(page_size=page, num_pages=num_pages, max_active=cfg.engine.max_active,
                        prefill_chunk_size=cfg.engine.prefill_chunk_size, max_model_len=max_model_len)
    core = EngineCore(model, mc, ecfg, dtype, device)
    name = cfg.model.recipe or detect_recipe(ckpt.model_id, mc.arch, ckpt.chat_template)
    is_default = default_path is not None or _is_default(path)
    generation_config = generation_defaults(ckpt.generation_config, cfg.model.generation_config, default_model=is_default)
    if name == "plain":
        recipe = plain_recipe(generation_config, output_parser=detect_parser_family(ckpt.chat_template))
    else:
        recipe = get_recipe(name, generation_config=generation_config)
    tok = ckpt.tokenizer
    eos = tuple(tok.eos_token_ids)
    info = ModelInfo(
        model_id=ckpt.model_id,
        aliases=model_aliases(cfg.server.aliases, default_model=is_default),
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
        has_reasoning=recipe.reasoning_parser is not None or recipe.output_parser not in ("plain", "hermes"),
        # has_tools is decided with the chat template, in serving.service_factory.tool_support.
    )
    return Runtime(cfg, core, info, tok, ckpt.chat_template, recipe, eos)
