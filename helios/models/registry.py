"""Architectures by name: the one place that maps a checkpoint to the module that runs it.

An `Architecture` entry names what a checkpoint says it is (a Hugging Face ``config.json``'s
``model_type`` or an ``architectures`` entry, a GGUF file's ``general.architecture``) and gives the
family's config parsers (``config.json`` -> its config; GGUF metadata -> the same config), its
GGUF tensor names (GGUF name -> the family's Hugging Face name) and the builder of its module (config
-> a `LoadableCausalLM`, whose ``load_weights`` maps the family's names onto its parameters). The
loaders (`helios.loaders`) and the runtime know architectures only through this module.

Built-in entries come from the architecture modules (`helios.models.llama.ARCHITECTURES`: llama,
mistral, qwen2, qwen3); more can be registered from outside::

    registry.register(Architecture(name="tiny", hf_model_types=("tiny",), ...))
    with registry.registered(Architecture(...)):  # for tests: unregistered on exit
        ...

Unknown architectures fail with one line naming the supported ones (`UnsupportedArchitecture`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.models.interface import CausalLM
from helios.models.quant import WeightFormat, WeightSource


class UnsupportedArchitecture(ValueError):
    """A checkpoint of an architecture no registry entry serves (the message is one line)."""


class ArchitectureConfig(Protocol):
    """What the loaders and the runtime read of any family's config."""

    @property
    def arch(self) -> str:
        """The registry entry's name."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    def projection_params(self) -> int:
        """Weights in the projections a weight format converts (what a dense copy of them costs)."""
        ...


class GGUFSource(Protocol):
    """What a family's GGUF config parser reads of an opened GGUF file."""

    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def tensor_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """GGUF tensor name -> shape, outermost dimension first."""
        ...

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32 (numpy layout)."""
        ...


@attrs.frozen
class GGUFTensor:
    """Where a GGUF tensor goes: its name in the family's (Hugging Face) naming, and, for q/k
    projections llama.cpp stored with interleaved rotary rows, the head count to un-permute them over
    (`helios.loaders.gguf_loader.unpermute_rotary_rows`)."""

    name: str
    rotary_heads: int | None = None


@attrs.frozen(kw_only=True)
class BuildOptions:
    """How a module is built: activation (and KV) dtype, device, projections' `WeightFormat` (None:
    dense in ``dtype``) and whether a ggml Q8_0 output projection keeps its codes (CPU kernels)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    weights: WeightFormat | None = None
    q8_head: bool = False


class LoadableCausalLM(CausalLM, Protocol):
    """A `CausalLM` as the runtime loads it: from the family's named weights, or from its own packed
    state (`helios.loaders.weight_cache`), then packed for the CPU."""

    def load_weights(self, tensors: Mapping[str, WeightSource]) -> None:
        """Build the parameters from the family's (Hugging Face) weight names."""
        ...

    def packed_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The built weights and the kind of each projection (for `load_packed_state`)."""
        ...

    def load_packed_state(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None: ...

    def pack_cpu_weights(self) -> int:
        """CPU-only packing once loaded (oneDNN, kernel layouts); how many tensors were packed."""
        ...

    @property
    def head_format(self) -> str:
        """How logits are computed (for the log)."""
        ...

    @property
    def head_bf16_rows(self) -> int | None:
        """From how many rows the output projection takes its bfloat16 kernel (None: never)."""
        ...

    def eval(self) -> object: ...


HFConfigParser = Callable[[Mapping[str, Any]], ArchitectureConfig]
GGUFConfigParser = Callable[[GGUFSource], ArchitectureConfig]
GGUFTensorMap = Callable[[ArchitectureConfig, str], GGUFTensor | None]
"""(config, GGUF tensor name) -> `GGUFTensor`, None for a tensor the model does not load (it is
metadata, e.g. llama.cpp's ``rope_freqs``); raises NotImplementedError for an unknown name."""
Builder = Callable[[ArchitectureConfig, BuildOptions], LoadableCausalLM]


@attrs.frozen(kw_only=True)
class Architecture:
    """One registry entry. ``name`` is the config's ``arch``; ``hf_model_types`` and
    ``hf_architectures`` (``config.json``'s ``model_type`` and ``architectures`` entries) and
    ``gguf_architectures`` (``general.architecture``) are what checkpoints of it say. An entry
    without ``config_from_gguf`` / ``gguf_tensor`` has no GGUF form."""

    name: str
    hf_model_types: tuple[str, ...]
    config_from_hf: HFConfigParser
    build: Builder
    hf_architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: GGUFConfigParser | None = None
    gguf_tensor: GGUFTensorMap | None = None

    def __attrs_post_init__(self) -> None:
        if self.gguf_architectures and (self.config_from_gguf is None or self.gguf_tensor is None):
            raise ValueError(f"architecture {self.name!r} names GGUF architectures but has no GGUF config parser "
                             "or tensor map")

    def parse_hf_config(self, config: Mapping[str, Any]) -> ArchitectureConfig:
        """This family's config from a ``config.json`` (found by ``architectures``: its ``model_type``
        is taken as this entry's first)."""
        if str(config.get("model_type", "")) not in self.hf_model_types:
            config = {**config, "model_type": self.hf_model_types[0]}
        return self.config_from_hf(config)

    def parse_gguf(self, source: GGUFSource) -> ArchitectureConfig:
        if self.config_from_gguf is None:
            raise UnsupportedArchitecture(f"architecture {self.name!r} has no GGUF form")
        return self.config_from_gguf(source)

    def gguf_name(self, config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
        if self.gguf_tensor is None:
            raise UnsupportedArchitecture(f"architecture {self.name!r} has no GGUF form")
        return self.gguf_tensor(config, gguf_name)


_lock = threading.Lock()
_entries: dict[str, Architecture] = {}
_builtins_loaded = False


def _builtin_architectures() -> Sequence[Architecture]:
    from helios.models import llama

    return llama.ARCHITECTURES


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
