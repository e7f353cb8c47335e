"""Nemotron-H (`helios.models.nemotron_h`) against transformers' ``NemotronHForCausalLM`` (its torch
path: no mamba_ssm kernels) on a tiny random checkpoint with Mamba2, attention, MLP and MoE
blocks: float32 logits of a long prompt in one pass and in chunks that split the SSD scan's chunks,
the engine's greedy continuations and logprobs (several requests batched, chunked prefill, recurrent
state slots) against transformers' greedy generation and against each request alone; and
llama.cpp's own converter's F32 GGUF files of a dense (``nemotron_h``) and an MoE
(``nemotron_h_moe``) variant against transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.models.dense_attention import DenseAttention
from helios.models.interface import RecurrentBatch, RecurrentStateSpec
from helios.models.nemotron_h import NemotronHForCausalLM, ssd_scan, ssd_step
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_gguf_families_parity import _LLAMA_CPP, _RUNNER
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer
from tests.unit.test_engine import run

transformers = pytest.importorskip("transformers")

TOL = 1e-4
PATTERN = "M*-MEM*M"  # Mamba2, attention, MLP, MoE in the hybrid_override_pattern spelling


def _config(pattern: str = PATTERN) -> object:
    return transformers.NemotronHConfig(
        vocab_size=258, hidden_size=64, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, expand=1, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
        topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, max_position_embeddings=1024,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, bos_token_id=257, pad_token_id=0)


def _random_model(pattern: str = PATTERN) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(_config(pattern)).eval()
    with torch.no_grad():  # weights that exercise every term: random A, D, dt bias, norms, router bias
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif name.endswith(".D") or name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.08)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    hf = _random_model()
    root = tmp_path_factory.mktemp("nemotron_h")
    hf.save_pretrained(root)
    write_byte_tokenizer(root)
    return root, hf


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


class StatefulDense(DenseAttention):
    """`DenseAttention` plus one sequence's recurrent state (slot 0) for the Mamba2 layers."""

    def __init__(self, model: NemotronHForCausalLM) -> None:
        cfg = model.config
        specs = model.cache_specs()
        super().__init__(len(specs), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
        self.states = {i: tuple(torch.zeros(1, *shape) for shape in spec.shapes)
                       for i, spec in enumerate(specs) if isinstance(spec, RecurrentStateSpec)}
        self.position = 0
        self.length = 0

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        return RecurrentBatch(self.states[layer_idx], ((0, self.length, 0, self.position),))


def _chunked_logits(model: NemotronHForCausalLM, ids: list[int], cuts: list[int]) -> torch.Tensor:
    ctx = StatefulDense(model)
    parts = []
    for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        ctx.position, ctx.length = a, b - a
        parts.append(our_logits(model, ctx, ids[a:b], a))
    return torch.cat(parts)


def test_ssd_scan_matches_the_sequential_recurrence() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, p, n = 37, 4, 3, 5
    x, b, c = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for d in (p, n, n))
    dt = torch.rand(t, h, generator=g, dtype=torch.float64)
    a = -torch.rand(h, generator=g, dtype=torch.float64) * 2
    s0 = torch.randn(h, p, n, generator=g, dtype=torch.float64)
    y, final = ssd_scan(x, dt, a, b, c, s0, chunk=8)
    state, rows = s0[None], []
    for r in range(t):
        out, state = ssd_step(x[r : r + 1], dt[r : r + 1], a, b[r : r + 1], c[r : r + 1], state)
        rows.append(out[0])
    assert torch.allclose(y, torch.stack(rows), atol=1e-10) and torch.allclose(final, state[0], atol=1e-10)


def test_registry_config(tiny: tuple[Path, torch.nn.Module]) -> None:
    model = load_ours(tiny[0], architecture="nemotron_h")
    assert isinstance(model, NemotronHForCausalLM)
    assert model.config.layer_types == ("linear_attention", "full_attention", "mlp", "linear_attention", "moe",
                                        "linear_attention", "full_attention", "linear_attention")
    assert [type(s).__name__ for s in model.cache_specs()] == [
        "RecurrentStateSpec", "FullAttentionSpec", "RecurrentStateSpec", "RecurrentStateSpec", "FullAttentionSpec",
        "RecurrentStateSpec"]


