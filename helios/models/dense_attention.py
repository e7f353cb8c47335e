"""A reference attention backend for ONE sequence, plus a greedy decoding helper.

`DenseAttention` keeps each layer's K/V in a growing contiguous buffer, so a prompt can be prefilled
(in one or several chunks) and then decoded token by token. It is what the parity tests and simple
tools use; the engine has its own paged backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.models.attention_sinks import sink_attention
from helios.models.decoder import FusedDecoderLM
from helios.models.interface import (
    CompressedSpec,
    DecodeArgs,
    FullAttentionSpec,
    LatentAttentionSpec,
    LatentProjection,
    RecurrentBatch,
    RowSpans,
    RowWindowSpec,
    SlidingWindowSpec,
    SparseIndex,
)
from helios.models.latent_attention import (
    absorb_query,
    absorbed_attention,
    absorbed_output,
    chunk_attention,
    sparse_attention,
)


class DenseAttention:
    """Causal attention for one sequence whose tokens arrive in order, chunk after chunk.

    Each call for ``layer_idx`` appends its ``k``/``v`` rows after the ones already stored for that
    layer, then attends the new queries over everything stored (causally within the chunk). GQA:
    prefill lets SDPA share each kv head across its query group (``enable_gqa``, i.e. a repeat);
    decode folds the query group into the query-length axis instead, so K/V are never copied.

    ``windows``: per layer, None (full causal attention) or a sliding window w: a query at position p
    sees only keys p - w + 1 .. p (`SlidingWindowSpec`). Every key is still kept.

    ``sinks`` (a call's per-head sink logits, gpt-oss): the same keys, through
    `attention_sinks.sink_attention` instead of SDPA.

    ``kv_shapes``: per layer, its (kv heads, head size) when layers differ (Gemma 4's global layers,
    MiMo-V2-Flash's sliding ones); None: ``(num_kv_heads, head_dim)`` for every layer.

    A latent-attention layer (`latent`) keeps its rows instead; a chunk of one token after the first
    (decode) attends in the absorbed form, any other chunk in the cheaper form
    (`helios.models.latent_attention.chunk_attention`); a sparse layer's (``index``: its rows end
    with the indexer keys) attend to their selected keys (`latent_attention.sparse_attention`).
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initial_capacity: int = 256, windows: Sequence[int | None] | None = None,
                 kv_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.dtype = dtype
        self.device = torch.device(device)
        # Per layer (num_kv_heads, head_dim): the arguments', unless ``kv_shapes`` gives each layer its own.
        self._shapes = list(kv_shapes) if kv_shapes is not None else [(num_kv_heads, head_dim)] * num_layers
        if len(self._shapes) != num_layers:
            raise ValueError(f"{len(self._shapes)} kv shapes for {num_layers} layers")
        capacity = max(1, initial_capacity)
        # [capacity, num_kv_heads, head_dim] per layer: token-major, so appends are plain slices.
        self._keys = [self._alloc(capacity, i) for i in range(num_layers)]
        self._values = [self._alloc(capacity, i) for i in range(num_layers)]
        self._lengths = [0] * num_layers
        self._rows: dict[int, Tensor] = {}  # latent-attention layers (and entry streams): [capacity, row_dim]
        self._entry_specs: dict[int, CompressedSpec] = {}  # entry streams by cache index (`for_model`)
        self._selection: list[Tensor | None] = []  # the last sparse layer's (`sparse_attention`)
        self._windows: list[int | None] = list(windows) if windows is not None else [None] * num_layers
        if len(self._windows) != num_layers:
            raise ValueError(f"{len(self._windows)} windows for {num_layers} layers")

    @classmethod
    def for_model(cls, model: FusedDecoderLM, initial_capacity: int = 256) -> DenseAttention:
        """For ``model``'s layers, with the sliding windows and K/V shapes its cache specs declare."""
        cfg = model.config
        specs = list(model.cache_specs())
        extra = specs[cfg.num_layers:]  # second streams (compressed entries), by cache index
        specs = specs[: cfg.num_layers]
        windows = [spec.window if isinstance(spec, SlidingWindowSpec) else None for spec in specs]
        shapes = [(spec.num_kv_heads, spec.head_dim) if isinstance(spec, FullAttentionSpec | SlidingWindowSpec)
                  else (0, 0) if isinstance(spec, LatentAttentionSpec | RowWindowSpec)  # rows only (`latent`, `rows`)
                  else (cfg.num_kv_heads, cfg.head_dim) for spec in specs]
        attn = cls(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype,
                   device=model.embed_tokens.device, initial_capacity=initial_capacity, windows=windows,
                   kv_shapes=shapes)
        for i, spec in enumerate(extra, start=cfg.num_layers):
            if not isinstance(spec, CompressedSpec):
                raise TypeError(f"cache spec {i} (after the layers') is not a CompressedSpec: {spec}")
            attn._entry_specs[i] = spec
        return attn

    @property
    def num_tokens(self) -> int:
        """Tokens stored for the last layer (the sequence length once a forward has finished)."""
        return self._lengths[-1]

    def reset(self) -> None:
        self._lengths = [0] * len(self._lengths)

    def all_decode_args(self, layer_idx: int) -> DecodeArgs | None:
        return None  # not the paged cache: the layers run one by one

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        raise NotImplementedError("DenseAttention keeps attention layers only")

    def _append_rows(self, layer_idx: int, rows: Tensor) -> tuple[Tensor, int, int]:
        """``rows`` stored after the layer's previous ones: (the store, first position, end)."""
        start = self._lengths[layer_idx]
        end = start + rows.shape[0]
        store = self._rows.get(layer_idx)
        if store is None or store.shape[0] < end:
            capacity = max(end, 2 * (0 if store is None else store.shape[0]), self._keys[layer_idx].shape[0])
            grown = torch.empty(capacity, rows.shape[1], dtype=self.dtype, device=self.device)
            if store is not None:
                grown[:start] = store[:start]
            store = self._rows[layer_idx] = grown
        store[start:end] = rows
        self._lengths[layer_idx] = end
        return store, start, end

    def rows(self, layer_idx: int, rows: Tensor, *, entries: int | None = None) -> RowSpans:
        """The rows stored; one span: this chunk over positions 0 .. end - 1 (`RowSpans`); with
        ``entries``, that stream's store (entry w at row w, grown as needed) and its slots."""
        store, start, end = self._append_rows(layer_idx, rows)
        span = ((0, end - start, torch.arange(end, device=self.device)),)
        if entries is None:
            return RowSpans(store, span)
        spec = self._entry_specs[entries]
        count = end // spec.rate
        stream = self._rows.get(entries)
        if stream is None or stream.shape[0] < count:
            grown = torch.zeros(max(count, 2 * (0 if stream is None else stream.shape[0]), 1), spec.row_dim,
                                dtype=self.dtype, device=self.device)
            if stream is not None:
                grown[: stream.shape[0]] = stream
            stream = self._rows[entries] = grown
        return RowSpans(store, span, stream, (torch.arange(count, device=self.device),))

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor:
        store, start, end = self._append_rows(layer_idx, rows)
        if index is not None:
            out = sparse_attention(q_nope, q_rope, store[:end], projection, scale, start, index, self._selection)
            return out.to(q_nope.dtype)
        if end - start == 1 and start > 0:  # decode: the absorbed form
            q = absorb_query(q_nope, q_rope, projection)
            latent = absorbed_attention(q, store[None, :end], None, scale, projection.rank)
            return absorbed_output(latent, projection).to(q_nope.dtype)
        return chunk_attention(q_nope, q_rope, store[:end], projection, scale, start).to(q_nope.dtype)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, *,
                 sinks: Tensor | None = None) -> Tensor:
        num_new = q.shape[0]
        start = self._lengths[layer_idx]
        end = start + num_new
        if end > self._keys[layer_idx].shape[0]:
            self._grow(layer_idx, end)
        keys = self._keys[layer_idx]
        values = self._values[layer_idx]
        keys[start:end] = k
        values[start:end] = v
        self._lengths[layer_idx] = end
        window = self._windows[layer_idx]
        if sinks is not None:
            return self._with_sinks(q, keys, values, start, end, window, scale, sinks)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group_size = num_heads // num_kv_heads
        if window is not None:
            return self._windowed(q, keys, values, start, end, window, scale)
        # [1, num_kv_heads, end, head_dim] views of the token-major cache.
        keys = keys[:end].transpose(0, 1).unsqueeze(0)
        values = values[:end].transpose(0, 1).unsqueeze(0)
        if num_new == 1:
            # Decode: the query heads sharing a kv head act as that head's queries; no causal mask.
            qg = q.view(1, num_kv_heads, group_size, head_dim)
            return F.scaled_dot_product_attention(qg, keys, values, scale=scale).view(1, num_heads, head_dim)
        qh = q.transpose(0, 1).unsqueeze(0)
        gqa = group_size > 1
        if start == 0:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=gqa, scale=scale)
        else:
            # Query i sits at absolute position start + i and sees keys 0 .. start + i.
            mask = torch.ones(num_new, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale)
        return out[0].transpose(0, 1)

    def _windowed(self, q: Tensor, keys: Tensor, values: Tensor, start: int, end: int, window: int,
                  scale: float | None) -> Tensor:
        """Attention of the queries at positions start .. end - 1 over keys within ``window``."""
        first = max(0, start + 1 - window)  # the first key the first query sees
        keys = keys[first:end].transpose(0, 1).unsqueeze(0)
        values = values[first:end].transpose(0, 1).unsqueeze(0)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = keys.shape[1]
        group_size = num_heads // num_kv_heads
        if end - start == 1:
            qg = q.view(1, num_kv_heads, group_size, head_dim)
            return F.scaled_dot_product_attention(qg, keys, values, scale=scale).view(1, num_heads, head_dim)
        query_pos = torch.arange(start, end, device=q.device)[:, None]
        key_pos = torch.arange(first, end, device=q.device)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                             enable_gqa=group_size > 1, scale=scale)
        return out[0].transpose(0, 1)

    def _with_sinks(self, q: Tensor, keys: Tensor, values: Tensor, start: int, end: int, window: int | None,
                    scale: float | None, sinks: Tensor) -> Tensor:
        first = 0 if window is None else max(0, start + 1 - window)
        kh = keys[first:end].transpose(0, 1).unsqueeze(0)
        vh = values[first:end].transpose(0, 1).unsqueeze(0)
        query_pos = torch.arange(start, end, device=q.device)[:, None]
        key_pos = torch.arange(first, end, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        out = sink_attention(q.transpose(0, 1).unsqueeze(0), kh, vh, sinks,
                             q.shape[2] ** -0.5 if scale is None else scale, mask)
        return out[0].transpose(0, 1)

    def _alloc(self, capacity: int, layer_idx: int) -> Tensor:
        heads, dim = self._shapes[layer_idx]
        return torch.empty(capacity, heads, dim, dtype=self.dtype, device=self.device)

    def _grow(self, layer_idx: int, needed: int) -> None:
        capacity = self._keys[layer_idx].shape[0]
        while capacity < needed:
            capacity *= 2
        length = self._lengths[layer_idx]
        for store in (self._keys, self._values):
            grown = self._alloc(capacity, layer_idx)
            grown[:length] = store[layer_idx][:length]
            store[layer_idx] = grown


@torch.inference_mode()
def greedy_generate(model: FusedDecoderLM, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Iterable[int] = ()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (the stop token, if reached, is included)."""
    stop = frozenset(eos_token_ids)
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    attn = DenseAttention.for_model(model, initial_capacity=len(prompt_ids) + max_new_tokens)
    device = model.embed_tokens.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(prompt_ids), dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(ids, positions, attn)
        token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1).item())
        out.append(token)
        if token in stop:
            break
        next_pos = int(positions[-1].item()) + 1
        ids = torch.tensor([token], dtype=torch.long, device=device)
        positions = torch.tensor([next_pos], dtype=torch.long, device=device)
    return out
