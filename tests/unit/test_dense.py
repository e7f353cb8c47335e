"""oneDNN matmuls at bucketed row counts (`helios.models.dense`): the buckets, the bits, the caches' bounds."""

from __future__ import annotations

import os

import pytest
import torch

from helios.models.dense import ONEDNN_CACHE_ENTRIES, onednn_linear, onednn_rows
from helios.models.quant import _onednn_pack, onednn_linear_works


def test_row_buckets_are_few_and_close() -> None:
    buckets = {onednn_rows(m) for m in range(1, 513)}
    assert len(buckets) <= 56 + 1
    for m in range(1, 5000):
        rows = onednn_rows(m)
        assert m <= rows <= m * 1.125 and onednn_rows(rows) == rows, m
        assert rows <= onednn_rows(m + 1)
    assert [onednn_rows(m) for m in (1, 15, 16, 17, 100, 512, 513)] == [1, 15, 16, 18, 104, 512, 576]


def test_the_caches_are_bounded_unless_the_environment_says() -> None:
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        assert int(os.environ[name]) > 0
    assert ONEDNN_CACHE_ENTRIES >= 4 * len({onednn_rows(m) for m in range(1, 513)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_give_the_same_bits(dtype: torch.dtype) -> None:
    """Every row of a padded call equals, bit for bit, oneDNN's own call at the exact row count."""
    if not torch.backends.mkldnn.is_available() or not onednn_linear_works(dtype):
        pytest.skip(f"oneDNN's prepacked linear is not used for {dtype} here")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 96, generator=g).to(dtype)
    packed = _onednn_pack(weight)
    x = torch.randn(600, 96, generator=g).to(dtype)
    for m in (1, 7, 16, 17, 23, 100, 130, 257, 513):
        exact = torch.ops.mkldnn._linear_pointwise(x[:m].contiguous(), packed, None, "none", [], "")
        got = onednn_linear(x[:m], packed)
        assert got.shape == exact.shape and got.dtype == dtype
        assert torch.equal(got, exact), m
        want = torch.nn.functional.linear(x[:m].float(), weight.float())
        assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
