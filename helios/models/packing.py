"""Weight packing and fusion shared by architecture modules: what a model's built weights are saved as
(`packed_state`, for `helios.loaders.weight_cache`) and restored from, the CPU packing decisions made
once the weights are loaded (oneDNN-packed dense GEMMs, the Q8_0 output projection's bfloat16 layout)
and which layers the one-operator CPU decode (`cpu_kernels.decode_layers`) can run.

An architecture module names its projections (attribute names on each decoder layer) and its
norms; everything here works on those names and the `helios.models.quant` modules, with no
architecture math.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import attrs
import torch
from torch import Tensor, nn

from helios.models import cpu_kernels
from helios.models.kquant import BlockQuantized, KQuantLinear
from helios.models.quant import BuildSource, DenseLinear, GroupQuantized, Int4Linear, Int8Linear, pack_onednn

LM_HEAD_FP32 = "lm_head_fp32"  # the float32 output projection's name in a packed state
LM_HEAD_Q8 = ("lm_head_q8.codes", "lm_head_q8.scales")  # the Q8_0 output projection's, likewise
# From this many rows a bfloat16 model's Q8_0 head takes `cpu_kernels.q8_linear_bf16` (bfloat16 pair dot
# products, twice the bytes of the int8 codes per step); below it `q8_linear` reads the int8 codes. On
# a 2-core AVX512-BF16 machine the two are even near 8 rows (1.45 against 1.33 ms for 49,152 outputs);
# at 32 rows q8_linear_bf16 takes 2.9 ms against 5.8.
Q8_BF16_ROWS = 8
# From this many bfloat16 rows, where the tiles path runs on AMX (`cpu_kernels.kquant_tiles_backend`), the
# Q8_0 head takes `cpu_kernels.q8_linear_tiles` with ``exact`` (the exact weights as three bfloat16 terms on the
# tiles). The AMX machine, 2 threads, 2026-12-06 (a session script: random codes with float16 scales,
# median of 9 calls): 49,152 x 576 (SmolLM2's head) at 8 / 16 / 32 / 64 rows 5.5 / 5.7 / 6.4-6.7 /
# 9.2-9.4 ms against q8_linear_bf16's 3.7-5.3 / 6.3-6.7 / 11.0-11.4 / 21.0-21.3.
Q8_EXACT_AMX_ROWS = 24

Projections = Sequence[str] | Callable[[nn.Module], Sequence[str]]
"""A model's projection attributes: the same for every layer, or per layer (layer -> attributes)."""


def _attrs(projections: Projections, layer: nn.Module) -> Sequence[str]:
    return projections(layer) if callable(projections) else projections


def linear_kind(module: nn.Module) -> str:
    """The packed-state kind of a projection module (`linear_from_state` rebuilds it)."""
    if isinstance(module, DenseLinear):
        return "dense"
    if isinstance(module, Int4Linear):
        return f"int4:{module.group_size}:{module.out_features}:{module.dense_above}"
    if isinstance(module, Int8Linear):
        return f"int8:{module.dense_above}"
    if isinstance(module, KQuantLinear):
        types = "+".join(str(t) for t in module.types)
        outs = "+".join(str(o) for o in module.outs)
        unpack = -1 if module.unpack_above is None else module.unpack_above
        unpack_dtype = str(module.unpack_dtype).removeprefix("torch.")
        return f"kquant:{types}:{outs}:{module.in_features}:{module.dense_above}:{unpack}:{unpack_dtype}"
    raise ValueError(f"{type(module).__name__} has no packed form")


