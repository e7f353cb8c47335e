"""GGUF block-quantized weights (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0) kept in their file form.

A `BlockQuantized` weight is the raw GGUF bytes of one [out, in] matrix (each row ``in / per``
blocks of ``bytes`` bytes, `cpu_kernels.KQUANT_LAYOUTS`), its ggml type and its shape: 4.5 (Q4_K) to
8.5 (Q8_0) bits a weight, where a float32 copy streams 32. `KQuantLinear` multiplies by it with
`cpu_kernels.kquant_linear`, which decodes each block to its exact float32 values in registers (the
numerics contract per type is in the `cpu_kernels` docstring): no rounding of the weights or of the
activations beyond float32 accumulation. Like `quant.Int4Linear` it may keep a dense copy for steps of
more than ``dense_above`` rows (prefill, large batches), where a dense GEMM is faster; without one,
steps of more than ``unpack_above`` rows dequantize the weight for the call and run a GEMM in
``unpack_dtype`` (bfloat16 for a prefill: the kernel writes the rounded values directly).
On the 2-core AVX-512 development machine (`scripts/bench_kernels.py --only kquant`, a busy machine)
the kernel took about half the dense bfloat16 matmul's time and a fifth of the float32 one's at one
row, about the bfloat16 one's at 8 rows and two to three times it at 32: a bfloat16 dense copy past
about 8 rows is the faster choice where memory allows. With the register-tiled kernels (2026-12-02,
one thread, bfloat16 activations, the 0.5B model's Q5_0 / Q4_K / Q6_K shapes) the
dequantize-then-bfloat16-GEMM ties the kernel at 32 rows and wins from 64 (1.1 to 1.3x; 2x at 128,
3 to 3.5x at 512): ``runtime.AUTO_BLOCKS_UNPACK_ABOVE`` stays 32.

`quant.build_linear` makes a `KQuantLinear` of a fused projection whose parts are all
`BlockQuantized` (parts of different types become segments of one module) under a quantized weight
format. Without the CPU kernels (not built, or turned off) the module dequantizes through
``gguf.quants`` on each call: correct, slow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels
from helios.models.dense import dense_matmul

KQUANT_TYPES = tuple(cpu_kernels.KQUANT_LAYOUTS)


@attrs.frozen(eq=False)
class BlockQuantized:
    """A [rows, cols] weight as its GGUF blocks: ``blocks`` uint8 [rows, cols / per * bytes] (row n's
    blocks in file order), ``ggml_type`` one of `KQUANT_TYPES`, ``shape`` (rows, cols)."""

    blocks: Tensor
    ggml_type: int
    shape: tuple[int, int]

    def __attrs_post_init__(self) -> None:
        if self.ggml_type not in cpu_kernels.KQUANT_LAYOUTS:
            raise ValueError(f"ggml type {self.ggml_type} is not one of the block types {KQUANT_TYPES}")
        rows, cols = self.shape
        per, nbytes = cpu_kernels.KQUANT_LAYOUTS[self.ggml_type]
        if cols % per:
            raise ValueError(f"{self.name} needs columns in multiples of {per}, not {cols}")
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != (rows, cols // per * nbytes):
            raise ValueError(f"{self.name} blocks of a {rows}x{cols} weight are uint8 [{rows}, {cols // per * nbytes}], "
                             f"not {self.blocks.dtype} {list(self.blocks.shape)}")

    @classmethod
    def from_bytes(cls, raw: Tensor, ggml_type: int, shape: tuple[int, int]) -> BlockQuantized:
        """From a GGUF tensor's data (uint8, any shape, ``shape`` in numpy order: rows outermost)."""
        return cls(raw.reshape(shape[0], -1).contiguous(), ggml_type, (int(shape[0]), int(shape[1])))

    @property
    def name(self) -> str:
        return cpu_kernels.KQUANT_NAMES.get(self.ggml_type, str(self.ggml_type))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """float32 [rows, cols], equal to ``gguf.quants.dequantize`` bit for bit (the kernel when the
        CPU kernels are available, else ``gguf.quants`` itself); another ``dtype``: those values
        converted (bfloat16 through the kernel: written directly, the same bits)."""
        rows, cols = self.shape
        if cpu_kernels.available():
            if dtype == torch.bfloat16:
                return cpu_kernels.kquant_dequantize(self.blocks.contiguous(), self.ggml_type, rows, cols, dtype)
            return cpu_kernels.kquant_dequantize(self.blocks.contiguous(), self.ggml_type, rows, cols).to(dtype)
        import gguf

        array = gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(rows, cols).to(dtype)

    def dequantize_rows(self, index: Tensor) -> Tensor:
        """float32 [len(index), cols]: rows ``index`` only (an embedding lookup), bit for bit as
        `dequantize` gives them."""
        return self.take_rows(index).dequantize()

    def take_rows(self, index: Tensor) -> BlockQuantized:
        """The weight's rows ``index`` (rows are whole blocks, so this is a row gather of the bytes)."""
        blocks = self.blocks[index].contiguous()
        return BlockQuantized(blocks, self.ggml_type, (int(blocks.shape[0]), self.shape[1]))