@pytest.mark.parametrize("cuts", [[], [5, 40, 41, 150, 211]], ids=["one-pass", "chunks"])
def test_logits_match_transformers(tiny: tuple[Path, torch.nn.Module], cuts: list[int]) -> None:
    root, hf = tiny
    model = load_ours(root, architecture="nemotron_h")
    ids = _prompt(300)
    ref = hf_logits(hf, ids)
    ours = _chunked_logits(model, ids, cuts)
    err = (ours - ref).abs().max().item()
    assert err < TOL, err


def _greedy(rid: str, prompt: list[int], n: int) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True,
                         num_top_logprobs=3)


def _engine(model: NemotronHForCausalLM, chunk: int, num_pages: int = 512) -> EngineCore:
    return EngineCore(model, EngineConfig(page_size=8, num_pages=num_pages, max_active=4, prefill_chunk_size=chunk,
                                          max_model_len=1024), torch.float32)


@pytest.mark.parametrize(("chunk", "num_pages"), [(37, 512), (16, 48)], ids=["chunks-37", "preempting"])
def test_engine_greedy_matches_transformers_and_batching(tiny: tuple[Path, torch.nn.Module], chunk: int,
                                                         num_pages: int) -> None:
    """Three requests of different lengths batched, prefill chunks of 37 tokens (splitting the scan's
    16-token chunks) or of 16 with a pool small enough to preempt (the state recomputed), 32 greedy
    tokens each: every token the argmax of transformers' logits over the
    prompt and the continuation so far, its logprob within 1e-4, and the same tokens and logprobs as
    each request alone (speculation off: `test_speculation_rolls_the_recurrent_state_back` has it on); a preempted request may resume from a
    state checkpoint of its own (`engine/kv/checkpoints.py`). (transformers' own
    ``generate`` can differ from its full forward at a near tie: its decode path is a different
    float32 sum; this prompt set has one at a 2e-4 margin, so the full forward is the reference.)"""
    root, hf = tiny
    model = load_ours(root, architecture="nemotron_h")
    prompts = [_prompt(n, seed) for n, seed in ((230, 2), (97, 3), (161, 4))]
    core = _engine(model, chunk, num_pages)
    assert core.stats().prefix_caching is True and core.checkpoints is not None
    assert not core.scheduler.speculative.enabled
    reqs = [_greedy(f"r{i}", p, 32) for i, p in enumerate(prompts)]
    outs = run(core, reqs)
    for req, prompt in zip(reqs, prompts, strict=True):
        tokens = [t for o in outs[req.request_id] for t in o.new_token_ids]
        batched_lp = [lp.logprob for o in outs[req.request_id] for lp in (o.logprobs or ())]
        # transformers' full forward over the prompt and the continuation: each token its argmax.
        ref = torch.log_softmax(hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1].double(), dim=-1)
        assert tokens == ref.argmax(-1).tolist(), req.request_id
        got = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (got - torch.tensor(batched_lp, dtype=torch.float64)).abs().max().item() < TOL
        alone = run(_engine(model, 64), [_greedy("alone", prompt, 32)])["alone"]
        alone_lp = [lp.logprob for o in alone for lp in (o.logprobs or ())]
        assert [t for o in alone for t in o.new_token_ids] == tokens
        assert max(abs(a - b) for a, b in zip(batched_lp, alone_lp, strict=True)) < TOL
    assert (core.scheduler.num_preemptions > 0) == (num_pages == 48)


def test_speculation_rolls_the_recurrent_state_back(tiny: tuple[Path, torch.nn.Module]) -> None:
    from tests.parity.test_qwen3_next_parity import check_speculation_rolls_back

    root, hf = tiny
    check_speculation_rolls_back(load_ours(root, architecture="nemotron_h"), hf, _prompt(60, 3),
                                 (5, 10, 15, 20, 25, 30), page_size=8, chunk=37)


