"""Paged KV storage: the K and V tensors, indexed by slot = page_id * page_size + offset.

Which request holds which page is the KV cache manager's business (`manager.py`).
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V tensors of shape [num_kv_heads, num_slots, head_dim].

    Head-major, so gathering a batch's history is one `index_select` over slots per layer that
    yields [kv_heads, B * L, head_dim] blocks attention can use without another copy."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        slots = num_pages * page_size
        self.k = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
