"""Dense matmuls: ``x @ w.T`` from a plain weight or from its oneDNN-packed copy (`quant.pack_onednn`).
The bottom of the weight formats: `quant` and `kquant` both multiply their dense copies here."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

ONEDNN_CACHE_ENTRIES = 512
"""The bound on each of oneDNN's two caches of built matmul primitives (oneDNN's own,
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and the one torch's ideep layer keeps, ``LRU_CACHE_CAPACITY``),
unless the environment sets them. The variables are read when the first primitive is built, so
they are set when this module (which makes oneDNN's matmuls) is imported."""

for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, str(ONEDNN_CACHE_ENTRIES))


def onednn_rows(m: int) -> int:
    """The row count a oneDNN matmul of ``m`` rows runs at: ``m`` itself below 16, else ``m``
    rounded up to the next multiple of an eighth of its power-of-two octave (at most 12.5% more
    rows; 17 -> 18, 100 -> 104, 513 -> 576).

    oneDNN builds (JIT-compiles) a primitive per shape, about 1.2 ms each here, and caches it (about
    0.2 MiB an entry): with every prefill chunk's exact row count a new shape, both caches grow
    towards 1,024 entries each over an hour of mixed traffic (docs/operations.md, "Soak"). Bucketed,
    a weight has about 56 shapes up to 512 rows, which the caches keep. The extra
    rows are zeros and dropped: every row's result is the same bits at any row count (checked in
    tests/unit/test_dense.py)."""
    if m < 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def onednn_linear(x: Tensor, packed: Tensor) -> Tensor:
    """``x @ w.T`` from `quant.pack_onednn`'s copy of ``w``, at `onednn_rows` rows."""
    x = x.contiguous()
    m = x.shape[0]
    rows = onednn_rows(m)
    if rows != m:  # the rows copied once, only the padding zeroed (a prefill chunk's x is megabytes)
        padded = x.new_empty((rows, *x.shape[1:]))
        padded[:m].copy_(x)
        padded[m:].zero_()
        x = padded
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out[:m] if rows != m else out


def dense_matmul(x: Tensor, w: Tensor | None, onednn: Tensor | None = None) -> Tensor:
    """``x @ w.T`` in ``w``'s dtype (``x`` converted there and the result back), from ``onednn``
    (`pack_onednn`'s copy of ``w``, which then may stand alone: ``w`` None) when given."""
    if onednn is not None:
        if x.dtype == onednn.dtype:
            return onednn_linear(x, onednn)
        return onednn_linear(x.to(onednn.dtype), onednn).to(x.dtype)
    assert w is not None
    if x.dtype == w.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)
