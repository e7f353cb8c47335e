"""MTP speculation: a checkpoint's multi-token-prediction layer drafts (`models.mtp.MultiTokenPredictor`).

One `MTPDrafter` per engine owns the predictor, its own KV page pool (the MTP block's one attention
layer: a `KVCacheManager` or a `KVCacheCoordinator` behind a `TorchPagedBackend`, with its own
prefix cache) and a persistent input batch for it. Every speculating request gets a `LearnedProposer`
(the scheduler's proposer chain, after the n-gram and history lookups: `speculative.FirstOf`).

The predictor reads, at position p, the target model's hidden state at p and token p + 1, and its
output there predicts token p + 2. (A `models.interface.DraftFeatureLM` target hands over other
features in place of its hidden states, DeepSeek V4 its residual streams before the HyperHead; the
drafter holds and feeds back whatever rows the runner and the predictor give it.) Its cache therefore lags the target's by one position: with
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

Joint drafting: before a step's decode rounds are planned the scheduler announces each round
(`prefetch`: the request's tokens and the depth its round will ask for, `Proposer.prefetch`). The
first `propose` of the step then drafts for every announced request at once: one forward over all
their caught-up positions, then one forward per depth with a position of each request still
drafting (`_propose_many`); the others' drafts are kept (``_ready``) and served by their own
`propose` when it asks no deeper (a deeper ask, or tokens that changed, computes again).

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

import itertools
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
        self.forwards = 0
        """Predictor forwards (a batched one counted once)."""
        self.joint_rounds = 0
        """Rounds whose drafts were computed in an earlier request's `propose`, with its own."""
        self._wanted: dict[str, tuple[Sequence[int], int, int]] = {}
        """Requests announced (`prefetch`): their committed tokens, how many then, the depth asked."""
        self._ready: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        """Drafts computed with another request's (committed tokens, depth asked, drafts)."""

    @property
    def num_states(self) -> int:
        """Requests the drafter holds state for (pages, a batch row, hidden states)."""
        return len(self._states)

    def proposer(self, request_id: str) -> LearnedProposer:
        return LearnedProposer(self, request_id, MTP_KIND)

    # -- the runner's side ------------------------------------------------------------------
    def capture(self, seq: RequestState, start: int, hidden: Tensor) -> None:
        """The target's hidden states (or features) [length, features] at positions ``start ..`` of
        ``seq``'s chunk (read during the runner's step, before its tokens are committed). Rows whose
        next token is committed are run now; the others wait for `propose`."""
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
    def prefetch(self, request_id: str, token_ids: Sequence[int], depth: int) -> None:
        """This step's `propose` for the request will come with ``token_ids`` and at most ``depth``:
        the first `propose` of the step computes the drafts of every request announced since, together."""
        depth = min(depth, self.max_model_len - len(token_ids))
        self._ready.pop(request_id, None)
        if depth > 0 and request_id in self._states and request_id not in self._off:
            self._wanted[request_id] = (token_ids, len(token_ids), depth)
        else:
            self._wanted.pop(request_id, None)

    def propose(self, request_id: str, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        """Up to ``depth`` greedy drafts after ``token_ids`` (the request's committed tokens): the
        ones computed for it with others' (`prefetch`) when they cover ``depth``, else computed now
        together with the other announced requests'."""
        n = len(token_ids)
        depth = min(depth, self.max_model_len - n)
        st = self._states.get(request_id)
        if depth <= 0 or st is None or request_id in self._off:
            return ()
        ready = self._ready.pop(request_id, None)
        if ready is not None and ready[0] == n and depth <= ready[1]:
            self.joint_rounds += 1
            return ready[2][:depth]
        wanted = self._wanted.pop(request_id, None)
        items = [(request_id, st, token_ids, depth if wanted is None or wanted[1] != n else max(depth, wanted[2]))]
        for rid, (ids, length, d) in self._wanted.items():
            other = self._states.get(rid)
            if other is not None and len(ids) == length:  # announced this step (its tokens unchanged)
                items.append((rid, other, ids, d))
        self._wanted.clear()
        with torch.inference_mode():  # the held hidden states are the runner's (inference) tensors
            drafts = self._propose_many(items)
        for rid, _, ids, d in items[1:]:
            if rid in self._states:  # not turned off on the way
                self._ready[rid] = (len(ids), d, drafts[rid])
        return drafts[request_id][:depth]

    def _propose_many(self, items: Sequence[tuple[str, _State, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """Each item's (request, state, committed tokens, depth) drafts: one forward over every
        request's positions the target computed since (their outputs at ``n - 2`` give draft 1),
        then one forward per further draft depth, a position of each request still drafting."""
        out: dict[str, tuple[int, ...]] = {}
        catch_up: list[tuple[_State, int, int, Tensor]] = []
        caught: list[tuple[str, Sequence[int]]] = []
        live: list[tuple[str, _State, Sequence[int], int]] = []
        for rid, st, token_ids, depth in items:
            out[rid] = ()
            n = len(token_ids)
            held = 0 if st.pending is None else st.pending.shape[0]
            ready = min(st.exact + held, n - 1) - st.exact
            if ready < 0 or st.exact + ready != n - 1:  # the target's hidden states of a committed position are missing
                continue
            if ready > 0:
                assert st.pending is not None
                if self.kv.allocate_slots(rid, st.exact, ready) is None:
                    self.pool_misses += 1
                    self._turn_off(rid)
                    continue
                del st.seq.token_ids[st.exact :]
                st.seq.token_ids.extend(token_ids[st.exact + 1 : n])
                catch_up.append((st, st.exact, ready, st.pending[:ready]))
                caught.append((rid, token_ids))
            live.append((rid, st, token_ids, depth))
        if catch_up:
            tails = self._run_many(catch_up)
            for (st, start, count, _), (rid, token_ids), tail in zip(catch_up, caught, tails, strict=True):
                st.tail = tail[None]
                st.exact = start + count
                self.kv.cache_full_pages(rid, _Pairs(token_ids), st.exact)
        chains: list[tuple[str, _State, int, int, list[int]]] = []
        gs: list[Tensor] = []
        for rid, st, token_ids, depth in live:
            st.pending = None  # rows past n - 1 followed rejected drafts
            if st.tail is not None:
                chains.append((rid, st, len(token_ids), depth, []))
                gs.append(st.tail)
        while chains:
            g = torch.cat(gs)
            for (_, _, _, _, drafts), d in zip(chains, self._drafts(g), strict=True):
                drafts.append(d)
            step: list[tuple[_State, int, int, Tensor]] = []
            going: list[tuple[str, _State, int, int, list[int]]] = []
            for i, (rid, st, n, depth, drafts) in enumerate(chains):
                # Position n - 2 + j: draft j as its token, the output before it as its hidden state.
                position = n - 2 + len(drafts)
                if len(drafts) >= depth or self.kv.allocate_slots(rid, position, 1) is None:
                    self.draft_tokens += len(drafts)
                    out[rid] = tuple(drafts)
                    continue
                del st.seq.token_ids[position:]
                st.seq.token_ids.append(drafts[-1])
                step.append((st, position, 1, g[i : i + 1]))
                going.append((rid, st, n, depth, drafts))
            chains = going
            if step:
                gs = list(self._run_many(step).split(1))
        return out

    def release(self, request_id: str) -> None:
        """Free the request's pages, batch row and held hidden states (idempotent); it may start
        again (a preempted request's recompute)."""
        self._off.discard(request_id)
        self._wanted.pop(request_id, None)
        self._ready.pop(request_id, None)
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
            stale = (set(self._states) | self._off | set(self._wanted) | set(self._ready)) - set(live)
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
        st.tail = self._run_many([(st, start, count, st.pending[:count])])
        st.exact = start + count
        st.pending = st.pending[count:] if st.pending.shape[0] > count else None
        self.kv.cache_full_pages(rid, _Pairs(token_ids), st.exact)
        return True

    def _run_many(self, items: Sequence[tuple[_State, int, int, Tensor]]) -> Tensor:
        """One predictor forward over each item's (state, start, length, hidden states or features
        [length, features]) positions ``start .. start + length - 1`` of its request's inputs: the
        outputs at each item's last position [len(items), features]."""
        batch = self.batch
        batch.release(self._take_freed())
        step = batch.prepare([ScheduledChunk(st.seq, start, length, False) for st, start, length, _ in items], self.kv)
        attn = self.attention.build(step.attention)
        lengths = [length for _, _, length, _ in items]
        last = torch.tensor(list(itertools.accumulate(lengths)), device=self.device) - 1
        hidden = torch.cat([rows for _, _, _, rows in items]).to(self.device)
        with torch.inference_mode():
            out = self.predictor(step.input_ids, step.positions, hidden, attn, keep=last)
        self.forward_tokens += sum(lengths)
        self.forwards += 1
        return out

    def _drafts(self, g: Tensor) -> list[int]:
        """The greedy draft of each output row of ``g`` [rows, hidden]."""
        with torch.inference_mode():
            logits = self.predictor.compute_logits(g)
        return [int(t) for t in logits[:, : self.vocab].argmax(dim=-1)]

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
