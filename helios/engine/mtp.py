"""MTP speculation: a checkpoint's multi-token-prediction layer drafts (`models.mtp.MultiTokenPredictor`).

One `MTPDrafter` per engine owns the predictor, its own KV page pool (the MTP block's one attention
layer: a `KVCacheManager` or a `KVCacheCoordinator` behind a `TorchPagedBackend`, with its own
prefix cache) and a persistent input batch for it. Every speculating request gets a `LearnedProposer`
(the scheduler's proposer chain, after the n-gram and history lookups: `speculative.FirstOf`).

The predictor reads, at position p, the target model's hidden state at p and token p + 1, and its
output there predicts token p + 2. Its cache therefore lags the target's by one position: with
committed tokens ``t[0 .. n-1]`` the target has computed positions ``0 .. n-2`` and the predictor
can compute exactly those. Per request the drafter keeps

- ``exact``: the predictor positions whose K/V were computed from committed tokens and the target's
  hidden states (the K/V of draft positions past it are overwritten when those positions are
  computed exactly);
- the target's hidden states for positions ``exact ..``, handed over by the runner after each
  forward (`capture`, `runner.ModelRunner.hidden_sink`: every row of every chunk of a speculating
  request; the model's last layer then runs for all rows, not only the sampled ones). Rows whose
  next token is committed already (a prefill chunk's, all but the last of the prompt) are run at
  once, so a prompt's hidden states are never held whole; a decode or verification chunk's wait
  for `propose`, which knows which of them the target accepted (rows past the committed tokens are
  dropped: they followed a rejected draft);
- the output ``g`` at position ``exact - 1`` (the first draft's logits).

`propose(tokens, depth)` runs the predictor over the positions the target computed since (one
forward for all of them, its output at ``n - 2`` giving draft 1), then one forward per further
draft: position ``n - 2 + j`` reads draft j as its token and the output before it as its hidden
state. Drafts are greedy (argmax within the tokenizer's ids): a deterministic proposer, verified
exactly by the target (`speculative`'s docstring).

Prefix cache: the predictor's K/V at position p depend on tokens ``0 .. p + 1``, so its page j is
registered under the chain hash of the token pairs ``(t[i], t[i+1])`` of its positions (the pairs
chained from position 0: tokens ``0 .. (j + 1) * page_size``), once computed exactly. When the
target admits a request after a prefix-cache hit of h pages it computes (and hands over) hidden
states from position ``h * page_size`` only; the drafter then takes the same h pages from its own
prefix cache. Where it has fewer (its pages were evicted, or its pool missed pages earlier), the
request drafts nothing from the predictor until it leaves the batch (`off`).

A request's state (pages, batch row, held hidden states) is released when it finishes, is aborted or
is preempted (`Proposer.release`, called by the scheduler); a recomputed request starts over with
its new prefill's hidden states. `check_integrity(live)` checks the pool and that the drafter holds
state for live requests only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import attrs
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.drafter import LearnedProposer, draft_pool
from helios.engine.kv.layout import CacheLayout
from helios.engine.records import EngineRequest
from helios.engine.runner import InputBatch
from helios.engine.scheduler import RequestState, ScheduledChunk
from helios.engine.speculative import MTP_KIND
from helios.models.mtp import MultiTokenPredictor

_GREEDY = SamplingParams(temperature=0.0)
_PAIR_SHIFT = 32  # a token pair (a, b) hashes as a << 32 | b (token ids are below 2**31)


@attrs.define(eq=False)
class _State:
    seq: RequestState
    """The predictor's inputs: ``seq.token_ids[p]`` is the token at position p + 1 (then drafts)."""
    exact: int = 0
    pending: Tensor | None = None
    """The target's hidden states at positions ``exact ..`` (None: none)."""
    tail: Tensor | None = None
    """The output at position ``exact - 1`` [1, hidden] (None: not computed in this batch stay)."""


