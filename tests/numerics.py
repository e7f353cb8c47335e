"""Tolerances for comparing a model's numbers with a float32 (or float64) reference, derived from
the dtype the model ran in.

float32 (24 significant bits): a correct model reproduces the reference up to accumulation noise,
far below any real bug, so fp32 comparisons are fidelity checks with fixed absolute bounds measured
with margin: FP32_TOLERANCE (1e-4) on the tiny random models of tests/parity; longer models state
their own (SmolLM2's 30 layers: 5e-4).

bfloat16 (8 significant bits: unit roundoff 2**-8, so the spacing at 25 is 0.125) and float16 (11):
the weights are rounded on load and activations after every matmul, and which kernel rounds where
depends on the CPU (native AVX512-BF16/AMX dot products or AVX2 code widening to fp32), so results
move by machine-dependent amounts. The bound is a number of roundings of the dtype's unit roundoff,
relative to the magnitude of the values compared; each test says how many roundings it allows and
why.
"""

from __future__ import annotations

import torch

FP32_TOLERANCE = 1e-4


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of one rounding to ``dtype``: 2**-8 for bfloat16, 2**-11 for float16."""
    return torch.finfo(dtype).eps / 2


def tolerance_for(dtype: torch.dtype, scale: float, *, roundings: float = 4) -> float:
    """Largest absolute difference accepted between values of magnitude ``scale`` computed in
    ``dtype`` and a float32 reference: FP32_TOLERANCE for float32 (a fidelity check), else
    ``roundings`` roundings of the dtype's unit roundoff at ``scale``."""
    if dtype in (torch.float32, torch.float64):
        return FP32_TOLERANCE
    return roundings * unit_roundoff(dtype) * scale
