"""Multi-token prediction (MTP) layers: a checkpoint's next-token-prediction module, as a drafter.

DeepSeek-V3 (and the checkpoints that share its layout: DeepSeek-V3.2, GLM-5's ``glm_moe_dsa``,
GLM-4.5 / 4.6's ``glm4_moe``) carry ``num_nextn_predict_layers`` modules after the decoder, each
under ``model.layers.{N + i}`` (N = ``num_hidden_layers``; transformers does not load them, nor does
the family's own module here). One module has

- ``enorm``, ``hnorm``: RMSNorms (the model's ``rms_norm_eps``) of the next token's embedding and of
  a hidden state;
- ``eh_proj``: a [hidden, 2 * hidden] projection of their concatenation, embedding first;
- one decoder block of the family's kind (its attention, its MoE or dense feed-forward, its
  norms), with a KV cache of its own;
- ``shared_head.norm`` and ``shared_head.head``: the output norm and head; ``embed_tokens``: the
  embedding. The DeepSeek-V3 report defines the embedding and the head as shared with the main
  model, and the released checkpoints store copies of the model's: the predictor uses the model's
  own (`MultiTokenPredictor.compute_logits`, ``embed``), and the loader checks that a stored copy
  equals the model's where the model keeps them as dense tensors (a differing one is refused).

For position p the predictor reads the model's hidden state at p (after the final norm: what the
model's forward returns, as vLLM and SGLang pass it) and the embedding of token p + 1, and its
output at p predicts token p + 2:
``g_p = shared_head.norm(block(eh_proj([enorm(embed(t[p+1])); hnorm(h_p)])))``,
``logits = head(g_p)``. As in vLLM's ``deepseek_mtp``, the embedding at position 0 is zeroed.
A draft deeper than one reuses the module on its own output: position p + 1 reads ``g_p`` as its
hidden state and the draft it predicted as its token (vLLM feeds the block's output before
``shared_head.norm`` there; Helios feeds ``g_p``, the normed output, as SGLang does, so the module
always reads a normed hidden state, the kind the model gives it).

GGUF files: llama.cpp's converters append the modules as blocks ``blk.{N + i}`` (``block_count``
counts them, ``nextn_predict_layers`` says how many) for ``glm4moe``, ``deepseek2`` (GLM-4.7-Flash's),
``deepseek32`` and ``glm-dsa``: the block's tensors under a layer's usual names, the module's own
as ``nextn.{eh_proj, enorm, hnorm, shared_head_norm, shared_head_head, embed_tokens}`` (the last
three optional). The families' GGUF name maps put them under the names above
(`moe_decoder.GGUF_NEXTN_NAMES`), so a file's module loads as a folder's; without a
``shared_head_norm`` the model's output norm is the module's, as llama.cpp does.

DSA (DeepSeek-V3.2, GLM-5): the block has an indexer of its own when the checkpoint stores one
(``self_attn.indexer.*``; its one-layer model then shares no selection). A module without one (a
GLM-5 layer of the "shared" kind, which would reuse a previous layer's selection: the block has
none) is built as a DeepSeek-V3 block, MLA over every position of its context, as llama.cpp's
GLM-DSA draft graph computes every MTP layer; its drafts are verified as any others.

The block is built as a one-layer model of the family (`load_mtp`: the registry entry's ``build``
with ``num_layers = 1``), so it takes the model's weight format (int4, int8, GGUF blocks, dense)
and attention code as they are; that model's own embedding and head are one-row placeholders.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from helios.models import deepseek_v3
from helios.models.architecture import Architecture, BuildOptions
from helios.models.decoder import FusedDecoderLM, param, rms_norm
from helios.models.deepseek_v3 import DeepseekV3Config
from helios.models.deepseek_v32 import DeepseekV32Config
from helios.models.interface import AttentionContext, CacheSpec
from helios.models.quant import BuildSource, UnloadedLinear, build_linear, dense_of

__all__ = ["MTP_ARCHITECTURES", "MultiTokenPredictor", "load_mtp", "mtp_layers"]

MTP_ARCHITECTURES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe")
"""Registry entries whose checkpoints' MTP layers `load_mtp` builds."""

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.norm.weight",
        "shared_head.head.weight")
