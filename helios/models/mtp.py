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

DeepSeek V4 (`DeepseekV4MTP`): the modules are stored as ``mtp.{i}.*`` in DeepSeek's release
names (``model.mtp.{i}.*`` in a folder that kept the ``model.`` prefix), and read the model's
residual streams rather than its hidden state: the ``hc_mult`` streams [hc_mult, hidden] of position
p after the last layer, before the HyperHead collapses them (`interface.DraftFeatureLM`: the
runner hands them over flattened). One module has

- ``enorm``, ``hnorm``: RMSNorms of the next token's embedding (zeroed at position 0) and of each
  stream;
- ``e_proj``, ``h_proj``: [hidden, hidden] projections, summed into streams:
  ``x = h_proj(hnorm(streams)) + e_proj(enorm(embed(t[p+1])))`` (the embedding term added to every
  stream);
- one V4 decoder block on those streams (its hyper-connections, attention and MoE: ``attn.*``,
  ``ffn.*``, ``attn_norm``, ``ffn_norm``, ``hc_attn_*``, ``hc_ffn_*``), with a KV cache of its own;
  DeepSeek's releases make it a sliding-window layer (the trailing ``compress_ratios`` entry is 0)
  routed by its gate (not hashed);
- its own HyperHead (``hc_head_fn``, ``hc_head_base``, ``hc_head_scale``: the model's
  ``rms_norm_eps`` and ``hc_eps``) and ``norm``, then the head: the block's output streams are
  collapsed, normed and projected to the logits; ``emb.tok_emb`` and ``head`` are copies of the
  model's embedding and head, checked as above.

The module's output at p is its block's output streams (before its HyperHead, flattened); a deeper
draft feeds them back as the next position's streams, as vLLM's ``deepseek_v4_mtp`` does. The
block is a one-layer `DeepseekV4ForCausalLM` whose HyperHead and final norm are the module's.

DeepSeek V4 GGUF files (`deepseek_v4.gguf_tensor`): llama.cpp's ``--mtp`` conversion writes the
modules alone to an MTP-only file (`mtp_only`), as ``blk.{N + i}``, mapped to ``mtp.{i}.*``: the
block under a layer's names, ``eh_proj`` (``e_proj`` and ``h_proj`` concatenated, e first; split on
load), ``enorm``, ``hnorm``, the module's ``norm`` (``shared_head_norm``), and its HyperHead at the
root names (``output_hc_*``), read as llama.cpp's MTP graph reads them where the module has none of
its own; the file's embedding and head, the model's copies, are checked against the model's
(`load_mtp` takes such a file's tensors over a target loaded from elsewhere).

The block is built as a one-layer model of the family (`load_mtp`: the registry entry's ``build``
with ``num_layers = 1``), so it takes the model's weight format (int4, int8, GGUF blocks, dense)
and attention code as they are; that model's own embedding and head are one-row placeholders.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor, nn

from helios.models import deepseek_v3
from helios.models.architecture import Architecture, BuildOptions
from helios.models.decoder import FusedDecoderLM, param, rms_norm
from helios.models.deepseek_v3 import DeepseekV3Config
from helios.models.deepseek_v4 import SLIDING, DeepseekV4Config, DeepseekV4ForCausalLM
from helios.models.deepseek_v32 import DeepseekV32Config
from helios.models.interface import AttentionContext, CacheSpec
from helios.models.quant import BuildSource, GroupQuantized, UnloadedLinear, build_linear, dense_of

__all__ = ["MTP_ARCHITECTURES", "DeepseekV3MTP", "DeepseekV4MTP", "MultiTokenPredictor", "load_mtp", "mtp_layers",
           "mtp_only"]

MTP_ARCHITECTURES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "deepseek_v4")
"""Registry entries whose checkpoints' MTP layers `load_mtp` builds."""

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.norm.weight",
        "shared_head.head.weight")
"""The MTP module's weights outside its decoder block (suffixes of ``model.layers.{N + i}.``)."""

_V4_PROJ = ("e_proj.weight", "eh_proj.weight")
"""A DeepSeek V4 module's input projections: a folder's ``e_proj`` (with ``h_proj``), or a GGUF
file's ``eh_proj`` [hidden, 2 * hidden], llama.cpp's concatenation of the two (``e_proj`` first)."""

_V4_OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "eh_proj.weight", "emb.tok_emb.weight",
           "head.weight")
"""A DeepSeek V4 MTP module's weights outside its block model (suffixes of ``mtp.{i}.``; its
``hc_head_*`` and ``norm`` are the block model's HyperHead and final norm)."""


