"""The one interface between the engine and a model module: what the runner calls, what a layer
calls back, and what each layer keeps in the cache.

The engine (`engine/runner.py`, `engine/core.py`) knows a model only through `CausalLM`; a model's
layers know the engine's step only through `AttentionContext`. Neither imports the other: a new
architecture is a module under `helios/models/` plus its registry entry (`models/registry.py`), with
no change in the runner, the scheduler, the KV cache manager or the loaders.

Cache specs (vLLM v1's KV-cache specs are the anchor). Every layer declares what it keeps:

- `FullAttentionSpec`: K and V rows for every token (``num_kv_heads`` x ``head_dim`` each).
- `SlidingWindowSpec`: the same rows, but a token attends only to the last ``window`` positions
  (itself included: query position p sees key positions p - window + 1 .. p, transformers'
  sliding-window mask), so pages that fall out of every such layer's window are reusable.
- `LatentAttentionSpec`: one compressed row of ``row_dim`` elements per token (multi-head latent
  attention keeps the latent and the rotary key, not expanded K/V; `LatentProjection` is what a
  layer hands the context to expand or absorb them).
  A sparse-attention layer (DeepSeek's DSA) appends its indexer key to the same row (`SparseIndex`).
  A layer may also keep rows of its own layout and compute its attention itself from them
  (`AttentionContext.rows`, `RowSpans`: DeepSeek V4's compressed attention).
- `RowWindowSpec`: a row of ``row_dim`` elements per token of the layer's own layout (read through
  `AttentionContext.rows`), of which the layer reads only the last ``window`` positions' (a
  compressor's raw rows: its partial window, the sliding keys): pages behind every window are
  reusable, and the engine holds a bounded number per running request.
- `CompressedSpec`: one row of ``row_dim`` elements per ``rate`` positions (a compressor's entries:
  entry w is the row of window w, positions w * rate .. (w + 1) * rate - 1, written by the step that
  computes its last position). Its pages hold entries, not positions (`engine/kv/compressed.py`).
- `RecurrentStateSpec`: a fixed state per request (tensors of ``shapes``), no per-token rows; a
  prefix is reused only through a snapshot of the state.

The KV cache manager groups the layers with equal specs and allocates pages (or state slots) per
group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

DecodeArgs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, Tensor | None, Tensor | None]
"""What the CPU decode operators need for one layer of an all-decode step: (k_cache, v_cache,
slot_mapping, block_table, rows, lens, page_size, k_scale, v_scale) (`cpu_kernels.write_paged_decode`);
the scales are None for a float cache, the rows' bfloat16 scales for int8 K/V."""


@attrs.frozen
class FullAttentionSpec:
    """K and V of every token: causal attention over the whole context."""

    num_kv_heads: int
    head_dim: int

    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


@attrs.frozen
class SlidingWindowSpec:
    """K and V of every token, attended only within the last ``window`` positions (the query's
    own included)."""

    num_kv_heads: int
    head_dim: int
    window: int

    def __attrs_post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"a sliding window must be positive, got {self.window}")

    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


@attrs.frozen
class LatentAttentionSpec:
    """One compressed row of ``row_dim`` elements per token (latent attention)."""

    row_dim: int

    def elements_per_token(self) -> int:
        return self.row_dim


@attrs.frozen
class RowWindowSpec:
    """One row of ``row_dim`` elements per token, read only for positions p - ``window`` + 1 .. by
    a query or compressor at position p or later (the layer's own layout, `AttentionContext.rows`)."""

    row_dim: int
    window: int

    def __attrs_post_init__(self) -> None:
        if self.row_dim <= 0 or self.window <= 0:
            raise ValueError(f"a row window needs a positive size and window, got {self.row_dim}, {self.window}")

    def elements_per_token(self) -> int:
        return self.row_dim


@attrs.frozen
class CompressedSpec:
    """One row of ``row_dim`` elements per ``rate`` positions: entry w, complete once position
    (w + 1) * rate - 1 is. A page of positions holds the entries its positions complete
    (`engine.kv.compressed.CompressedPool`); per token, ``row_dim / rate`` elements."""

    row_dim: int
    rate: int

    def __attrs_post_init__(self) -> None:
        if self.row_dim <= 0 or self.rate <= 0:
            raise ValueError(f"a compressed row needs a positive size and rate, got {self.row_dim}, {self.rate}")

    def elements_per_token(self) -> float:
        return self.row_dim / self.rate


