"""One decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

The model sees a flat batch: the tokens of several sequences concatenated into ``T`` rows, each with
its absolute position. Attention across the rows of one sequence is the job of an `AttentionBackend`
(the engine's paged backend, or `helios.models.dense_attention.DenseAttention` for one sequence).

Layout choices for CPU speed: q/k/v are one matmul and gate/up another (weights concatenated at load
time); RoPE is applied to q and k in one pass, with cos/sin computed once per forward from the
positions. RMSNorm runs in float32 whatever the weight dtype, and so do the logits (the output
projection keeps a float32 copy for bf16/fp16 weights unless ``lm_head_fp32=False``).

The projections' storage is a `helios.models.quant.WeightFormat`: dense in the model dtype by default,
or grouped int4 / per-channel int8 (with an optional dense copy for large steps). `load_weights` takes
dense tensors or `GroupQuantized` codes (GGUF Q4_0/Q4_1/Q8_0 blocks) and builds each fused projection
in that format; `packed_state` / `load_packed_state` save and restore the built tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels, packing
from helios.models.architecture import Architecture, ArchitectureConfig, BuildOptions, GGUFSource, GGUFTensor
from helios.models.config import LLAMA_FAMILY, ROPE_FREQS, ModelConfig, config_from_gguf, rope_inv_freq
from helios.models.dense import dense_matmul
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec
from helios.models.kquant import BlockQuantized
from helios.models.packing import LM_HEAD_FP32, LM_HEAD_Q8
from helios.models.packing import Q8_BF16_ROWS as Q8_BF16_ROWS  # re-exported: compute_logits' threshold
from helios.models.quant import (
    BuildSource,
    DenseLinear,
    GroupQuantized,
    UnloadedLinear,
    WeightFormat,
    build_linear,
    dense_of,
    q8_0_blocks,
)

EMBED_BLOCKS = "embed_blocks"  # a keep_blocks model's token embedding blocks, in a packed state
LM_HEAD_BLOCKS = "lm_head_blocks"  # its output projection's blocks ("empty" kind: an untied Q8_0 head's codes alone)
__all__ = ["PROJECTIONS", "Q8_BF16_ROWS", "LlamaForCausalLM", "rope_inv_freq"]
# The fused projections of a decoder layer: attribute -> the Hugging Face weight names (suffixes of
# "model.layers.{i}.") that make up its row blocks, in order.
PROJECTIONS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


class LlamaForCausalLM(nn.Module):
    inv_freq: Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        """``dtype``: activations, norms' outputs, embeddings and the KV cache; dense projections
        too unless ``weights`` says otherwise (default: dense in ``dtype``). ``lm_head_fp32``: with
        bf16/fp16 weights, keep a float32 copy of the output projection, made from the checkpoint's
        own values (not from the rounded copy), so logits are neither rounded to the weight dtype nor
        computed from rounded weights. Rounding matters: bf16 logits near 25 are multiples of 0.125,
        which turns the default model's first-token near tie into an exact one (and the wrong answer).
        It costs a float32 vocab x hidden matrix of memory and its bandwidth each step; with False,
        logits are computed in the weight dtype and upcast.

        ``q8_head``: when the checkpoint's output projection is a ggml Q8_0 weight (the default model's
        tied embedding is), keep its int8 codes and block scales and compute logits with
        `cpu_kernels.q8_linear`: the same float32 weights and float32 accumulation as the float32
        copy, from a quarter of the bytes (the copy is then not made). CPU only; the caller checks
        that the kernels are built."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.weight_format = weights or WeightFormat()
        self.softmax_scale = config.head_dim ** -0.5
        self.embed_tokens = _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(
            _DecoderLayer(config, i, dtype, torch.device(device), self._placeholder_dtype())
            for i in range(config.num_layers)
        )
        self.norm = _param(torch.ones(config.hidden_size, dtype=torch.float32, device=device))
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
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

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Every layer keeps full-attention K/V (a sliding window in the config is not applied)."""
        spec = FullAttentionSpec(self.config.num_kv_heads, self.config.head_dim)
        return (spec,) * self.config.num_layers

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

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, [T, hidden_size], for flat ``input_ids``/``positions`` [T].

        ``embeds = (rows, features)``: rows (1-D long, indices into the T flattened tokens) take the
        given features ([len(rows), hidden_size], the model dtype) in place of their token embeddings
        before layer 0 (image features at their placeholder tokens; `helios.models.vision`).

        ``keep`` (1-D long, indices into the T tokens): only these rows' hidden states are wanted
        (those that get logits), returned in that order, [len(keep), hidden_size]. Every token still
        goes through every layer up to the last one's attention (their K/V are written to the cache),
        but the last layer's o projection, norm and MLP, and the final norm, run for the kept rows only:
        a 512-token prompt's first token needs one row of them, not 512. Each row's values are its
        own (attention, projections and norms are row by row), though a projection may pick another
        kernel for fewer rows."""
        cos, sin = self._rope_tables(positions)
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        i = 0
        while i < len(layers):
            # An all-decode step: each run of layers with one fused projection kind is one operator.
            run = layers[i].fused_decode(h.shape[0], attn) if fused else None
            if run is None:
                last = i == len(layers) - 1
                h, delta = layers[i](h, delta, cos, sin, attn, fused, keep=keep if last else None)
                keep = None if last else keep  # the last layer applied it
                i += 1
                continue
            runs = [run]
            while i + len(runs) < len(layers):
                more = layers[i + len(runs)].fused_decode(h.shape[0], attn)
                if more is None or more[0].group != run[0].group:
                    break
                runs.append(more)
            first = layers[i]
            h, delta = cpu_kernels.decode_layers(h, delta, [r[0] for r in runs], [r[1] for r in runs], cos, sin,
                                                 first.eps, first.num_heads, first.num_kv_heads)
            i += len(runs)
        if keep is not None:  # the last layer ran inside a fused run (an all-decode step)
            h, delta = h.index_select(0, keep), cast(Tensor, delta).index_select(0, keep)
        if h.shape[0] == 0:
            return h
        return _add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps, fused)[1]

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings of ``input_ids`` [T] -> [T, hidden_size] in the model dtype."""
        if self._embed_blocks is not None:
            return self._embed_blocks.dequantize_rows(input_ids.to(torch.long).cpu()).to(device=self.device,
                                                                                       dtype=self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, vocab_size] in float32 for hidden states [N, hidden_size]."""
        if self._lm_head_blocks is not None:
            head = self._lm_head_blocks
            return cpu_kernels.kquant_linear(hidden.float().contiguous(), head.blocks, head.ggml_type, head.shape[0])
        if self._lm_head_q8 is not None:
            if self._lm_head_q8_bf16 is not None and hidden.dtype == torch.bfloat16 and hidden.shape[0] >= Q8_BF16_ROWS:
                return cpu_kernels.q8_linear_bf16(hidden, *self._lm_head_q8_bf16)
            return cpu_kernels.q8_linear(hidden, *self._lm_head_q8)
        if self._lm_head_fp32 is not None:
            return dense_matmul(hidden.float(), self._lm_head_fp32, self._lm_head_onednn)
        return dense_matmul(hidden, self.lm_head, self._lm_head_onednn).float()

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
        count += packing.pack_projections_onednn(self._decoder_layers(), tuple(PROJECTIONS))
        for layer in self._decoder_layers():
            layer.find_fused_decode()
        head = self._lm_head_fp32 if self._lm_head_fp32 is not None else self.lm_head.detach()
        if self._lm_head_q8 is None:
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
                    target.copy_(dense)
                    if q8_head:
                        pass
                    elif self._wants_lm_head_fp32 and name == self._head_name():
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
            self.embed_tokens = _param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))
            if self.config.tie_word_embeddings:
                self.lm_head = self.embed_tokens
        if head is not None:
            self._lm_head_blocks = head
            self._lm_head_fp32 = None
            if not self.config.tie_word_embeddings:
                self.lm_head = _param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))
        elif self.weight_format.keep_blocks and self._lm_head_q8 is not None and not self.config.tie_word_embeddings:
            # A q8 head needs no dense copy (the engine reads logits from the codes).
            self.lm_head = _param(torch.empty(0, hidden, dtype=self.dtype, device=self.device))

    def _restore_dense(self, name: str) -> Tensor:
        """A full-size dense parameter again for ``name`` (the embedding or head), after an emptied one."""
        cfg = self.config
        fresh = _param(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, device=self.device))
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
        kinds = packing.projection_kinds(layers, tuple(PROJECTIONS))
        state = self._stored_state()
        state.update(packing.dropped_dense_copies(layers, tuple(PROJECTIONS)))  # `pack_onednn` dropped them
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
        for layer, modules in zip(layers, packing.restore_projections(layers, tuple(PROJECTIONS), state, kinds),
                                  strict=True):
            for attr, module in zip(PROJECTIONS, modules, strict=True):
                layer.set_projection(attr, module)
        expected = set(self._stored_state())
        expected.update(key for key in (EMBED_BLOCKS, LM_HEAD_BLOCKS) if kinds.get(key, "empty") != "empty")
        q8 = self._wants_q8_head and all(name in state for name in LM_HEAD_Q8)
        if q8:
            expected.update(LM_HEAD_Q8)
        elif self._wants_lm_head_fp32:
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
            self.lm_head = _param(torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device))
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
        cfg = self.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        part_shapes = {
            "self_attn.q_proj.weight": (cfg.q_size, hidden), "self_attn.k_proj.weight": (cfg.kv_size, hidden),
            "self_attn.v_proj.weight": (cfg.kv_size, hidden), "self_attn.o_proj.weight": (hidden, cfg.q_size),
            "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        out: dict[str, tuple[int, str, tuple[int, int], int, int]] = {}
        for i in range(cfg.num_layers):
            for attr, suffixes in PROJECTIONS.items():
                for index, suffix in enumerate(suffixes):
                    out[f"model.layers.{i}.{suffix}"] = (i, attr, part_shapes[suffix], index, len(suffixes))
        return out

    def _decoder_layers(self) -> list[_DecoderLayer]:
        return [cast(_DecoderLayer, layer) for layer in self.layers]

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim], so that rope(x) = x*cos + roll(x, d/2)*sin."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.intermediate_size = config.intermediate_size
        hidden = config.hidden_size
        qkv_rows = config.q_size + 2 * config.kv_size

        def empty(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return _param(torch.empty(*shape, dtype=dt, device=device))

        self.input_norm = empty(hidden, dt=torch.float32)
        # The projections (PROJECTIONS) are built by load_weights in the model's weight format; dense
        # formats start with uninitialised dense parameters (so a model can also be filled in place).
        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.qkv_proj: nn.Module = projection(qkv_rows, hidden)
        self.o_proj: nn.Module = projection(hidden, config.q_size)
        self.gate_up_proj: nn.Module = projection(2 * config.intermediate_size, hidden)
        self.down_proj: nn.Module = projection(hidden, config.intermediate_size)
        self.qkv_bias = empty(qkv_rows) if config.attention_bias else None
        # One weight for q and k heads side by side: [num_heads + num_kv_heads, head_dim].
        self.qk_norm = empty(config.num_heads + config.num_kv_heads, config.head_dim, dt=torch.float32) \
            if config.qk_norm else None
        self.post_attention_norm = empty(hidden, dt=torch.float32)
        # find_fused_decode: the one-operator decode layers' weights and the step sizes they serve.
        self._int4: cpu_kernels.FusedLayer | None = None
        self._int4_rows = 0
        self._onednn: cpu_kernels.FusedLayer | None = None
        self._onednn_above = 0

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One decoder layer on the residual stream ``h`` plus the previous layer's MLP output ``delta``
        (None before layer 0): returns the stream after attention and this layer's MLP output, so the
        next residual add is fused with the next norm. ``fused``: Helios's CPU kernels do the residual
        add + RMSNorm, the rotary embedding and the SwiGLU activation (`models/cpu_kernels.py`).
        ``keep``: after attention (every token's K/V written, every token attended), only these rows
        go on; both results have len(keep) rows (none: the MLP is skipped).
        (In an all-decode step the model runs the layers `fused_decode` offers as one operator
        instead: the same operators in the same order.)"""
        num_tokens = h.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        h, x = _add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = _rms_norm(qk, self.qk_norm, self.eps)
        qk = cpu_kernels.rope_(qk, cos, sin) if fused else _apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v)
        if keep is not None:
            num_tokens = keep.shape[0]
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if num_tokens == 0:
                return h, h
        h, x = _add_rms_norm(h, self.o_proj(out.reshape(num_tokens, self.q_size)), self.post_attention_norm,
                             self.eps, fused)
        gate_up = self.gate_up_proj(x)
        if fused:
            return h, self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return h, self.down_proj(F.silu(gate).mul_(up))

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in PROJECTIONS:
            raise KeyError(attr)
        setattr(self, attr, module)
        self._int4 = None  # until finish_loading looks at the new set
        self._onednn = None

    def fused_decode(self, num_tokens: int, attn: AttentionContext) -> tuple[cpu_kernels.FusedLayer,
                                                                              cpu_kernels.DecodeArgs] | None:
        """This layer as `cpu_kernels.decode_layers` runs it, for an all-decode step of ``num_tokens``
        rows whose attention offers `all_decode_args`: its weights (int4 up to ``_int4_rows`` rows,
        oneDNN-packed above ``_onednn_above``) and its decode arguments; None where it does not apply."""
        if self._int4 is not None and num_tokens <= self._int4_rows:
            layer = self._int4
        elif self._onednn is not None and num_tokens > self._onednn_above:
            layer = self._onednn
        else:
            return None
        args = attn.all_decode_args(self.layer_idx)
        return (layer, args) if args is not None else None

    def find_fused_decode(self) -> None:
        """Where the one-operator decode layers apply (no q/k/v bias, no q/k norm):
        ``_int4`` (packed weights and scales in PROJECTIONS order, and the group size) when every
        projection is int4 with one group size, for steps of up to ``_int4_rows`` rows (above those,
        a dense copy answers); ``_onednn`` (the four oneDNN-packed weights) when every projection
        multiplies through one (`quant.pack_onednn`) for steps of more than ``_onednn_above`` rows.
        Called by `finish_loading` and after packing."""
        self._int4 = None
        self._onednn = None
        mods = [getattr(self, attr) for attr in PROJECTIONS]
        if self.qkv_bias is not None or self.qk_norm is not None:
            return
        int4 = packing.fused_int4_layer(mods, self.input_norm, self.post_attention_norm)
        if int4 is not None:
            self._int4, self._int4_rows = int4
        onednn = packing.fused_onednn_layer(mods, self.input_norm, self.post_attention_norm)
        if onednn is not None:
            self._onednn, self._onednn_above = onednn

    def weight_targets(self) -> dict[str, Tensor]:
        """Hugging Face suffix -> parameter (view) for the norms and biases (not the projections)."""
        q, kv = self.q_size, self.kv_size
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
        }
        if self.qkv_bias is not None:
            targets["self_attn.q_proj.bias"] = self.qkv_bias[:q]
            targets["self_attn.k_proj.bias"] = self.qkv_bias[q : q + kv]
            targets["self_attn.v_proj.bias"] = self.qkv_bias[q + kv :]
        if self.qk_norm is not None:
            # Loaded into the first q row and first k row; finish_loading() broadcasts them.
            targets["self_attn.q_norm.weight"] = self.qk_norm[0]
            targets["self_attn.k_norm.weight"] = self.qk_norm[self.num_heads]
        return targets

    def finish_loading(self) -> None:
        self.find_fused_decode()
        if self.qk_norm is not None:
            with torch.no_grad():
                self.qk_norm[1 : self.num_heads].copy_(self.qk_norm[0].expand(self.num_heads - 1, -1))
                self.qk_norm[self.num_heads + 1 :].copy_(
                    self.qk_norm[self.num_heads].expand(self.num_kv_heads - 1, -1)
                )


def _param(tensor: Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, fused: bool) -> tuple[Tensor, Tensor]:
    """``(s, rms_norm(s))`` for the residual stream ``s = h + delta`` (``h`` when delta is None)."""
    if fused and h.is_contiguous() and (delta is None or delta.is_contiguous()):
        return cpu_kernels.add_rms_norm(h, delta, weight, eps)
    s = h if delta is None else h + delta
    return s, _rms_norm(s, weight, eps)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32; ``weight`` is float32 and broadcastable."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX (rotate-half) RoPE on [T, heads, head_dim] with tables from `_rope_tables`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)



# -- weight names and registry entries -------------------------------------------------------------------

# llama.cpp's GGUF tensor names -> the Hugging Face names `load_weights` takes.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


def gguf_to_hf_name(gguf_name: str) -> str:
    """A llama-family GGUF tensor's Hugging Face name (NotImplementedError for names it has none for)."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in GGUF_LAYER_NAMES:
        raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"


def gguf_tensor(config: ArchitectureConfig, gguf_name: str, *, interleaved_rotary: bool) -> GGUFTensor | None:
    """Where a GGUF tensor goes; llama.cpp's ``llama`` files store q/k rows in interleaved rotary
    order (``interleaved_rotary``), which are put back into the rotate-half order `forward` uses."""
    if gguf_name == ROPE_FREQS:
        return None  # read into the config's rope scaling
    name = gguf_to_hf_name(gguf_name)
    if interleaved_rotary:
        assert isinstance(config, ModelConfig)
        if ".self_attn.q_proj." in name:
            return GGUFTensor(name, config.num_heads)
        if ".self_attn.k_proj." in name:
            return GGUFTensor(name, config.num_kv_heads)
    return GGUFTensor(name)


def build(config: ArchitectureConfig, options: BuildOptions) -> LlamaForCausalLM:
    assert isinstance(config, ModelConfig), type(config)
    return LlamaForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                            q8_head=options.q8_head)


def _gguf_config(arch: str) -> partial[ModelConfig]:
    return partial(_config_from_gguf, arch=arch)


def _config_from_gguf(source: GGUFSource, *, arch: str) -> ModelConfig:
    return config_from_gguf(source, arch)


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}
# GGUF general.architecture per variant (llama.cpp writes Mistral checkpoints as "llama"); only
# "llama" files interleave the q/k rotary rows.
_GGUF_ARCHITECTURES = {"llama": ("llama",), "mistral": (), "qwen2": ("qwen2",), "qwen3": ("qwen3",)}

ARCHITECTURES = tuple(
    Architecture(
        name=variant,
        hf_model_types=(variant,),
        hf_architectures=(_HF_ARCHITECTURES[variant],),
        gguf_architectures=_GGUF_ARCHITECTURES[variant],
        config_from_hf=ModelConfig.from_hf_config,
        config_from_gguf=_gguf_config(variant) if _GGUF_ARCHITECTURES[variant] else None,
        gguf_tensor=partial(gguf_tensor, interleaved_rotary=variant == "llama") if _GGUF_ARCHITECTURES[variant] else None,
        build=build,
    )
    for variant in LLAMA_FAMILY
)
"""The llama family's registry entries (`helios.models.registry`): one per variant."""
