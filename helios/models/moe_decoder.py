"""The decoder of the mixture-of-experts families (`helios.models.qwen3_moe`, `helios.models.glm4_moe`,
`helios.models.minimax_m2`).

A llama-style pre-norm decoder (q/k/v with optional bias, optional q/k RMSNorm per head or over all
heads, rotate-half RoPE on the first ``rotary_dim`` dimensions of each head, full causal attention)
whose feed-forward
is, per layer, either a dense SwiGLU MLP (``intermediate_size``) or the `helios.models.moe` block:
routed experts plus optional shared experts (``shared_intermediate_size``, with an optional sigmoid
gate as Qwen2-MoE has). `MoEConfig.moe_layers` says which layers are MoE layers (Qwen3-MoE's
``decoder_sparse_step`` / ``mlp_only_layers``, GLM's ``first_k_dense_replace``).

Built on `helios.models.decoder.FusedDecoderLM`: the attention's fused q/k/v and o projections, the
dense layers' gate/up and down projections and the shared experts' (as the gate/up and down
projections of an MoE layer) are built in the model's `WeightFormat`; the router weight and the score
correction bias are plain parameters. The routed experts are, under a dense format, stacked
parameters filled from the per-expert Hugging Face names (``mlp.experts.{e}.gate_proj.weight`` ...);
under a quantized format, one gate/up and one down module per expert built by `quant.build_linear`
from those names (``experts_gate_up_{e}``, ``experts_down_{e}``). Packed states carry both.

GGUF files store each layer's experts stacked ([E, rows, cols], `GGUF_MOE_LAYER_NAMES`). In a block
type (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0, Q4_1) the loader hands the stack over as a
`quant.StackedExperts` and `_PerExpert` takes expert e as the 2-D weight of its own contiguous byte
range, in the form a 2-D tensor of that type is read: `kquant.BlockQuantized` blocks (a view, no
dequantization; a ``keep_blocks`` format makes Q8_0 codes blocks again, exactly), or Q4_0 / Q4_1
`quant.GroupQuantized` codes. So under ``keep_blocks`` (``weights = "auto"`` for a k-quant GGUF) each
expert's gate/up and down are `kquant.KQuantLinear` over the file's blocks (the expert bytes kept
are the file's), under int4 Q4_0 / Q4_1 experts are `quant.Int4Linear` from their codes, and a dense
format dequantizes each expert into the stack. `MoEForCausalLM.decode_weight_bytes` counts
top_k / num_experts of those bytes per step; which kernel path a step's rows take is in
`helios.models.moe`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels
from helios.models.architecture import ArchitectureConfig, GGUFTensor
from helios.models.config import DecoderDims, check_rope_scaling, inv_freq_of
from helios.models.decoder import (
    DecoderLayer,
    FusedDecoderLM,
    add_rms_norm,
    apply_rope,
    broadcast_qk_norm,
    param,
    rms_norm,
    rope_tables,
)
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec
from helios.models.kquant import TILE_ROWS, BlockExperts, KQuantLinear, plan_segments
from helios.models.moe import Experts, RouterSpec, expert_mix, route, run_experts
from helios.models.quant import BuildSource, DenseLinear, StackedExperts, UnloadedLinear, WeightFormat
from helios.models.tp import ParallelContext, dispatch_experts

__all__ = ["EXPERT_FORMS", "GGUF_MOE_LAYER_NAMES", "GGUF_NEXTN_NAMES", "MoEConfig", "MoEForCausalLM", "MoELayer", "gguf_moe_tensor"]

EXPERT_FORMS = {
    # Hugging Face checkpoints: one tensor per expert and projection.
    "per_expert": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                   "mlp.experts.{e}.down_proj.weight"),
    # transformers 5's in-memory layout: [E, 2I, H] gate rows first, and [E, H, I].
    "fused": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    # llama.cpp's: [E, I, H] gate, [E, I, H] up, [E, H, I] down (`gguf_moe_tensor`'s names).
    "stacked": ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"),
}
"""The names (suffixes of ``model.layers.{i}.``) routed expert weights come under, by form."""


@attrs.frozen(kw_only=True)
class MoEConfig(DecoderDims):
    """Shape and numerics of an MoE decoder. ``intermediate_size``: the dense layers' MLP;
    ``moe_intermediate_size``: each expert's; ``shared_intermediate_size``: the shared experts'
    (all of them as one MLP; 0: none), under ``mlp.{shared_name}.`` with a sigmoid gate
    ``mlp.shared_expert_gate`` when ``shared_expert_gate``. ``rotary_dim``: how many leading
    dimensions of each head are rotated (``head_dim`` unless the rotary embedding is partial).
    ``qk_norm_per_head``: the q/k RMSNorm is over each head (``head_dim`` weights, Qwen3 / GLM);
    False: one RMSNorm over all the q heads together and one over all the k heads
    (``q_size`` / ``kv_size`` weights, MiniMax-M2)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[bool, ...]
    router: RouterSpec
    moe_intermediate_size: int
    shared_intermediate_size: int = 0
    shared_name: str = "shared_experts"
    shared_expert_gate: bool = False
    rotary_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    qk_norm_per_head: bool = True

    def __attrs_post_init__(self) -> None:
        self.check_dims()
        check_rope_scaling(self.rope_scaling)
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        rot = self.rotary
        if rot <= 0 or rot > self.head_dim or rot % 2:
            raise ValueError(f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {rot}")

    @property
    def rotary(self) -> int:
        """The rotated dimensions of each head."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def projection_params(self) -> int:
        """Weights of the attention, dense MLPs and shared experts (what `runtime.choose_weights`
        sizes a dense copy by; the routed experts, which quantized formats convert too, are not
        counted)."""
        attention = (self.q_size + 2 * self.kv_size) * self.hidden_size + self.hidden_size * self.q_size
        total = 0
        for moe in self.moe_layers:
            inter = self.shared_intermediate_size if moe else self.intermediate_size
            total += attention + 3 * inter * self.hidden_size
        return int(total)


class MoEForCausalLM(FusedDecoderLM):
    """An MoE decoder on `FusedDecoderLM` (same constructor arguments as
    `helios.models.llama.LlamaForCausalLM`)."""

    config: MoEConfig
    inv_freq: Tensor

    def __init__(self, config: MoEConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head,
                         parallel=parallel)
        freq = inv_freq_of(config.rotary, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", freq.to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [MoELayer(cfg, i, self.dtype, device, dense_dtype, parallel=self.parallel)
                for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        spec = FullAttentionSpec(self.config.num_kv_heads, self.config.head_dim)
        return (spec,) * self.config.num_layers

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`FusedDecoderLM.load_weights`, with the routed experts in any `EXPERT_FORMS` form (read
        as per-expert weights, `_PerExpert`), and without the layers past ``num_layers`` a
        checkpoint may carry (GLM-4.5's multi-token-prediction layer, which transformers ignores too)."""
        cfg = cast(MoEConfig, self.full_config)  # the checkpoint's sizes (tensor parallel: before sharding)
        super().load_weights(_PerExpert(tensors, cfg.num_layers, cfg.router.num_experts, cfg.moe_intermediate_size))

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm (``embeds`` and ``keep`` as in `LlamaForCausalLM.forward`)."""
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        planned = self.planned_decode(h, cos, sin, attn, self._build_plan, self._router_weights) \
            if fused and type(self) is MoEForCausalLM else None
        if planned is not None:
            h, delta = planned
            if keep is not None:
                h, delta = h.index_select(0, keep), delta.index_select(0, keep)
        else:
            for i, layer in enumerate(layers):
                last = i == len(layers) - 1
                h, delta = layer(h, delta, cos, sin, attn, fused, keep=keep if last else None)
        if h.shape[0] == 0:
            return h
        return add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps, fused)[1]

    def _build_plan(self) -> cpu_kernels.KqDecodePlan | None:
        return build_decode_plan(self.config, self._decoder_layers())

    def _router_weights(self, dtype: torch.dtype) -> list[Tensor]:
        return [layer.router_weight(dtype) for layer in self._decoder_layers()]

    def decode_weight_bytes(self) -> int:
        """`FusedDecoderLM.decode_weight_bytes`, with each MoE layer's routed experts counted for the
        ``top_k`` of them one token reads."""
        total = super().decode_weight_bytes()
        spec = self.config.router
        for layer in self._decoder_layers():
            total -= layer.routed_expert_bytes() * (spec.num_experts - spec.top_k) // spec.num_experts
        return total

    def _decoder_layers(self) -> Sequence[MoELayer]:
        return [cast(MoELayer, layer) for layer in self.layers]


class _PerExpert(Mapping[str, BuildSource]):
    """``tensors`` (read lazily) with stacked expert tensors (`EXPERT_FORMS` "fused", "stacked")
    seen as the per-expert weights they hold, and without the names of decoder layers
    ``num_layers`` and above. A stacked tensor is read once for all its experts (the last one read
    is kept while its experts are taken; the names of one come one after the other)."""

    def __init__(self, tensors: Mapping[str, BuildSource], num_layers: int, num_experts: int, inter: int) -> None:
        self._tensors = tensors
        self._num_experts = num_experts
        # per-expert name -> (stacked name, expert, row slice of the expert's matrix or None)
        self._parts: dict[str, tuple[str, int, slice | None]] = {}
        self._names: list[str] = []
        self._plain: set[str] = set()
        for name in tensors:
            prefix, _, suffix = name.partition(".mlp.experts.")
            if prefix.startswith("model.layers."):
                index = prefix.split(".")[2]
                if index.isdigit() and int(index) >= num_layers:
                    continue
            if suffix in ("gate_up_proj", "gate_proj", "up_proj", "down_proj") and "." not in suffix:
                self._expand(name, prefix, suffix, num_experts, inter)
            else:
                self._names.append(name)
                self._plain.add(name)
        self._cached: tuple[str, Tensor | StackedExperts] | None = None

    def _expand(self, name: str, prefix: str, suffix: str, num_experts: int, inter: int) -> None:
        for e in range(num_experts):
            base = f"{prefix}.mlp.experts.{e}."
            if suffix == "gate_up_proj":  # [E, 2I, H], gate rows first
                for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
                    self._parts[f"{base}{part}.weight"] = (name, e, rows)
                    self._names.append(f"{base}{part}.weight")
            else:
                self._parts[f"{base}{suffix}.weight"] = (name, e, None)
                self._names.append(f"{base}{suffix}.weight")

    def _stacked(self, name: str) -> Tensor | StackedExperts:
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # drop the previous one first
            value = self._tensors[name]
            if not isinstance(value, (Tensor, StackedExperts)) or value.dim() != 3:
                raise ValueError(f"{name}: stacked expert weights must be a dense [experts, rows, cols] tensor "
                                 "or GGUF blocks")
            if value.shape[0] != self._num_experts:
                raise ValueError(f"{name}: {value.shape[0]} experts, the config has {self._num_experts}")
            self._cached = (name, value)
        return self._cached[1]

    def __getitem__(self, name: str) -> BuildSource:
        part = self._parts.get(name)
        if part is None:
            if name not in self._plain:
                raise KeyError(name)
            return self._tensors[name]
        stacked, expert, rows = part
        value = self._stacked(stacked)
        if isinstance(value, StackedExperts):  # GGUF blocks: the expert's own bytes, as a 2-D tensor's
            if rows is not None:
                raise ValueError(f"{stacked}: a fused gate/up tensor in GGUF blocks is not a llama.cpp layout")
            return value.expert(expert)
        matrix = value[expert]
        return (matrix if rows is None else matrix[rows]).clone()  # its own storage, not the stack's

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


_PROJ_ATTRS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class MoELayer(DecoderLayer):
    def __init__(self, config: MoEConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None, *, parallel: ParallelContext | None = None) -> None:
        """``parallel``: a tensor-parallel rank's shard (``config`` is then already sharded); with
        expert parallelism it holds routed experts ``expert_lo .. expert_hi - 1`` only."""
        super().__init__(config, layer_idx)
        self.parallel = parallel
        self.expert_lo, self.expert_hi = (parallel.expert_range(config.router.num_experts) if parallel is not None
                                          else (0, config.router.num_experts))
        hidden = config.hidden_size
        self.moe = config.moe_layers[layer_idx]
        self.router_spec = config.router
        self.rotary_dim = config.rotary
        self.shared_name = config.shared_name
        self.qk_norm_per_head = config.qk_norm_per_head
        # A quantized weight format: each expert's gate/up and down are projections built by
        # `quant.build_linear` (attributes experts_gate_up_{e}, experts_down_{e}); a dense one: stacked.
        self.quantized_experts = self.moe and dense_dtype is None
        self._routed: tuple[list[nn.Module], list[nn.Module]] | None = None  # `routed_experts`, per-expert modules
        self._blocks: tuple[BlockExperts | None] | None = None  # `block_experts`, listed once
        self.mlp_size = config.shared_intermediate_size if self.moe else config.intermediate_size
        self.moe_intermediate_size = config.moe_intermediate_size

        def empty(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=dt, device=device))

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.input_norm = empty(hidden, dt=torch.float32)
        self.qkv_proj: nn.Module = projection(config.q_size + 2 * config.kv_size, hidden)
        self.o_proj: nn.Module = projection(hidden, config.q_size)
        self.qkv_bias = empty(config.q_size + 2 * config.kv_size) if config.attention_bias else None
        self.qk_norm = empty(config.num_heads + config.num_kv_heads, config.head_dim, dt=torch.float32) \
            if config.qk_norm else None
        self.post_attention_norm = empty(hidden, dt=torch.float32)
        # The dense MLP, or the MoE layer's shared experts (absent: None).
        self.gate_up_proj: nn.Module | None = projection(2 * self.mlp_size, hidden) if self.mlp_size else None
        self.down_proj: nn.Module | None = projection(hidden, self.mlp_size) if self.mlp_size else None
        self.router: nn.Parameter | None = None
        self._router_f32: tuple[tuple[int, int], Tensor] | None = None  # `_router_widened`
        self.correction_bias: nn.Parameter | None = None
        self.shared_gate: nn.Parameter | None = None
        self.experts_gate_up: nn.Parameter | None = None
        self.experts_down: nn.Parameter | None = None
        if self.moe:
            spec = config.router
            experts, inter = spec.num_experts, config.moe_intermediate_size
            self.router = empty(experts, hidden, dt=torch.float32 if spec.router_fp32 else dtype)
            if spec.scoring == "sigmoid":
                self.correction_bias = empty(experts, dt=torch.float32)
            if config.shared_expert_gate and self.mlp_size:
                self.shared_gate = empty(1, hidden)
            if self.quantized_experts:
                for e in range(experts):
                    self.add_module(f"experts_gate_up_{e}", UnloadedLinear())
                    self.add_module(f"experts_down_{e}", UnloadedLinear())
            else:
                local = self.expert_hi - self.expert_lo
                self.experts_gate_up = empty(local, 2 * inter, hidden)
                self.experts_down = empty(local, hidden, inter)

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        """The attention's projections; a dense layer's MLP, an MoE layer's shared experts as its
        gate/up and down projections, and with a quantized format each routed expert's."""
        parts = super().projection_parts()
        if not self.moe:
            return parts
        parts = {attr: parts[attr] for attr in ("qkv_proj", "o_proj")}
        hidden = self.hidden_size
        if self.mlp_size:
            prefix, size = f"mlp.{self.shared_name}.", self.mlp_size
            parts["gate_up_proj"] = ((f"{prefix}gate_proj.weight", (size, hidden)),
                                     (f"{prefix}up_proj.weight", (size, hidden)))
            parts["down_proj"] = ((f"{prefix}down_proj.weight", (hidden, size)),)
        if self.quantized_experts:
            inter = self.moe_intermediate_size
            for e in range(self.router_spec.num_experts):
                prefix = f"mlp.experts.{e}."
                parts[f"experts_gate_up_{e}"] = ((f"{prefix}gate_proj.weight", (inter, hidden)),
                                                 (f"{prefix}up_proj.weight", (inter, hidden)))
                parts[f"experts_down_{e}"] = ((f"{prefix}down_proj.weight", (hidden, inter)),)
        return parts

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in _PROJ_ATTRS and not (self.quantized_experts and attr.startswith(("experts_gate_up_",
                                                                                         "experts_down_"))):
            raise KeyError(attr)
        setattr(self, attr, module)
        self._routed = None
        self._blocks = None
        self.generation += 1

    def routed_experts(self) -> tuple[Experts, Experts]:
        """The routed experts' gate/up and down weights: stacked tensors, or one module per expert
        (listed once and kept until `set_projection` replaces one: a step asks for them in every
        layer, and 2 x num_experts module attribute lookups cost ~60 µs a layer)."""
        if self.experts_gate_up is not None and self.experts_down is not None:
            return self.experts_gate_up, self.experts_down
        if self._routed is None:
            count = self.router_spec.num_experts
            self._routed = ([cast(nn.Module, getattr(self, f"experts_gate_up_{e}")) for e in range(count)],
                            [cast(nn.Module, getattr(self, f"experts_down_{e}")) for e in range(count)])
            # GGUF-block experts keep the exact kernel at every row count up to unpack_above: a decode
            # step gives each expert a few rows (the tiles gain nothing there), and the fused mix
            # (`kquant.BlockExperts`) is that kernel's bits, whatever the rows; an expert given more
            # than unpack_above rows (a prefill) takes the tiles instead of unpacking
            for module in (*self._routed[0], *self._routed[1]):
                if isinstance(module, KQuantLinear):
                    module.tiles = False
        return self._routed

    def block_experts(self) -> BlockExperts | None:
        """The routed experts as GGUF blocks for the fused mix (`kquant.BlockExperts`; None where
        they are not all single-segment `kquant.KQuantLinear` modules), listed once like
        `routed_experts`."""
        if self._blocks is None:
            gate_up, down = self.routed_experts()
            self._blocks = (None if isinstance(gate_up, Tensor) or isinstance(down, Tensor)
                            else BlockExperts.of(gate_up, down),)
        return self._blocks[0]

    def routed_expert_bytes(self) -> int:
        """Bytes of the routed experts' parameters (0 in a dense layer)."""
        if not self.moe:
            return 0
        gate_up, down = self.routed_experts()
        if isinstance(gate_up, Tensor) and isinstance(down, Tensor):
            tensors: list[Tensor] = [gate_up, down]
        else:
            tensors = [p for m in (*gate_up, *down) for p in cast(nn.Module, m).parameters()]
        return sum(int(t.numel() * t.element_size()) for t in tensors)

    def weight_targets(self) -> dict[str, Tensor]:
        q, kv = self.q_size, self.kv_size
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
        }
        if self.qkv_bias is not None:
            targets["self_attn.q_proj.bias"] = self.qkv_bias[:q]
            targets["self_attn.k_proj.bias"] = self.qkv_bias[q : q + kv]
            targets["self_attn.v_proj.bias"] = self.qkv_bias[q + kv :]
        if self.qk_norm is not None and not self.qk_norm_per_head:
            # One weight per q (k) dimension of all heads: the q rows, then the k rows, flattened.
            targets["self_attn.q_norm.weight"] = self.qk_norm[: self.num_heads].view(-1)
            targets["self_attn.k_norm.weight"] = self.qk_norm[self.num_heads :].view(-1)
        elif self.qk_norm is not None:
            # Loaded into the first q row and first k row; finish_loading() broadcasts them.
            targets["self_attn.q_norm.weight"] = self.qk_norm[0]
            targets["self_attn.k_norm.weight"] = self.qk_norm[self.num_heads]
        if self.router is not None:
            targets["mlp.gate.weight"] = self.router
        if self.correction_bias is not None:
            targets["mlp.gate.e_score_correction_bias"] = self.correction_bias
        if self.shared_gate is not None:
            targets["mlp.shared_expert_gate.weight"] = self.shared_gate
        if self.experts_gate_up is not None and self.experts_down is not None:
            gate_up, down = self.experts_gate_up, self.experts_down
            inter = down.shape[-1]
            for e in range(gate_up.shape[0]):
                parts = (gate_up[e, :inter], gate_up[e, inter:], down[e])
                names = (name.format(e=e + self.expert_lo) for name in EXPERT_FORMS["per_expert"])
                targets.update(zip(names, parts, strict=True))
        return targets

    def finish_loading(self) -> None:
        if self.qk_norm is not None and self.qk_norm_per_head:
            broadcast_qk_norm(self.qk_norm, self.num_heads, self.num_kv_heads)
        self.generation += 1

    def router_weight(self, dtype: torch.dtype) -> Tensor:
        """The router weight of an MoE layer as `_router_logits` multiplies rows of ``dtype`` by it."""
        assert self.router is not None
        if not self.router_spec.router_fp32 and dtype == torch.bfloat16 and self.router.device.type == "cpu":
            return self._router_widened()
        return self.router

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``h`` plus the previous layer's feed-forward output
        ``delta``: the stream after attention and this layer's feed-forward output (``keep`` as in
        the llama layer)."""
        num_tokens = h.shape[0]
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = cast(nn.Module, self.qkv_proj)(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        rot = self.rotary_dim
        rotated = False
        if self.qk_norm is not None and self.qk_norm_per_head and fused and rot == self.head_dim:
            qk = cpu_kernels.qk_norm_rope_(qk, self.qk_norm, self.eps, cos, sin)
            rotated = True
        elif self.qk_norm is not None and self.qk_norm_per_head:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        elif self.qk_norm is not None:  # over all the q heads, and over all the k heads
            q_part, k_part = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            q_w, k_w = self.qk_norm.split((self.num_heads, self.num_kv_heads))
            qk = torch.cat((rms_norm(q_part.reshape(num_tokens, -1), q_w.reshape(-1), self.eps),
                            rms_norm(k_part.reshape(num_tokens, -1), k_w.reshape(-1), self.eps)), dim=-1)
            qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if not rotated and rot == self.head_dim:
            qk = cpu_kernels.rope_(qk, cos, sin) if fused else apply_rope(qk, cos, sin)
        elif not rotated:
            qk = torch.cat((apply_rope(qk[..., :rot], cos, sin), qk[..., rot:]), dim=-1)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v)
        return self.finish(h, out, keep, fused, self.q_size)

    def finish(self, h: Tensor, out: Tensor, keep: Tensor | None, fused: bool, width: int) -> tuple[Tensor, Tensor]:
        """After attention: the rows ``keep`` selects (None: all), ``o_proj`` over the attention
        output's ``width`` columns, the post-attention norm into the stream ``h``, and this layer's
        feed-forward output (the pair `forward` returns)."""
        if keep is not None:
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if keep.shape[0] == 0:
                return h, h
        attended = self.o_proj(out.reshape(out.shape[0], width))
        if self.parallel is None:
            h, x = add_rms_norm(h, attended, self.post_attention_norm, self.eps, fused)
            return h, self.feed_forward(x, fused)
        # Tensor parallel: o_proj and the feed-forward are row parallel (partial sums per rank).
        h, x = add_rms_norm(h, self.parallel.all_reduce(attended), self.post_attention_norm, self.eps, fused)
        return h, self.parallel.all_reduce(self.feed_forward(x, fused))

    def feed_forward(self, x: Tensor, fused: bool = False) -> Tensor:
        """The dense MLP, or the routed experts plus the shared ones."""
        dense = self._mlp(x, fused) if self.gate_up_proj is not None else None
        if not self.moe:
            return cast(Tensor, dense)
        assert self.router is not None
        if self.parallel is not None and self.parallel.expert_parallel:
            out = self._dispatched(x, self.parallel)
        else:
            weights, ids = route(self._router_logits(x), self.router_spec, self.correction_bias)
            out = expert_mix(x, weights, ids, *self.routed_experts(), blocks=self.block_experts() if fused else None)
        if dense is not None:
            if self.shared_gate is not None:
                dense = torch.sigmoid(F.linear(x, self.shared_gate)) * dense
            out = out + dense
        return out

    def _router_logits(self, x: Tensor) -> Tensor:
        assert self.router is not None
        if self.router_spec.router_fp32:
            return F.linear(x.float(), self.router)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # The bfloat16 product's value (products of bfloat16 values are exact in float32, float32
            # sums, one rounding) through a float32 copy of the bfloat16 weight: on the CPU torch's
            # bfloat16 GEMM of a few rows against these 8-256 expert rows costs 2.5x a float32 one.
            return F.linear(x.float(), self._router_widened()).to(x.dtype)
        return F.linear(x, self.router)

    def _router_widened(self) -> Tensor:
        """The router weight widened to float32 (its values, kept until the weight changes)."""
        assert self.router is not None
        key = (self.router.data_ptr(), self.router._version)
        if self._router_f32 is None or self._router_f32[0] != key:
            self._router_f32 = (key, self.router.detach().float())
        return self._router_f32[1]

    def _dispatched(self, x: Tensor, ctx: ParallelContext) -> Tensor:
        """Expert parallelism: this rank routes its share of the tokens, their rows go to the
        experts' ranks and back (`tp.dispatch_experts`); rows of other ranks' tokens are zero (the
        layer's all-reduce adds them)."""
        lo, hi = ctx.token_range(x.shape[0])
        mine = x[lo:hi]
        weights, ids = route(self._router_logits(mine), self.router_spec, self.correction_bias)
        gate_up, down = self.routed_experts()
        mixed = dispatch_experts(mine, weights, ids, ctx, self.router_spec.num_experts,
                                 lambda rows, counts: run_experts(rows, counts, gate_up, down))
        out = torch.zeros_like(x)
        out[lo:hi] = mixed
        return out

    def _mlp(self, x: Tensor, fused: bool) -> Tensor:
        gate_up = cast(nn.Module, self.gate_up_proj)(x)
        down = cast(nn.Module, self.down_proj)
        if fused and gate_up.is_contiguous():
            return cast(Tensor, down(cpu_kernels.silu_mul(gate_up)))
        gate, up = gate_up.split(self.mlp_size, dim=-1)
        return cast(Tensor, down(F.silu(gate).mul_(up)))


def build_decode_plan(config: MoEConfig, layers: Sequence[MoELayer]) -> cpu_kernels.KqDecodePlan | None:
    """The layers as one `cpu_kernels.KqDecodePlan`, where they are Qwen3-MoE's: every one a plain
    `MoELayer` (no subclass, no tensor parallelism) with a per-head q/k norm, full rotary, no bias,
    `kquant.KQuantLinear` q/k/v and o projections (`kquant.plan_segments`), no shared experts and
    softmax routing over `kquant.BlockExperts`; otherwise None. ``max_rows``: the most rows a step may
    have for every projection to take the kernels the plan calls (no dense copy, no unpacking, no more
    rows than the experts' fused mix takes, at most `kquant.TILE_ROWS`' upper end)."""
    spec = config.router
    if not layers or spec.scoring != "softmax" or config.rotary != config.head_dim or not config.qk_norm \
            or not config.qk_norm_per_head or not cpu_kernels.available():
        return None
    limits = [TILE_ROWS[1]]
    plan = cpu_kernels.KqDecodePlan(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                    top_k=spec.top_k, norm_topk=spec.norm_topk_prob, router_fp32=spec.router_fp32)
    for layer in layers:
        if type(layer) is not MoELayer or layer.parallel is not None or not layer.moe \
                or layer.qkv_bias is not None or layer.gate_up_proj is not None:
            return None
        qkv, o = plan_segments(layer.qkv_proj, limits), plan_segments(layer.o_proj, limits)
        experts = layer.block_experts()
        if qkv is None or o is None or experts is None:
            return None
        if experts.max_rows is not None:
            limits.append(experts.max_rows)
        plan.add_layer(layer.input_norm, layer.post_attention_norm, None, layer.qk_norm, qkv, o,
                       experts=(experts.gate_up, experts.gate_up_type, experts.down, experts.down_type,
                                experts.max_rows))
    plan.max_rows = min(limits)
    return plan


# -- GGUF names ------------------------------------------------------------------------------------------

# llama.cpp's per-layer names of the MoE architectures (qwen3moe, glm4moe, minimax-m2, mimo2) -> Hugging
# Face suffixes;
# the expert tensors are stacked ([E, rows, cols]) under `EXPERT_FORMS["stacked"]` (split per expert
# on load, `_PerExpert`).
GGUF_MOE_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": EXPERT_FORMS["stacked"][0],
    "ffn_up_exps.weight": EXPERT_FORMS["stacked"][1],
    "ffn_down_exps.weight": EXPERT_FORMS["stacked"][2],
    "ffn_gate_shexp.weight": "mlp.{shared}.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.{shared}.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.{shared}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


GGUF_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
}
"""llama.cpp's names of a multi-token-prediction module's own tensors (``blk.{N}.nextn.*``, N past
the decoder's layers) -> their Hugging Face suffixes (of ``model.layers.{N}.``, `helios.models.mtp`)."""


