"""Per-group caches (`engine/kv/coordinator.py`, `engine/kv/layout.py`, the backend's per-spec
attention) on the synthetic hybrid model of `tests/unit/hybrid_model.py`: the engine's greedy
tokens and logprobs against an independent float64 full-sequence reference written here (no cache,
plain masks, a sequential scan), and the coordinator's groups directly."""

from __future__ import annotations

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.attention import KVCache
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.drafter import Drafter
from helios.engine.kv.coordinator import KVCacheCoordinator, SlidingWindowPool, group_key
from helios.engine.kv.layout import CacheLayout
from helios.engine.records import EngineRequest, RequestOutput
from helios.engine.speculative import SpeculativeConfig
from helios.models import cpu_kernels
from helios.models.interface import (
    CausalLM,
    FullAttentionSpec,
    LatentAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from tests.unit.hybrid_model import HybridModel, build_hybrid_model
from tests.unit.test_engine import run

PS = 4
WINDOW = 5
TOL = 1e-4


# -- the reference -----------------------------------------------------------------------------------


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def reference_logprobs(model: HybridModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float64 log-probabilities of the whole sequence, computed directly."""
    n = len(ids)
    f = {name: p.detach().double() for name, p in model.named_parameters()}
    x = f["embed"][torch.tensor(ids)] + f["pos_embed"][:n]
    qpos = torch.arange(n)[:, None]
    kpos = torch.arange(n)[None, :]
    nh, nkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    for i, kind in enumerate(model.kinds):
        h = _rms(x)
        j = model.slot[i]
        if kind == "recurrent":
            u = h @ f[f"w_in.{j}"]
            a = torch.sigmoid(f[f"decay.{j}"])
            s = torch.zeros(u.shape[1], dtype=torch.float64)
            rows = []
            for t in range(n):
                s = a * s + (1 - a) * u[t]
                rows.append(s)
            x = x + torch.stack(rows) @ f[f"w_out.{j}"]
            continue
        q = (h @ f[f"wq.{j}"]).view(n, nh, d)
        k = (h @ f[f"wk.{j}"]).view(n, nkv, d).repeat_interleave(nh // nkv, dim=1)
        v = (h @ f[f"wv.{j}"]).view(n, nkv, d).repeat_interleave(nh // nkv, dim=1)
        allowed = kpos <= qpos
        if kind == "sliding":
            allowed &= kpos > qpos - model.window
        scores = torch.einsum("qhd,khd->hqk", q, k) * model.scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        x = x + o.reshape(n, -1) @ f[f"wo.{j}"]
    return torch.log_softmax(_rms(x) @ f["embed"].T, dim=-1)


def check_against_reference(model: HybridModel, prompt: list[int], records: list[RequestOutput],
                            max_tokens: int) -> None:
    tokens = [t for o in records for t in o.new_token_ids]
    lps = [lp for o in records for lp in (o.logprobs or ())]
    assert len(tokens) == max_tokens and len(lps) == max_tokens
    ref = reference_logprobs(model, prompt + tokens)
    for g, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        row = ref[len(prompt) + g - 1]
        assert token == int(row.argmax()), f"token {g} of a {len(prompt)}-token prompt"
        assert abs(lp.logprob - row[token].item()) < TOL
        for alt, value in lp.top:
            assert abs(value - row[alt].item()) < TOL


def prompts(lengths: tuple[int, ...], vocab: int = 64) -> list[list[int]]:
    return [[(7 * i + 3 * j * j + 1) % vocab for j in range(n)] for i, n in enumerate(lengths)]


def greedy(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=max_tokens,
                         ignore_eos=True, num_top_logprobs=5)


# -- the layout --------------------------------------------------------------------------------------


def test_layers_with_equal_specs_form_one_group() -> None:
    model = build_hybrid_model()
    assert isinstance(model, CausalLM)
    layout = CacheLayout.from_specs(model.cache_specs())
    assert [(type(g.spec), g.layers) for g in layout.groups] == [
        (FullAttentionSpec, (0,)), (SlidingWindowSpec, (1, 3)), (RecurrentStateSpec, (2,))]
    assert layout.has_recurrent and not layout.is_single_full
    # Full and sliding rows per token, no bytes per token for the state; its bytes are per request.
    assert layout.bytes_per_token(torch.float32) == 3 * 2 * 2 * 8 * 4
    assert layout.bytes_per_request(torch.float32) == 16 * 4
    llama = CacheLayout.from_specs([FullAttentionSpec(2, 8)] * 3)
    assert llama.is_single_full and llama.describe(torch.float32) == "3:2:8:torch.float32"
    with pytest.raises(ValueError, match="paged"):
        CacheLayout.from_specs([RecurrentStateSpec(((4,),))])


# -- the engine against the reference --------------------------------------------------------------


@pytest.mark.parametrize(("num_pages", "chunk", "head_dim"), [(64, 7, 8), (64, 3, 8), (12, 5, 8), (64, 7, 16)],
                         ids=["roomy", "small-chunks", "preempting", "cpu-kernels"])
def test_hybrid_engine_matches_reference(num_pages: int, chunk: int, head_dim: int) -> None:
    """Requests of 3 to 21 prompt tokens (most longer than the window) interleaved, chunked prefill,
    12 decode steps each (well past the window); with 12 pages of 4 tokens, preemption and
    recompute; with a head size of 16, the CPU decode kernel where it applies (the full layer, and
    the sliding layers while every context is within the window). After every step: integrity,
    every decoding request holds only the sliding pages its window reaches, and the free pages are
    overwritten with garbage."""
    model = build_hybrid_model({"head_dim": head_dim})
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=num_pages, max_active=4, prefill_chunk_size=chunk,
                                          max_model_len=128), torch.float32)
    assert core.attention.decode_kernel == (head_dim == 16 and cpu_kernels.available())
    kv = core.kv_manager
    # A recurrent group: prefix hits only at state checkpoints (a preempted request may resume
    # from its own; tests/unit/test_state_checkpoints.py).
    assert isinstance(kv, KVCacheCoordinator) and kv.enable_caching and kv.snapshots is not None
    sliding = kv.sliding[0]
    released = [0]
    freer = [False]

    def each_step() -> None:
        for seq in core.scheduler.running:
            table = sliding.block_table(seq.request_id)
            live = [p for p in table if p != sliding.null_page]
            released[0] = max(released[0], len(table) - len(live))
            if not seq.is_prefilling:
                # At most the pages of the window before the next token, and the next token's page.
                assert len(live) <= -(-(WINDOW - 1) // PS) + 2
        freer[0] |= sliding.num_free > kv.primary.num_free
        # Free pages hold garbage (finite: masked reads of stale entries stay harmless): a page
        # released while some query still sees it would spoil the logprobs.
        for group, pool in zip(core.layout.paged_groups, kv.groups, strict=True):
            slots = (torch.tensor(list(pool._free), dtype=torch.long)[:, None] * PS + torch.arange(PS)).flatten()
            for layer in group.layers:
                core.kv.k[layer][:, slots] = 1e3
                core.kv.v[layer][:, slots] = -1e3

    ps = prompts((3, 9, 14, 21))
    reqs = [greedy(f"r{i}", p, 12) for i, p in enumerate(ps)]
    outs = run(core, reqs, each_step=each_step)
    for req, prompt in zip(reqs, ps, strict=True):
        check_against_reference(model, prompt, outs[req.request_id], 12)
    assert released[0] >= 5 and freer[0]
    assert (core.scheduler.num_preemptions > 0) == (num_pages == 12)
    assert kv.num_free == num_pages and kv.states is not None and kv.states.num_free == 4


def test_recurrent_layout_speculates_and_hits_only_checkpoints() -> None:
    """The same 13-token prompt three times, speculating: a's anchor (12) is skipped (a split's
    cost is unknown before any decode step), b captures it, c restores it. (The allowance is all of
    the step time: a split is charged a whole decode step, which a tenth of a's few steps may not
    cover.)"""
    model = build_hybrid_model()
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=64, max_active=4, prefill_chunk_size=16,
                                          max_model_len=128, host_memory_bytes=1 << 20, checkpoint_work_fraction=1.0,
                                          speculative=SpeculativeConfig(mode="ngram")), torch.float32)
    assert core.scheduler.speculative.enabled and core.scheduler.rollback is not None
    assert core.host_store is not None and core.stats().speculative_mode == "ngram"
    prompt = prompts((13,))[0]
    for rid in ("a", "b", "c"):
        outs = run(core, [greedy(rid, prompt, 4)])
        check_against_reference(model, prompt, outs[rid], 4)
    assert core.scheduler.reused_tokens == 12 and core.stats().prefix_caching is True


REPEATS = [[1, 2, 3, 4, 5, 6] * 3, [9, 8, 7] * 5, [5, 17, 33, 5, 17, 33, 5, 17, 40, 2, 5, 17]]


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "checkpoints"])
def test_recurrent_speculation_rolls_the_state_back(caching: bool) -> None:
    """Greedy n-gram speculation on the hybrid model (full, sliding, recurrent, sliding): prompts
    with repeats, so drafts are proposed, some accepted and some rejected (the saved state put back,
    the round recomputed); 24 tokens of each match the float64 reference (tokens and logprobs). With
    the prefix cache, a round never passes a page boundary, so every boundary's endpoint copy is
    taken, and a second request extending a finished one's text restores its endpoint checkpoint
    and still matches."""
    model = build_hybrid_model()
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=96, max_active=4, prefill_chunk_size=32,
                                          max_model_len=128, prefix_caching=caching, checkpoint_work_fraction=1.0,
                                          speculative=SpeculativeConfig(mode="ngram", max_depth=5)), torch.float32)
    sched = core.scheduler
    assert sched.rollback is not None and (core.checkpoints is not None) == caching
    reqs = [greedy(f"s{i}", p, 24) for i, p in enumerate(REPEATS)]
    outs = run(core, reqs)
    for req, prompt in zip(reqs, REPEATS, strict=True):
        check_against_reference(model, prompt, outs[req.request_id], 24)
    spec = sched.spec_stats
    assert spec.verification_drafts > 0 and 0 < spec.accepted_drafts < spec.verification_drafts
    assert sched.state_rollbacks > 0
    if caching:
        assert core.checkpoints is not None
        assert core.checkpoints.counters.captures["endpoint"] == len(REPEATS)
        # The first request's prompt and output, and more: its endpoint checkpoint is restored.
        text = list(REPEATS[0]) + [t for o in outs["s0"] for t in o.new_token_ids] + [3, 1, 4]
        before = core.checkpoints.counters.restores
        again = run(core, [greedy("again", text, 8)])
        check_against_reference(model, text, again["again"], 8)
        assert core.checkpoints.counters.restores == before + 1 and sched.reused_tokens >= 36


def test_recurrent_speculation_sampled_rows_keep_exact_state() -> None:
    """Seeded sampling at temperature 1 with speculation (rejection sampling on the drafts): the
    logprob of every sampled token equals the float64 reference's for the committed text, so no
    rejected draft's update stayed in the state."""
    model = build_hybrid_model()
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=96, max_active=4, prefill_chunk_size=32,
                                          max_model_len=128, speculative=SpeculativeConfig(mode="ngram", max_depth=4)),
                      torch.float32)
    reqs = [EngineRequest(f"t{i}", tuple(p), SamplingParams(temperature=1.0, seed=11 + i), max_tokens=24,
                          ignore_eos=True, num_top_logprobs=2) for i, p in enumerate(REPEATS)]
    outs = run(core, reqs)
    for req, prompt in zip(reqs, REPEATS, strict=True):
        tokens = [t for o in outs[req.request_id] for t in o.new_token_ids]
        lps = [lp for o in outs[req.request_id] for lp in (o.logprobs or ())]
        assert len(tokens) == len(lps) == 24
        ref = reference_logprobs(model, prompt + tokens)
        for g, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            assert abs(lp.logprob - ref[len(prompt) + g - 1][token].item()) < TOL
    assert core.scheduler.spec_stats.accepted_drafts > 0 and core.scheduler.state_rollbacks > 0


