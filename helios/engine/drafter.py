"""Draft-model speculation: a second, smaller model with the target's vocabulary drafts greedily.

One `Drafter` per engine owns the draft model, its own KV page pool (a `KVCacheManager`, or a
`KVCacheCoordinator` for other layouts, behind a `TorchPagedBackend`) and a `ModelRunner` over them.
Every speculating request gets a `LearnedProposer` (the scheduler's proposer chain, after the
n-gram and history lookups: `speculative.FirstOf`), which asks the drafter for its drafts.

Per request the drafter keeps a `RequestState` of its own (the request's id, the tokens whose K/V
its pages hold, and after them the one draft sampled last, not computed). `propose(tokens, depth)`:

- keeps the longest prefix its tokens share with the request's ``tokens`` (the committed ones; the
  drafts the target rejected are dropped, and the draft pool's pages past them trimmed), so when
  ``tokens`` is a prefix of what it holds, the drafts it already made are reused as they are;
- prefills what is new (the accepted drafts and the target's own token; a whole prompt the first
  time, in chunks of ``prefill_chunk_size``, after the longest prefix the draft pool's prefix cache
  holds; a chunk of at most 16 positions after some context as decode rows, the model's decode
  path) and greedy-decodes until ``depth`` drafts follow ``tokens``: one draft-model forward per
  draft, the first together with the new tokens.

The drafts are greedy, so a function of the request's tokens only: a deterministic proposer, whose
drafts the target verifies exactly (`speculative`'s docstring). With a ``vocab_prefix`` (``[speculative]
draft_vocab``, for byte-level BPE vocabularies: `runtime.draft_vocab_prefix`) the draft model ranks
them over the first token ids alone, its output projection's first rows (`interface.PrefixLogitsLM`):
a byte-level BPE vocabulary's ids follow the order its merges were learned, most frequent first, so
the first 65,536 of Qwen2.5's 151,936 hold 97.7% of the tokens of Helios's own Python source and
98.2% of its docs, and a draft of any later id is a draft the target rejects; the output stays the
target's, which verifies every draft. The draft pool registers only pages
of committed tokens in its prefix cache. A request's drafter state is released (`release`: its pages
freed, its batch row handed back) when it finishes, is aborted or is preempted (`Proposer.release`,
called by the scheduler), and when the draft pool cannot give it the pages a round needs (that
round then has the drafts made so far, maybe none).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol, cast

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.attention import TorchPagedBackend
from helios.engine.kv.coordinator import KVCacheCoordinator, KVManager
from helios.engine.kv.layout import CacheLayout
from helios.engine.kv.manager import KVCacheManager
from helios.engine.records import EngineRequest
from helios.engine.runner import ModelRunner
from helios.engine.sampling import Sampler
from helios.engine.scheduler import RequestState, ScheduledChunk, SchedulerOutput
from helios.engine.speculative import DRAFT_MODEL_KIND
from helios.models.interface import CausalLM, PrefixLogitsLM

_GREEDY = SamplingParams(temperature=0.0)
_CATCH_UP_AS_DECODE = 16  # positions of a chunk after the request's context that run as decode rows


class Drafter:
    """The draft model and its KV pool, shared by every speculating request. Engine-thread state."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, device: str | torch.device = "cpu", *,
                 num_pages: int, page_size: int, max_active: int, max_model_len: int,
                 prefill_chunk_size: int = 512, prefix_caching: bool = True, fingerprint: bytes = b"",
                 token_vocab_size: int | None = None, kv_prefault: bool = False, vocab_prefix: int = 0) -> None:
        """``num_pages`` of ``page_size`` tokens for the draft model's K/V; ``max_active``: the
        requests it drafts for at once (the target's); ``max_model_len``: the longest context it
        drafts in (no drafts past it); ``token_vocab_size``: the tokenizer's ids (drafts never
        leave them); ``kv_prefault``: touch the whole pool at start (as the target's, `EngineConfig`);
        ``vocab_prefix``: rank the drafts over the first token ids alone (0: all; the module docstring)."""
        layout = CacheLayout.from_specs(model.cache_specs())
        if layout.has_recurrent:
            raise ValueError("a draft model with recurrent layers cannot draft: rejected drafts would need a "
                             "state rollback")
        self.model = model
        self.device = torch.device(device)
        self.attention, self.kv = draft_pool(layout, num_pages, page_size, dtype, self.device, max_active=max_active,
                                             prefix_caching=prefix_caching, fingerprint=fingerprint,
                                             kv_prefault=kv_prefault)
        if vocab_prefix < 0:
            raise ValueError(f"vocab_prefix must be 0 (the whole vocabulary) or positive, got {vocab_prefix}")
        vocab = min(model.vocab_size, token_vocab_size or model.vocab_size)
        self.vocab_prefix = vocab_prefix if 0 < vocab_prefix < vocab and isinstance(model, PrefixLogitsLM) else 0
        """The token ids the drafts are ranked over (0: all the tokenizer's)."""
        self.sampler = Sampler(self.vocab_prefix or vocab, device=self.device)
        self.runner = ModelRunner(model, self.attention, self.kv, self.sampler, self.device, max_rows=max_active,
                                  max_model_len=max_model_len)
        # The tokens a round adds after the drafts the target accepted (its last draft and the target's
        # own token: two positions when it took them all) run as decode rows, through the model's
        # decode path: the 0.5B's forward of 2 positions 9.9 ms against 12.4-12.8 as a prefill chunk (1
        # position: 8.3-8.6 ms; 2026-12-06, the Zen 5 VM, a cold code-writing request in process).
        self.runner.batch.short_chunks_as_decode = _CATCH_UP_AS_DECODE
        if self.vocab_prefix:
            self.runner.compute_logits = functools.partial(cast(PrefixLogitsLM, model).compute_logits_prefix,
                                                           rows=self.vocab_prefix)
        self.max_model_len = max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        self._states: dict[str, RequestState] = {}
        self._committed: dict[str, int] = {}  # request -> committed tokens at its last `propose`
        self._freed: list[str] = []
        self._trimmed: dict[str, int] = {}
        self.draft_tokens = 0
        """Drafts the draft model produced (its decode positions), reused ones counted once."""
        self.forward_tokens = 0
        """Positions the draft model ran (prefill and decode)."""
        self.pool_misses = 0
        """Rounds cut short because the draft pool had no page for them (the request's state released)."""

    @property
    def num_states(self) -> int:
        """Requests the drafter holds state (pages, a batch row) for."""
        return len(self._states)

    def proposer(self, request_id: str) -> LearnedProposer:
        return LearnedProposer(self, request_id, DRAFT_MODEL_KIND)

    def propose(self, request_id: str, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        """Up to ``depth`` greedy draft-model tokens after ``token_ids`` (the request's committed
        tokens; across calls for one request the list only grows)."""
        depth = min(depth, self.max_model_len - len(token_ids))
        if depth <= 0 or not token_ids:
            return ()
        st = self._states.get(request_id)
        n = len(token_ids)
        if st is None:
            st = self._start(request_id, token_ids)
        else:
            known = st.token_ids
            # The committed tokens of the last call are still a prefix (the list only grows): compare
            # from there, over the drafts made after them.
            same = self._committed[request_id]
            limit = min(len(known), n)
            while same < limit and known[same] == token_ids[same]:
                same += 1
            if same < n:  # the target rejected a draft (or went past them): drop what differs
                del known[same:]
                known.extend(token_ids[same:])
                if st.num_computed > same:
                    st.num_computed = same
                    if self.kv.trim(request_id, same):
                        kept = len(self.kv.block_table(request_id))
                        self._trimmed[request_id] = min(kept, self._trimmed.get(request_id, kept))
        self._committed[request_id] = n
        known = st.token_ids
        while len(known) - n < depth:
            start = st.num_computed  # at most len(known) - 1: the last token is never computed
            length = min(len(known) - start, self.prefill_chunk_size)
            if self.kv.allocate_slots(request_id, start, length) is None:
                drafts = tuple(known[n:n + depth])
                self.pool_misses += 1
                self.release(request_id)
                return drafts
            samples = start + length == len(known)
            out = SchedulerOutput((ScheduledChunk(st, start, length, samples),), freed=self._take_freed(),
                                  trimmed=self._take_trimmed())
            result = self.runner.execute(out)
            st.num_computed = start + length
            self.forward_tokens += length
            self.kv.cache_full_pages(request_id, known, min(st.num_computed, n))
            if samples:
                known.append(result.sampled[request_id][0])
                self.draft_tokens += 1
        return tuple(known[n:n + depth])

    def prefetch(self, request_id: str, token_ids: Sequence[int], depth: int) -> None:
        """Nothing ahead: the draft model drafts for each request when it is asked."""

    def release(self, request_id: str) -> None:
        """Free the request's draft pages and batch row (idempotent)."""
        if self._states.pop(request_id, None) is None:
            return
        self._committed.pop(request_id, None)
        self._trimmed.pop(request_id, None)
        self.kv.free(request_id)
        self._freed.append(request_id)

    def check_integrity(self, live: Sequence[str] | None = None) -> None:
        """The draft pool's own checks; with ``live`` (the requests that may speculate), that the
        drafter holds state for none other."""
        self.kv.check_integrity()
        for rid, st in self._states.items():
            assert len(self.kv.block_table(rid)) * self.kv.page_size >= st.num_computed
            assert st.num_computed < len(st.token_ids)
        if live is not None:
            stale = set(self._states) - set(live)
            assert not stale, f"drafter state held for requests that ended: {sorted(stale)}"

    def _start(self, request_id: str, token_ids: Sequence[int]) -> RequestState:
        request = EngineRequest(request_id, (), _GREEDY, max_tokens=self.max_model_len)
        st = RequestState(request, list(token_ids), 0, None, 0)
        hits, hashes = self.kv.lookup(token_ids)
        if hits and self.kv.can_admit(len(token_ids) + 1, hits):
            self.kv.allocate_cached(request_id, hits, hashes)
            st.num_computed = len(hits) * self.kv.page_size
        self._states[request_id] = st
        self._committed[request_id] = len(token_ids)
        return st

    def _take_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def _take_trimmed(self) -> tuple[tuple[str, int], ...]:
        trimmed, self._trimmed = tuple(self._trimmed.items()), {}
        return trimmed


def draft_pool(layout: CacheLayout, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device, *,
               max_active: int, prefix_caching: bool, fingerprint: bytes,
               kv_prefault: bool) -> tuple[TorchPagedBackend, KVManager]:
    """A learned drafter's own KV pool over ``layout`` (the draft model's, or the MTP block's): the
    attention backend with its cache (touched whole with ``kv_prefault``) and the page manager, one
    `KVCacheManager` for a single full-attention group, else a `KVCacheCoordinator`."""
    attention = TorchPagedBackend.for_layout(layout, num_pages, page_size, dtype, device, num_state_slots=max_active)
    if kv_prefault:
        attention.kv.prefault()
    kv: KVManager
    if layout.is_single_full:
        kv = KVCacheManager(num_pages, page_size, enable_caching=prefix_caching, fingerprint=fingerprint)
    else:
        kv = KVCacheCoordinator(layout, num_pages, page_size, enable_caching=prefix_caching,
                                fingerprint=fingerprint, num_state_slots=max_active)
    return attention, kv


class LearnedDrafter(Protocol):
    """What a learned drafter offers its per-request proposers (`Drafter`, `mtp.MTPDrafter`)."""

    def propose(self, request_id: str, token_ids: Sequence[int], depth: int) -> tuple[int, ...]: ...

    def prefetch(self, request_id: str, token_ids: Sequence[int], depth: int) -> None: ...

    def release(self, request_id: str) -> None: ...


class LearnedProposer:
    """One request's drafts from a learned drafter shared by the engine's requests: the draft model
    (kind `DRAFT_MODEL_KIND`) or the checkpoint's MTP layer (`MTP_KIND`)."""

    def __init__(self, drafter: LearnedDrafter, request_id: str, kind: str) -> None:
        self.drafter = drafter
        self.request_id = request_id
        self.kind = kind
        self.last_kind: str | None = kind

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        return self.drafter.propose(self.request_id, token_ids, depth)

    def prefetch(self, token_ids: Sequence[int], depth: int) -> None:
        self.drafter.prefetch(self.request_id, token_ids, depth)

    def release(self) -> None:
        self.drafter.release(self.request_id)
