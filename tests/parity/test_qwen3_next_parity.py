"""Numerical parity of `helios.models.qwen3_next` with transformers' ``Qwen3NextForCausalLM`` (fp32),
and of the gated delta rule's chunked scan with its one-token update.

A tiny random seeded model (hidden 64, four layers: three Gated DeltaNet layers with grouped value
heads and one gated full-attention layer; 8 experts, top 2, with a shared expert, and a dense first
layer), saved with ``save_pretrained`` and loaded through `load_checkpoint` and the registry.
transformers runs its torch fallbacks (no flash-linear-attention): the chunked rule (blocks of 64)
for a whole prompt, the recurrent one for cached decode. Prompts of a few hundred tokens, so the
scan crosses several blocks, and engine chunk sizes that split them.

Decay rates ``exp(A_log)`` are drawn in (0.01, 1). With the larger ones transformers' initialiser
allows (up to 16), the chunked form's within-block decays come from differences of cumulative
log decays in the hundreds, and float32 loses about 1e-4 of them: transformers' own float32 logits
then sit ~5e-4 from a float64 evaluation of the same model (measured; ours likewise), so a 1e-4
comparison would test rounding, not the model.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.decoder import FusedDecoderLM
from helios.models.dense_attention import DenseAttention
from helios.models.gated_delta import chunked_scan, l2norm, recurrent_step
from helios.models.interface import LatentProjection, RecurrentBatch, RecurrentStateSpec, SparseIndex
from helios.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from tests.numerics import FP32_TOLERANCE

transformers = pytest.importorskip("transformers")

VOCAB = 272
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, linear_conv_kernel_dim=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              mlp_only_layers=[0], norm_topk_prob=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(31 * j + 7 * salt + (j * j) % 17) % VOCAB for j in range(n)]


def tiny_hf_model() -> torch.nn.Module:
    return seeded(transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)))


def seeded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (Qwen3-Next or Qwen3.5) with seeded weights of the scales the module docstring
    explains, in eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) in (0.01, 1): see the module docstring
                p.copy_(torch.empty_like(p).uniform_(0.01, 1.0).log())
            elif name.endswith("conv1d.weight"):  # outputs of order one: a well-conditioned gated norm
                p.copy_(0.6 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight"):  # the 1 + weight norms
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_hf_model()


@pytest.fixture(scope="module")
def root(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("qwen3-next")
    hf_model.save_pretrained(path, safe_serialization=True)
    vocab = {chr(0x100 + i): i for i in range(256)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in ("<eos>", "<bos>")])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "add_bos_token": False}))
    return path


@pytest.fixture(scope="module")
def model(root: Path) -> Qwen3NextForCausalLM:
    checkpoint = load_checkpoint(root, torch.float32)
    built = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    built.load_weights(checkpoint.tensors)
    assert isinstance(built, Qwen3NextForCausalLM)
    return built


class OneSequence:
    """One request's cache for calling the model directly: `DenseAttention` for the attention
    layers (latent ones too), state slot 0 of every recurrent layer."""

    def __init__(self, model: FusedDecoderLM) -> None:
        self.dense = DenseAttention.for_model(model)
        self.states: dict[int, tuple[Tensor, ...]] = {}
        for i, spec in enumerate(model.cache_specs()):
            if isinstance(spec, RecurrentStateSpec):
                self.states[i] = tuple(torch.full((1, *s), float("nan")) for s in spec.shapes)
        self.span = (0, 0, 0, 0)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, *,
                 sinks: Tensor | None = None) -> Tensor:
        return self.dense(layer_idx, q, k, v, scale, sinks=sinks)

    def all_decode_args(self, layer_idx: int) -> None:
        return None

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        return RecurrentBatch(self.states[layer_idx], (self.span,))

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor:
        return self.dense.latent(layer_idx, q_nope, q_rope, rows, projection, scale, index=index)

    def logits(self, model: FusedDecoderLM, ids: list[int], start: int) -> Tensor:
        self.span = (0, len(ids), 0, start)
        with torch.no_grad():
            return model.compute_logits(model(torch.tensor(ids), torch.arange(start, start + len(ids)), self))


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_generate(hf_model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation: its chunked rule for the prompt, the recurrent one for each
    decoded token (the attention mask given: a prompt token equal to the pad id is not padding; no
    stop token, as the engine's ``ignore_eos``: ``min_new_tokens`` would instead forbid the eos id)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, eos_token_id=[], do_sample=False)
    return [int(t) for t in out[0, len(ids):]]


def test_config(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    cfg = model.config
    assert isinstance(cfg, Qwen3NextConfig) and cfg.arch == "qwen3_next"
    assert cfg.linear_layers == (True, True, False, True)
    assert cfg.moe_layers == (False, True, True, True)
    assert cfg.rotary == 4  # partial_rotary_factor 0.25 of 16
    specs = model.cache_specs()
    assert isinstance(specs[0], RecurrentStateSpec) and specs[0].shapes == ((3, 2 * 32 + 32), (4, 16, 8))


def test_prompt_logits(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    """A 300-token prompt in one pass: transformers' chunked rule over five blocks of 64."""
    ids = prompt_of(300)
    expected = hf_logits(hf_model, ids)
    got = OneSequence(model).logits(model, ids, 0)
    diff = (got - expected).abs().max().item()
    print(f"qwen3_next prompt fp32: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_chunk_boundaries_and_decode(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    """Chunks that split the scan's blocks anywhere (1, 3, 61, 100 tokens), then one-token decode
    steps, against transformers' logits of the whole sequence."""
    ids = prompt_of(200, salt=1)
    expected = hf_logits(hf_model, ids)
    seq = OneSequence(model)
    cuts = [0, 1, 4, 65, 165, 190, *range(191, 201)]
    got = torch.cat([seq.logits(model, ids[a:b], a) for a, b in itertools.pairwise(cuts)])
    diff = (got - expected).abs().max().item()
    print(f"qwen3_next chunked + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_greedy_32_tokens_match_transformers_generate(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    """transformers' generate (its recurrent rule for every decoded token) and ours, one sequence."""
    ids = prompt_of(150, salt=2)
    with torch.no_grad():
        expected = hf_generate(hf_model, ids, 32)
    seq = OneSequence(model)
    logits = seq.logits(model, ids, 0)
    tokens: list[int] = []
    for _ in range(32):
        tokens.append(int(logits[-1].argmax()))
        logits = seq.logits(model, tokens[-1:], len(ids) + len(tokens) - 1)
    assert tokens == expected


def _engine_run(model: FusedDecoderLM, prompts: list[list[int]], chunk: int, max_tokens: int,
                max_active: int = 4) -> dict[str, list[tuple[int, float, tuple[tuple[int, float], ...]]]]:
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    core = EngineCore(model, EngineConfig(page_size=16, num_pages=96, max_active=max_active,
                                          prefill_chunk_size=chunk, max_model_len=512, prefix_caching=False),
                      torch.float32)
    assert core.checkpoints is None and not core.scheduler.speculative.enabled
    reqs = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True,
                          num_top_logprobs=3) for i, p in enumerate(prompts)]
    outs = run(core, reqs)
    result = {}
    for rid, records in outs.items():
        result[rid] = [(t, lp.logprob, tuple(lp.top)) for o in records
                       for t, lp in zip(o.new_token_ids, o.logprobs or (), strict=True)]
    return result