def linear_from_state(kind: str, state: Mapping[str, Tensor]) -> nn.Module:
    """The projection module of packed-state ``kind`` from its tensors (names relative to it)."""
    name, *args = kind.split(":")
    try:
        if name == "dense":
            return DenseLinear(state["weight"])
        if name == "int4":
            group_size, out_features, dense_above = (int(a) for a in args)
            return Int4Linear(state["packed"], state["scales_and_zeros"], group_size, out_features,
                              state.get("dense"), dense_above)
        if name == "int8":
            return Int8Linear(state["weight"], state["scales"], state.get("dense"), int(args[0]))
        if name == "kquant":
            types, outs = ([int(v) for v in a.split("+")] for a in args[:2])
            cols, dense_above, unpack = (int(a) for a in args[2:5])
            unpack_dtype = getattr(torch, args[5])
            parts = [BlockQuantized(state[f"blocks.{i}"], t, (o, cols))
                     for i, (t, o) in enumerate(zip(types, outs, strict=True))]
            return KQuantLinear(parts, state.get("dense"), dense_above, None if unpack < 0 else unpack, unpack_dtype)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"packed state of kind {kind!r} is incomplete: {exc}") from None
    raise ValueError(f"unknown packed projection kind {kind!r}")


def projection_kinds(layers: Sequence[nn.Module], projections: Projections) -> dict[str, str]:
    """``layers.{i}.{attr}`` -> `linear_kind` of every projection of every layer."""
    return {f"layers.{i}.{attr}": linear_kind(getattr(layer, attr))
            for i, layer in enumerate(layers) for attr in _attrs(projections, layer)}


def dropped_dense_copies(layers: Sequence[nn.Module], projections: Projections) -> dict[str, Tensor]:
    """The plain dense copies of quantized projections that `quant.pack_onednn` replaced by their
    oneDNN-packed form (recovered with ``to_dense()``), under their packed-state names."""
    state: dict[str, Tensor] = {}
    for i, layer in enumerate(layers):
        for attr in _attrs(projections, layer):
            module = getattr(layer, attr)
            if (isinstance(module, (Int4Linear, Int8Linear, KQuantLinear)) and module.dense is None
                    and module.onednn is not None):
                state[f"layers.{i}.{attr}.dense"] = module.onednn.to_dense()
    return state


def restore_projections(layers: Sequence[nn.Module], projections: Projections, state: Mapping[str, Tensor],
                        kinds: Mapping[str, str]) -> list[list[nn.Module]]:
    """Rebuild every layer's projections from a packed state: per layer, the modules in
    ``projections`` order (the caller installs them)."""
    out: list[list[nn.Module]] = []
    for i, layer in enumerate(layers):
        row: list[nn.Module] = []
        for attr in _attrs(projections, layer):
            prefix = f"layers.{i}.{attr}."
            kind = kinds.get(f"layers.{i}.{attr}")
            if kind is None:
                raise ValueError(f"packed state lacks the kind of layers.{i}.{attr}")
            row.append(linear_from_state(kind, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}))
        out.append(row)
    return out


def stored_state(model: nn.Module, *, tied_head: bool, keep_vars: bool = False) -> dict[str, Tensor]:
    """``model.state_dict`` without empty entries and, with ``tied_head``, without ``lm_head`` (the
    embedding holds it)."""
    state = {name: t for name, t in model.state_dict(keep_vars=keep_vars).items() if t is not None}
    if tied_head:
        state.pop("lm_head", None)
    return state


def is_q8_0(value: BuildSource) -> bool:
    """A ggml Q8_0 weight: int8 codes, one scale per 32 columns, no offset."""
    return (isinstance(value, GroupQuantized) and value.bits == 8 and value.group_size == cpu_kernels.Q8_GROUP
            and value.codes.dtype == torch.int8 and not bool(value.offset.any()))


def q8_codes(value: GroupQuantized) -> tuple[Tensor, Tensor]:
    """A Q8_0 weight's int8 codes and float32 block scales, as `cpu_kernels.q8_linear` takes them."""
    return value.codes.to(torch.int8).contiguous(), value.scale.to(torch.float32).contiguous()


def q8_bf16_layout(q8: tuple[Tensor, Tensor] | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, int] | None:
    """A Q8_0 output projection's `q8_linear_bf16` layout for a bfloat16 model where the CPU has
    AVX512-BF16 (None otherwise)."""
    if q8 is not None and dtype == torch.bfloat16 and cpu_kernels.available() and cpu_kernels.bf16_kernels_supported():
        return cpu_kernels.pack_q8_bf16(*q8)
    return None