"""The MTP module's weights outside its decoder block (suffixes of ``model.layers.{N + i}.``)."""


def mtp_layers(num_layers: int, names: Iterable[str]) -> int:
    """How many MTP modules a checkpoint whose decoder has ``num_layers`` layers carries (each has an
    ``eh_proj``), by its tensor names."""
    have = set(names)
    count = 0
    while f"model.layers.{num_layers + count}.eh_proj.weight" in have:
        count += 1
    return count


class MultiTokenPredictor(nn.Module):
    """One MTP module over a target model (see the module docstring). Its cache: the block's one
    layer (`cache_specs`)."""

    def __init__(self, target: FusedDecoderLM, block: FusedDecoderLM) -> None:
        super().__init__()
        self._target = (target,)  # not a submodule: the embedding and head are the model's parameters
        self.block = block
        hidden = target.config.hidden_size
        self.eps = target.config.rms_norm_eps
        self.enorm = param(torch.ones(hidden, dtype=torch.float32, device=target.device))
        self.hnorm = param(torch.ones(hidden, dtype=torch.float32, device=target.device))
        self.eh_proj: nn.Module = UnloadedLinear()

    @property
    def target(self) -> FusedDecoderLM:
        return self._target[0]

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        return tuple(self.block.cache_specs())

    def forward(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, attn: AttentionContext, *,
                keep: Tensor | None = None) -> Tensor:
        """The normed outputs ``g`` [T, hidden] for tokens ``input_ids`` (token p + 1 at position p)
        and hidden states ``hidden`` [T, hidden] (the model's at p, or the module's own output for
        a deeper draft); ``keep`` as in `interface.CausalLM.__call__` (the rows returned; every row
        writes the block's cache)."""
        embeds = self.target.embed(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat((rms_norm(embeds, self.enorm, self.eps),
                       rms_norm(hidden.to(embeds.dtype), self.hnorm, self.eps)), dim=-1)
        x = self.eh_proj(x)
        rows = torch.arange(x.shape[0], device=x.device)
        # The block model's embedding is a one-row placeholder: every row is replaced by ``x``.
        return self.block(torch.zeros_like(input_ids), positions, attn, embeds=(rows, x), keep=keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits of outputs ``g`` through the model's own head (shared)."""
        return self.target.compute_logits(hidden)

    def load_own(self, tensors: Mapping[str, BuildSource], prefix: str) -> None:
        """``enorm``, ``hnorm``, ``eh_proj`` from ``{prefix}*``, and the check of a stored embedding
        or head copy against the model's."""
        target = self.target
        hidden = target.config.hidden_size
        with torch.no_grad():
            for name, norm in (("enorm.weight", self.enorm), ("hnorm.weight", self.hnorm)):
                value = dense_of(tensors[prefix + name])
                if tuple(value.shape) != (hidden,):
                    raise ValueError(f"{prefix}{name}: expected shape {(hidden,)}, got {tuple(value.shape)}")
                norm.copy_(value)
            proj = tensors[prefix + "eh_proj.weight"]
            if tuple(proj.shape) != (hidden, 2 * hidden):
                raise ValueError(f"{prefix}eh_proj.weight: expected shape {(hidden, 2 * hidden)}, got {tuple(proj.shape)}")
            self.eh_proj = build_linear([proj], target.weight_format, target.dtype).to(target.device)
            shared = {"embed_tokens.weight": target.embed_tokens,
                      "shared_head.head.weight": target.embed_tokens if target.config.tie_word_embeddings
                      else target.lm_head}
            for name, own in shared.items():
                if prefix + name in tensors and own.shape[0] == target.vocab_size:
                    value = dense_of(tensors[prefix + name])
                    if tuple(value.shape) != tuple(own.shape) or not torch.equal(value.to(own.dtype), own.detach()):
                        raise ValueError(f"{prefix}{name} differs from the model's: an MTP layer with an embedding "
                                         "or output head of its own is not supported (DeepSeek-V3's share the model's)")


class _Renamed(Mapping[str, BuildSource]):
    """``tensors`` under other names (read when asked for), plus fixed ``extra`` tensors."""

    def __init__(self, tensors: Mapping[str, BuildSource], names: Mapping[str, str], extra: Mapping[str, Tensor]) -> None:
        self._tensors = tensors
        self._names = dict(names)
        self._extra = dict(extra)

    def __getitem__(self, name: str) -> BuildSource:
        if name in self._extra:
            return self._extra[name]
        return self._tensors[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        yield from self._names
        yield from self._extra

    def __len__(self) -> int:
        return len(self._names) + len(self._extra)


def block_config(config: Any, *, moe: bool, indexer: bool = True) -> Any:
    """The family config of the MTP block as a one-layer model: ``num_layers`` 1 (a MoE layer when
    ``moe``), a one-row placeholder vocabulary, and (DSA) an indexer of its own; a DSA block
    without one (not ``indexer``) is a `DeepseekV3Config`: MLA over its whole context."""
    changes: dict[str, Any] = dict(num_layers=1, moe_layers=(moe,), vocab_size=1)
    if isinstance(config, DeepseekV32Config):
        if not indexer:
            fields = {f.name: getattr(config, f.name) for f in attrs.fields(DeepseekV3Config)}
            return DeepseekV3Config(**{**fields, **changes, "arch": "deepseek_v3"})
        changes["index_shared"] = ()
    return attrs.evolve(config, **changes)


def load_mtp(target: object, architecture: Architecture, tensors: Mapping[str, BuildSource],
             layer: int = 0) -> MultiTokenPredictor:
    """The checkpoint's MTP module ``layer`` (``model.layers.{num_layers + layer}``) over the loaded
    ``target`` (a `FusedDecoderLM` of an `MTP_ARCHITECTURES` entry, one rank: no tensor parallelism),
    built in the target's dtype and weight format. Raises ValueError when the checkpoint has no such
    module or its weights do not fit."""
    if architecture.name not in MTP_ARCHITECTURES or not isinstance(target, FusedDecoderLM):
        raise ValueError(f"MTP layers of {architecture.name} checkpoints are not supported")
    cfg = target.config
    if target.parallel is not None:
        raise ValueError("MTP drafting runs on one rank: tensor parallelism is not supported with it")
    prefix = f"model.layers.{cfg.num_layers + layer}."
    if prefix + "eh_proj.weight" not in tensors:
        raise ValueError(f"the checkpoint has no MTP layer {layer} ({prefix}eh_proj.weight)")
    config = block_config(cfg, moe=prefix + "mlp.gate.weight" in tensors,
                          indexer=prefix + "self_attn.indexer.wk.weight" in tensors)
    build = architecture.build if type(config) is type(cfg) else deepseek_v3.build
    block = build(config, BuildOptions(dtype=target.dtype, device=str(target.device), weights=target.weight_format))
    assert isinstance(block, FusedDecoderLM), type(block)
    names: dict[str, str] = {}
    for name in tensors:
        if name.startswith(prefix) and name[len(prefix):] not in _OWN:
            names["model.layers.0." + name[len(prefix):]] = name
    # llama.cpp reads the model's output norm where a GGUF file has no shared_head_norm of the module.
    norm = prefix + "shared_head.norm.weight"
    names["model.norm.weight"] = norm if norm in tensors else "model.norm.weight"
    placeholder = torch.zeros(1, cfg.hidden_size)
    block.load_weights(_Renamed(tensors, names, {"model.embed_tokens.weight": placeholder,
                                                 "lm_head.weight": placeholder}))
    block.eval()
    predictor = MultiTokenPredictor(target, block)
    predictor.load_own(tensors, prefix)
    if target.device.type == "cpu":
        block.pack_cpu_weights()
    return predictor.eval()
