"""What the decoders built on fused projections share (`helios.models.llama`, `helios.models.gemma3`):
the embedding and output projection, the fused q/k/v and gate/up projections in the model's
`WeightFormat` (`load_weights` builds them from the family's Hugging Face names), the packed state
(`packed_state` / `load_packed_state`, for `helios.loaders.weight_cache`), the CPU packing
decisions, the logits (float32 copy or ggml Q8_0 codes of the head), and the float32 RMSNorm and
rotate-half RoPE helpers.

A family module subclasses `FusedDecoderLM`: it builds its layers (`_build_layers`, each a
`DecoderLayer` with the `PROJECTIONS` attributes, or the ones its `DecoderLayer.projection_parts`
names: an MoE layer has no dense MLP), its buffers, ``forward`` and ``cache_specs``, and may convert
checkpoint values on load (`_checkpoint_value`). Everything here is the llama family's original
code, moved, so its behaviour is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels, packing
from helios.models.dense import dense_matmul
from helios.models.interface import AttentionContext, CacheSpec, DecodeArgs
from helios.models.kquant import TILE_ROWS, BlockQuantized, tiles_take
from helios.models.packing import LM_HEAD_FP32, LM_HEAD_Q8, Q8_BF16_ROWS, Q8_EXACT_AMX_ROWS
from helios.models.quant import BuildSource, GroupQuantized, WeightFormat, build_linear, dense_of, q8_0_blocks
from helios.models.tp import ParallelContext, ShardedWeights, shard_config

EMBED_BLOCKS = "embed_blocks"  # a keep_blocks model's token embedding blocks, in a packed state
LM_HEAD_BLOCKS = "lm_head_blocks"  # its output projection's blocks ("empty" kind: an untied Q8_0 head's codes alone)
__all__ = ["EMBED_BLOCKS", "LM_HEAD_BLOCKS", "PROJECTIONS", "DecoderLayer", "DecoderShape", "FusedDecoderLM", "add_rms_norm", "apply_rope",
           "broadcast_qk_norm", "layer_projections", "param", "rms_norm", "rope_tables"]

# The fused projections of a decoder layer: attribute -> the Hugging Face weight names (suffixes of
# "model.layers.{i}.") that make up its row blocks, in order.
PROJECTIONS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


class DecoderShape(Protocol):
    """What `FusedDecoderLM` reads of a family's config."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def q_size(self) -> int: ...

    @property
    def kv_size(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def rms_norm_eps(self) -> float: ...


class DecoderLayer(nn.Module):
    """A decoder layer as `FusedDecoderLM` loads it: the `PROJECTIONS` attributes, its other
    weights by Hugging Face suffix, and the hooks run once they are in place. ``parallel``: the
    tensor-parallel rank it is a shard of (None: the whole layer; `helios.models.tp`)."""

    parallel: ParallelContext | None = None

    def __init__(self, config: DecoderShape, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.intermediate_size = config.intermediate_size
        self.hidden_size = config.hidden_size
        # Counts the changes of this layer's weights (`set_projection`, `finish_loading`): the model's
        # decode plan (`FusedDecoderLM.planned_decode`) is rebuilt when a layer's count moves.
        self.generation = 0

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        """This layer's fused projections: attribute -> its row blocks as (Hugging Face suffix,
        [rows, cols]), in order. By default every `PROJECTIONS` attribute with the attention's and
        the MLP's shapes; a layer without a dense MLP (an MoE layer) names fewer or other parts."""
        hidden, inter, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes = {
            "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
            "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        return {attr: tuple((suffix, shapes[suffix]) for suffix in suffixes) for attr, suffixes in PROJECTIONS.items()}

    def weight_targets(self) -> dict[str, Tensor]:
        """Hugging Face suffix -> parameter (view) for everything but the projections."""
        raise NotImplementedError

    def set_projection(self, attr: str, module: nn.Module) -> None:
        raise NotImplementedError

    def find_fused_decode(self) -> None:
        """Where the one-operator CPU decode applies (none by default)."""

    def finish_loading(self) -> None:
        """Called once every weight is loaded (or restored from a packed state)."""


class FusedDecoderLM(nn.Module):
    """The shared body of a decoder on fused projections (see the module docstring)."""

    def __init__(self, config: DecoderShape, dtype: torch.dtype, device: torch.device | str, *,
                 lm_head_fp32: bool, weights: WeightFormat | None, q8_head: bool,
                 parallel: ParallelContext | None = None) -> None:
        """``parallel``: build one tensor-parallel rank's shard (`helios.models.tp`): ``config`` is
        the checkpoint's, the model holds `tp.shard_config` of it (``full_config`` keeps the
        checkpoint's), loads `tp.ShardedWeights` and all-reduces after its row-parallel projections;
        None (one rank): nothing of this exists on the path."""
        super().__init__()
        self.full_config = config
        self.parallel = parallel
        if parallel is not None:
            if weights is not None and weights.kind != "dense":
                raise ValueError(f"tensor parallelism shards dense weights only; the weight format is "
                                 f"{weights.describe()} (use weights = float32, bfloat16 or auto on a float checkpoint)")
            config = shard_config(config, parallel)
            q8_head = False
        self.config = config
        self.dtype = dtype
        self.weight_format = weights or WeightFormat()
        self.embed_tokens = param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(self._build_layers(torch.device(device), self._placeholder_dtype()))
        for layer in self._decoder_layers():
            layer.parallel = parallel
        self.norm = param(torch.ones(config.hidden_size, dtype=torch.float32, device=device))
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            rows = config.vocab_size
            if parallel is not None:
                lo, hi, _ = parallel.vocab_range(rows)
                rows = hi - lo
            self.lm_head = param(torch.empty(rows, config.hidden_size, dtype=dtype, device=device))
        self._lm_head_fp32: Tensor | None = None
        self._lm_head_onednn: Tensor | None = None  # `pack_cpu_weights`
        self._wants_lm_head_fp32 = lm_head_fp32 and dtype != torch.float32
        self._lm_head_q8: tuple[Tensor, Tensor] | None = None
        self._lm_head_q8_bf16: tuple[Tensor, Tensor, int] | None = None  # `pack_cpu_weights`
        self._wants_q8_head = q8_head
        # A ``keep_blocks`` weight format: the token embedding's GGUF blocks (looked up row by row,
        # `BlockQuantized.dequantize_rows`) and an output projection multiplied from its blocks
        # (`cpu_kernels.kquant_linear`, float32 activations and logits); the dense parameters are then
        # empty.
        self._embed_blocks: BlockQuantized | None = None
        self._lm_head_blocks: BlockQuantized | None = None
        # `planned_decode`: the decode plan, keyed by the layers' generations (None: none applies)
        self._plan: tuple[tuple[int, ...], cpu_kernels.KqDecodePlan | None] | None = None

    def planned_decode(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
                       build: Callable[[], cpu_kernels.KqDecodePlan | None],
                       routers: Callable[[torch.dtype], list[Tensor]] | None = None) -> tuple[Tensor, Tensor] | None:
        """Every layer of an all-decode step through the model's decode plan (`cpu_kernels.KqDecodePlan`,
        made by ``build`` and kept until a layer's weights change; ``routers``: the layers' router
        weights for rows of a dtype, for the MoE layers): the last layer's (stream, feed-forward
        output), or None where no plan applies (the caller runs the layers)."""
        layers = self._decoder_layers()
        key = tuple(layer.generation for layer in layers)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, build())
        plan = self._plan[1]
        rows = h.shape[0]
        if plan is None or rows > plan.max_rows:
            return None
        decode = [attn.all_decode_args(i) for i in range(len(layers))]
        if any(d is None for d in decode):
            return None
        tiles = h.dtype == torch.bfloat16 and TILE_ROWS[0] <= rows <= TILE_ROWS[1] and cpu_kernels.kquant_tiles_active()
        weights = routers(h.dtype) if routers is not None else [h] * len(layers)
        return plan.run(h, cos, sin, weights, cast(list[DecodeArgs], decode), self.config.head_dim ** -0.5, tiles)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        """The decoder layers (``dense_dtype``: the dense projections' placeholder dtype, None for
        a quantized format: `quant.UnloadedLinear`)."""
        raise NotImplementedError

    def cache_specs(self) -> Sequence[CacheSpec]:
        """What each layer keeps, one spec per layer (`interface.CausalLM.cache_specs`)."""
        raise NotImplementedError

    def _checkpoint_value(self, name: str, value: Tensor) -> Tensor:
        """A non-projection weight as the model keeps it (``value`` as read: the identity here)."""
        return value

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads for one request: every parameter once (tied ones
        once), except that the input embedding contributes only the one row it looks up, and the
        output projection counts as the tensor the logits are computed from (the float32 copy of a
        bf16/fp16 head, where there is one)."""

        def size(t: Tensor) -> int:
            return int(t.numel() * t.element_size())

        embed, head = self.embed_tokens, self.lm_head
        total = sum(size(p) for p in self.parameters() if p is not embed and p is not head)  # tied: once
        if self._embed_blocks is not None:
            total += size(self._embed_blocks.blocks[0])
        elif embed.dim() == 2 and embed.shape[0]:
            total += size(embed[0])  # the lookup reads one row per token
        if self._lm_head_blocks is not None:
            return total + size(self._lm_head_blocks.blocks)
        if self._lm_head_q8 is not None and head.shape[0] == 0:
            return total + sum(size(t) for t in self._lm_head_q8)
        return total + size(self._lm_head_fp32 if self._lm_head_fp32 is not None else head)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings of ``input_ids`` [T] -> [T, hidden_size] in the model dtype."""
        if self._embed_blocks is not None:
            return self._embed_blocks.dequantize_rows(input_ids.to(torch.long).cpu()).to(device=self.device,
                                                                                       dtype=self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, vocab_size] in float32 for hidden states [N, hidden_size] (tensor parallel:
        every rank calls it with the same rows, and every rank gets the whole rows)."""
        if self.parallel is not None:
            return self._final_logits(self.parallel.gather_vocab(
                dense_matmul(hidden.float(), self._head_shard()).float(), self.config.vocab_size))
        return self._final_logits(self._logits(hidden, self.config.vocab_size))

    def compute_logits_prefix(self, hidden: Tensor, rows: int) -> Tensor:
        """float32 logits [N, rows] of the vocabulary's first ``rows`` entries (`interface.PrefixLogitsLM`):
        the output projection's first ``rows`` rows alone, by the kernel `compute_logits` takes for
        them (a GGUF-block or Q8_0 head: the same values, each logit computed alone; a dense head
        without its oneDNN-packed copy, which holds the whole head)."""
        if self.parallel is not None:
            raise NotImplementedError("a tensor-parallel model computes the whole vocabulary's logits")
        if not 0 < rows <= self.config.vocab_size:
            raise ValueError(f"rows must be in 1..{self.config.vocab_size}, got {rows}")
        return self._final_logits(self._logits(hidden, rows))

    def _final_logits(self, logits: Tensor) -> Tensor:
        """The projection's logits as the model gives them: soft-capped (tanh(x / c) * c) where the
        config has a final cap (Gemma 3 and Gemma 4's ``final_logit_softcapping``)."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _logits(self, hidden: Tensor, rows: int) -> Tensor:
        """float32 logits of the output projection's first ``rows`` rows (all: `compute_logits`)."""
        whole = rows == self.config.vocab_size
        if self._lm_head_blocks is not None:
            head = self._lm_head_blocks
            blocks = head.blocks if whole else head.blocks[:rows]
            if tiles_take(hidden) and not cpu_kernels.kquant_pair_before_tiles(hidden.shape[0], head.ggml_type):
                return cpu_kernels.kquant_linear_tiles(hidden, blocks, head.ggml_type, rows, float_out=True)
            # float32 logits from bfloat16 rows without widening them first (the pair dot path)
            x = hidden if hidden.dtype in (torch.float32, torch.bfloat16) else hidden.float()
            return cpu_kernels.kquant_linear(x.contiguous(), blocks, head.ggml_type, rows, float_out=True)
        if self._lm_head_q8 is not None:
            codes, scales = self._lm_head_q8 if whole else (self._lm_head_q8[0][:rows], self._lm_head_q8[1][:rows])
            packed = self._lm_head_q8_bf16
            if packed is not None and not whole:  # its 16-output tiles that hold the rows
                tiles = -(-rows // 16)
                packed = (packed[0][:tiles], packed[1][:tiles], rows)
            if (packed is not None and hidden.dtype == torch.bfloat16
                    and hidden.shape[0] >= Q8_EXACT_AMX_ROWS and cpu_kernels.kquant_tiles_active()
                    and cpu_kernels.kquant_tiles_backend() == "amx"):
                return cpu_kernels.q8_linear_tiles(hidden.contiguous(), codes, scales, exact=True)
            if packed is not None and hidden.dtype == torch.bfloat16 and hidden.shape[0] >= Q8_BF16_ROWS:
                return cpu_kernels.q8_linear_bf16(hidden, *packed)
            if self.weight_format.keep_blocks and tiles_take(hidden):  # codes alone (`pack_cpu_weights`)
                return cpu_kernels.q8_linear_tiles(hidden, codes, scales)
            return cpu_kernels.q8_linear(hidden, codes, scales)
        if self._lm_head_fp32 is not None:
            if whole:
                return dense_matmul(hidden.float(), self._lm_head_fp32, self._lm_head_onednn)
            return dense_matmul(hidden.float(), self._lm_head_fp32[:rows], None)
        if whole:
            return dense_matmul(hidden, self.lm_head, self._lm_head_onednn).float()
        return dense_matmul(hidden, self.lm_head[:rows], None).float()

    def _head_shard(self) -> Tensor:
        """A tensor-parallel rank's rows of the output projection (float32 where the model keeps a
        float32 copy): the untied head's own shard, or its rows of the tied embedding."""
        if self._lm_head_fp32 is not None:
            return self._lm_head_fp32
        if not self.config.tie_word_embeddings:
            return self.lm_head.detach()
        assert self.parallel is not None
        lo, hi, _ = self.parallel.vocab_range(self.config.vocab_size)
        return self.embed_tokens.detach()[lo:hi]

    def pack_cpu_weights(self) -> int:
        """Once the weights are loaded (CPU): give every dense projection, and the float32 output
        projection, a oneDNN-packed copy where oneDNN's prepacked linear is faster here
        (`quant.pack_onednn`); give a Q8_0 head of a bfloat16 model its `q8_linear_bf16` layout where
        the CPU has AVX512-BF16. Returns how many tensors were packed. Loading weights again drops them."""
        # A keep_blocks model (memory first) keeps its Q8_0 head's codes alone: the bfloat16 layout is
        # twice their bytes (272 MB for a 151,936 x 896 head) and only serves steps of 8 or more rows.
        keep_q8_only = self.weight_format.keep_blocks
        self._lm_head_q8_bf16 = None if keep_q8_only else packing.q8_bf16_layout(self._lm_head_q8, self.dtype)
        count = int(self._lm_head_q8_bf16 is not None)
        count += packing.pack_projections_onednn(self._decoder_layers(), layer_projections)
        for layer in self._decoder_layers():
            layer.find_fused_decode()
        head = self._lm_head_fp32 if self._lm_head_fp32 is not None else self.lm_head.detach()
        if self._lm_head_q8 is None and self._lm_head_blocks is None and self.parallel is None:
            self._lm_head_onednn = packing.pack_head_onednn(head)
            count += int(self._lm_head_onednn is not None)
        return count

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """Build the parameters from Hugging Face-named weights: dense tensors (converted to the
        target dtype) or `GroupQuantized` codes (kept as codes where the weight format allows, else
        dequantized). Each fused projection is built once all its parts are read.

        Every expected tensor must be present, except ``lm_head.weight`` when the embeddings are tied
        (then an ``lm_head.weight`` is ignored, as transformers does). Unknown names raise.
        """
        cfg = self.config
        if self.parallel is not None:
            tensors = ShardedWeights(tensors, self.full_config, self.parallel)
        self._lm_head_onednn = None
        self._lm_head_q8_bf16 = None
        self._embed_blocks = None
        self._lm_head_blocks = None
        blocks: dict[str, BlockQuantized] = {}  # keep_blocks: the embedding's / head's blocks
        loaded: set[str] = set()
        unexpected: list[str] = []
        targets = self._weight_targets()
        shapes = self._projection_shapes()
        pending: dict[tuple[int, str], list[BuildSource | None]] = {}
        layers = self._decoder_layers()
        with torch.no_grad():
            for name in tensors:
                if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                target = targets.get(name)
                slot = shapes.get(name)
                if target is None and slot is None:
                    unexpected.append(name)
                    continue
                value = tensors[name]  # read (lazily, for checkpoints) only what is used
                expected = tuple(target.shape) if target is not None else slot[2]  # type: ignore[index]
                if name in self._blocks_names():
                    expected = (cfg.vocab_size, cfg.hidden_size)
                if tuple(value.shape) != expected:
                    raise ValueError(f"{name}: expected shape {expected}, got {tuple(value.shape)}")
                loaded.add(name)
                kept = self._as_blocks(name, value)
                if kept is not None:
                    blocks[name] = kept
                    continue
                if target is not None:
                    if target.shape[0] == 0:  # emptied by a previous load that kept blocks
                        target = self._restore_dense(name)
                    q8_head = name == self._head_name() and self._wants_q8_head and packing.is_q8_0(value)
                    if q8_head:
                        assert isinstance(value, GroupQuantized)
                        self._lm_head_q8 = packing.q8_codes(value)
                        if name in self._blocks_names() and not cfg.tie_word_embeddings:
                            continue  # keep_blocks: the codes alone (`_install_blocks` empties lm_head)
                    dense = dense_of(value)
                    dense = self._checkpoint_value(name, dense)
                    target.copy_(dense)
                    if q8_head:
                        pass
                    elif self._wants_lm_head_fp32 and name == self._head_name():
                        if self.parallel is not None and cfg.tie_word_embeddings:  # this rank's rows
                            lo, hi, _ = self.parallel.vocab_range(cfg.vocab_size)
                            dense = dense[lo:hi]
                        self._lm_head_fp32 = dense.to(device=self.device, dtype=torch.float32, copy=True)
                    continue
                layer_idx, attr, _, index, count = slot  # type: ignore[misc]
                parts = pending.setdefault((layer_idx, attr), [None] * count)
                parts[index] = value
                if all(p is not None for p in parts):
                    del pending[(layer_idx, attr)]
                    module = build_linear([p for p in parts if p is not None], self.weight_format, self.dtype)
                    layers[layer_idx].set_projection(attr, module.to(self.device))
        if unexpected:
            raise ValueError(f"unexpected weights: {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
        missing = sorted((set(targets) | set(shapes)) - loaded)
        if missing:
            raise ValueError(f"missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        for layer in layers:
            layer.finish_loading()
        self._install_blocks(blocks)
        if self.parallel is not None and self._wants_lm_head_fp32 and self._lm_head_fp32 is None:
            self._lm_head_fp32 = self._head_shard().float()  # this rank's rows only
        if (self._wants_lm_head_fp32 and self._lm_head_fp32 is None and self._lm_head_q8 is None
                and self._lm_head_blocks is None):
            self._lm_head_fp32 = self.lm_head.detach().float()

    def _blocks_names(self) -> tuple[str, ...]:
        """The weights a ``keep_blocks`` format may keep as blocks: the embedding and the head."""
        if not self.weight_format.keep_blocks:
            return ()
        return ("model.embed_tokens.weight",) if self.config.tie_word_embeddings else \
            ("model.embed_tokens.weight", "lm_head.weight")

    def _as_blocks(self, name: str, value: BuildSource) -> BlockQuantized | None:
        """``value`` as the blocks to keep for the embedding or head ``name`` (None: load it dense).
        A Q8_0 head the model multiplies with `cpu_kernels.q8_linear` (``q8_head``) stays on that
        path; a tied Q8_0 embedding then stays dense (the q8 head needs its codes, the lookup a
        dense table)."""
        if name not in self._blocks_names() or not cpu_kernels.available() or self.device.type != "cpu":
            return None
        q8 = packing.is_q8_0(value)
        if q8 and self._wants_q8_head and name == self._head_name():
            return None
        if isinstance(value, BlockQuantized):
            return value
        if q8:
            assert isinstance(value, GroupQuantized)
            return q8_0_blocks(value)
        return None

    def _install_blocks(self, blocks: Mapping[str, BlockQuantized]) -> None:
        """Keep the embedding's and head's blocks (`_as_blocks`), emptying their dense parameters."""
        hidden = self.config.hidden_size
        embed = blocks.get("model.embed_tokens.weight")
        head = embed if self.config.tie_word_embeddings else blocks.get("lm_head.weight")
        if embed is not None:
            self._embed_blocks = embed
            self.embed_tokens = param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))
            if self.config.tie_word_embeddings:
                self.lm_head = self.embed_tokens
        if head is not None:
            self._lm_head_blocks = head
            self._lm_head_fp32 = None
            if not self.config.tie_word_embeddings:
                self.lm_head = param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))
        elif self.weight_format.keep_blocks and self._lm_head_q8 is not None and not self.config.tie_word_embeddings:
            # A q8 head needs no dense copy (the engine reads logits from the codes).
            self.lm_head = param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))

    def _restore_dense(self, name: str) -> Tensor:
        """A full-size dense parameter again for ``name`` (the embedding or head), after an emptied one."""
        cfg = self.config
        fresh = param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, device=self.device))
        if name == "model.embed_tokens.weight":
            self.embed_tokens = fresh
            if cfg.tie_word_embeddings:
                self.lm_head = fresh
        else:
            self.lm_head = fresh
        return fresh

    @property
    def embed_format(self) -> str:
        """How token embeddings are held: ``<type> blocks`` (looked up from the GGUF blocks) or the dtype."""
        if self._embed_blocks is not None:
            return f"{self._embed_blocks.name} blocks"
        return str(self.embed_tokens.dtype).removeprefix("torch.")

    @property
    def head_format(self) -> str:
        """How logits are computed: ``q8_0`` (the checkpoint's codes, `cpu_kernels.q8_linear`),
        ``<type> blocks`` (`cpu_kernels.kquant_linear`, float32), ``float32`` (a float32 copy) or the
        weight dtype's name."""
        if self._lm_head_blocks is not None:
            return f"{self._lm_head_blocks.name} blocks"
        if self._lm_head_q8 is not None:
            return "q8_0"
        if self._lm_head_fp32 is not None:
            return "float32"
        return str(self.lm_head.dtype).removeprefix("torch.")

    @property
    def head_bf16_rows(self) -> int | None:
        """From how many rows the Q8_0 head takes `q8_linear_bf16` (None: it never does here)."""
        return Q8_BF16_ROWS if self._lm_head_q8_bf16 is not None else None

    def packed_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The loaded weights as stored (packed int4, int8, dense copies, norms, embeddings) and the
        kind of module each projection is, for `load_packed_state`."""
        layers = self._decoder_layers()
        kinds = packing.projection_kinds(layers, layer_projections)
        state = self._stored_state()
        state.update(packing.dropped_dense_copies(layers, layer_projections))  # `pack_onednn` dropped them
        if self._lm_head_fp32 is not None:
            state[LM_HEAD_FP32] = self._lm_head_fp32
        if self._lm_head_q8 is not None:
            state.update(zip(LM_HEAD_Q8, self._lm_head_q8, strict=True))
        for key, kept in ((EMBED_BLOCKS, self._embed_blocks), (LM_HEAD_BLOCKS, self._lm_head_blocks)):
            if kept is not None:
                state[key] = kept.blocks
                kinds[key] = f"blocks:{kept.ggml_type}:{kept.shape[0]}:{kept.shape[1]}"
        if self.lm_head.shape[0] == 0 and LM_HEAD_BLOCKS not in kinds:
            kinds[LM_HEAD_BLOCKS] = "empty"  # a keep_blocks model's untied Q8_0 head: the codes alone
        return state, kinds

    def load_packed_state(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None:
        """Restore what `packed_state` returned (from a model of the same config, dtype and format)."""
        self._lm_head_onednn = None
        self._lm_head_q8_bf16 = None
        self._restore_blocks(state, kinds)
        layers = self._decoder_layers()
        for layer, modules in zip(layers, packing.restore_projections(layers, layer_projections, state, kinds),
                                  strict=True):
            for attr, module in zip(layer_projections(layer), modules, strict=True):
                layer.set_projection(attr, module)
        expected = set(self._stored_state())
        expected.update(key for key in (EMBED_BLOCKS, LM_HEAD_BLOCKS) if kinds.get(key, "empty") != "empty")
        q8 = self._wants_q8_head and all(name in state for name in LM_HEAD_Q8)
        if q8:
            expected.update(LM_HEAD_Q8)
        elif self._wants_lm_head_fp32 and self._lm_head_blocks is None:  # a head kept as blocks has no copy
            expected.add(LM_HEAD_FP32)
        if set(state) != expected:
            raise ValueError(f"packed state does not match the model: missing {sorted(expected - set(state))[:4]}, "
                             f"unexpected {sorted(set(state) - expected)[:4]}")
        with torch.no_grad():
            for name, target in self._stored_state(keep_vars=True).items():
                if target.data_ptr() != state[name].data_ptr():
                    target.copy_(state[name])
        if q8:
            codes, scales = (state[name] for name in LM_HEAD_Q8)
            self._lm_head_q8 = (codes.contiguous(), scales.contiguous())
        elif self._wants_lm_head_fp32 and self._lm_head_blocks is None:
            self._lm_head_fp32 = state[LM_HEAD_FP32].to(self.device)
        for layer in self._decoder_layers():
            layer.finish_loading()

    def _restore_blocks(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None:
        """The embedding's and head's blocks of a packed state (`packed_state`), or full-size dense
        parameters again where the state has none."""
        self._embed_blocks = None
        self._lm_head_blocks = None
        kept: dict[str, BlockQuantized] = {}
        for key, name in ((EMBED_BLOCKS, "model.embed_tokens.weight"), (LM_HEAD_BLOCKS, "lm_head.weight")):
            kind = kinds.get(key, "")
            if kind.startswith("blocks:"):
                ggml_type, rows, cols = (int(v) for v in kind.split(":")[1:])
                kept[name] = BlockQuantized(state[key], ggml_type, (rows, cols))
        if self.embed_tokens.shape[0] == 0 and "model.embed_tokens.weight" not in kept:
            self._restore_dense("model.embed_tokens.weight")
        if self.lm_head.shape[0] == 0 and "lm_head.weight" not in kept and kinds.get(LM_HEAD_BLOCKS) != "empty":
            self._restore_dense("lm_head.weight")
        if kinds.get(LM_HEAD_BLOCKS) == "empty" and not self.config.tie_word_embeddings:
            self.lm_head = param(torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device))
        self._install_blocks(kept)

    def _stored_state(self, keep_vars: bool = False) -> dict[str, Tensor]:
        """state_dict without empty entries and without the tied head (the embedding holds it)."""
        return packing.stored_state(self, tied_head=self.config.tie_word_embeddings, keep_vars=keep_vars)

    def _placeholder_dtype(self) -> torch.dtype | None:
        """The dtype of the projections before loading: a dense format's, else None (none)."""
        fmt = self.weight_format
        return (fmt.dtype or self.dtype) if fmt.kind == "dense" else None

    def _head_name(self) -> str:
        return "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    def _weight_targets(self) -> dict[str, Tensor]:
        """Hugging Face name -> the (view of the) parameter it fills, for everything but the projections."""
        targets: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self._decoder_layers()):
            for suffix, view in layer.weight_targets().items():
                targets[f"model.layers.{i}.{suffix}"] = view
        return targets

    def _projection_shapes(self) -> dict[str, tuple[int, str, tuple[int, int], int, int]]:
        """Hugging Face name -> (layer, projection attribute, shape, part index, number of parts)."""
        out: dict[str, tuple[int, str, tuple[int, int], int, int]] = {}
        for i, layer in enumerate(self._decoder_layers()):
            for attr, parts in layer.projection_parts().items():
                for index, (suffix, shape) in enumerate(parts):
                    out[f"model.layers.{i}.{suffix}"] = (i, attr, shape, index, len(parts))
        return out

    def _decoder_layers(self) -> Sequence[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]