def check_speculation_rolls_back(model: torch.nn.Module, hf_model: torch.nn.Module, base: list[int],
                                 changed_at: tuple[int, ...], *, chunk: int = 48, page_size: int = 16,
                                 max_tokens: int = 24) -> None:
    """A hybrid family speculating from the shared decoded history (depth 4): first ``base`` alone
    (its output goes into the history), then ``base`` again and variants of it with one token
    changed at each of ``changed_at``, batched. The repeat's drafts are accepted; a variant drafts
    from the history while its output agrees with the base's and is rejected where they part, its
    round's recurrent state put back (`scheduler.StateRollback`). With and without the prefix
    cache's checkpoints: the greedy tokens and logprobs of the engine without speculation (tokens
    identical, logprobs within 1e-4), every token the argmax of transformers' full forward and its
    logprob within 1e-4."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from helios.engine.speculative import SpeculativeConfig
    from tests.unit.test_engine import run

    vocab = hf_model.config.vocab_size
    prompts = [base, base] + [[*base[:j], (base[j] + 1) % vocab, *base[j + 1:]] for j in changed_at]

    def once(mode: str, caching: bool) -> tuple[list[list[tuple[int, float]]], EngineCore]:
        core = EngineCore(model, EngineConfig(page_size=page_size, num_pages=160, max_active=len(prompts),
                                              prefill_chunk_size=chunk, max_model_len=1024, prefix_caching=caching,
                                              checkpoint_work_fraction=1.0,
                                              speculative=SpeculativeConfig(mode=mode, max_depth=4)), torch.float32)
        reqs = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=max_tokens,
                              ignore_eos=True, num_top_logprobs=1) for i, p in enumerate(prompts)]
        outs = run(core, reqs[:1]) | run(core, reqs[1:])
        return ([[(t, lp.logprob) for o in outs[r.request_id] for t, lp in zip(o.new_token_ids, o.logprobs or (),
                                                                                 strict=True)] for r in reqs], core)

    plain, _ = once("off", False)
    for caching in (False, True):
        spec, core = once("ngram", caching)
        stats = core.scheduler.spec_stats
        assert core.scheduler.rollback is not None and stats.accepted_drafts > 0, caching
        assert core.scheduler.state_rollbacks > 0, caching
        print(f"{type(model).__name__} speculating (cache {caching}): {stats.accepted_drafts} of "
              f"{stats.verification_drafts} drafts accepted, {core.scheduler.state_rollbacks} rounds rolled back")
        for i, prompt in enumerate(prompts):
            got, want = spec[i], plain[i]
            assert [t for t, _ in got] == [t for t, _ in want], (caching, i)
            assert max(abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)) < FP32_TOLERANCE, (caching, i)
            if i == 0:
                continue
            tokens = [t for t, _ in got]
            with torch.no_grad():
                ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
            rows = ref[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
            assert tokens == rows.argmax(-1).tolist(), (caching, i)
            lps = torch.tensor([lp for _, lp in got], dtype=torch.float64)
            assert (rows.gather(1, torch.tensor(tokens)[:, None])[:, 0] - lps).abs().max().item() < FP32_TOLERANCE


def test_speculation_rolls_the_recurrent_state_back(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    check_speculation_rolls_back(model, hf_model, prompt_of(60, 3), (5, 10, 15, 20, 25, 30))


def test_the_engine_serves_it(model: Qwen3NextForCausalLM, hf_model: torch.nn.Module) -> None:
    """Three requests of 230, 170 and 90 tokens batched through the engine (paged full attention,
    recurrent state slots, prefill chunks of 48 tokens so every request's scan is split, then
    batched decode): 32 greedy tokens each, identical to transformers' generate, with logprobs
    within 1e-4 of transformers' log-softmax over the whole sequence; and each request alone gives
    the same numbers as in the batch."""
    prompts = [prompt_of(230, 3), prompt_of(170, 4), prompt_of(90, 5)]
    batched = _engine_run(model, prompts, chunk=48, max_tokens=32)
    worst = 0.0
    for i, prompt in enumerate(prompts):
        got = batched[f"r{i}"]
        tokens = [t for t, _, _ in got]
        with torch.no_grad():
            expected = hf_generate(hf_model, prompt, 32)
        assert tokens == expected, i
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp, top) in enumerate(got):
            row = ref[len(prompt) - 1 + j]
            worst = max(worst, abs(lp - float(row[t])), *(abs(v - float(row[a])) for a, v in top))
    print(f"qwen3_next engine fp32: max abs logprob diff {worst:.3g}")
    assert worst < FP32_TOLERANCE
    for i, prompt in enumerate(prompts):
        alone = _engine_run(model, [prompt], chunk=48, max_tokens=32)["r0"]
        assert [t for t, _, _ in alone] == [t for t, _, _ in batched[f"r{i}"]]
        diff = max(abs(a[1] - b[1]) for a, b in zip(alone, batched[f"r{i}"], strict=True))
        assert diff < 1e-5, (i, diff)


def test_preemption_recomputes_the_state(model: Qwen3NextForCausalLM) -> None:
    """Few pages: requests are preempted and recomputed (from position 0, a fresh state, or from a
    state checkpoint of their own); the tokens are those of a roomy run."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    prompts = [prompt_of(40, 6), prompt_of(50, 7), prompt_of(30, 8)]
    roomy = _engine_run(model, prompts, chunk=16, max_tokens=24)
    core = EngineCore(model, EngineConfig(page_size=8, num_pages=14, max_active=3, prefill_chunk_size=16,
                                          max_model_len=128), torch.float32)
    reqs = [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=24, ignore_eos=True)
            for i, p in enumerate(prompts)]
    outs = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for rid, records in outs.items():
        assert [t for o in records for t in o.new_token_ids] == [t for t, _, _ in roomy[rid]]