def test_recurrent_target_with_a_draft_model() -> None:
    """A draft model (attention only, the target's vocabulary, other weights) drafts for the hybrid
    target: greedy output matches the reference, the drafter ran, rejected rounds were rolled back."""
    model = build_hybrid_model()
    draft = Drafter(build_hybrid_model({"layers": ("full", "full"), "seed": 5}), torch.float32,  # type: ignore[arg-type]
                    num_pages=64, page_size=PS, max_active=4, max_model_len=128, prefill_chunk_size=16)
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=96, max_active=4, prefill_chunk_size=32,
                                          max_model_len=128, speculative=SpeculativeConfig(mode="ngram", max_depth=3)),
                      torch.float32, drafter=draft)
    reqs = [greedy(f"d{i}", p, 16) for i, p in enumerate(prompts((5, 11)))]
    outs = run(core, reqs)
    for req, prompt in zip(reqs, prompts((5, 11)), strict=True):
        check_against_reference(model, prompt, outs[req.request_id], 16)
    assert draft.forward_tokens > 0 and core.scheduler.state_rollbacks > 0


SLIDING_ONLY = {"layers": ("full", "sliding", "sliding", "full"), "seed": 3}


def test_sliding_prefix_hits_match_reference() -> None:
    """A full + sliding model with the prefix cache: a repeated long prompt hits (its sliding
    group's pages before the window are placeholders) and still matches the reference; a prompt
    sharing only a prefix hits that prefix."""
    model = build_hybrid_model(SLIDING_ONLY)
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=64, max_active=4, prefill_chunk_size=6,
                                          max_model_len=128), torch.float32)
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator) and kv.enable_caching
    base = prompts((23,))[0]
    for rid, prompt in (("a", base), ("b", base), ("c", [*base[:17], 5, 6, 7, 8, 9])):
        outs = run(core, [greedy(rid, prompt, 10)])
        check_against_reference(model, prompt, outs[rid], 10)
    # b reuses 5 full pages (20 tokens), c the 4 pages of its shared 17 tokens.
    assert core.scheduler.reused_tokens == 20 + 16