def layer_projections(layer: nn.Module) -> tuple[str, ...]:
    """The projection attributes of a `DecoderLayer` (`DecoderLayer.projection_parts`)."""
    return tuple(cast(DecoderLayer, layer).projection_parts())


def param(tensor: Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, fused: bool) -> tuple[Tensor, Tensor]:
    """``(s, rms_norm(s))`` for the residual stream ``s = h + delta`` (``h`` when delta is None)."""
    if fused and h.is_contiguous() and (delta is None or delta.is_contiguous()):
        return cpu_kernels.add_rms_norm(h, delta, weight, eps)
    s = h if delta is None else h + delta
    return s, rms_norm(s, weight, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32; ``weight`` is float32 and broadcastable."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX (rotate-half) RoPE on [T, heads, head_dim] with tables from `rope_tables`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)




def rope_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sign-folded sin, [T, 1, head_dim], so that rope(x) = x*cos + roll(x, d/2)*sin."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = freqs.cos()
    sin = freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((-sin, sin), dim=-1)
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def broadcast_qk_norm(qk_norm: Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Copy the q norm (row 0) and k norm (row ``num_heads``) of a [num_heads + num_kv_heads,
    head_dim] q/k norm weight to every q and k head row."""
    with torch.no_grad():
        qk_norm[1:num_heads].copy_(qk_norm[0].expand(num_heads - 1, -1))
        qk_norm[num_heads + 1 :].copy_(qk_norm[num_heads].expand(num_kv_heads - 1, -1))
