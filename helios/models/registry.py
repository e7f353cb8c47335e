"""Architectures by name: the one place that maps a checkpoint to the module that runs it.

An `Architecture` entry names what a checkpoint says it is (a Hugging Face ``config.json``'s
``model_type`` or an ``architectures`` entry, a GGUF file's ``general.architecture``) and gives the
family's config parsers (``config.json`` -> its config; GGUF metadata -> the same config), its
GGUF tensor names (GGUF name -> the family's Hugging Face name) and the builder of its module (config
-> a `LoadableCausalLM`, whose ``load_weights`` maps the family's names onto its parameters). The
loaders (`helios.loaders`) and the runtime know architectures only through this module.

Built-in entries come from the architecture modules (`helios.models.llama.ARCHITECTURES`: llama,
mistral, qwen2, qwen3; `helios.models.gemma3.ARCHITECTURES`: gemma3; `helios.models.gemma4`: gemma4 (text);
`helios.models.qwen3_moe`, `helios.models.glm4_moe`, `helios.models.minimax_m2`,
`helios.models.gpt_oss`, `helios.models.mimo_v2_flash`, `helios.models.deepseek_v3`,
`helios.models.deepseek_v32`, `helios.models.deepseek_v4`: the mixture-of-experts families; `helios.models.qwen3_next` and
`helios.models.nemotron_h`, `helios.models.kimi_linear`: the hybrid recurrent ones, the first
also Qwen3.5 text); more can be
registered from outside::

    registry.register(Architecture(name="tiny", hf_model_types=("tiny",), ...))
    with registry.registered(Architecture(...)):  # for tests: unregistered on exit
        ...

Unknown architectures fail with one line naming the supported ones (`UnsupportedArchitecture`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from helios.models.architecture import (
    Architecture,
    ArchitectureConfig,
    BuildOptions,
    GGUFSource,
    GGUFTensor,
    LoadableCausalLM,
    UnsupportedArchitecture,
)

__all__ = ["Architecture", "ArchitectureConfig", "BuildOptions", "GGUFSource", "GGUFTensor", "LoadableCausalLM",
           "UnsupportedArchitecture", "for_gguf", "for_hf_config", "get", "names", "register", "registered",
           "unregister"]


_lock = threading.Lock()
_entries: dict[str, Architecture] = {}
_builtins_loaded = False


def _builtin_architectures() -> Sequence[Architecture]:
    from helios.models import (
        deepseek_v3,
        deepseek_v4,
        deepseek_v32,
        gemma3,
        gemma4,
        glm4_moe,
        gpt_oss,
        kimi_linear,
        llama,
        mimo_v2_flash,
        minimax_m2,
        nemotron_h,
        qwen3_moe,
        qwen3_next,
    )

    return (*llama.ARCHITECTURES, *gemma3.ARCHITECTURES, *qwen3_moe.ARCHITECTURES, *glm4_moe.ARCHITECTURES,
            *minimax_m2.ARCHITECTURES, *gpt_oss.ARCHITECTURES, *mimo_v2_flash.ARCHITECTURES, *gemma4.ARCHITECTURES,
            *deepseek_v3.ARCHITECTURES, *deepseek_v32.ARCHITECTURES, *deepseek_v4.ARCHITECTURES,
            *qwen3_next.ARCHITECTURES, *nemotron_h.ARCHITECTURES, *kimi_linear.ARCHITECTURES)


def _table() -> dict[str, Architecture]:
    global _builtins_loaded
    if not _builtins_loaded:
        with _lock:
            if not _builtins_loaded:
                for arch in _builtin_architectures():
                    _add(arch)
                _builtins_loaded = True
    return _entries


def _add(arch: Architecture) -> None:
    if arch.name in _entries:
        raise ValueError(f"architecture {arch.name!r} is already registered")
    for other in _entries.values():
        clash = (set(arch.hf_model_types) & set(other.hf_model_types)
                 | set(arch.hf_architectures) & set(other.hf_architectures)
                 | set(arch.gguf_architectures) & set(other.gguf_architectures))
        if clash:
            raise ValueError(f"architecture {arch.name!r} claims {sorted(clash)}, which {other.name!r} already serves")
    _entries[arch.name] = arch


def register(arch: Architecture) -> None:
    """Add an entry; raises ValueError when its name or any model_type / architectures / GGUF name is
    already registered."""
    _table()
    with _lock:
        _add(arch)


def unregister(name: str) -> None:
    """Remove an entry (KeyError when there is none)."""
    _table()
    with _lock:
        del _entries[name]


@contextmanager
def registered(arch: Architecture) -> Iterator[Architecture]:
    """`register` for the duration of a ``with`` block (tests)."""
    register(arch)
    try:
        yield arch
    finally:
        unregister(arch.name)


def names() -> tuple[str, ...]:
    """Registered entries' names, sorted."""
    return tuple(sorted(_table()))


def get(name: str) -> Architecture:
    """The entry called ``name`` (`UnsupportedArchitecture` when none is)."""
    table = _table()
    if name not in table:
        raise UnsupportedArchitecture(f"unsupported architecture {name!r}; supported: {', '.join(names())}")
    return table[name]


def for_hf_config(config: Mapping[str, Any]) -> Architecture:
    """The entry for a ``config.json``: by ``model_type``, else by its ``architectures`` entries."""
    table = _table()
    model_type = str(config.get("model_type", ""))
    for arch in table.values():
        if model_type in arch.hf_model_types:
            return arch
    listed = [str(a) for a in config.get("architectures") or ()]
    for wanted in listed:
        for arch in table.values():
            if wanted in arch.hf_architectures:
                return arch
    supported = sorted({t for arch in table.values() for t in arch.hf_model_types})
    said = f"model_type {model_type!r}" + (f", architectures {', '.join(listed)}" if listed else "")
    raise UnsupportedArchitecture(f"unsupported architecture {model_type or (listed[0] if listed else '')!r} "
                                  f"({said}); supported: {', '.join(supported)}")


def for_gguf(general_architecture: str) -> Architecture:
    """The entry for a GGUF file's ``general.architecture``."""
    table = _table()
    for arch in table.values():
        if general_architecture in arch.gguf_architectures:
            return arch
    supported = sorted({g for arch in table.values() for g in arch.gguf_architectures})
    raise UnsupportedArchitecture(f"unsupported architecture {general_architecture!r} (GGUF general.architecture); "
                                  f"supported: {', '.join(supported)}")