def test_sliding_speculation_matches_reference() -> None:
    model = build_hybrid_model(SLIDING_ONLY)
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=64, max_active=4, prefill_chunk_size=32,
                                          max_model_len=128, speculative=SpeculativeConfig(mode="ngram")),
                      torch.float32)
    assert core.scheduler.speculative.enabled
    ps = [[1, 2, 3, 4, 5, 6] * 3, [9, 8, 7] * 5]
    reqs = [greedy(f"s{i}", p, 16) for i, p in enumerate(ps)]
    outs = run(core, reqs)
    for req, prompt in zip(reqs, ps, strict=True):
        check_against_reference(model, prompt, outs[req.request_id], 16)


def test_host_store_restores_every_group() -> None:
    """A tiny pool with a host store: a prompt's pages are evicted by others, then restored from
    per-group records (sliding pages included) for its second run, which matches the reference."""
    model = build_hybrid_model(SLIDING_ONLY)
    core = EngineCore(model, EngineConfig(page_size=PS, num_pages=10, max_active=1, prefill_chunk_size=32,
                                          max_model_len=64, host_memory_bytes=1 << 22), torch.float32)
    assert core.host_store is not None
    first = prompts((21,))[0]
    run(core, [greedy("a", first, 4)])
    for i, other in enumerate(prompts((21, 21, 21), vocab=61)[1:]):
        run(core, [greedy(f"x{i}", [t + 1 for t in other], 4)])
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator)
    assert core.host_store.contains(group_key(kv.chain(first, 1)[0], 1))
    outs = run(core, [greedy("again", first, 4)])
    check_against_reference(model, first, outs["again"], 4)
    assert core.scheduler.host_hits == 1 and core.scheduler.host_reused_tokens == 20