def test_state_checkpoints_restore_exactly(model: Qwen3NextForCausalLM, tmp_path: Path) -> None:
    """A follow-up turn (the first turn's 150-token prompt, its 24 generated tokens and 20 more)
    restores the first turn's endpoint checkpoint at 160 (its attention pages and the Gated
    DeltaNet layers' conv and recurrent states), reports 160 cached tokens and gives the logprobs
    of the same request on a fresh engine without a prefix cache (float32, 1e-5); so does the
    same turn on a new engine over the first one's disk tier (a restart), and on an engine whose
    one snapshot row and small page pool pushed the first turn's snapshot and pages out to the
    host store's DRAM tier."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest, RequestOutput
    from tests.unit.test_engine import run

    def config(**overrides: object) -> EngineConfig:
        base = dict(page_size=16, num_pages=64, max_active=2, prefill_chunk_size=64, max_model_len=512,
                    host_memory_bytes=1 << 24, disk_dir=str(tmp_path), disk_bytes=1 << 26)
        base.update(overrides)
        return EngineConfig(**base)  # type: ignore[arg-type]

    def request(rid: str, prompt: list[int], n: int) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True,
                             num_top_logprobs=3)

    def numbers(records: list[RequestOutput]) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
        return [(t, lp.logprob, tuple(lp.top)) for o in records
                for t, lp in zip(o.new_token_ids, o.logprobs or (), strict=True)]

    def worst(a: list[tuple[int, float, tuple[tuple[int, float], ...]]],
              b: list[tuple[int, float, tuple[tuple[int, float], ...]]]) -> float:
        assert [x[0] for x in a] == [x[0] for x in b]
        assert [[t for t, _ in x[2]] for x in a] == [[t for t, _ in x[2]] for x in b]
        return max(max(abs(x[1] - y[1]), *(abs(u - v) for (_, u), (_, v) in zip(x[2], y[2], strict=True)))
                   for x, y in zip(a, b, strict=True))

    core = EngineCore(model, config(), torch.float32)
    assert core.checkpoints is not None and not core.scheduler.speculative.enabled
    first = prompt_of(150, 11)
    outs = run(core, [request("a", first, 24)])["a"]
    stats = core.stats().checkpoints
    assert stats is not None and stats.captures["endpoint"] == 1 and stats.snapshots == 1
    follow = request("b", [*first, *[t for o in outs for t in o.new_token_ids], *prompt_of(20, 12)], 16)
    restored = run(core, [follow])["b"]
    stats = core.stats().checkpoints
    assert stats is not None and stats.restores == 1
    assert restored[-1].num_cached_tokens == 160
    reference = numbers(run(EngineCore(model, config(prefix_caching=False), torch.float32), [follow])["b"])
    diff = worst(numbers(restored), reference)
    print(f"qwen3_next restored from the pool: max abs logprob diff {diff:.3g}")
    assert diff <= 1e-5
    core.close()

    again = EngineCore(model, config(), torch.float32)
    from_disk = run(again, [request("b", list(follow.prompt_token_ids), 16)])["b"]
    stats = again.stats().checkpoints
    assert stats is not None and stats.host_restores == 1 and from_disk[-1].num_cached_tokens >= 160
    diff = worst(numbers(from_disk), reference)
    print(f"qwen3_next restored from disk: max abs logprob diff {diff:.3g}")
    assert diff <= 1e-5
    again.close()

    small = EngineCore(model, config(num_pages=20, checkpoint_slots=1, disk_dir=None, disk_bytes=0), torch.float32)
    assert small.host_store is not None and small.checkpoints is not None
    run(small, [request("a", first, 24)])
    run(small, [request("x", prompt_of(200, 13), 24)])  # its pages and snapshots push a's out
    assert small.checkpoints.counters.host_restores == 0
    from_dram = run(small, [request("b", list(follow.prompt_token_ids), 16)])["b"]
    assert small.checkpoints.counters.host_restores == 1 and small.scheduler.host_hits == 1
    assert from_dram[-1].num_cached_tokens == 160
    diff = worst(numbers(from_dram), reference)
    print(f"qwen3_next restored from DRAM: max abs logprob diff {diff:.3g}")
    assert diff <= 1e-5


# -- the rule itself -------------------------------------------------------------------------------------


def test_chunked_scan_matches_the_recurrence() -> None:
    """`chunked_scan` (blocks of 8 over 37 tokens, from a nonzero state) against the token-by-token
    `recurrent_step`, in float64."""
    g = torch.Generator().manual_seed(0)
    heads, n, dk, dv = 3, 37, 8, 5
    q = l2norm(torch.randn(heads, n, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(heads, n, dk, generator=g, dtype=torch.float64))
    v = torch.randn(heads, n, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(heads, n, generator=g, dtype=torch.float64)
    beta = torch.rand(heads, n, generator=g, dtype=torch.float64)
    s0 = torch.randn(heads, dk, dv, generator=g, dtype=torch.float64)
    out, final = chunked_scan(q, k, v, decay, beta, s0, block=8)
    s = s0[None]
    rows = []
    for t in range(n):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        rows.append(o[0])
    assert torch.allclose(out, torch.stack(rows, dim=1), atol=1e-10)
    assert torch.allclose(final, s[0], atol=1e-10)


def test_bfloat16_runs_close(root: Path, hf_model: torch.nn.Module) -> None:
    """bfloat16 weights and activations (the states stay float32): logits near float32's."""
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    assert isinstance(model, Qwen3NextForCausalLM)
    ids = prompt_of(120, salt=9)
    expected = hf_logits(hf_model, ids)
    got = OneSequence(model).logits(model, ids, 0)
    assert got.dtype == torch.float32
    assert (got - expected).abs().mean().item() < 0.05 * expected.abs().max().item()


