"""Small tensor helpers the sampling modules share: row selections and host values sent to the device."""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def finite_peak(peak: Tensor) -> Tensor:
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


def row_index(selected: list[int], num_rows: int, device: torch.device) -> Tensor | None:
    """Index tensor for ``selected`` rows, or None when they are all rows in order."""
    if len(selected) == num_rows:
        return None
    return to_device(selected, torch.long, device)


def as_index(selected: list[int], device: torch.device) -> Tensor:
    return to_device(selected, torch.long, device)


def to_device(values: list[int] | list[float] | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values as a tensor on ``device``. On CUDA they cross through pinned memory in a
    non-blocking copy: a blocking host-to-device copy synchronises the stream, a host sync too."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def select_rows(x: Tensor, selected: list[int], num_rows: int) -> Tensor:
    index = row_index(selected, num_rows, x.device)
    return x if index is None else x.index_select(0, index)


def column(values: list[float], device: torch.device) -> Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)