def _prefix(num_layers: int, layer: int, names: Container[str]) -> str | None:
    """Where MTP module ``layer`` of a checkpoint whose decoder has ``num_layers`` layers is stored:
    ``model.layers.{num_layers + layer}.`` (DeepSeek-V3's layout: an ``eh_proj``), ``mtp.{layer}.`` or
    ``model.mtp.{layer}.`` (DeepSeek V4's: an ``e_proj``, or a GGUF file's ``eh_proj``, llama.cpp's
    concatenation of ``e_proj`` and ``h_proj``); None when it has none."""
    for prefix, own in ((f"model.layers.{num_layers + layer}.", ("eh_proj.weight",)),
                        (f"mtp.{layer}.", _V4_PROJ), (f"model.mtp.{layer}.", _V4_PROJ)):
        if any(prefix + name in names for name in own):
            return prefix
    return None


def mtp_only(num_layers: int, names: Iterable[str]) -> bool:
    """Whether a checkpoint holds MTP modules and no decoder (llama.cpp's ``--mtp`` conversion: an
    MTP-only GGUF file, with the shared embedding, head and output norm), by its tensor names."""
    have = set(names)
    # decoder layer 0 under transformers' names or DeepSeek's release names (a V4 folder's ``layers.0.``)
    return (_prefix(num_layers, 0, have) is not None
            and not any(name.startswith(("model.layers.0.", "layers.0.")) for name in have))


def mtp_layers(num_layers: int, names: Iterable[str]) -> int:
    """How many MTP modules a checkpoint whose decoder has ``num_layers`` layers carries (each has an
    ``eh_proj``, or a DeepSeek V4 module an ``e_proj`` or ``eh_proj``), by its tensor names."""
    have = set(names)
    count = 0
    while _prefix(num_layers, count, have) is not None:
        count += 1
    return count