@attrs.frozen(eq=False)
class LatentProjection:
    """How a latent-attention layer's cached rows become keys and values (DeepSeek's MLA).

    A row is ``[c | k_rope]``: the normed latent ``c`` (``rank`` elements) and the rotary key
    shared by every head (RoPE applied). ``kv_up`` [heads, nope_dim + v_dim, rank] is the layer's
    up-projection (``kv_b_proj``) per head: head h's key is ``[kv_up[h, :nope_dim] @ c | k_rope]``
    and its value ``kv_up[h, nope_dim:] @ c``. The context computes attention either expanded
    (keys and values made from the rows) or absorbed (the query's non-rotary part taken into the
    latent space, ``q_nope @ kv_up[h, :nope_dim]``, scored against the rows themselves, and the
    latent output taken out through ``kv_up[h, nope_dim:]``); `helios.models.latent_attention`."""

    kv_up: Tensor
    nope_dim: int

    @property
    def num_heads(self) -> int:
        return int(self.kv_up.shape[0])

    @property
    def rank(self) -> int:
        return int(self.kv_up.shape[2])

    @property
    def v_dim(self) -> int:
        return int(self.kv_up.shape[1]) - self.nope_dim


@attrs.frozen(eq=False)
class SparseIndex:
    """A sparse latent-attention layer's indexer for one step (DeepSeek's DSA lightning indexer):
    each query attends only to the ``top_k`` keys of its causal context with the highest index
    scores (all of them where the context is no longer).

    The layer's cache row is ``[c | k_rope | k_index]``: the latent row (`LatentProjection`) and
    the indexer key (``index_dim`` elements, RoPE applied), so the indexer keys page and hit the
    prefix cache with the latent rows. Query i's score of key j is
    ``sum_h weights[i, h] * relu(q[i, h] . k_index[j] * index_dim ** -0.5)``, in float32. ``q``:
    [T, index_heads, index_dim] (RoPE applied); ``weights``: [T, index_heads] float32 (the head
    weights, their ``index_heads ** -0.5`` factor included). ``q`` and ``weights`` None: a layer
    without an indexer of its own (GLM-5's shared layers; its row has no indexer key) reuses the
    selection of the step's previous sparse layer."""

    q: Tensor | None
    weights: Tensor | None
    top_k: int


@attrs.frozen(eq=False)
class RowSpans:
    """One step of a layer that keeps rows of its own layout (`LatentAttentionSpec`, `RowWindowSpec`) and attends
    over them itself (`AttentionContext.rows`). ``cache``: the layer's rows [slots, row_dim], the
    step's rows already written; the layer may complete rows of the step's own positions in place
    (nothing else). ``spans``: per decode token and prefill chunk of the step, (first token index
    in the flattened batch, length, the slots of its sequence's positions 0 .. end - 1), so its
    first position is ``len(slots) - length``; in a `RowWindowSpec` group the slots of positions
    before the window name the placeholder page (never to be read)."""

    cache: Tensor
    spans: tuple[tuple[int, int, Tensor], ...]
    entries: Tensor | None = None
    """With ``rows(..., entries=index)``: the layer's entry stream (`CompressedSpec` of cache index
    ``index``), [entry slots, row_dim]."""
    entry_slots: tuple[Tensor, ...] = ()
    """Per span (in ``spans``' order), the slots of its sequence's entries 0 .. end // rate - 1 (end:
    the span's last position + 1): the entries its positions complete are written there by the layer."""