def pack_head_onednn(head: Tensor) -> Tensor | None:
    """A oneDNN-packed copy of a dense output projection where oneDNN's prepacked linear is faster."""
    holder = DenseLinear(head)
    return holder.onednn if pack_onednn(holder) else None


def pack_projections_onednn(layers: Sequence[nn.Module], projections: Projections) -> int:
    """`quant.pack_onednn` on every projection of every layer; how many were packed."""
    return sum(pack_onednn(getattr(layer, attr)) for layer in layers for attr in _attrs(projections, layer))


def fused_int4_layer(mods: Sequence[nn.Module], input_norm: Tensor,
                     post_attention_norm: Tensor) -> tuple[cpu_kernels.FusedLayer, int] | None:
    """The one-operator int4 decode layer of a layer whose projections ``mods`` (in the kernel's
    order) are all int4 with one group size, and the most rows it serves (above those, a dense
    copy answers); None where it does not apply."""
    if not all(isinstance(m, Int4Linear) for m in mods):
        return None
    linears = cast(list[Int4Linear], list(mods))
    if len({m.group_size for m in linears}) != 1:
        return None
    layer = cpu_kernels.FusedLayer(input_norm, post_attention_norm,
                                   tuple(t for m in linears for t in (m.packed, m.scales_and_zeros)),
                                   linears[0].group_size)
    rows = min((m.dense_above if m.dense is not None or m.onednn is not None else 1 << 62) for m in linears)
    return layer, rows


def fused_onednn_layer(mods: Sequence[nn.Module], input_norm: Tensor,
                       post_attention_norm: Tensor) -> tuple[cpu_kernels.FusedLayer, int] | None:
    """The one-operator oneDNN decode layer of a layer whose projections ``mods`` all multiply
    through a oneDNN-packed weight (`quant.pack_onednn`), and the rows above which it serves; None
    where it does not apply."""
    packed = [getattr(m, "onednn", None) for m in mods]
    if not all(p is not None for p in packed):
        return None
    layer = cpu_kernels.FusedLayer(input_norm, post_attention_norm, tuple(cast(Tensor, p) for p in packed), 0)
    above = max(0 if isinstance(m, DenseLinear) else int(cast(Int4Linear | Int8Linear, m).dense_above) for m in mods)
    return layer, above


HUGE_PAGE = 2 << 20  # bytes: an x86-64 transparent huge page
Q8_HEAD = "_lm_head_q8"  # a decoder's Q8_0 output projection kept as (codes, scales) (`q8_codes`)


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def _huge_pages_on() -> bool:
    """Whether Linux would back a ``MADV_HUGEPAGE`` mapping with huge pages (its transparent huge page
    setting is ``always`` or ``madvise``, not ``[never]``); True where the setting cannot be read."""
    try:
        with open(THP_SETTING) as fh:
            return "[never]" not in fh.read()
    except OSError:
        return True


