"""What a registry entry is: an architecture's config, GGUF and builder hooks (`registry.py` holds
the table of entries; an architecture module imports only this)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.models.interface import CausalLM
from helios.models.quant import BuildSource, WeightFormat
from helios.models.tp import ParallelContext


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


MLA_CACHE_FORMS = ("latent", "expanded")
"""`BuildOptions.mla_cache`'s values."""


@attrs.frozen(kw_only=True)
class BuildOptions:
    """How a module is built: activation (and KV) dtype, device, projections' `WeightFormat` (None:
    dense in ``dtype``) and whether a ggml Q8_0 output projection keeps its codes (CPU kernels)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    weights: WeightFormat | None = None
    q8_head: bool = False
    mla_cache: str = attrs.field(default="latent", validator=attrs.validators.in_(MLA_CACHE_FORMS))
    """A multi-head latent attention family's cache (`MLA_CACHE_FORMS`): "latent", one compressed row
    per token (absorbed decode), or "expanded", each head's K and V as a server without MLA keeps
    them (DeepSeek-V3 only; the comparison of docs/benchmarks.md)."""
    parallel: ParallelContext | None = None
    """One tensor-parallel rank's shard (`helios.models.tp`; the families of `tp.TP_ARCHITECTURES`)."""


class LoadableCausalLM(CausalLM, Protocol):
    """A `CausalLM` as the runtime loads it: from the family's named weights, or from its own packed
    state (`helios.loaders.weight_cache`), then packed for the CPU."""

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
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


def gguf_key(source: GGUFSource) -> Callable[..., Any]:
    """``key(name, default=None)``: the metadata value ``<general.architecture>.<name>`` of a GGUF
    file (``default`` when absent; ValueError naming the key when neither is there)."""
    meta = source.metadata
    prefix = str(meta.get("general.architecture"))

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{prefix}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {prefix}.{name}")
        return value

    return key


def gguf_kv_heads(key: Callable[..., Any], num_heads: int) -> int:
    """``attention.head_count_kv`` (a number, or one per layer: then they must be equal)."""
    value = key("attention.head_count_kv", num_heads)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise NotImplementedError("per-layer kv head counts are not supported")
        value = value[0]
    return int(value)