class MTPDrafter:
    """The MTP module and its KV pool, shared by every speculating request. Engine-thread state."""

    def __init__(self, predictor: MultiTokenPredictor, dtype: torch.dtype, device: str | torch.device = "cpu", *,
                 num_pages: int, page_size: int, max_active: int, max_model_len: int, prefix_caching: bool = True,
                 fingerprint: bytes = b"", token_vocab_size: int | None = None, kv_prefault: bool = False) -> None:
        """``num_pages`` of ``page_size`` positions for the block's K/V; ``max_active``: the
        requests it drafts for at once; ``max_model_len``: no position at or past it is drafted;
        ``token_vocab_size``: the tokenizer's ids (drafts never leave them); ``fingerprint``: the
        target's, in every chain hash of the pool (with the predictor's mark)."""
        layout = CacheLayout.from_specs(predictor.cache_specs())
        if layout.has_recurrent:
            raise ValueError("an MTP block with recurrent layers cannot draft")
        self.predictor = predictor
        self.device = torch.device(device)
        self.attention, self.kv = draft_pool(layout, num_pages, page_size, dtype, self.device, max_active=max_active,
                                             prefix_caching=prefix_caching, fingerprint=fingerprint + b"|mtp",
                                             kv_prefault=kv_prefault)
        self.batch = InputBatch(max_active, -(-(max_model_len + 1) // page_size), page_size, self.device,
                                num_groups=len(layout.paged_groups))
        self.max_model_len = max_model_len
        vocab = predictor.vocab_size
        self.vocab = min(vocab, token_vocab_size or vocab)
        self._states: dict[str, _State] = {}
        self._off: set[str] = set()
        self._freed: list[str] = []
        self.forward_tokens = 0
        """Positions the predictor ran (exact ones and drafts): the engine's ``draft_steps``."""
        self.draft_tokens = 0
        """Drafts it produced."""
        self.pool_misses = 0
        """Requests turned off because the pool had no page for them."""
        self.cache_misses = 0
        """Requests turned off because the target reused a prefix its own prefix cache lacked."""

    @property
    def num_states(self) -> int:
        """Requests the drafter holds state for (pages, a batch row, hidden states)."""
        return len(self._states)

    def proposer(self, request_id: str) -> LearnedProposer:
        return LearnedProposer(self, request_id, MTP_KIND)

    # -- the runner's side ------------------------------------------------------------------
    def capture(self, seq: RequestState, start: int, hidden: Tensor) -> None:
        """The target's hidden states [length, hidden] at positions ``start ..`` of ``seq``'s chunk
        (read during the runner's step, before its tokens are committed). Rows whose next token is
        committed are run now; the others wait for `propose`."""
        rid = seq.request_id
        if rid in self._off:
            return
        st = self._states.get(rid)
        if st is None:
            st = self._start(rid, seq.token_ids, start)
            if st is None:
                return
        held = 0 if st.pending is None else st.pending.shape[0]
        if start > st.exact + held:  # a gap: the hidden states of some positions never came
            self._turn_off(rid)
            return
        if start < st.exact:
            hidden = hidden[st.exact - start :]
            start = st.exact
        rows = hidden.detach().clone()
        if st.pending is not None and start > st.exact:
            rows = torch.cat((st.pending[: start - st.exact], rows))
        st.pending = rows if rows.shape[0] else None
        ready = min(st.exact + (0 if st.pending is None else st.pending.shape[0]), len(seq.token_ids) - 1) - st.exact
        if ready > 0:
            self._advance(rid, st, seq.token_ids, ready)

    # -- the scheduler's side ---------------------------------------------------------------
    def propose(self, request_id: str, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        """Up to ``depth`` greedy drafts after ``token_ids`` (the request's committed tokens)."""
        n = len(token_ids)
        depth = min(depth, self.max_model_len - n)
        st = self._states.get(request_id)
        if depth <= 0 or st is None or request_id in self._off:
            return ()
        with torch.inference_mode():  # the held hidden states are the runner's (inference) tensors
            return self._propose(request_id, st, token_ids, depth)

    def _propose(self, request_id: str, st: _State, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        n = len(token_ids)
        held = 0 if st.pending is None else st.pending.shape[0]
        ready = min(st.exact + held, n - 1) - st.exact
        if ready < 0 or st.exact + ready != n - 1:  # the target's hidden states of a committed position are missing
            return ()
        if ready > 0:
            if not self._advance(request_id, st, token_ids, ready):
                return ()
        st.pending = None  # rows past n - 1 followed rejected drafts
        if st.tail is None:
            return ()
        g = st.tail
        drafts = [self._draft(g)]
        position = n - 1
        while len(drafts) < depth:
            # Position n - 2 + j: draft j as its token, the output before it as its hidden state.
            if self.kv.allocate_slots(request_id, position, 1) is None:
                break
            del st.seq.token_ids[position:]
            st.seq.token_ids.append(drafts[-1])
            g = self._run(st, position, 1, g)
            drafts.append(self._draft(g))
            position += 1
        self.draft_tokens += len(drafts)
        return tuple(drafts)

    def release(self, request_id: str) -> None:
        """Free the request's pages, batch row and held hidden states (idempotent); it may start
        again (a preempted request's recompute)."""
        self._off.discard(request_id)
        if self._states.pop(request_id, None) is None:
            return
        self.kv.free(request_id)
        self._freed.append(request_id)

    def check_integrity(self, live: Sequence[str] | None = None) -> None:
        """The pool's own checks, each state's pages and held rows; with ``live`` (the requests that
        may speculate), that the drafter holds state for none other."""
        self.kv.check_integrity()
        ps = self.kv.page_size
        for rid, st in self._states.items():
            assert rid not in self._off, f"{rid}: off yet holding state"
            assert len(self.kv.block_table(rid)) * ps >= st.exact, f"{rid}: fewer pages than exact positions"
            assert len(st.seq.token_ids) >= st.exact, f"{rid}: fewer inputs than exact positions"
            assert st.tail is None or st.tail.shape[0] == 1
        if live is not None:
            stale = (set(self._states) | self._off) - set(live)
            assert not stale, f"MTP state held for requests that ended: {sorted(stale)}"

    # -- helpers ----------------------------------------------------------------------------
    def _start(self, rid: str, token_ids: Sequence[int], start: int) -> _State | None:
        """A request's state at its first captured position ``start`` (after the target's prefix
        hit, if any: the same pages from this pool's prefix cache, else None and the request off)."""
        request = EngineRequest(rid, (), _GREEDY, max_tokens=self.max_model_len)
        st = _State(RequestState(request, [], 0, None, 0))
        if start > 0:
            ps = self.kv.page_size
            hits, hashes = self.kv.lookup(_Pairs(token_ids))
            need = start // ps
            if start % ps or len(hits) < need or not self.kv.can_admit(start + 1, hits[:need]):
                self.cache_misses += 1
                self._off.add(rid)
                return None
            self.kv.allocate_cached(rid, hits[:need], hashes)
            st.exact = start
            st.seq.token_ids.extend(token_ids[1 : start + 1])
        self._states[rid] = st
        return st

    def _advance(self, rid: str, st: _State, token_ids: Sequence[int], count: int) -> bool:
        """Run positions ``exact .. exact + count - 1`` exactly (their next tokens are committed, their
        hidden states held); False when the pool has no page for them (the request is then off)."""
        assert st.pending is not None and st.pending.shape[0] >= count
        start = st.exact
        if self.kv.allocate_slots(rid, start, count) is None:
            self.pool_misses += 1
            self._turn_off(rid)
            return False
        del st.seq.token_ids[start:]
        st.seq.token_ids.extend(token_ids[start + 1 : start + count + 1])
        st.tail = self._run(st, start, count, st.pending[:count])
        st.exact = start + count
        st.pending = st.pending[count:] if st.pending.shape[0] > count else None
        self.kv.cache_full_pages(rid, _Pairs(token_ids), st.exact)
        return True

    def _run(self, st: _State, start: int, length: int, hidden: Tensor) -> Tensor:
        """One predictor forward over positions ``start .. start + length - 1`` of the request's
        inputs and the hidden states ``hidden`` [length, hidden]: the last position's output [1, hidden]."""
        batch = self.batch
        batch.release(self._take_freed())
        step = batch.prepare([ScheduledChunk(st.seq, start, length, False)], self.kv)
        attn = self.attention.build(step.attention)
        last = torch.tensor([length - 1], device=self.device)
        with torch.inference_mode():
            out = self.predictor(step.input_ids, step.positions, hidden.to(self.device), attn, keep=last)
        self.forward_tokens += length
        return out

    def _draft(self, g: Tensor) -> int:
        with torch.inference_mode():
            logits = self.predictor.compute_logits(g)
        return int(logits[0, : self.vocab].argmax())

    def _turn_off(self, rid: str) -> None:
        self.release(rid)
        self._off.add(rid)

    def _take_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed


class _Pairs(Sequence[int]):
    """A request's tokens as the pairs ``(t[i], t[i+1])`` of the predictor's positions (one int each),
    for its pool's chain hashes. The last entry pairs the last token with a placeholder: hashes
    never reach it (a lookup leaves the last entry, registration stops at the exact positions)."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def _pair(self, i: int) -> int:
        ids = self._ids
        nxt = ids[i + 1] if i + 1 < len(ids) else (1 << _PAIR_SHIFT) - 1
        return (ids[i] << _PAIR_SHIFT) | nxt

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self._pair(i) for i in range(*index.indices(len(self._ids)))]
        if index < 0:
            index += len(self._ids)
        return self._pair(index)