# -- the groups directly -----------------------------------------------------------------------------


def _coordinator(num_pages: int = 8) -> KVCacheCoordinator:
    layout = CacheLayout.from_specs([FullAttentionSpec(1, 2), SlidingWindowSpec(1, 2, WINDOW)])
    return KVCacheCoordinator(layout, num_pages, PS, enable_caching=True)


def test_sliding_group_releases_pages_behind_every_window() -> None:
    pool = SlidingWindowPool(8, PS, enable_caching=True, window=WINDOW)
    null = pool.null_page
    assert pool.allocate_slots("a", 0, 13) == [0, 1, 2, 3]
    # Query position 12 sees 8..12: pages 0 and 1 (positions 0..7) are dead, page 2 is not.
    assert pool.release_before("a", 12) == 2 and pool.block_table("a") == [null, null, 2, 3]
    assert pool.release_before("a", 12) == 0  # idempotent
    # Position 12 - window + 1 = 8 is page 2's first: one more position frees nothing yet...
    assert pool.release_before("a", 13) == 0
    # ... until its last position 11 leaves the window of query 16 (which sees 12..16).
    assert pool.release_before("a", 15) == 0 and pool.release_before("a", 16) == 1
    pool.check_integrity()
    assert pool.num_free == 8 - 1
    pool.free("a")
    pool.check_integrity()
    assert pool.num_free == 8


def test_sliding_hits_need_only_the_window_before_the_hit() -> None:
    pool = SlidingWindowPool(6, PS, enable_caching=True, window=WINDOW)
    tokens = list(range(25))
    pool.allocate_slots("a", 0, 24)
    pool.cache_full_pages("a", tokens, 24)
    pool.release_before("a", 24)  # pages of positions 0..19 leave every window: evictable
    pool.free("a")
    hashes = pool.chain(tokens, 6)
    assert pool.hit_length(hashes, 6) == 6
    pool.allocate_slots("x", 0, 12)  # takes the pages of positions 0..11 (least recently used)
    pool.check_integrity()
    # A 6-page hit needs only the page of positions 20..23 (the window of query 24).
    assert pool.hit_length(hashes, 6) == 6
    assert pool.hit_pages(hashes, 6)[:5] == [pool.null_page] * 5
    # A 4-page hit needs positions 12..15 (query 16 sees 12..16): cached too; 3 pages need 8..11: gone.
    assert pool.hit_length(hashes, 4) == 4 and pool.hit_length(hashes, 3) == 0