def test_a_follow_up_turn_restores_its_state_checkpoint(tiny: tuple[Path, torch.nn.Module]) -> None:
    """A second turn (the first turn's 120-token prompt, its 20 generated tokens and 15 more)
    restores the first turn's endpoint checkpoint at 136 (attention pages and the Mamba2 layers'
    conv and SSM states), reports 136 cached tokens and gives the logprobs of the same request on
    a fresh engine without a prefix cache (float32, 1e-5)."""
    root, _ = tiny
    model = load_ours(root, architecture="nemotron_h")
    core = _engine(model, 64)
    assert core.checkpoints is not None
    first = _prompt(120, 5)
    outs = run(core, [_greedy("a", first, 20)])["a"]
    follow = _greedy("b", [*first, *[t for o in outs for t in o.new_token_ids], *_prompt(15, 6)], 12)
    restored = run(core, [follow])["b"]
    assert restored[-1].num_cached_tokens == 136
    stats = core.stats().checkpoints
    assert stats is not None and stats.restores == 1 and stats.captures["endpoint"] >= 1
    plain = EngineCore(model, EngineConfig(page_size=8, num_pages=512, max_active=4, prefill_chunk_size=64,
                                           max_model_len=1024, prefix_caching=False), torch.float32)
    reference = run(plain, [follow])["b"]
    got = [(t, lp) for o in restored for t, lp in zip(o.new_token_ids, o.logprobs or (), strict=True)]
    want = [(t, lp) for o in reference for t, lp in zip(o.new_token_ids, o.logprobs or (), strict=True)]
    assert [t for t, _ in got] == [t for t, _ in want] and len(got) == 12
    diff = max(max(abs(a.logprob - b.logprob), *(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)))
               for (_, a), (_, b) in zip(got, want, strict=True))
    print(f"nemotron_h restored from the pool: max abs logprob diff {diff:.3g}")
    assert diff <= 1e-5


# -- llama.cpp's converter -----------------------------------------------------------------------------

# llama.cpp keeps MLP blocks and MoE blocks apart (``nemotron_h``: dense MLPs only; ``nemotron_h_moe``:
# every feed-forward block is MoE), so the mixed PATTERN above has no GGUF form; one variant each.
DENSE_PATTERN = "M*-M-M*M"
MOE_PATTERN = "M*EME*M"
_MOE_KEYS = ("num_experts_per_tok", "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
             "moe_latent_size", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "n_shared_experts",
             "mtp_layers_block_type", "moe_shared_expert_overlap")


def _release_folder(hf_model: torch.nn.Module, root: Path, *, dense: bool) -> Path:
    """``hf_model`` saved by transformers; a dense one with the dense releases' ``config.json``
    spelling (``hybrid_override_pattern``, ``num_hidden_layers``, no MoE keys): the converter takes
    ``nemotron_h_moe`` wherever the config names ``num_experts_per_tok``, which transformers 5's
    config always does, so the file also names no ``model_type`` (transformers' AutoConfig fails and
    the converter reads the file itself, as with an older transformers)."""
    hf_model.save_pretrained(root, safe_serialization=True)
    if dense:
        config = json.loads((root / "config.json").read_text())
        kinds = config.pop("layers_block_type")
        config["hybrid_override_pattern"] = "".join(
            {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[k] for k in kinds)
        config["num_hidden_layers"] = len(kinds)
        for key in ("model_type", *_MOE_KEYS):
            config.pop(key, None)
        (root / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(root)
    return root


def _convert(root: Path, path: Path) -> None:
    run_ = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(root), str(path), "f32"],
                          capture_output=True, text=True, timeout=300)
    assert run_.returncode == 0, run_.stderr[-3000:]


def _gguf_arch(path: Path) -> str:
    from helios.loaders.gguf_reader import read_gguf

    return str(read_gguf(path, None).metadata["general.architecture"])


def _one_pass(model: NemotronHForCausalLM, ids: list[int]) -> torch.Tensor:
    return _chunked_logits(model, ids, [])


def _engine_tokens(model: NemotronHForCausalLM, prompt: list[int], n: int) -> list[int]:
    outs = run(_engine(model, 37), [_greedy("g", prompt, n)])["g"]
    return [t for o in outs for t in o.new_token_ids]