def concat_rows(parts: Sequence[BlockQuantized]) -> list[BlockQuantized]:
    """Consecutive parts of one type joined into one weight (a fused projection's row blocks)."""
    joined: list[BlockQuantized] = []
    for part in parts:
        last = joined[-1] if joined else None
        if last is not None and last.ggml_type == part.ggml_type and last.shape[1] == part.shape[1]:
            blocks = torch.cat([last.blocks, part.blocks])
            joined[-1] = BlockQuantized(blocks, part.ggml_type, (last.shape[0] + part.shape[0], part.shape[1]))
        else:
            joined.append(part)
    return joined


# Steps of TILE_ROWS[0] .. TILE_ROWS[1] bfloat16 rows take the tiles path where the CPU has AMX or
# AVX512-BF16 (`cpu_kernels.kquant_linear_tiles`: the weights rounded to bfloat16 as the unpack path
# rounds them, decoded per call in L1 instead of written out whole). Measured 2026-12-05 at 68958f8 (the
# AMX machine, 1 thread, `scripts/bench_kquant_tiles.py --rows 1 8 32`, Q4_K 17920 x 1536 from memory, ps
# a weight): tiles 80 / 86 / 153 against the exact kernel's 69 / 213 / 851; past 128 rows
# dequantize-then-GEMM wins on all but the largest projections (docs/benchmarks.md, "Decode batches on
# AMX tiles"). On AMD Zen 5's AVX512-BF16 backend (2 threads, 2026-12-06, the same script): 20.6 / 35.6 /
# 101 against 17.5 / 60.1 / 249 at 1 / 8 / 32 rows (docs/benchmarks.md, "The tiles path on AVX512-BF16"). Fewer
# rows keep the exact kernel: a single stream's decode and its speculative verification (at most 1 +
# the default depth 4 rows) give the same bits with and without speculation. Where rows take vdpbf16ps
# (AMD), the pair dot path's types keep the exact kernel up to 8 rows (`cpu_kernels.kquant_pair_before_tiles`,
# per segment): there it leads the tiles (Q4_K 33.3 against 35.7 ps a weight at 8 rows, Q5_0 37.9 against 56.2).
TILE_ROWS = (8, 128)
# Past TILE_ROWS[1], up to TILE_LARGE_ROWS rows (a batch of prompts, a prefill chunk), the tiles still win
# for projections of at least TILE_LARGE_WEIGHTS weights, whose dense copy (2 bytes a weight, written
# out and read back per call) outgrows the caches: 2 threads, `scripts/bench_kquant_tiles.py --threads 2
# --rows 224 512` (2026-12-05): Q4_K 17,920 x 1,536 (27.5M weights) tiles 10.4-16.1 ms against
# 20.8-25.8 at 224 rows, 25.6 against 29.7 at 512; the smaller ones lose there (224 rows: Q4_K
# 2,048 x 1,536 1.6 against 1.0 ms, Q6_K 1,536 x 8,960 7.0 against 4.8, Q4_K 9,728 x 896 (8.7M)
# 2.5 against 1.7).
# On the AVX512-BF16 backend (no tile unit: half the tiles' rate per weight decoded) the dense copy wins
# sooner: the 1.5B's gate/up (17,920 x 1,536) at 512 rows took 54.7 ms a call on the dot products against
# about 33 dequantized (AMD Zen 5, 2 threads, 2026-12-06: `scripts/profile_prefill.py --tokens 512
# --profile`, the 512-token prefill's operator time 2.31 s against 1.88 s; `scripts/bench_kquant_tiles.py
# --threads 2 --rows 256 320 384 512`: tiles 21.1 / 26.3 / 34.3 / 49.3 ms against 31.6 / 35.5 / 42.5 /
# 32.8), so there the large projections take the tiles up to TILE_LARGE_ROWS_DP rows, set by measurements with
# the dense copy's buffers kept in the heap as the server keeps them (`runtime.keep_large_buffers`; the script
# above faults a fresh mapping in per call) and 8 weight rows decoded at a time (2026-12-06, a Zen 5 VM, 2
# threads, 17,920 x 1,536, the best of 5, two runs): tiles / dequantize-then-GEMM 8.4-9.4 / 9.6-9.7 ms at 129
# rows, 12.2-12.5 / 12.9-13.1 at 192, 16.6-19.9 / 16.9-17.1 at 256, 21.8-23.2 / 20.9-21.4 at 320, 30.2-31.8 /
# 24.2-24.6 at 384, 37.4-42.1 / 30.8-31.9 at 512; `scripts/bench_kquant_tiles.py --threads 2 --rows 256 320
# 384 --keep-buffers`, two runs: 16.9-20.2 / 16.5-16.9, 20.6-23.8 / 22.4-23.2, 24.5-26.8 / 26.0-26.9, about even
# past 256 rows alone), and in the model the tiles lose past 256: the 1.5B's 380-token prefill
# (`scripts/profile_prefill.py --tokens 380 --runs 5`, two sets of two alternations) 1,389-1,487 ms
# with 384, 1,213-1,249 with 256.
TILE_LARGE_ROWS = 512
TILE_LARGE_ROWS_DP = 256
TILE_LARGE_WEIGHTS = 16_000_000
# A weight of more than TILE_WIDE_IN columns (the tiles' decoded rows outgrow L1, 4 weight rows at a time)
# meets the dequantize-then-GEMM path sooner: a step of more than TILE_WIDE_ROWS rows that its module would
# unpack anyway goes there (2026-12-06, a Zen 5 VM, 2 threads, the dense buffers kept in the heap, tiles /
# dequantize-then-GEMM ms at 32 / 48 / 64 / 96 / 128 rows: Q6_K 1,536 x 8,960 1.61 / 2.45 / 3.38 / 4.92 / 7.08
# against 2.42 / 2.78 / 2.85 / 3.74 / 4.94; Q4_K 1,536 x 8,960 1.31 / 2.43 / 3.01 / 4.77 against 1.89 / 2.28 /
# 2.77 / 3.62; Q5_0 896 x 4,864 0.48 / 0.77 / 0.98 / 1.39 / 2.00 against 0.52 / 0.64 / 0.77 / 1.04 / 1.40; the
# narrower ones about even up to 128 rows). The AVX512-BF16 backend only: measured there, not on AMX tiles.
TILE_WIDE_IN = 2048
TILE_WIDE_ROWS = 48