def test_coordinator_hit_is_what_every_group_serves() -> None:
    kv = _coordinator()
    tokens = list(range(30))
    kv.allocate_slots("a", 0, 24)
    kv.cache_full_pages("a", tokens, 24)  # registers 6 pages per group; query 24 sees 20..24
    kv.check_integrity()
    sliding = kv.sliding[0]
    assert sliding.block_table("a")[:6] == [sliding.null_page] * 5 + [5]
    hits, hashes = kv.lookup(tokens[:25])
    assert len(hits) == 6 and [h[1] for h in hits[:5]] == [sliding.null_page] * 5
    assert [h[0] for h in hits] == kv.primary.block_table("a")
    assert kv.can_admit(26, hits)
    kv.allocate_cached("b", hits, hashes)
    kv.allocate_slots("b", 24, 1)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    # The sliding group alone loses its pages of positions 0..19 (the 2 free pages, then the 5
    # least recently used): a 6-page hit needs only positions 20..23 there; a 5-page one needs
    # 16..19, gone, and so on down: no hit, though the full group has all 5.
    sliding.allocate_slots("y", 0, PS * 7)
    hits, _ = kv.lookup(tokens[:25])
    assert len(hits) == 6
    hits, _ = kv.lookup(tokens[:21])
    assert hits == [] and all(h in kv.primary._cached for h in kv.primary.chain(tokens, 5))
    sliding.free("y")
    kv.check_integrity()
    assert kv.num_free == 8


def test_coordinator_state_slots_follow_the_running_requests() -> None:
    layout = CacheLayout.from_specs([FullAttentionSpec(1, 2), RecurrentStateSpec(((3,),))])
    kv = KVCacheCoordinator(layout, 8, PS, enable_caching=True, num_state_slots=2)
    assert kv.enable_caching and kv.lookup(list(range(20)))[0] == []  # no state snapshot: no hit
    assert kv.allocate_slots("a", 0, 5) is not None and kv.allocate_slots("b", 0, 5) is not None
    assert kv.state_slot("a") == 0 and kv.state_slot("b") == 1
    assert not kv.can_admit(4, []) and not kv.can_allocate("c", 4) and kv.allocate_slots("c", 0, 4) is None
    assert kv.can_allocate("a", 8)  # a holds its slot
    kv.check_integrity()
    kv.free("a")
    assert kv.allocate_slots("c", 0, 4) is not None and kv.state_slot("c") == 0
    kv.check_integrity()


def test_a_latent_group_keeps_one_row_per_token_and_pages_like_the_others() -> None:
    """A full-attention layer beside two latent layers (one compressed row per token): two paged
    groups with aligned tables, hits served by both, and the host-store page bytes of the latent
    group (its rows only, [page_size, row_dim] per layer) round-trip."""
    specs = [FullAttentionSpec(2, 4), LatentAttentionSpec(6), LatentAttentionSpec(6)]
    layout = CacheLayout.from_specs(specs)
    assert [type(g.spec) for g in layout.groups] == [FullAttentionSpec, LatentAttentionSpec]
    assert layout.groups[1].layers == (1, 2)
    assert layout.bytes_per_token(torch.float32) == (2 * 2 * 4 + 2 * 6) * 4
    kv = KVCacheCoordinator(layout, 8, PS, enable_caching=True)
    tokens = list(range(13))
    kv.allocate_slots("a", 0, 12)
    kv.cache_full_pages("a", tokens, 12)
    kv.check_integrity()
    hits, hashes = kv.lookup(tokens)
    assert len(hits) == 3 and all(len(h) == 2 for h in hits)
    assert [h[1] for h in hits] == kv.groups[1].block_table("a")
    kv.allocate_cached("b", hits, hashes)
    kv.allocate_slots("b", 12, 1)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()

    cache = KVCache.for_layout(layout, 8, PS, torch.float32)
    assert set(cache.rows) == {1, 2} and tuple(cache.rows[1].shape[1:]) == (6,)
    for layer in (1, 2):
        cache.rows[layer][PS:2 * PS] = torch.randn(PS, 6)
    data = cache.read_page(1, PS, group=1)
    assert len(data) == 2 * PS * 6 * 4
    assert cache.write_page(5, PS, data, group=1)
    for layer in (1, 2):
        assert torch.equal(cache.rows[layer][5 * PS:6 * PS], cache.rows[layer][PS:2 * PS])
    assert not cache.write_page(5, PS, data[:-4], group=1)