@attrs.frozen
class RecurrentStateSpec:
    """A fixed per-request state: one tensor of each shape in ``shapes``, in ``dtype`` (None: the
    model's dtype). Nothing is kept per token."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None

    def elements_per_token(self) -> int:
        return 0

    def elements_per_request(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


CacheSpec = (FullAttentionSpec | SlidingWindowSpec | LatentAttentionSpec | RowWindowSpec | CompressedSpec
             | RecurrentStateSpec)
"""What one layer keeps in the cache."""

PAGED_SPECS = (FullAttentionSpec, SlidingWindowSpec, LatentAttentionSpec, RowWindowSpec, CompressedSpec)
"""The specs whose layers keep rows per token in pages."""


@attrs.frozen
class RecurrentBatch:
    """One step's view of a recurrent-state layer's cache.

    ``states``: the layer's state tensors, each [num_slots, *shape] (persistent across steps; the
    layer reads and updates the rows of its chunks' slots in place). ``spans``: (first token index
    in the flattened batch, length, state slot, first position) of every chunk of the step, in
    batch order; a chunk whose first position is 0 starts from a zero state (the layer clears its
    slot first)."""

    states: tuple[Tensor, ...]
    spans: tuple[tuple[int, int, int, int], ...]


@runtime_checkable
class AttentionContext(Protocol):
    """One step's cache, as a model's layers see it (the engine's `PagedAttention`, or
    `dense_attention.DenseAttention` for one sequence).

    ``__call__``: attention for layer ``layer_idx`` (full or sliding-window: the context knows the
    layer's spec). ``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim],
    rotary embedding already applied, possibly non-contiguous views. Writes the step's K/V into the
    cache, then attends causally. Returns [T, num_heads, head_dim] in q's dtype. Scores are scaled
    by ``scale`` (None: ``head_dim ** -0.5``); query head h uses kv head h // (num_heads //
    num_kv_heads). ``sinks``: per query head, a learned logit added to the softmax's denominator
    (gpt-oss's attention sinks, `helios.models.attention_sinks`); None: none.

    ``all_decode_args``: for a step of decode tokens only that the CPU decode operators serve, what
    they need for this layer (so a model may run the layer as one operator); None otherwise.

    ``recurrent``: a recurrent-state layer's state and the step's chunks.

    ``latent``: attention for a latent-attention layer (`LatentAttentionSpec`). ``q_nope`` [T,
    heads, nope_dim], ``q_rope`` [T, heads, rope_dim] (RoPE applied), ``rows`` [T, rank +
    rope_dim]: this step's cache rows (`LatentProjection`), written into the cache first. Returns
    [T, heads, v_dim] in q's dtype: prefill chunks in the expanded form, decode tokens in the
    absorbed form (both the same attention); scores scaled by ``scale``. ``index`` (a sparse layer):
    ``rows`` end with the indexer keys, and each query attends only to the keys it selects
    (`SparseIndex`).

    ``rows``: a layer that keeps rows of its own layout in a `LatentAttentionSpec` (or
    `RowWindowSpec`) group and
    attends over them itself (DeepSeek V4's compressed layers): writes the step's ``rows`` [T,
    row_dim] at their positions and returns the cache and the step's spans (`RowSpans`); with
    ``entries``, the cache index of the layer's entry stream (a `CompressedSpec` after the layers'
    specs), that stream and each span's entry slots too."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, *,
                 sinks: Tensor | None = None) -> Tensor: ...

    def all_decode_args(self, layer_idx: int) -> DecodeArgs | None: ...

    def recurrent(self, layer_idx: int) -> RecurrentBatch: ...

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor: ...

    def rows(self, layer_idx: int, rows: Tensor, *, entries: int | None = None) -> RowSpans: ...


@runtime_checkable
class CausalLM(Protocol):
    """What the engine's runner calls: the typed model interface of every architecture module."""

    @property
    def vocab_size(self) -> int:
        """Rows of the logits (the embedding's rows; may exceed the tokenizer's vocabulary)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Activations and the KV cache's dtype."""
        ...

    def cache_specs(self) -> Sequence[CacheSpec]:
        """What each layer keeps, one spec per layer in layer order; then the specs of second
        streams some layers keep (a `CompressedSpec`: DeepSeek V4's compressed entries), which those
        layers address by their index in this sequence (`AttentionContext.rows`)."""
        ...

    def __call__(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                 embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm for a flattened batch: ``input_ids`` and ``positions``
        [T] (several requests' chunks concatenated); ``embeds = (rows, features)`` replaces those
        rows' token embeddings; ``keep``: only these rows' hidden states are returned (in that
        order), the others still write the cache."""
        ...

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [N, vocab_size] of hidden states [N, hidden]."""
        ...

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads for one request (0: undeclared)."""
        ...


@runtime_checkable
class PrefixLogitsLM(Protocol):
    """A `CausalLM` that computes the logits of a prefix of its vocabulary alone (the first token ids:
    a byte-level BPE vocabulary's most frequent tokens, in the order its merges were learned), with
    the output projection's first rows only. A draft model ranks its drafts over such a prefix
    (`engine.drafter.Drafter`'s ``vocab_prefix``): its head is then a fraction of the bytes a step reads."""

    def compute_logits_prefix(self, hidden: Tensor, rows: int) -> Tensor:
        """float32 logits [N, rows] of hidden states [N, hidden]: the first ``rows`` columns of what
        `CausalLM.compute_logits` gives (1 <= rows <= vocab_size)."""
        ...


@runtime_checkable
class DraftFeatureLM(Protocol):
    """A `CausalLM` whose multi-token-prediction layers read other features than its hidden states
    (`models.mtp`; DeepSeek V4's read the residual streams before its HyperHead). The runner then
    hands the MTP drafter these features (`engine.runner.ModelRunner.hidden_sink`); for every other
    model the drafter gets the hidden states `CausalLM.__call__` returns."""

    def forward_with_features(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                              embeds: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Every row's hidden state (as `CausalLM.__call__` without ``keep`` returns them) and its
        features [T, features] (what the model's MTP layers read)."""
        ...
