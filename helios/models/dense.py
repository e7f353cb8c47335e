"""Dense matmuls: ``x @ w.T`` from a plain weight or from its oneDNN-packed copy (`quant.pack_onednn`).
The bottom of the weight formats: `quant` and `kquant` both multiply their dense copies here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def onednn_linear(x: Tensor, packed: Tensor) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    return out


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
