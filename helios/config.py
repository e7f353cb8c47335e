"""Configuration: a TOML file (HELIOS_CONFIG or --config) plus CLI overrides, validated once at start."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

LOG_LEVELS = ("debug", "info", "warning", "error")
# [model] weights: how the decoder's projections are stored and multiplied (helios.runtime.choose_weights).
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
# [engine] kv_dtype (docs/operations.md, "KV cache"; helios.engine.kv.layout.KV_DTYPES).
KV_DTYPES = ("auto", "int8")
# [model] mla_cache (helios.models.architecture.MLA_CACHE_FORMS).
MLA_CACHE_FORMS = ("latent", "expanded")
# [speculative] mode (docs/operations.md, "Speculative decoding").
SPECULATIVE_MODES = ("off", "ngram", "adaptive")
MAX_SPECULATIVE_DEPTH = 16


class ConfigError(ValueError):
    """A configuration problem, reported at start-up with the offending key."""


def _positive(_inst: Any, attr: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    if value <= 0:
        raise ConfigError(f"{attr.name} must be positive, got {value}")


def _non_negative(_inst: Any, attr: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
    if value < 0:
        raise ConfigError(f"{attr.name} must not be negative, got {value}")


def _seconds(_inst: Any, attr: attrs.Attribute, value: float) -> None:  # type: ignore[type-arg]
    if isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{attr.name} must be a finite number of seconds, at least 0; got {value!r}")


def _positive_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive, finite number of seconds, got {value!r}")


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_non_negative)
    api_key: str = ""
    aliases: list[str] = attrs.field(factory=list)
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_positive)
    # HTTP admission slots: one per generated choice, held until the response is delivered (429).
    max_concurrency: int = attrs.field(default=256, validator=_positive)
    # Requests the model may hold beyond its active slots before new ones get 503.
    model_queue_size: int = attrs.field(default=256, validator=_positive)
    default_max_tokens: int = attrs.field(default=4096, validator=_positive)
    # A request's explicit output limit beyond the context its prompt leaves: "clamp" (llama.cpp's and
    # Ollama's rule: the limit becomes what is left, the answer ends with the protocol's length reason
    # there) or "reject" (vLLM's, OpenAI's and Anthropic's: a 400 context_length_exceeded in each
    # protocol's words). Coding clients ask for 32,000 output tokens whatever the model's context.
    max_tokens_overflow: str = attrs.field(default="clamp", validator=attrs.validators.in_(["clamp", "reject"]))
    # A cap on every request's output tokens (llama-server's --n-predict): a larger limit, or none, is cut
    # to it and the answer ends with the protocol's length reason there. 0: no cap.
    max_output_tokens: int = attrs.field(default=0, validator=_non_negative)
    frontend_workers: int = attrs.field(default=2, validator=_positive)
    thinking_token_budget: int | None = None
    max_top_logprobs: int = 20
    prompt_logprobs: bool = True
    # One `helios.access` INFO line per HTTP request; log_level applies to Helios's loggers.
    access_log: bool = True
    log_level: str = attrs.field(default="info", validator=attrs.validators.in_(LOG_LEVELS))
    # Graceful shutdown: how long in-flight requests may run after SIGTERM before they are aborted.
    shutdown_grace_seconds: float = attrs.field(default=30.0, validator=_seconds)
    # /health answers 503 when the engine thread has been inside one step (or inbox batch) this long.
    health_stall_seconds: float = attrs.field(default=60.0, validator=lambda _i, a, v: _positive_seconds(a.name, v))


@attrs.frozen
class ModelConfigSection:
    path: str = ""  # GGUF file or Hugging Face directory; empty = the default model
    dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(["auto", "float32", "bfloat16", "float16"]))
    # "auto" picks per machine and checkpoint at load (and logs why); see docs/benchmarks.md, "Weight formats".
    weights: str = attrs.field(default="auto", validator=attrs.validators.in_(WEIGHT_FORMATS))
    # Keep the built weights (packed int4, dense copies) in <model cache dir>/packed for a fast warm start.
    weight_cache: bool = True
    # Helios's own CPU kernels (helios/models/cpu_kernels.py: the Q8_0 output projection and paged
    # decode attention), built once with the machine's C++ compiler; false keeps the torch paths.
    cpu_kernels: bool = True
    device: str = "cpu"
    max_model_len: int = attrs.field(default=0, validator=_non_negative)  # 0 = the model's own limit
    recipe: str = ""  # empty = detect from the model
    threads: int = attrs.field(default=0, validator=_non_negative)  # torch intra-op threads; 0 = all cores
    # Shrink the engine's team while other processes take cores, grow it back when they leave
    # (helios/engine/threads.py); false keeps `threads` fixed.
    adapt_threads: bool = True
    # A DeepSeek-V3 checkpoint's attention cache: "latent" (one 576-element row per token and layer,
    # absorbed decode) or "expanded" (each head's K and V, as a server without MLA support keeps
    # them; for comparison, docs/benchmarks.md "MLA: absorbed decode against expanded KV").
    mla_cache: str = attrs.field(default="latent", validator=attrs.validators.in_(MLA_CACHE_FORMS))
    # Overrides the checkpoint's generation_config sampling defaults (vLLM's
    # --override-generation-config), e.g. {temperature = 0.2, top_p = 0.9}.
    generation_config: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class EngineSection:
    page_size: int = attrs.field(default=16, validator=_positive)
    kv_pages: int = attrs.field(default=0, validator=_non_negative)  # 0 = derive from kv_memory_gib
    kv_memory_gib: float = 2.0
    prefill_chunk_size: int = attrs.field(default=512, validator=_positive)
    max_active: int = attrs.field(default=64, validator=_positive)
    # Touch every page of the KV pool at start, so its memory is resident (and any shortage shows)
    # from the first request; off: a page's memory is taken when it is first used.
    kv_prefault: bool = False
    # "auto": K/V rows in the model's dtype (exact); "int8": full-attention and sliding-window K/V as
    # int8 codes with a bfloat16 scale per row, about half the bytes a token takes in bfloat16.
    kv_dtype: str = attrs.field(default="auto", validator=attrs.validators.in_(KV_DTYPES))


@attrs.frozen
class CacheSection:
    """The prefix cache (docs/operations.md, "Prefix cache")."""

    prefix_caching: bool = True  # reuse full KV pages of earlier requests
    host_memory_gib: float = attrs.field(default=1.0, validator=_non_negative)  # DRAM tier behind the page pool
    disk_dir: str = ""  # the disk tier's directory (it survives a restart); empty: no disk tier
    disk_gib: float = attrs.field(default=8.0, validator=_non_negative)
    # State checkpoints of a model with recurrent layers (engine/kv/checkpoints.py): snapshots kept
    # (each the size of one request's recurrent state, taken from the KV memory budget), and the
    # share of step time their captures may add.
    checkpoint_slots: int = attrs.field(default=16, validator=_non_negative)
    checkpoint_work_fraction: float = attrs.field(default=0.1, validator=_non_negative)


def _depth(_inst: Any, attr: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    if isinstance(value, bool) or not 1 <= value <= MAX_SPECULATIVE_DEPTH:
        raise ConfigError(f"{attr.name} must be within 1..{MAX_SPECULATIVE_DEPTH}, got {value!r}")


@attrs.frozen
class SpeculativeSection:
    """Exact speculative decoding (helios/engine/speculative.py): drafts verified by the model in one
    step, outputs identical in distribution (greedy: token-identical) to decoding without them."""

    # off: no drafts; ngram: prompt-lookup drafts of max_depth tokens; adaptive (the default): n-gram
    # drafts whose length per request follows its recent acceptance, paused per request while none
    # are accepted, and none in batches of five or more decode rows (docs/operations.md).
    mode: str = attrs.field(default="adaptive", validator=attrs.validators.in_(SPECULATIVE_MODES))
    max_depth: int = attrs.field(default=4, validator=_depth)  # drafts verified per request and step
    # Also draft from the recent outputs of other requests (the shared decoded history).
    history: bool = True
    # A second, smaller model with the target's tokenizer that drafts greedily when the n-gram and
    # history lookups have no guess (a catalog name or a GGUF file / model folder; empty: none); or
    # an MTP-only GGUF of the target (llama.cpp's convert_hf_to_gguf.py --mtp: DeepSeek V4's), whose
    # MTP layer then drafts in that place (runtime.mtp_file).
    draft_model: str = ""
    # The token ids a draft model ranks its drafts over: the first draft_vocab (0: all), for a byte-level
    # BPE vocabulary, whose first ids are its most frequent tokens (others draft over all of theirs); the
    # draft model's output projection then reads that many rows alone (engine/drafter.py). The target
    # verifies every draft, so the output is the same at any value.
    draft_vocab: int = attrs.field(default=65536, validator=_non_negative)
    # A checkpoint's multi-token-prediction layers (DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5, V4 folders) draft
    # in that place when there is no draft_model: loaded when speculation is on and the checkpoint
    # has them; false never loads them (their memory: one decoder layer in the model's format).
    mtp: bool = True


@attrs.frozen
class VisionSection:
    """Image input (helios/serving/images.py; docs/vision.md). A limit of 0 is derived from the
    model and the context (serving.images.derive_limits); a text-only model's limits are all zero
    whatever is set here."""

    max_images_per_prompt: int = attrs.field(default=0, validator=_non_negative)
    max_image_tokens_per_prompt: int = attrs.field(default=0, validator=_non_negative)
    max_image_tokens_per_image: int = attrs.field(default=0, validator=_non_negative)
    image_feature_window_tokens: int = attrs.field(default=0, validator=_non_negative)
    max_image_pixels: int = attrs.field(default=0, validator=_non_negative)
    max_image_bytes: int = attrs.field(default=0, validator=_non_negative)
    # Host caches: decoded images and the model's prepared inputs (bytes), source descriptions (entries).
    decoded_cache_mib: float = attrs.field(default=256.0, validator=_non_negative)
    prepared_cache_mib: float = attrs.field(default=512.0, validator=_non_negative)
    source_cache_entries: int = attrs.field(default=4096, validator=_non_negative)


DATA_PARALLEL_MODES = ("internal", "external")
ROUTING_POLICIES = ("cache_aware", "round_robin")
PARALLEL_BACKENDS = ("auto", "gloo", "nccl")


@attrs.frozen
class ParallelSection:
    """Parallelism. Data parallelism (docs/parallel.md): several engine processes behind one HTTP
    front end ("internal"), or one rank of a deployment whose router is outside ("external").
    Tensor and expert parallelism (docs/operations.md, "Tensor and expert parallelism"):
    ``tensor_parallel_size`` ranks on torch.distributed, each holding a shard of every layer and
    its own KV pool (``[engine] kv_memory_gib`` is per rank). `helios serve` starts the other
    ranks itself on this machine (a free port on ``master_addr`` when ``master_port`` is 0);
    under torchrun every process runs `helios serve` and the env:// rendezvous (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) decides: rank 0 serves HTTP, the others run their shards.
    ``expert_parallel``: the routed experts of a mixture-of-experts model are split across the same
    ranks (tokens dispatched to them with all-to-all) instead of each expert being split.
    ``backend``: auto is gloo on the CPU, nccl on CUDA."""

    # Engine processes (ranks); 1: the engine runs on a thread of the server process, as always.
    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    # internal: this server spawns data_parallel_size engine processes and routes between them;
    # external: this server is rank data_parallel_rank of a deployment whose router is elsewhere
    # (it serves one engine, as data_parallel_size = 1 does, and names its rank in its KV events).
    data_parallel_mode: str = attrs.field(default="internal", validator=attrs.validators.in_(DATA_PARALLEL_MODES))
    data_parallel_rank: int = attrs.field(default=0, validator=_non_negative)
    # Internal mode's routing: cache_aware (the rank with the longest cached prefix of the prompt's
    # pages, balanced by in-flight requests) or round_robin.
    routing: str = attrs.field(default="cache_aware", validator=attrs.validators.in_(ROUTING_POLICIES))
    # cache_aware: a rank's score is its cached prefix tokens minus this many tokens per request it
    # has in flight (the load term).
    load_weight_tokens: int = attrs.field(default=512, validator=_non_negative)
    # cache_aware: below this share of the prompt cached on any rank, a request goes to the least
    # loaded rank (fewest in flight, then fewest cached pages), so new conversations spread.
    cache_threshold: float = attrs.field(default=0.25, validator=_non_negative)
    # Publish KV events (block stored / removed) at GET /v1/kv_events (server-sent events, vLLM's
    # KVEventBatch JSON). Off by default: the events carry cached prompts' token ids.
    kv_events: bool = False
    # Internal mode: restart a rank whose process died (its cache starts empty); /health is 503
    # until it is back.
    restart_ranks: bool = True

    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    expert_parallel: bool = False
    backend: str = attrs.field(default="auto", validator=attrs.validators.in_(PARALLEL_BACKENDS))
    master_addr: str = "127.0.0.1"
    master_port: int = attrs.field(default=0, validator=_non_negative)


@attrs.frozen
class HeliosConfig:
    server: ServerConfig = ServerConfig()
    model: ModelConfigSection = ModelConfigSection()
    engine: EngineSection = EngineSection()
    cache: CacheSection = CacheSection()
    speculative: SpeculativeSection = SpeculativeSection()
    vision: VisionSection = VisionSection()
    parallel: ParallelSection = ParallelSection()


_converter = cattrs.Converter(forbid_extra_keys=True)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> HeliosConfig:
    """Read TOML (path, else $HELIOS_CONFIG, else defaults) and apply per-section overrides."""
    data: dict[str, Any] = {}
    path = path or os.environ.get("HELIOS_CONFIG") or None
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"configuration file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"invalid TOML in {path}: {exc}") from None
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    _check_server_logging(data.get("server"))
    _check_weights(data.get("model"))
    _check_shutdown_grace(data.get("server"))
    _check_speculative(data.get("speculative"))
    _check_engine(data.get("engine"))
    _check_parallel(data.get("parallel"))
    try:
        cfg = _converter.structure(data, HeliosConfig)
    except ConfigError:
        raise
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        raise ConfigError("invalid configuration: " + "; ".join(cattrs.transform_error(exc))) from None
    except Exception as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    if cfg.server.api_key and not cfg.server.api_key.strip():
        raise ConfigError("server.api_key is only whitespace; set a key, or leave it empty to serve without "
                          "authentication")
    if cfg.server.thinking_token_budget is not None and not 0 < cfg.server.thinking_token_budget < 2**31:
        raise ConfigError("server.thinking_token_budget must be a positive 32-bit integer")
    if not 0 <= cfg.server.max_top_logprobs <= 20:
        raise ConfigError("server.max_top_logprobs must be within 0..20")
    unknown = sorted(set(cfg.model.generation_config) - GENERATION_CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"model.generation_config: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(GENERATION_CONFIG_KEYS))}"
        )
    for key, value in cfg.model.generation_config.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or (key == "top_k" and not isinstance(value, int)):
            raise ConfigError(f"model.generation_config.{key} must be a number{' (an integer)' if key == 'top_k' else ''}")
    return cfg


# The sampling defaults a checkpoint's generation_config may declare (recipes.plain_recipe reads them).
GENERATION_CONFIG_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty"})


def _check_server_logging(server: Any) -> None:
    """Plain messages for the logging keys (cattrs would say only "invalid value", or take any
    truthy string for a bool)."""
    if not isinstance(server, dict):
        return
    if "access_log" in server and not isinstance(server["access_log"], bool):
        raise ConfigError(f"server.access_log must be true or false, got {server['access_log']!r}")
    if "log_level" in server and server["log_level"] not in LOG_LEVELS:
        raise ConfigError(f"server.log_level must be one of {', '.join(LOG_LEVELS)}, got {server['log_level']!r}")


def _check_weights(model: Any) -> None:
    """Plain messages for `weights` and `weight_cache` (cattrs would say only "invalid value", or
    take any truthy string for a bool)."""
    if not isinstance(model, dict):
        return
    if "weights" in model and model["weights"] not in WEIGHT_FORMATS:
        raise ConfigError(f"model.weights must be one of {', '.join(WEIGHT_FORMATS)}, got {model['weights']!r}")
    for flag in ("weight_cache", "cpu_kernels"):
        if flag in model and not isinstance(model[flag], bool):
            raise ConfigError(f"model.{flag} must be true or false, got {model[flag]!r}")


def _check_speculative(section: Any) -> None:
    """Plain messages for the [speculative] keys (cattrs would say only "invalid value")."""
    if not isinstance(section, dict):
        return
    if "mode" in section and section["mode"] not in SPECULATIVE_MODES:
        raise ConfigError(f"speculative.mode must be one of {', '.join(SPECULATIVE_MODES)}, got {section['mode']!r}")
    for flag in ("history", "mtp"):
        if flag in section and not isinstance(section[flag], bool):
            raise ConfigError(f"speculative.{flag} must be true or false, got {section[flag]!r}")
    draft = section.get("draft_model", "")
    if not isinstance(draft, str):
        raise ConfigError(f"speculative.draft_model must be a model name or path (a string), got {draft!r}")
    if draft.strip() != draft:
        raise ConfigError(f"speculative.draft_model has surrounding whitespace: {draft!r}")
    if draft and section.get("mode", "off") == "off":
        raise ConfigError(f"speculative.draft_model = {draft!r} drafts for speculative decoding, which is off: "
                          "set speculative.mode to ngram or adaptive, or remove draft_model")
    vocab = section.get("draft_vocab", 0)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
        raise ConfigError(f"speculative.draft_vocab must be 0 (the whole vocabulary) or a positive number of token "
                          f"ids, got {vocab!r}")
    depth = section.get("max_depth", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_SPECULATIVE_DEPTH:
        raise ConfigError(f"speculative.max_depth must be an integer within 1..{MAX_SPECULATIVE_DEPTH}, got {depth!r}")


def _check_engine(section: Any) -> None:
    """Plain messages for `kv_dtype` and `kv_prefault` (cattrs would say only "invalid value", or
    take any truthy string for a bool)."""
    if not isinstance(section, dict):
        return
    if "kv_dtype" in section and section["kv_dtype"] not in KV_DTYPES:
        raise ConfigError(f"engine.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {section['kv_dtype']!r}")
    if "kv_prefault" in section and not isinstance(section["kv_prefault"], bool):
        raise ConfigError(f"engine.kv_prefault must be true or false, got {section['kv_prefault']!r}")


def _check_parallel(section: Any) -> None:
    """Plain messages for the [parallel] keys (cattrs would say only "invalid value")."""
    if not isinstance(section, dict):
        return
    for key, allowed in (("data_parallel_mode", DATA_PARALLEL_MODES), ("routing", ROUTING_POLICIES)):
        if key in section and section[key] not in allowed:
            raise ConfigError(f"parallel.{key} must be one of {', '.join(allowed)}, got {section[key]!r}")
    for flag in ("kv_events", "restart_ranks"):
        if flag in section and not isinstance(section[flag], bool):
            raise ConfigError(f"parallel.{flag} must be true or false, got {section[flag]!r}")
    size = section.get("data_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"parallel.data_parallel_size must be a positive integer, got {size!r}")
    rank = section.get("data_parallel_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"parallel.data_parallel_rank must be a non-negative integer, got {rank!r}")
    mode = section.get("data_parallel_mode", "internal")
    if mode == "external" and rank >= size:
        raise ConfigError(f"parallel.data_parallel_rank {rank} is not below data_parallel_size {size}")
    if mode == "internal" and rank:
        raise ConfigError("parallel.data_parallel_rank is for data_parallel_mode = \"external\" (one rank per "
                          "server); internal mode numbers its ranks itself")
    size = section.get("tensor_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"parallel.tensor_parallel_size must be a positive integer, got {size!r}")
    if "expert_parallel" in section and not isinstance(section["expert_parallel"], bool):
        raise ConfigError(f"parallel.expert_parallel must be true or false, got {section['expert_parallel']!r}")
    if "backend" in section and section["backend"] not in PARALLEL_BACKENDS:
        raise ConfigError(f"parallel.backend must be one of {', '.join(PARALLEL_BACKENDS)}, got {section['backend']!r}")
    if section.get("tensor_parallel_size", 1) > 1 and section.get("data_parallel_size", 1) > 1:
        raise ConfigError("parallel.tensor_parallel_size and data_parallel_size cannot both be above 1 yet: "
                          "run tensor-parallel servers as the external data-parallel ranks instead")


def _check_shutdown_grace(server: Any) -> None:
    """A plain message for `shutdown_grace_seconds` (cattrs would take true as 1.0)."""
    if not isinstance(server, dict) or "shutdown_grace_seconds" not in server:
        return
    value = server["shutdown_grace_seconds"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"server.shutdown_grace_seconds must be a finite number of seconds, at least 0; got {value!r}")


def read_api_key_file(path: str | Path) -> str:
    """The serving key in a key file, surrounding whitespace removed. A file with no key in it is a
    start-up error: silently serving without authentication is never what its author meant."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from None
    if not key:
        raise ConfigError(f"the API key file {path} is empty (or only whitespace); put the serving key in it, "
                          "or start without --api-key-file to serve without authentication")
    return key