def tiles_take(x: Tensor, weights: int = 0) -> bool:
    """Whether a step of ``x`` (a bfloat16 [rows, in] CPU tensor) times a weight of ``weights``
    elements goes to `kquant_linear_tiles`."""
    rows = x.shape[0]
    if x.dtype != torch.bfloat16 or rows < TILE_ROWS[0] or not cpu_kernels.kquant_tiles_active():
        return False
    if rows <= TILE_ROWS[1]:
        return True
    large = TILE_LARGE_ROWS if cpu_kernels.kquant_tiles_backend() == "amx" else TILE_LARGE_ROWS_DP
    return rows <= large and weights >= TILE_LARGE_WEIGHTS


class KQuantLinear(nn.Module):
    """``x @ W.T`` for ``W`` held as GGUF blocks: one or more row segments (``blocks[i]`` of
    ``types[i]``, ``outs[i]`` rows each; the output is their concatenation), ``x`` [N, in] float32 or
    bfloat16 -> [N, out] in ``x``'s dtype. ``dense`` (a buffer, like `quant.Int4Linear`'s, so the
    engine's count of the bytes a decode step reads stays the blocks) serves steps of more than
    ``dense_above`` rows; without it, steps of more than ``unpack_above`` rows (None: never)
    dequantize the weight for the call and run ``F.linear`` in ``unpack_dtype`` (float32: exact
    weights; bfloat16, a prefill's choice without a dense copy's memory: the weights rounded as a
    bfloat16 dense copy would round them, bfloat16 GEMM speed plus one dequantization per call)."""

    dense: Tensor | None

    def __init__(self, parts: Sequence[BlockQuantized], dense: Tensor | None = None, dense_above: int = 0,
                 unpack_above: int | None = None, unpack_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        segments = concat_rows(parts)
        if not segments or any(s.shape[1] != segments[0].shape[1] for s in segments):
            raise ValueError("KQuantLinear: one or more weights with the same columns")
        self.blocks = nn.ParameterList([nn.Parameter(s.blocks, requires_grad=False) for s in segments])
        self.types = tuple(s.ggml_type for s in segments)
        self.outs = tuple(s.shape[0] for s in segments)
        self.in_features = segments[0].shape[1]
        self.out_features = sum(self.outs)
        self.register_buffer("dense", dense)
        self.dense_above = dense_above
        self.unpack_above = unpack_above
        self.unpack_dtype = unpack_dtype
        self.onednn: Tensor | None = None  # `quant.pack_onednn`: the dense copy prepacked for oneDNN
        # bfloat16 steps of TILE_ROWS rows on the tiles path; False (a MoE layer's experts): only the steps of
        # more than unpack_above rows, which the unpack path would otherwise take
        self.tiles = True

    def weights(self) -> list[BlockQuantized]:
        return [BlockQuantized(b, t, (o, self.in_features)) for b, t, o in zip(self.blocks, self.types, self.outs,
                                                                                strict=True)]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight's float32 values [out, in] (exact), or those values in ``dtype``."""
        parts = [w.dequantize(dtype) for w in self.weights()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        if (self.dense is not None or self.onednn is not None) and rows > self.dense_above:
            return dense_matmul(x, self.dense, self.onednn)
        kernels = cpu_kernels.available() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        # (a module off the tiles, a MoE layer's expert, still takes them where it would unpack)
        unpacks = self.unpack_above is not None and rows > self.unpack_above
        wide = (unpacks and rows > TILE_WIDE_ROWS and self.in_features > TILE_WIDE_IN
                and cpu_kernels.kquant_tiles_backend() != "amx")
        if kernels and (self.tiles or unpacks) and not wide and tiles_take(x, self.out_features * self.in_features):
            outs = [cpu_kernels.kquant_linear(x, b, t, o) if cpu_kernels.kquant_pair_before_tiles(rows, t)
                    else cpu_kernels.kquant_linear_tiles(x, b, t, o)
                    for b, t, o in zip(self.blocks, self.types, self.outs, strict=True)]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if not kernels or unpacks:
            dtype = self.unpack_dtype if kernels else torch.float32
            y = F.linear(x.to(dtype), self.dequantize(dtype))
            return y if y.dtype == x.dtype else y.to(x.dtype)
        outs = [cpu_kernels.kquant_linear(x, b, t, o) for b, t, o in zip(self.blocks, self.types, self.outs,
                                                                         strict=True)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        kinds = "+".join(f"{cpu_kernels.KQUANT_NAMES[t]}[{o}]" for t, o in zip(self.types, self.outs, strict=True))
        return (f"{kinds} x {self.in_features}, dense_above={self.dense_above}, unpack_above={self.unpack_above}, "
                f"unpack_dtype={str(self.unpack_dtype).removeprefix('torch.')}")


def plan_segments(module: object, limits: list[int]) -> cpu_kernels.Segments | None:
    """A projection as `cpu_kernels.KqDecodePlan` takes it: its segments (blocks, type, rows), where it
    is a `KQuantLinear` whose bfloat16 steps of `TILE_ROWS` rows take the tiles (``tiles``), as the
    plan's ``tiles`` steps do; None otherwise. Appends to ``limits`` the most rows its kernels serve
    (its dense copy's ``dense_above``, its ``unpack_above``)."""
    if not isinstance(module, KQuantLinear) or not module.tiles:
        return None
    if module.dense is not None or module.onednn is not None:
        limits.append(module.dense_above)
    if module.unpack_above is not None:
        limits.append(module.unpack_above)
    return list(zip(module.blocks, module.types, module.outs, strict=True))


def grouped_linear(modules: Sequence[object], sizes: Sequence[int], x: Tensor) -> Tensor | None:
    """Row groups through their own `KQuantLinear` (``sizes[i]`` rows of ``x`` for ``modules[i]``,
    in order) as one `cpu_kernels.kquant_linear_grouped` call per row segment: [rows, out] in ``x``'s
    dtype, each row the same bits as ``modules[i](rows)`` gives. None where that does not hold: a
    module that is not a `KQuantLinear` of the same segments, a group that its module would serve
    with its dense copy or by unpacking, or no kernels for ``x``."""
    if not modules or len(modules) != len(sizes):
        return None
    first = modules[0]
    if not isinstance(first, KQuantLinear) or not (cpu_kernels.available() and x.device.type == "cpu"
                                                   and x.dtype in (torch.float32, torch.bfloat16)):
        return None
    mods: list[KQuantLinear] = []
    for m, size in zip(modules, sizes, strict=True):
        if not isinstance(m, KQuantLinear) or m.types != first.types or m.outs != first.outs:
            return None
        if (m.dense is not None or m.onednn is not None) and size > m.dense_above:
            return None
        if (m.unpack_above is not None and size > m.unpack_above) or (
                m.tiles and tiles_take(x[:size], m.out_features * m.in_features)
                and not all(cpu_kernels.kquant_pair_before_tiles(size, t) for t in m.types)):
            return None
        mods.append(m)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    outs = [cpu_kernels.kquant_linear_grouped(x, offsets, [m.blocks[s] for m in mods], t, o)
            for s, (t, o) in enumerate(zip(first.types, first.outs, strict=True))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


@attrs.frozen(eq=False)
class BlockExperts:
    """Every routed expert of a mixture-of-experts layer as GGUF blocks, listed once for
    `cpu_kernels.moe_kquant_mix` (`helios.models.moe.expert_mix`'s fused path): ``gate_up[e]`` /
    ``down[e]`` expert e's blocks (the modules' own parameters, so a later ``.to()`` is seen),
    ``max_rows`` the most rows a step may give the fused path (the modules would use their dense
    copy or dequantize past it; None: no limit)."""

    gate_up: list[Tensor]
    gate_up_type: int
    down: list[Tensor]
    down_type: int
    max_rows: int | None

    @classmethod
    def of(cls, gate_up: Sequence[object], down: Sequence[object]) -> BlockExperts | None:
        """The experts' blocks where every expert's gate/up is one `KQuantLinear` segment [2I, H]
        and its down one [H, I], all experts of the same types and off the tiles path (``tiles``
        False, as `MoELayer.routed_experts` sets them); otherwise None (the per-expert path)."""
        if not gate_up or len(gate_up) != len(down):
            return None
        gu0, d0 = gate_up[0], down[0]
        if not isinstance(gu0, KQuantLinear) or not isinstance(d0, KQuantLinear):
            return None
        if len(gu0.types) != 1 or len(d0.types) != 1 or gu0.out_features != 2 * d0.in_features \
                or d0.out_features != gu0.in_features:
            return None
        limits: list[int] = []
        for first, mods in ((gu0, gate_up), (d0, down)):
            for m in mods:
                if not isinstance(m, KQuantLinear) or m.types != first.types or m.outs != first.outs \
                        or m.in_features != first.in_features:
                    return None
                if m.tiles:  # its bfloat16 steps of TILE_ROWS rows would take the tiles, not the kernel
                    return None
                if m.dense is not None or m.onednn is not None:
                    limits.append(m.dense_above)
                if m.unpack_above is not None:
                    limits.append(m.unpack_above)
        return cls([cast(KQuantLinear, m).blocks[0] for m in gate_up], gu0.types[0],
                   [cast(KQuantLinear, m).blocks[0] for m in down], d0.types[0], min(limits) if limits else None)

    def mix(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor | None:
        """`cpu_kernels.moe_kquant_mix` of the step (SiLU experts), or None where it does not apply:
        ``x`` not a float32 or bfloat16 CPU tensor, weights neither float32 nor ``x``'s dtype, or more
        tokens than ``max_rows`` (an expert might then get more rows than the kernel path takes). The
        caller has checked that the CPU kernels are available (`cpu_kernels.available`: once a step,
        not once a layer)."""
        if (self.max_rows is not None and x.shape[0] > self.max_rows) or x.dtype not in _KERNEL_DTYPES \
                or ids.dtype != torch.int64 or weights.dtype not in (torch.float32, x.dtype) or x.device.type != "cpu":
            return None
        return cpu_kernels.moe_kquant_mix(x, weights, ids, self.gate_up, self.gate_up_type, self.down,
                                          self.down_type, self.max_rows)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