class HugePageMove:
    """`blocks_into_huge_pages` in two halves: `copy` fills the arena from the current tensors (any
    thread: nothing writes them), `swap` points the model's modules at the copies (on the thread that
    runs the model, between its steps). ``total``: the bytes to move (0: nothing to do, also where the
    platform has no ``MADV_HUGEPAGE`` or transparent huge pages are off)."""

    def __init__(self, model: object) -> None:
        self.params: list[nn.Parameter] = []
        self.kept: list[tuple[nn.Module, str, BlockQuantized]] = []
        self.codes: list[tuple[nn.Module, str, tuple[Tensor, ...]]] = []
        seen: set[int] = set()
        for module in model.modules() if isinstance(model, nn.Module) else ():
            if isinstance(module, KQuantLinear):
                for p in module.blocks:
                    if p.device.type == "cpu" and id(p) not in seen:
                        seen.add(id(p))
                        self.params.append(p)
            for name, value in vars(module).items():
                if isinstance(value, BlockQuantized) and value.blocks.device.type == "cpu":
                    self.kept.append((module, name, value))
                elif name == Q8_HEAD and isinstance(value, tuple) and all(
                        isinstance(v, Tensor) and v.device.type == "cpu" for v in value):
                    self.codes.append((module, name, value))
        self.tensors: dict[int, Tensor] = {id(p): p.detach() for p in self.params}
        for _, _, value in self.kept:
            self.tensors.setdefault(id(value.blocks), value.blocks)
        for _, _, pair in self.codes:
            for v in pair:
                self.tensors.setdefault(id(v), v)
        advice = getattr(mmap, "MADV_HUGEPAGE", None) if _huge_pages_on() else None
        self.advice = advice
        self.total = 0 if advice is None else sum((t.numel() * t.element_size() + 63) // 64 * 64
                                                  for t in self.tensors.values())
        self.copies: dict[int, Tensor] | None = None
        self.ready = threading.Event()
        self.done = False  # swapped

    def copy(self) -> None:
        """The arena: one anonymous mapping advised ``MADV_HUGEPAGE``, the tensors copied in, 64-byte
        aligned. Sets `ready`."""
        if self.total == 0 or self.advice is None:
            self.copies = {}
            self.ready.set()
            return
        arena = mmap.mmap(-1, self.total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive with its views
        start = -whole.data_ptr() % HUGE_PAGE  # huge pages back 2 MiB-aligned ranges
        with contextlib.suppress(OSError, ValueError):
            arena.madvise(self.advice, start, len(arena) - start)
        copies: dict[int, Tensor] = {}
        offset = start
        for key, t in self.tensors.items():
            nbytes = t.numel() * t.element_size()
            copy = whole[offset:offset + nbytes].view(t.dtype).view(t.shape)
            if t.is_contiguous():
                # a plain memmove (the GIL released), no torch operator: this may run on a thread of its
                # own, and a torch copy there (its OpenMP team) still running at interpreter exit aborted
                # the process
                ctypes.memmove(copy.data_ptr(), t.data_ptr(), nbytes)
            else:
                copy.copy_(t)
            copies[key] = copy
            offset += (nbytes + 63) // 64 * 64
        self.copies = copies
        self.ready.set()

    def swap(self) -> int:
        """The modules read the copies (after `copy`); returns the bytes moved. The originals are left
        to their owners (file pages to the checkpoint's `release_pages`, cache reads to the allocator)."""
        copies = self.copies
        if copies is None:
            raise RuntimeError("HugePageMove.swap before copy")
        self.done = True
        if not copies:
            return 0
        for p in self.params:
            p.data = copies[id(p)]
        for module, name, value in self.kept:
            setattr(module, name, attrs.evolve(value, blocks=copies[id(value.blocks)]))
        for module, name, pair in self.codes:
            setattr(module, name, tuple(copies[id(v)] for v in pair))
        self.tensors.clear()
        self.params.clear()
        self.kept.clear()
        self.codes.clear()
        self.copies = {}
        return self.total


def blocks_into_huge_pages(model: object) -> int:
    """Every GGUF block tensor of a loaded CPU model (each `KQuantLinear` segment; a block embedding or
    head held as `BlockQuantized`; a Q8_0 head's codes and scales, ``Q8_HEAD``) copied into one anonymous mapping advised for transparent huge pages
    (``MADV_HUGEPAGE``), 64-byte aligned, each module then reading its copy. A decode step streams every
    weight once: on 4 KiB pages each page is a TLB miss and the hardware prefetchers stop at its edge,
    and Qwen2.5-Coder-1.5B's one-row step took 79.0-80.4 ms against 69.4 ms with its blocks on 2 MiB
    pages (2026-12-05, this AMX machine, 2 threads). Returns the bytes moved (0 where the platform has
    no ``MADV_HUGEPAGE`` or the model has no blocks). The originals are left to their owners (file
    pages to the checkpoint's `release_pages`, cache reads to the allocator). Faulting the huge pages
    in is the cost: on this VM a fresh process took 2.3-3.4 s for 0.4-1 GB (the same copy onto 4 KiB
    pages 0.1 s), so the server makes the copy on a thread after it loads and swaps between engine
    steps (`HugePageMove`; `runtime.load_model(defer_huge_pages=True)`)."""
    move = HugePageMove(model)
    move.copy()
    return move.swap()
