"""The engine under random arrivals, aborts and page pressure, against a dense fp64 reference and
against itself with the prefix cache off.

A hypothesis state machine drives one EngineCore on the tiny random model with a deliberately
small page pool (preemption and cache eviction happen often), prefix caching on and, in some runs,
a host store behind it; prompts are random branches of a few shared heads. A twin engine with the
prefix cache off gets the same arrivals and aborts. After every step the KV cache manager's
ownership rules hold (no page leaked, none owned twice except by design), the runner's persistent
block table agrees with the manager's tables, and no cached page is written (its K/V bytes stay
those it was registered with). At the end every token any request received, aborted ones
included, carries the logprob that an independent dense forward in fp64 gives it after the same
history (within 1e-4); every request that was not aborted finished with its own cause, with the
same tokens as the cache-off twin and logprobs within 1e-6 of it; and every page is reusable again.
"""

from __future__ import annotations

import copy
import hashlib

import attrs
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineFinish, EngineRequest, RequestOutput
from tests.unit.test_engine import CFG, dense_logprobs, tiny_model

MODEL = tiny_model()
# The engine runs the model in float64 here: reuse changes which tokens share a batch, and in
# float32 that alone moves a logprob by an ulp (2e-6 at 10); float64 leaves only the prefix cache.
MODEL64 = copy.deepcopy(MODEL).double()
NUM_PAGES = 12  # 48 slots of 4: a few requests of up to 28 tokens overflow it
HEADS = [[(h * 31 + 7 * j) % CFG.vocab_size for j in range(16)] for h in range(3)]  # shared prompt heads


class EngineUnderLoad(RuleBasedStateMachine):
    @initialize(chunk=st.integers(3, 16), max_active=st.integers(1, 5), host=st.booleans())
    def start(self, chunk: int, max_active: int, host: bool) -> None:
        cfg = EngineConfig(page_size=4, num_pages=NUM_PAGES, max_active=max_active, prefill_chunk_size=chunk,
                           max_model_len=64, host_memory_bytes=(1 << 20) if host else 0)
        self.core = EngineCore(MODEL64, cfg, torch.float64)
        self.twin = EngineCore(MODEL64, attrs.evolve(cfg, prefix_caching=False, host_memory_bytes=0),
                               torch.float64)
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.twin_outputs: dict[str, list[RequestOutput]] = {}
        self.live: list[str] = []
        self.aborted: set[str] = set()
        self.page_bytes: dict[int, tuple[int, str]] = {}  # page -> (its chain hash, digest of its K/V) while registered

    @rule(head=st.integers(0, 2), head_len=st.integers(0, 16), tail=st.integers(0, 8), max_tokens=st.integers(1, 8),
          seed=st.integers(0, 2**16), greedy=st.booleans())
    def arrive(self, head: int, head_len: int, tail: int, max_tokens: int, seed: int, greedy: bool) -> None:
        rid = f"r{len(self.prompts)}"
        prompt = HEADS[head][:head_len] + [(seed * 7 + 13 * j) % CFG.vocab_size for j in range(tail)]
        prompt = prompt or [seed % CFG.vocab_size]
        self.prompts[rid] = prompt
        self.outputs[rid] = []
        self.twin_outputs[rid] = []
        sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=seed)
        for core in (self.core, self.twin):
            core.add(EngineRequest(rid, tuple(prompt), sampling, max_tokens=max_tokens, ignore_eos=True,
                                   num_top_logprobs=0))
        self.live.append(rid)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self._record(self.core.abort([rid]))
        self.twin.abort([rid])
        self.aborted.add(rid)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._record(self.core.step())
            self._twin_step()

    @invariant()
    def pages_are_owned_once(self) -> None:
        if hasattr(self, "core"):
            self.core.scheduler.check_integrity()

    @invariant()
    def cached_pages_are_never_written(self) -> None:
        """A registered page keeps the K/V bytes it had when first seen registered under its hash.

        Per page and registration: a chain evicted and computed again lands on another page, whose
        bytes may differ from the first computation's by rounding (another batch shape)."""
        if not hasattr(self, "core"):
            return
        kv = self.core.kv_manager
        for page, block_hash in enumerate(kv.block_hash):
            if block_hash is None:
                self.page_bytes.pop(page, None)
                continue
            digest = hashlib.blake2b(self.core.attention.read_page(page), digest_size=16).hexdigest()
            seen_hash, seen_digest = self.page_bytes.setdefault(page, (block_hash, digest))
            if seen_hash != block_hash:  # registered again, under another chain, since the last check
                self.page_bytes[page] = (block_hash, digest)
                continue
            assert seen_digest == digest, f"cached page {page} was written"

    @invariant()
    def batch_rows_follow_the_manager(self) -> None:
        """The runner's persistent block table holds each running request's pages after every step."""
        if not hasattr(self, "core"):
            return
        batch = self.core.runner.batch
        for seq in self.core.scheduler.running:
            row = batch.row_of(seq.request_id)
            if row is not None:
                table = self.core.kv_manager.block_table(seq.request_id)
                assert batch.block_table[row, : len(table)].tolist() == table

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(2000):
            if not self.core.scheduler.has_work:
                break
            self._record(self.core.step())
            self._twin_step()
            self.core.scheduler.check_integrity()
        assert not self.core.scheduler.has_work
        assert self.core.kv_manager.num_free == NUM_PAGES
        for _ in range(2000):
            if not self.twin.scheduler.has_work:
                break
            self._twin_step()
        for rid, prompt in self.prompts.items():
            records = self.outputs[rid]
            tokens = [t for o in records for t in o.new_token_ids]
            lps = [lp for o in records for lp in (o.logprobs or ())]
            assert len(lps) == len(tokens)
            finish = records[-1].finish if records else None
            if rid not in self.aborted:
                assert finish is not None and finish is not EngineFinish.ERROR
                twin = self.twin_outputs[rid]
                assert [t for o in twin for t in o.new_token_ids] == tokens, rid
                twin_lps = [lp.logprob for o in twin for lp in (o.logprobs or ())]
                assert max((abs(a.logprob - b) for a, b in zip(lps, twin_lps, strict=True)), default=0.0) < 1e-6, rid
            if tokens:
                ref = dense_logprobs(MODEL, prompt + tokens)
                for i, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
                    assert lp.token_id == tok
                    assert abs(lp.logprob - ref[len(prompt) - 1 + i, tok].item()) < 1e-4, (rid, i)

    def _twin_step(self) -> None:
        """The cache-off twin steps with the engine, so their batches differ only by cache reuse."""
        if self.twin.scheduler.has_work:
            for o in self.twin.step():
                self.twin_outputs[o.request_id].append(o)

    def _record(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self.outputs[o.request_id].append(o)
            if o.finish is not None and o.request_id in self.live:
                self.live.remove(o.request_id)


EngineUnderLoad.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
test_engine_under_load = EngineUnderLoad.TestCase
