"""SigLIP vision transformer with Idefics3's variable-size patch positions (the Idefics3 / SmolVLM encoder).

A tile [3, H, W] is cut into ``patch_size`` squares, each projected to ``hidden_size`` (a convolution
with stride = kernel = patch size). Positions: the learned table covers a square grid of
``image_size // patch_size`` patches per side; a tile whose real (unpadded) area is ``h x w`` patches
maps patch (i, j) to bucket (floor-ish of i / h on that grid, same for j), i.e. the fractional
coordinate ``min(i / h, 1 - 1e-6)`` bucketized against the grid's boundaries ``k / side``
(k = 1 .. side-1, right-closed), as NaViT-style variable resolution does; padded patches take
position 0 and are masked out as keys. Then pre-LayerNorm encoder layers (bidirectional attention
with biases, a GELU MLP) and a final LayerNorm.

Layout choices: q/k/v are one matmul (weights concatenated at load time); attention is
``scaled_dot_product_attention`` with a key mask only when some tile has padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@attrs.frozen(kw_only=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> SiglipVisionConfig:
        return cls(
            hidden_size=int(config.get("hidden_size", 1152)),
            intermediate_size=int(config.get("intermediate_size", 3072)),
            num_layers=int(config.get("num_hidden_layers", 12)),
            num_heads=int(config.get("num_attention_heads", 16)),
            patch_size=int(config.get("patch_size", 32)),
            image_size=int(config.get("image_size", 224)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-6)),
            hidden_act=str(config.get("hidden_act", "gelu_pytorch_tanh")),
            num_channels=int(config.get("num_channels", 3)),
        )


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class SiglipVisionEncoder(nn.Module):
    """Tiles [N, C, H, W] and their patch mask [N, H/p, W/p] -> hidden states [N, (H/p)(W/p), hidden]."""

    boundaries: Tensor

    def __init__(self, config: SiglipVisionConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        d, p = config.hidden_size, config.patch_size

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.patch_weight = empty(d, config.num_channels, p, p)
        self.patch_bias = empty(d)
        self.position_embedding = empty(config.patches_per_side ** 2, d)
        self.layers = nn.ModuleList(_EncoderLayer(config, empty) for _ in range(config.num_layers))
        self.post_norm_weight = empty(d)
        self.post_norm_bias = empty(d)
        # The grid's bucket boundaries 1/side, 2/side, ...: built as transformers builds them
        # (float32 arange with a float step), so that bucketization agrees exactly at the edges.
        side = config.patches_per_side
        self.register_buffer("boundaries", torch.arange(1 / side, 1.0, 1 / side, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_weight.dtype

    def forward(self, pixel_values: Tensor, patch_mask: Tensor) -> Tensor:
        cfg = self.config
        n = pixel_values.shape[0]
        x = F.conv2d(pixel_values.to(self.dtype), self.patch_weight, self.patch_bias, stride=cfg.patch_size)
        x = x.flatten(2).transpose(1, 2)
        x = x + F.embedding(self._position_ids(patch_mask), self.position_embedding)
        flat_mask = patch_mask.reshape(n, -1)
        key_mask = None if bool(flat_mask.all()) else flat_mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        return F.layer_norm(x, (cfg.hidden_size,), self.post_norm_weight, self.post_norm_bias, cfg.layer_norm_eps)

    def _position_ids(self, patch_mask: Tensor) -> Tensor:
        """[N, h*w] indices into the position table for each tile's real patch area (0 for padding)."""
        n, rows, cols = patch_mask.shape
        real_rows = patch_mask[:, :, 0].sum(dim=1)
        real_cols = patch_mask[:, 0, :].sum(dim=1)
        limit = 1.0 - 1e-6
        frac_h = (torch.arange(rows, dtype=torch.float32, device=patch_mask.device)[None, :]
                  * (1.0 / real_rows)[:, None]).clamp(max=limit)
        frac_w = (torch.arange(cols, dtype=torch.float32, device=patch_mask.device)[None, :]
                  * (1.0 / real_cols)[:, None]).clamp(max=limit)
        bucket_h = torch.bucketize(frac_h, self.boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, self.boundaries, right=True)
        ids = (bucket_h[:, :, None] * self.config.patches_per_side + bucket_w[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))

    def load_weights(self, tensors: Mapping[str, Tensor], prefix: str = "") -> set[str]:
        """Fill from Hugging Face SigLIP / Idefics3 names under ``prefix`` (``embeddings.*``,
        ``encoder.layers.{i}.*``, ``post_layernorm.*``). Returns the names used; raises on a missing
        one or a wrong shape."""
        cfg = self.config
        used: set[str] = set()

        def take(name: str, target: Tensor) -> None:
            full = prefix + name
            if full not in tensors:
                raise ValueError(f"missing vision weight {full}")
            value = tensors[full]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{full}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
            target.copy_(value)
            used.add(full)

        with torch.no_grad():
            take("embeddings.patch_embedding.weight", self.patch_weight)
            take("embeddings.patch_embedding.bias", self.patch_bias)
            take("embeddings.position_embedding.weight", self.position_embedding)
            take("post_layernorm.weight", self.post_norm_weight)
            take("post_layernorm.bias", self.post_norm_bias)
            d = cfg.hidden_size
            for i, module in enumerate(self.layers):
                layer: _EncoderLayer = module  # type: ignore[assignment]
                base = f"encoder.layers.{i}."
                for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    take(f"{base}self_attn.{part}.weight", layer.qkv_weight[j * d : (j + 1) * d])
                    take(f"{base}self_attn.{part}.bias", layer.qkv_bias[j * d : (j + 1) * d])
                for name, target in (("self_attn.out_proj.weight", layer.out_weight),
                                     ("self_attn.out_proj.bias", layer.out_bias),
                                     ("layer_norm1.weight", layer.norm1_weight), ("layer_norm1.bias", layer.norm1_bias),
                                     ("layer_norm2.weight", layer.norm2_weight), ("layer_norm2.bias", layer.norm2_bias),
                                     ("mlp.fc1.weight", layer.fc1_weight), ("mlp.fc1.bias", layer.fc1_bias),
                                     ("mlp.fc2.weight", layer.fc2_weight), ("mlp.fc2.bias", layer.fc2_bias)):
                    take(base + name, target)
        return used


class _EncoderLayer(nn.Module):
    def __init__(self, config: SiglipVisionConfig, empty: Any) -> None:
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.hidden = d
        self.num_heads = config.num_heads
        self.head_dim = d // config.num_heads
        self.eps = config.layer_norm_eps
        self.act = _ACTIVATIONS[config.hidden_act]
        self.norm1_weight, self.norm1_bias = empty(d), empty(d)
        self.qkv_weight, self.qkv_bias = empty(3 * d, d), empty(3 * d)
        self.out_weight, self.out_bias = empty(d, d), empty(d)
        self.norm2_weight, self.norm2_bias = empty(d), empty(d)
        self.fc1_weight, self.fc1_bias = empty(inter, d), empty(inter)
        self.fc2_weight, self.fc2_bias = empty(d, inter), empty(d)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        n, seq, d = x.shape
        h = F.layer_norm(x, (d,), self.norm1_weight, self.norm1_bias, self.eps)
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias).view(n, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        x = x + F.linear(attn.transpose(1, 2).reshape(n, seq, d), self.out_weight, self.out_bias)
        h = F.layer_norm(x, (d,), self.norm2_weight, self.norm2_bias, self.eps)
        return x + F.linear(self.act(F.linear(h, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias)
