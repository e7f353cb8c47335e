"""Weight formats of the decoder's linear layers: dense float, grouped int4, per-channel int8.

A checkpoint hands the model each weight either as a dense tensor or as `GroupQuantized` codes (what
a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks hold); `build_linear` turns the parts of one fused projection
(q, k, v or gate, up) into the module that multiplies by it:

* `DenseLinear`: ``F.linear`` in float32, bfloat16 or float16.
* `Int4Linear`: torch's grouped int4 weight-only matmul (``_weight_int4pack_mm_for_cpu``, groups of
  32 along the input dimension, one scale and one zero point per group). Q4_0 and Q4_1 blocks map onto
  it without re-quantizing: the 4-bit codes are copied as they are, scale = d and
  zero = m + 8 d (the kernel computes ``(code - 8) * scale + zero``; Q4_0's m is -8 d). The kernel
  takes activations, scales and zeros in bfloat16 (its float32 path is scalar code, 10-100x slower),
  so scales and zeros are rounded to bfloat16 at packing and activations on entry.
* `Int8Linear`: torch's per-output-channel int8 weight-only matmul (``_weight_int8pack_mm``),
  bfloat16 activations. No GGUF type maps onto it exactly (Q8_0 has a scale per 32 weights): weights
  are re-quantized symmetrically per row.
* `kquant.KQuantLinear`: GGUF Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / Q8_0 blocks (`kquant.BlockQuantized`)
  kept as they are, multiplied by Helios's CPU kernel (`cpu_kernels.kquant_linear`: exact weights,
  float32 or bfloat16 activations as given, float32 sums). `build_linear` makes one when every part of
  a projection is blocks, under either quantized kind.

A quantized projection may also keep a dense copy for steps of many rows (`WeightFormat.dense_above`):
the int4 kernel is fastest for a few rows (decode), a dense bfloat16 GEMM for many (prefill, large
batches); see docs/benchmarks.md, "Weight formats".

Dense GEMMs on the CPU run from a oneDNN-packed copy of the weight when `onednn_linear_works` says
oneDNN's prepacked linear is correct and faster here (`pack_onednn`, called once the model is
loaded): the same products and float32 accumulation as ``F.linear`` (bfloat16 results are bit-equal
in the probe), without re-laying-out the weight on every call. At 32 rows the default model's bf16
projections took 12.3 ms a step against 20.0 (docs/benchmarks.md). The packed copy is an opaque
oneDNN tensor. A quantized projection's dense copy is replaced by it (the plain copy is recovered
with ``to_dense()`` when the weights are saved); a `DenseLinear` keeps its plain weight, a parameter
the engine counts.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeGuard, Union

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models.dense import dense_matmul, onednn_linear

if TYPE_CHECKING:
    from helios.models.kquant import BlockQuantized

log = logging.getLogger("helios.weights")

GROUP_SIZE = 32  # GGUF's block size for Q4_0/Q4_1/Q8_0, and the int4 kernel's group size here
QUANTIZED_KINDS = ("int4", "int8")


@attrs.frozen(eq=False)
class GroupQuantized:
    """A [rows, cols] weight as integer codes with one affine map per row and group of columns:
    ``w[n, k] = codes[n, k] * scale[n, k // group_size] + offset[n, k // group_size]`` in float32.

    Q4_0: codes 0..15 (uint8), offset = -8 scale. Q4_1: codes 0..15, offset = the block minimum.
    Q8_0: codes -128..127 (int8), offset 0. `dequantize` reproduces ggml's own dequantization
    exactly (the products are exact in float32 for 4- and 8-bit codes times a float16 scale)."""

    codes: Tensor  # uint8 (4-bit codes) or int8, [rows, cols]
    scale: Tensor  # float32 [rows, cols // group_size]
    offset: Tensor  # float32 [rows, cols // group_size]
    bits: int
    group_size: int = GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> Tensor:
        """float32 [rows, cols], computed as ggml does (``codes * scale + offset``)."""
        rows, cols = self.shape
        codes = self.codes.view(rows, cols // self.group_size, self.group_size).to(torch.float32)
        out = codes * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return out.view(rows, cols)

    def take_rows(self, index: Tensor) -> GroupQuantized:
        return GroupQuantized(self.codes[index], self.scale[index], self.offset[index], self.bits, self.group_size)

    def int4_scales_and_zeros(self) -> tuple[Tensor, Tensor]:
        """float32 (scale, zero) of the int4 kernel's ``(code - 8) * scale + zero`` form."""
        if self.bits != 4:
            raise ValueError(f"{self.bits}-bit codes have no int4 form")
        return self.scale, self.offset + 8 * self.scale


WeightSource = Tensor | GroupQuantized
# What `build_linear` and `dense_of` also take: `kquant.BlockQuantized`, GGUF K-quant / Q5_x / Q8_0 blocks
# kept as they are (a forward reference: kquant imports this module); and what a checkpoint hands over
# for a stacked expert tensor kept in its file form, `StackedExperts` (never a projection's part: the
# MoE decoder takes its experts one at a time).
BuildSource = Union[WeightSource, "BlockQuantized", "StackedExperts"]


@attrs.frozen(eq=False)
class StackedExperts:
    """A stacked [experts, rows, cols] weight in a GGUF block type (llama.cpp's ``ffn_*_exps``), kept
    in the file's form: ``read(e)`` gives expert e's [rows, cols] matrix as a 2-D tensor of that type
    is read (`GroupQuantized` Q4_0 / Q4_1 / Q8_0 codes, `kquant.BlockQuantized` blocks: the expert's
    rows are one contiguous byte range of the stack, so this is a view, no dequantization).
    ``nbytes``: the stack's bytes in the file."""

    shape: tuple[int, int, int]
    ggml_type: int
    nbytes: int
    read: Callable[[int], WeightSource | BlockQuantized]

    def dim(self) -> int:
        return 3

    def expert(self, e: int) -> WeightSource | BlockQuantized:
        if not 0 <= e < self.shape[0]:
            raise IndexError(f"expert {e} of {self.shape[0]}")
        return self.read(e)

    def dequantize(self) -> Tensor:
        """float32 [experts, rows, cols]."""
        return torch.stack([dense_of(self.read(e)).to(torch.float32) for e in range(self.shape[0])])


def dense_of(weight: BuildSource) -> Tensor:
    """The weight as a dense tensor (float32 when dequantized, else as stored)."""
    return weight if isinstance(weight, Tensor) else weight.dequantize()


def quantize_int4(weight: Tensor, group_size: int = GROUP_SIZE) -> GroupQuantized:
    """Asymmetric 4-bit quantization per group of ``group_size`` columns (Q4_1's scheme: scale =
    (max - min) / 15, offset = min, codes rounded to nearest), for weights whose source is not already
    4-bit. Lossy: each weight moves by up to half a step."""
    rows, cols = weight.shape
    w = weight.to(torch.float32).view(rows, cols // group_size, group_size)
    low = w.amin(dim=-1)
    high = w.amax(dim=-1)
    scale = (high - low) / 15
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = ((w - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return GroupQuantized(codes.view(rows, cols), scale, low, bits=4, group_size=group_size)


@attrs.frozen
class WeightFormat:
    """How the decoder layers' projections are stored and multiplied.

    ``kind``: "dense" (``dtype`` is the storage dtype), "int4" or "int8". For the quantized kinds,
    ``dense_dtype`` (optional) keeps a dense copy used by steps of more than ``dense_above`` rows, and
    ``requantize`` says what happens to a projection whose source is not already in the kind's form
    (int4: Q4_0/Q4_1 codes; int8: never): True quantizes it (lossy), False keeps it dense in
    ``dense_dtype`` (or in the model dtype)."""

    kind: str = "dense"
    dtype: torch.dtype | None = None  # dense: the storage dtype (None: the model dtype)
    dense_dtype: torch.dtype | None = None
    dense_above: int = 0
    requantize: bool = True
    # GGUF block weights kept as blocks (`kquant.BlockQuantized`): projections whose parts are all
    # blocks become `kquant.KQuantLinear` (always, under a quantized kind); with ``keep_blocks`` Q8_0
    # parts count as blocks too (converted exactly, `q8_0_blocks`), and the model keeps a block token
    # embedding (looked up row by row) and a block output projection as blocks.
    keep_blocks: bool = False
    # `kquant.KQuantLinear` without a dense copy: steps of more than this many rows dequantize the
    # weight for the call into the dense dtype (``dense_dtype`` or the model dtype) and run a dense
    # GEMM (None: the kernel at every size).
    unpack_above: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("dense", *QUANTIZED_KINDS):
            raise ValueError(f"unknown weight format kind {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "dense":
            return f"dense {_dtype_name(self.dtype) if self.dtype else 'model dtype'}"
        text = f"{self.kind} (bfloat16 activations into the kernel)"
        if self.dense_dtype is not None:
            text += f", dense {_dtype_name(self.dense_dtype)} copy for steps of more than {self.dense_above} rows"
        if self.keep_blocks:
            text = (f"{self.kind} where Q4_0/Q4_1 codes, GGUF blocks (K-quants, Q5_x, Q8_0) kept as they are "
                    "(Helios's kquant_linear: exact weights, float32 sums)")
            if self.dense_dtype is not None:
                text += f", dense {_dtype_name(self.dense_dtype)} copy for steps of more than {self.dense_above} rows"
            else:
                text += ", no dense copy"
            if self.unpack_above is not None:
                text += f"; steps of more than {self.unpack_above} rows dequantize per call into a dense GEMM"
            from helios.models import cpu_kernels, kquant

            if cpu_kernels.kquant_tiles_active():
                lo, hi = kquant.TILE_ROWS
                backend = {"amx": "AMX tiles", "avx512_bf16": "AVX512-BF16 dot products"}.get(
                    cpu_kernels.kquant_tiles_backend(), "tiles")
                text += (f"; bfloat16 steps of {lo}-{hi} rows on {backend} (kquant_linear_tiles: the weights rounded "
                         "to bfloat16 per call)")
                if cpu_kernels.kquant_pair_before_tiles(lo, 12):
                    text += f", but Q4_K, Q5_K, Q5_0 and Q6_K weights keep the exact kernel up to {lo} rows"
            return text
        if self.kind == "int4" and not self.requantize:
            text += ", projections without Q4_0/Q4_1 codes kept dense"
        return text

    def cache_tag(self) -> str:
        """What distinguishes the stored tensors of this format (for the packed-weight cache)."""
        dense = _dtype_name(self.dense_dtype) if self.dense_dtype is not None else "-"
        dtype = _dtype_name(self.dtype) if self.dtype is not None else "-"
        return f"{self.kind}:{dtype}:{dense}:{self.dense_above}:{int(self.requantize)}" + (
            f":blocks:{self.unpack_above}" if self.keep_blocks else "")


class UnloadedLinear(nn.Module):
    """A projection before `LlamaForCausalLM.load_weights` has run."""

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("the model's weights are not loaded")


class DenseLinear(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.onednn: Tensor | None = None  # `pack_onednn`: the weight prepacked for oneDNN (not in state_dict)

    def forward(self, x: Tensor) -> Tensor:
        return dense_matmul(x, self.weight, self.onednn)


class Int4Linear(nn.Module):
    """Grouped int4 weight-only matmul; ``packed`` is torch's CPU int4 layout ([N, K/2] uint8),
    ``scales_and_zeros`` bfloat16 [K/group, N, 2]. ``dense`` (a buffer, so that the engine's count of
    the bytes a decode step reads stays the int4 tensors) serves steps of more than ``dense_above`` rows."""

    dense: Tensor | None

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, group_size: int, out_features: int,
                 dense: Tensor | None = None, dense_above: int = 0) -> None:
        super().__init__()
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)
        self.group_size = group_size
        self.out_features = out_features
        self.register_buffer("dense", dense)
        self.dense_above = dense_above
        self.onednn: Tensor | None = None  # `pack_onednn`: the dense copy prepacked for oneDNN

    def forward(self, x: Tensor) -> Tensor:
        if (self.dense is not None or self.onednn is not None) and x.shape[0] > self.dense_above:
            return dense_matmul(x, self.dense, self.onednn)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed,
                                                        self.group_size, self.scales_and_zeros)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @classmethod
    def pack(cls, weight: GroupQuantized, dense: Tensor | None = None, dense_above: int = 0) -> Int4Linear:
        rows = weight.shape[0]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        scale, zero = weight.int4_scales_and_zeros()
        scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        return cls(packed, scales_and_zeros, weight.group_size, rows, dense, dense_above)


class Int8Linear(nn.Module):
    """Per-output-channel int8 weight-only matmul: ``weight`` int8 [N, K], ``scales`` bfloat16 [N]."""

    dense: Tensor | None

    def __init__(self, weight: Tensor, scales: Tensor, dense: Tensor | None = None, dense_above: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.register_buffer("dense", dense)
        self.dense_above = dense_above
        self.onednn: Tensor | None = None  # `pack_onednn`: the dense copy prepacked for oneDNN

    def forward(self, x: Tensor) -> Tensor:
        if (self.dense is not None or self.onednn is not None) and x.shape[0] > self.dense_above:
            return dense_matmul(x, self.dense, self.onednn)
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @classmethod
    def quantize(cls, weight: Tensor, dense: Tensor | None = None, dense_above: int = 0) -> Int8Linear:
        """Symmetric per-row quantization: scale = max |w| / 127 (rounded to bfloat16 first, so the
        codes are rounded against the scale the kernel uses)."""
        w = weight.to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127).to(torch.bfloat16)
        s = scales.to(torch.float32)
        inverse = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
        codes = (w * inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(codes, scales, dense, dense_above)


def build_linear(parts: Sequence[BuildSource], fmt: WeightFormat, model_dtype: torch.dtype) -> nn.Module:
    """The module for one fused projection whose row blocks are ``parts`` (all with the same columns).

    Parts that are all `kquant.BlockQuantized` (GGUF Q4_K/Q5_K/Q6_K/Q5_0/Q5_1/Q8_0 blocks) become a
    `kquant.KQuantLinear` under either quantized kind, with the format's dense copy, when the CPU
    kernels are available; otherwise they are dequantized like any other source."""
    dense_dtype = fmt.dense_dtype or model_dtype
    if fmt.kind == "dense":
        return DenseLinear(_cat_dense(parts, fmt.dtype or model_dtype))
    if fmt.keep_blocks:
        parts = [q8_0_blocks(p) if _is_q8_0(p) else p for p in parts]
    copy = _cat_dense(parts, fmt.dense_dtype) if fmt.dense_dtype is not None else None
    kquant = _build_kquant(parts, copy, fmt.dense_above, fmt.unpack_above, dense_dtype)
    if kquant is not None:
        return kquant
    cols = parts[0].shape[1]
    if fmt.kind == "int4":
        if cols % GROUP_SIZE:
            return DenseLinear(copy if copy is not None else _cat_dense(parts, dense_dtype))
        if all(_is_int4(p) for p in parts):
            return Int4Linear.pack(_cat_quantized(parts), copy, fmt.dense_above)
        if not fmt.requantize:
            return DenseLinear(copy if copy is not None else _cat_dense(parts, dense_dtype))
        quantized = [p if _is_int4(p) else quantize_int4(dense_of(p)) for p in parts]
        return Int4Linear.pack(_cat_quantized(quantized), copy, fmt.dense_above)
    return Int8Linear.quantize(_cat_dense(parts, torch.float32), copy, fmt.dense_above)


def _build_kquant(parts: Sequence[BuildSource], copy: Tensor | None, dense_above: int, unpack_above: int | None,
                  unpack_dtype: torch.dtype) -> nn.Module | None:
    from helios.models import cpu_kernels
    from helios.models.kquant import BlockQuantized, KQuantLinear

    blocks = [p for p in parts if isinstance(p, BlockQuantized)]
    if len(blocks) != len(parts) or not cpu_kernels.available():
        return None
    if unpack_above is None:
        return KQuantLinear(blocks, copy, dense_above)
    return KQuantLinear(blocks, copy, dense_above, unpack_above, unpack_dtype)


def q8_0_blocks(weight: GroupQuantized) -> BlockQuantized:
    """A Q8_0 weight's `GroupQuantized` codes back as its GGUF blocks (float16 d, 32 int8 codes), exactly:
    the scales were widened from float16."""
    from helios.models.kquant import BlockQuantized

    rows, cols = weight.shape
    groups = cols // GROUP_SIZE
    d = weight.scale.to(torch.float16).contiguous().view(torch.uint8).view(rows, groups, 2)
    codes = weight.codes.to(torch.int8).contiguous().view(torch.uint8).view(rows, groups, GROUP_SIZE)
    blocks = torch.cat((d, codes), dim=2).view(rows, groups * (GROUP_SIZE + 2))
    return BlockQuantized(blocks, 8, (rows, cols))


def _is_q8_0(part: BuildSource) -> TypeGuard[GroupQuantized]:
    return (isinstance(part, GroupQuantized) and part.bits == 8 and part.group_size == GROUP_SIZE
            and part.codes.dtype == torch.int8 and not bool(part.offset.any()))


def _is_int4(part: BuildSource) -> bool:
    return isinstance(part, GroupQuantized) and part.bits == 4 and part.group_size == GROUP_SIZE


def _cat_dense(parts: Sequence[BuildSource], dtype: torch.dtype) -> Tensor:
    dense = [dense_of(p).to(dtype) for p in parts]
    return dense[0].contiguous() if len(dense) == 1 else torch.cat(dense)


def _cat_quantized(parts: Sequence[BuildSource]) -> GroupQuantized:
    qs = [p for p in parts if isinstance(p, GroupQuantized)]
    if len(qs) == 1:
        return qs[0]
    return GroupQuantized(torch.cat([q.codes for q in qs]), torch.cat([q.scale for q in qs]),
                          torch.cat([q.offset for q in qs]), qs[0].bits, qs[0].group_size)


def pack_onednn(module: nn.Module) -> bool:
    """Give a loaded projection (`DenseLinear`, or a quantized one's dense copy) a oneDNN-packed copy
    of its dense weight when `onednn_linear_works` for that dtype; returns whether it did."""
    weight = module.weight if isinstance(module, DenseLinear) else getattr(module, "dense", None)
    if not isinstance(weight, Tensor) or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if not onednn_linear_works(weight.dtype):
        return False
    module.onednn = _onednn_pack(weight.detach())
    from helios.models.kquant import KQuantLinear

    if isinstance(module, (Int4Linear, Int8Linear, KQuantLinear)):
        # A quantized projection: the packed copy serves the large steps alone;
        # `LlamaForCausalLM.packed_state` recovers the plain one from it (`to_dense()`) if the weights
        # are saved again.
        module.dense = None
    return True


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """A short probe, once per dtype: oneDNN's prepacked linear exists in this torch build, agrees
    with ``F.linear`` (float32 accumulation either way) and is not slower than it on a projection-sized
    problem (16 rows x 1,536 x 576; on a CPU without native support for the dtype oneDNN falls back to
    slow reference code). Logs what it found."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator).to(dtype)
    x = torch.randn(16, 576, generator=generator).to(dtype)
    try:
        with torch.no_grad():
            packed = _onednn_pack(weight)
            got = onednn_linear(x, packed)
            want = F.linear(x, weight)
            tolerance = 1e-4 if dtype == torch.float32 else 1e-2
            if not torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance):
                log.info("oneDNN prepacked linear (%s) disagrees with F.linear: not used", _dtype_name(dtype))
                return False
            onednn_s = best_time(lambda: onednn_linear(x, packed))
            torch_s = best_time(lambda: F.linear(x, weight))
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        log.info("oneDNN prepacked linear (%s) unavailable: %s", _dtype_name(dtype), exc)
        return False
    works = onednn_s <= torch_s
    log.info("oneDNN prepacked linear (%s): %.0f us against F.linear's %.0f us on the probe: %s",
             _dtype_name(dtype), onednn_s * 1e6, torch_s * 1e6, "used" if works else "not used")
    return works


def best_time(fn: Callable[[], object], repeats: int = 15) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _onednn_pack(weight: Tensor) -> Tensor:
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)
    return packed


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")