def gguf_moe_tensor(config: ArchitectureConfig, gguf_name: str,
                    extra: Mapping[str, str] | None = None, *, mtp: bool = False) -> GGUFTensor | None:
    """Where an MoE GGUF tensor goes (q/k rows are in rotate-half order in these files: no
    permutation). The layers past ``num_layers`` (next-token-prediction layers: GLM's, MiMo's) go
    nowhere (None), unless ``mtp``: then, as in a Hugging Face folder, to ``model.layers.{N}.*``
    (their decoder block's tensors under the same names as a layer's, their own under
    `GGUF_NEXTN_NAMES`; a name known to neither goes nowhere), which the model skips and
    `helios.models.mtp.load_mtp` reads. ``extra``: a family's own per-layer names (GGUF suffix ->
    Hugging Face suffix), looked up before `GGUF_MOE_LAYER_NAMES`."""
    assert isinstance(config, MoEConfig), type(config)
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return GGUFTensor(_GGUF_GLOBAL_NAMES[gguf_name])
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        past = int(parts[1]) >= config.num_layers
        if past and not mtp:
            return None
        suffix = (extra or {}).get(parts[2]) or GGUF_MOE_LAYER_NAMES.get(parts[2])
        if past and suffix is None:
            suffix = GGUF_NEXTN_NAMES.get(parts[2])
            if suffix is None:
                return None
        if suffix is not None:
            return GGUFTensor(f"model.layers.{parts[1]}.{suffix.format(shared=config.shared_name)}")
    raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