_NOT_IN_GGUF = {"chunk_size": 128, "max_position_embeddings": 2 ** 20}
"""Config fields a GGUF file does not carry (the loader's values): the SSD chunk (an evaluation
detail) and the trained context (the converter writes 2**20)."""

_needs_converter = pytest.mark.skipif(not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                                      reason=f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")


@_needs_converter
def test_real_converter_dense_gguf_matches_transformers(tmp_path: Path) -> None:
    """A dense Nemotron-H (Mamba2, attention, MLP blocks) converted by llama.cpp's
    ``convert_hf_to_gguf.py`` (F32) to ``nemotron_h``: the config of the safetensors load (but the
    fields the file lacks, and the MoE sizes a dense file has none of), a 200-token prompt's logits
    within FP32_TOLERANCE of transformers, 16 greedy engine tokens equal to the safetensors load's."""
    hf = _random_model(DENSE_PATTERN)
    root = _release_folder(hf, tmp_path / "hf", dense=True)
    path = tmp_path / "tiny-nemotron-h.gguf"
    _convert(root, path)
    assert _gguf_arch(path) == "nemotron_h"
    model = load_ours(path, architecture="nemotron_h")
    reference = load_ours(root, architecture="nemotron_h")
    assert isinstance(model, NemotronHForCausalLM) and isinstance(reference, NemotronHForCausalLM)
    cfg = model.config
    assert {k: getattr(cfg, k) for k in _NOT_IN_GGUF} == _NOT_IN_GGUF
    assert (cfg.router, cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (None, 0, 0)
    assert attrs.evolve(cfg, **{k: getattr(reference.config, k) for k in (
        *_NOT_IN_GGUF, "moe_intermediate_size", "shared_intermediate_size")}) == reference.config
    ids = _prompt(200, seed=7)
    diff = (_one_pass(model, ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"nemotron_h GGUF (llama.cpp's converter): max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    prompt = _prompt(90, seed=8)
    assert _engine_tokens(model, prompt, 16) == _engine_tokens(reference, prompt, 16)


@_needs_converter
def test_real_converter_moe_gguf_matches_transformers(tmp_path: Path) -> None:
    """An MoE Nemotron-H (Mamba2, attention, MoE blocks: 8 sigmoid-routed experts in 2 groups,
    top-1 group, top-2, renormalised, scaled 1.5, a shared expert) converted by llama.cpp's
    converter (F32) to ``nemotron_h_moe``: the config of the safetensors load (but the fields the
    file lacks and the unused dense MLP size), a 200-token prompt's logits within FP32_TOLERANCE of
    transformers, 16 greedy engine tokens equal to the safetensors load's."""
    hf = _random_model(MOE_PATTERN)
    root = _release_folder(hf, tmp_path / "hf", dense=False)
    path = tmp_path / "tiny-nemotron-h-moe.gguf"
    _convert(root, path)
    assert _gguf_arch(path) == "nemotron_h_moe"
    model = load_ours(path, architecture="nemotron_h")
    reference = load_ours(root, architecture="nemotron_h")
    assert isinstance(model, NemotronHForCausalLM) and isinstance(reference, NemotronHForCausalLM)
    cfg = model.config
    assert {k: getattr(cfg, k) for k in _NOT_IN_GGUF} == _NOT_IN_GGUF and cfg.intermediate_size == 0
    assert cfg.router is not None and (cfg.router.n_group, cfg.router.topk_group) == (2, 1)
    assert attrs.evolve(cfg, **{k: getattr(reference.config, k) for k in (*_NOT_IN_GGUF, "intermediate_size")}) \
        == reference.config
    ids = _prompt(200, seed=9)
    diff = (_one_pass(model, ids) - hf_logits(hf, ids)).abs().max().item()
    print(f"nemotron_h_moe GGUF (llama.cpp's converter): max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    prompt = _prompt(90, seed=10)
    assert _engine_tokens(model, prompt, 16) == _engine_tokens(reference, prompt, 16)