# -- GGUF -------------------------------------------------------------------------------------------------

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}


def _write_gguf(path: Path, model: torch.nn.Module, q8: bool = False) -> None:
    """``model`` as llama.cpp's converter writes ``qwen3next`` (F32): the metadata it writes, q/k/v
    of ``in_proj_qkvz`` regrouped as ``attn_qkv`` and its z rows as ``attn_gate``, ``ssm_a`` =
    -exp(A_log), the conv weight squeezed, the 1 + w norms shifted, stacked experts, and one
    next-token-prediction block (stored, not loaded). With ``q8`` the projections and experts are
    Q8_0 blocks (per row, so regrouping rows commutes with it) and ``model``'s weights are replaced
    by what the blocks hold, so it stays the file's reference."""
    import gguf
    import numpy as np

    from tests.parity.test_moe_parity import add_test_vocab

    cfg = model.config
    arch = "qwen3next"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers + 1)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_uint32(f"{arch}.rope.dimension_count", int(cfg.head_dim * 0.25))
    writer.add_uint32(f"{arch}.expert_count", cfg.num_experts)
    writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", cfg.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", cfg.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", cfg.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", cfg.linear_num_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    add_test_vocab(writer)
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q8_type = gguf.GGMLQuantizationType.Q8_0

    def quantized(name: str, t: Tensor) -> bool:
        return q8 and t.dim() >= 2 and t.shape[-1] % 32 == 0 and not any(part in name for part in ("embed", "lm_head", "mlp.gate.", "conv1d"))

    if q8:
        with torch.no_grad():
            for hf_name, tensor in model.state_dict().items():
                if quantized(hf_name, tensor):
                    blocks = gguf.quants.quantize(tensor.numpy().astype(np.float32), q8_type)
                    tensor.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, q8_type),
                                                             dtype=np.float32).reshape(tensor.shape)))

    def add(name: str, array: np.ndarray, quantize: bool) -> None:
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(array, q8_type), raw_dtype=q8_type)
        else:
            writer.add_tensor(name, array)

    for hf_name, tensor in model.state_dict().items():
        t = tensor.detach().float()
        qz = quantized(hf_name, t)
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = t + 1.0
        if hf_name in fixed:
            add(fixed[hf_name], t.numpy(), qz)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            add(f"{blk}.ffn_gate_exps.weight", t[:, :inter].contiguous().numpy(), qz)
            add(f"{blk}.ffn_up_exps.weight", t[:, inter:].contiguous().numpy(), qz)
        elif rest == "linear_attn.in_proj_qkvz.weight":
            per_head = t.view(nk, 2 * dk + 2 * (nv // nk) * dv, -1)
            q, k, v, z = per_head.split((dk, dk, nv // nk * dv, nv // nk * dv), dim=1)
            qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            add(f"{blk}.attn_qkv.weight", qkv.contiguous().numpy(), qz)
            add(f"{blk}.attn_gate.weight", z.reshape(-1, t.shape[-1]).contiguous().numpy(), qz)
        elif rest == "linear_attn.A_log":
            add(f"{blk}.ssm_a", (-t.exp()).numpy(), qz)
        elif rest == "linear_attn.conv1d.weight":
            add(f"{blk}.ssm_conv1d.weight", t.squeeze(1).contiguous().numpy(), qz)
        else:
            add(f"{blk}.{_HF_TO_GGUF[rest]}", t.numpy(), qz)
    writer.add_tensor(f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight",
                      np.zeros((cfg.hidden_size, 2 * cfg.hidden_size), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("q8", [False, True], ids=["f32", "q8_0"])
def test_gguf_matches_transformers(tmp_path: Path, q8: bool) -> None:
    """An F32 ``qwen3next`` GGUF file, and a Q8_0 one (2-D projections and experts read as codes,
    against transformers with the weights the blocks hold): the same config, and a 160-token
    prompt's logits within 1e-4 of transformers."""
    hf_model = tiny_hf_model()
    path = tmp_path / "tiny-qwen3next.gguf"
    _write_gguf(path, hf_model, q8=q8)
    checkpoint = load_checkpoint(path, torch.float32)
    cfg = checkpoint.config
    assert isinstance(cfg, Qwen3NextConfig) and cfg.norms_shifted
    assert cfg.num_layers == 4 and cfg.linear_layers == (True, True, False, True)
    assert cfg.moe_layers == (False, True, True, True) and cfg.rotary == 4
    if q8:
        from helios.models.quant import GroupQuantized

        for name in ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "self_attn.q_proj"):
            layer = 2 if name.startswith("self_attn") else 0
            assert isinstance(checkpoint.weights[f"model.layers.{layer}.{name}.weight"], GroupQuantized)
    model = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.weights)
    assert isinstance(model, Qwen3NextForCausalLM)
    ids = prompt_of(160, salt=10)
    expected = hf_logits(hf_model, ids)
    diff = (OneSequence(model).logits(model, ids, 0) - expected).abs().max().item()
    print(f"qwen3next GGUF {'q8_0' if q8 else 'f32'}: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_the_decode_kernel_is_the_update() -> None:
    """`cpu_kernels.gated_delta_step` (in place on the slots, one fresh) against `recurrent_step`."""
    from helios.models import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    g = torch.Generator().manual_seed(1)
    n, heads, dk, dv = 3, 4, 16, 8
    q = l2norm(torch.randn(n, heads, dk, generator=g)) * dk ** -0.5
    k = l2norm(torch.randn(n, heads, dk, generator=g))
    v = torch.randn(n, heads, dv, generator=g)
    decay = -torch.rand(n, heads, generator=g)
    beta = torch.rand(n, heads, generator=g)
    state = torch.randn(5, heads, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    fresh = torch.tensor([0, 1, 0], dtype=torch.uint8)
    s0 = state[slots].clone()
    s0[1] = 0.0
    want, s1 = recurrent_step(q, k, v, decay, beta, s0)
    before = state.clone()
    got = cpu_kernels.gated_delta_step(q, k, v, decay, beta, state, slots, fresh)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(state[slots], s1, atol=1e-6)
    assert torch.equal(state[[1, 3]], before[[1, 3]])