class MultiTokenPredictor(nn.Module):
    """One MTP module over a target model (see the module docstring): what the engine's drafter
    calls. Its cache: the block's one layer (`cache_specs`). Subclasses: `DeepseekV3MTP` (the
    DeepSeek-V3 layout), `DeepseekV4MTP`."""

    def __init__(self, target: FusedDecoderLM, block: FusedDecoderLM) -> None:
        super().__init__()
        self._target = (target,)  # not a submodule: the embedding and head are the model's parameters
        self.block = block
        hidden = target.config.hidden_size
        self.eps = target.config.rms_norm_eps
        self.enorm = param(torch.ones(hidden, dtype=torch.float32, device=target.device))
        self.hnorm = param(torch.ones(hidden, dtype=torch.float32, device=target.device))

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
        """The outputs [T, features] for tokens ``input_ids`` (token p + 1 at position p) and the
        model's features ``hidden`` [T, features] at p (its hidden states, or what its
        `interface.DraftFeatureLM.forward_with_features` gives), or the module's own outputs for a
        deeper draft; ``keep`` as in `interface.CausalLM.__call__` (the rows returned; every row
        writes the block's cache)."""
        raise NotImplementedError

    def compute_logits(self, outputs: Tensor) -> Tensor:
        """float32 logits of outputs of `forward`."""
        raise NotImplementedError

    def normed_embeds(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """``enorm`` of the tokens' embeddings (the model's), zeroed at position 0."""
        embeds = self.target.embed(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        return rms_norm(embeds, self.enorm, self.eps)

    def load_norms(self, tensors: Mapping[str, BuildSource], prefix: str) -> None:
        """``enorm`` and ``hnorm`` from ``{prefix}enorm.weight`` / ``hnorm.weight``."""
        hidden = self.target.config.hidden_size
        with torch.no_grad():
            for name, norm in (("enorm.weight", self.enorm), ("hnorm.weight", self.hnorm)):
                value = dense_of(tensors[prefix + name])
                if tuple(value.shape) != (hidden,):
                    raise ValueError(f"{prefix}{name}: expected shape {(hidden,)}, got {tuple(value.shape)}")
                norm.copy_(value)

    def projection(self, tensors: Mapping[str, BuildSource], name: str, columns: int) -> nn.Module:
        """The [hidden, ``columns``] projection ``name`` in the model's weight format."""
        target = self.target
        proj = tensors[name]
        shape = (target.config.hidden_size, columns)
        if tuple(proj.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(proj.shape)}")
        return build_linear([proj], target.weight_format, target.dtype).to(target.device)

    def check_shared(self, tensors: Mapping[str, BuildSource], embedding: str, head: str) -> None:
        """A stored copy of the embedding (``embedding``) or head (``head``) must equal the model's
        where the model keeps them as dense tensors (a differing one is refused: ValueError)."""
        target = self.target
        shared = {embedding: target.embed_tokens,
                  head: target.embed_tokens if target.config.tie_word_embeddings else target.lm_head}
        for name, own in shared.items():
            if name in tensors and own.shape[0] == target.vocab_size:
                value = dense_of(tensors[name])
                if tuple(value.shape) != tuple(own.shape) or not torch.equal(value.to(own.dtype), own.detach()):
                    raise ValueError(f"{name} differs from the model's: an MTP layer with an embedding "
                                     "or output head of its own is not supported (DeepSeek's share the model's)")


class DeepseekV3MTP(MultiTokenPredictor):
    """The DeepSeek-V3 layout's module: ``eh_proj`` over the normed embedding and hidden state, its
    block a one-layer model of the family, the model's head on its normed output ``g``."""

    def __init__(self, target: FusedDecoderLM, block: FusedDecoderLM) -> None:
        super().__init__(target, block)
        self.eh_proj: nn.Module = UnloadedLinear()

    def forward(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, attn: AttentionContext, *,
                keep: Tensor | None = None) -> Tensor:
        """The normed outputs ``g`` [T, hidden] (`MultiTokenPredictor.forward`; ``hidden``: the
        model's hidden states [T, hidden], or the module's own ``g``)."""
        embeds = self.normed_embeds(input_ids, positions)
        x = self.eh_proj(torch.cat((embeds, rms_norm(hidden.to(embeds.dtype), self.hnorm, self.eps)), dim=-1))
        rows = torch.arange(x.shape[0], device=x.device)
        # The block model's embedding is a one-row placeholder: every row is replaced by ``x``.
        return self.block(torch.zeros_like(input_ids), positions, attn, embeds=(rows, x), keep=keep)

    def compute_logits(self, outputs: Tensor) -> Tensor:
        """float32 logits of outputs ``g`` through the model's own head (shared)."""
        return self.target.compute_logits(outputs)

    def load_own(self, tensors: Mapping[str, BuildSource], prefix: str) -> None:
        """``enorm``, ``hnorm``, ``eh_proj`` from ``{prefix}*``, and the check of a stored embedding
        or head copy against the model's."""
        self.load_norms(tensors, prefix)
        self.eh_proj = self.projection(tensors, prefix + "eh_proj.weight", 2 * self.target.config.hidden_size)
        self.check_shared(tensors, prefix + "embed_tokens.weight", prefix + "shared_head.head.weight")


class DeepseekV4MTP(MultiTokenPredictor):
    """DeepSeek V4's module (see the module docstring): features and outputs are residual streams,
    flattened [T, hc_mult * hidden]; ``block`` a one-layer `DeepseekV4ForCausalLM` whose HyperHead
    and final norm are the module's own."""

    block: DeepseekV4ForCausalLM

    def __init__(self, target: DeepseekV4ForCausalLM, block: DeepseekV4ForCausalLM) -> None:
        super().__init__(target, block)
        self.e_proj: nn.Module = UnloadedLinear()
        self.h_proj: nn.Module = UnloadedLinear()
        self.streams = target.config.hc_mult

    def forward(self, input_ids: Tensor, positions: Tensor, hidden: Tensor, attn: AttentionContext, *,
                keep: Tensor | None = None) -> Tensor:
        """The block's output streams [T, hc_mult * hidden] (`MultiTokenPredictor.forward`;
        ``hidden``: the model's streams before its HyperHead, or the module's own outputs)."""
        embeds = self.normed_embeds(input_ids, positions)
        rows, width = embeds.shape
        streams = rms_norm(hidden.to(embeds.dtype).reshape(rows * self.streams, width), self.hnorm, self.eps)
        x = self.h_proj(streams).view(rows, self.streams, width) + self.e_proj(embeds).unsqueeze(1)
        return self.block.run_streams(x, input_ids, positions, attn, keep=keep).flatten(1)

    def compute_logits(self, outputs: Tensor) -> Tensor:
        """float32 logits of output streams: the module's HyperHead and norm, then the model's head."""
        hidden = self.target.config.hidden_size
        return self.target.compute_logits(self.block.hyper_head(outputs.view(-1, self.streams, hidden)))

    def load_own(self, tensors: Mapping[str, BuildSource], prefix: str) -> None:
        """``enorm``, ``hnorm``, ``e_proj``, ``h_proj`` from ``{prefix}*``, and the check of a stored
        embedding or head copy against the model's."""
        self.load_norms(tensors, prefix)
        hidden = self.target.config.hidden_size
        if prefix + "e_proj.weight" in tensors:
            self.e_proj = self.projection(tensors, prefix + "e_proj.weight", hidden)
            self.h_proj = self.projection(tensors, prefix + "h_proj.weight", hidden)
        else:  # a GGUF file's [e_proj | h_proj]
            name = prefix + "eh_proj.weight"
            both = tensors[name]
            if tuple(both.shape) != (hidden, 2 * hidden):
                raise ValueError(f"{name}: expected shape {(hidden, 2 * hidden)}, got {tuple(both.shape)}")
            halves = {"e": _columns(both, 0, hidden), "h": _columns(both, hidden, 2 * hidden)}
            self.e_proj = self.projection(halves, "e", hidden)
            self.h_proj = self.projection(halves, "h", hidden)
        self.check_shared(tensors, prefix + "emb.tok_emb.weight", prefix + "head.weight")


def _columns(source: BuildSource, start: int, stop: int) -> BuildSource:
    """Columns ``start:stop`` of a [rows, cols] weight: `GroupQuantized` codes (GGUF Q4_0 / Q4_1 /
    Q8_0) stay codes where the cut falls on their groups; anything else is sliced dense."""
    if isinstance(source, GroupQuantized) and start % source.group_size == 0 and stop % source.group_size == 0:
        a, b = start // source.group_size, stop // source.group_size
        return GroupQuantized(source.codes[:, start:stop].contiguous(), source.scale[:, a:b].contiguous(),
                              source.offset[:, a:b].contiguous(), source.bits, source.group_size)
    return dense_of(source)[:, start:stop].contiguous()


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
    without one (not ``indexer``) is a `DeepseekV3Config`: MLA over its whole context. DeepSeek V4:
    a sliding-window layer routed by its gate."""
    changes: dict[str, Any] = dict(num_layers=1, moe_layers=(moe,), vocab_size=1)
    if isinstance(config, DeepseekV32Config):
        if not indexer:
            fields = {f.name: getattr(config, f.name) for f in attrs.fields(DeepseekV3Config)}
            return DeepseekV3Config(**{**fields, **changes, "arch": "deepseek_v3"})
        changes["index_shared"] = ()
    if isinstance(config, DeepseekV4Config):
        changes.update(layer_types=(SLIDING,), hash_layers=(False,))
    return attrs.evolve(config, **changes)


def load_mtp(target: object, architecture: Architecture, tensors: Mapping[str, BuildSource],
             layer: int = 0) -> MultiTokenPredictor:
    """The checkpoint's MTP module ``layer`` (``model.layers.{num_layers + layer}``, DeepSeek V4's
    ``mtp.{layer}``) over the loaded ``target`` (a `FusedDecoderLM` of an `MTP_ARCHITECTURES` entry,
    one rank: no tensor parallelism), built in the target's dtype and weight format. ``tensors``:
    the target's checkpoint, or an MTP-only one of the same model (`mtp_only`: its embedding and
    head must equal the model's). Raises ValueError when the checkpoint has no such module or its
    weights do not fit."""
    if architecture.name not in MTP_ARCHITECTURES or not isinstance(target, FusedDecoderLM):
        raise ValueError(f"MTP layers of {architecture.name} checkpoints are not supported")
    cfg = target.config
    if target.parallel is not None:
        raise ValueError("MTP drafting runs on one rank: tensor parallelism is not supported with it")
    prefix = _prefix(cfg.num_layers, layer, tensors)
    if isinstance(target, DeepseekV4ForCausalLM):
        if prefix is None or not prefix.endswith(f"mtp.{layer}."):
            raise ValueError(f"the checkpoint has no MTP layer {layer} (mtp.{layer}.e_proj.weight)")
        return _check_root(_load_v4(target, architecture, tensors, prefix), tensors)
    if prefix is None or not prefix.startswith("model.layers."):
        raise ValueError(f"the checkpoint has no MTP layer {layer} "
                         f"(model.layers.{cfg.num_layers + layer}.eh_proj.weight)")
    config = block_config(cfg, moe=prefix + "mlp.gate.weight" in tensors,
                          indexer=prefix + "self_attn.indexer.wk.weight" in tensors)
    build = architecture.build if type(config) is type(cfg) else deepseek_v3.build
    block = _build_block(target, config, build)
    names = {"model.layers.0." + suffix: name for suffix, name in _suffixes(tensors, prefix, _OWN).items()}
    # llama.cpp reads the model's output norm where a GGUF file has no shared_head_norm of the module.
    norm = prefix + "shared_head.norm.weight"
    names["model.norm.weight"] = norm if norm in tensors else "model.norm.weight"
    block.load_weights(_Renamed(tensors, names, _placeholders(cfg.hidden_size, "model.embed_tokens.weight",
                                                              "lm_head.weight")))
    predictor = DeepseekV3MTP(target, block)
    predictor.load_own(tensors, prefix)
    return _check_root(_finish(predictor), tensors)


def _check_root(predictor: _P, tensors: Mapping[str, BuildSource]) -> _P:
    """An MTP-only checkpoint's (`mtp_only`) embedding and head, the shared copies llama.cpp's
    ``--mtp`` conversion writes beside the modules, checked against the model's (`check_shared`:
    a file of another model is refused)."""
    if mtp_only(predictor.target.config.num_layers, tensors):
        predictor.check_shared(tensors, "model.embed_tokens.weight", "lm_head.weight")
    return predictor


_V4_HEAD = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")
"""A DeepSeek V4 module's HyperHead and norm: the block model's own (the same release names)."""

_V4_ROOT = {"norm.weight": "model.norm.weight", **{f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}}
"""Where a module without its own (a GGUF file's: llama.cpp's ``--mtp`` conversion writes the
module's HyperHead at the root names, ``output_hc_*``, and its norm as ``nextn.shared_head_norm``)
finds its HyperHead and norm: the checkpoint's root tensors, as llama.cpp's MTP graph reads them."""


def _load_v4(target: DeepseekV4ForCausalLM, architecture: Architecture, tensors: Mapping[str, BuildSource],
             prefix: str) -> DeepseekV4MTP:
    """DeepSeek V4's module at ``prefix`` (``mtp.{i}.`` or ``model.mtp.{i}.``): its block, HyperHead
    and norm as a one-layer `DeepseekV4ForCausalLM` loaded under release names (``layers.0.*`` for
    the block's, ``hc_head_*``, ``norm.weight``), which that model maps as it maps its own."""
    if any(name.startswith((prefix + "attn.compressor.", prefix + "self_attn.compressor.")) for name in tensors):
        raise ValueError(f"{prefix}: a compressed-attention MTP block is not supported (DeepSeek's releases make "
                         "it a sliding-window layer)")
    if prefix + "ffn.gate.tid2eid" in tensors or prefix + "mlp.gate.tid2eid" in tensors:
        raise ValueError(f"{prefix}: a hash-routed MTP block is not supported")
    block = _build_block(target, block_config(target.config, moe=True), architecture.build)
    assert isinstance(block, DeepseekV4ForCausalLM), type(block)
    names = {(suffix if suffix in _V4_HEAD else "layers.0." + suffix): name
             for suffix, name in _suffixes(tensors, prefix, _V4_OWN).items()}
    for suffix, root in _V4_ROOT.items():
        if suffix not in names and root in tensors:
            names[suffix] = root
    block.load_weights(_Renamed(tensors, names, _placeholders(target.config.hidden_size, "embed.weight",
                                                              "head.weight")))
    predictor = DeepseekV4MTP(target, block)
    predictor.load_own(tensors, prefix)
    return _finish(predictor)


def _build_block(target: FusedDecoderLM, config: Any, build: Callable[[Any, BuildOptions], object]) -> FusedDecoderLM:
    """The one-layer block model, in the target's dtype, device and weight format (not loaded)."""
    block = build(config, BuildOptions(dtype=target.dtype, device=str(target.device), weights=target.weight_format))
    assert isinstance(block, FusedDecoderLM), type(block)
    return block


def _suffixes(tensors: Mapping[str, BuildSource], prefix: str, own: tuple[str, ...]) -> dict[str, str]:
    """The module's tensors outside ``own``: their suffixes of ``prefix`` -> their names."""
    return {name[len(prefix):]: name for name in tensors if name.startswith(prefix) and name[len(prefix):] not in own}


def _placeholders(hidden: int, *names: str) -> dict[str, Tensor]:
    """The block model's one-row embedding and head (never read)."""
    return dict.fromkeys(names, torch.zeros(1, hidden))


_P = TypeVar("_P", bound=MultiTokenPredictor)


def _finish(predictor: _P) -> _P:
    """The loaded predictor in eval mode, its block's weights packed for the CPU kernels (on CPU)."""
    predictor.block.eval()
    if predictor.target.device.type == "cpu":
        predictor.block.pack_cpu_weights()
    return predictor.eval()
