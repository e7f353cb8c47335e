"""MTP layers as the learned drafter (`helios.models.mtp`, `helios.engine.mtp`) on tiny DeepSeek-V3,
GLM-4.5, DeepSeek-V3.2 and GLM-5 checkpoints.

The checkpoints: a seeded random transformers model of the family (``DeepseekV3ForCausalLM``, ...)
of three layers is saved, and
its config then says two layers and ``num_nextn_predict_layers`` 1, so its third layer is the MTP
module's decoder block (``model.layers.2.*``, an MoE layer as DeepSeek-V3's is); the module's own
weights (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the embedding and
head, as DeepSeek's files carry them) are written into the file, seeded (transformers writes none).

- the predictor's logits at every position, in float32 through Helios's own module (chunked, its
  cache read back), against a float64 reference: the MTP glue in plain torch ops here, the decoder
  block transformers' ``DeepseekV3Model`` of one layer; its multi-draft chain against the same;
- through the engine (chunked prefill, three requests batched, pages of 4): greedy output with the
  MTP drafter identical to the output without speculation; ``learned_drafter`` and ``draft_steps``
  in the stats; preempted and aborted requests release their MTP state (``check_integrity`` after
  every step); a prompt served again from the prefix cache drafts from the MTP pool's own cache;
- acceptance: a checkpoint built so that the model's greedy output walks a fixed cycle of tokens and
  the MTP layer predicts it (the layers' outputs scaled down, the head mapping each token's
  embedding to its successor, ``eh_proj`` reading the embedding half): drafts are accepted, the
  output is identical;
- DSA: DeepSeek-V3.2's and GLM-5's MTP blocks with an indexer of their own (``index_topk`` under
  the prompts), GLM-5's target with a layer sharing the previous one's selection; a GLM-5 MTP
  layer without an indexer (attending to its whole context);
- GGUF: each family's folder converted by llama.cpp's own converter (``blk.2.nextn.*``): the same
  logits bit for bit, the runtime's drafter, and the cycling checkpoint's drafts accepted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineCore
from helios.engine.mtp import MTPDrafter
from helios.engine.records import EngineRequest
from helios.loaders.checkpoint import load_checkpoint
from helios.models.deepseek_v32 import DeepseekV32ForCausalLM
from helios.models.dense_attention import DenseAttention
from helios.models.interface import LatentAttentionSpec
from helios.models.moe_decoder import MoEForCausalLM
from helios.models.mtp import MultiTokenPredictor, load_mtp, mtp_layers
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import drive_mtp, follow_cycle, load_ours, mtp_engine, randomize, write_byte_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 272
HIDDEN = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
               num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
               max_position_embeddings=512, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
               pad_token_id=0, bos_token_id=2, eos_token_id=1)
_MLA = dict(num_key_value_heads=4, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32, kv_lora_rank=24,
            qk_rope_head_dim=8)
_DSA = dict(index_topk=7, index_head_dim=16, index_n_heads=4)
FAMILIES = {
    # MLA (rows of 32: the CPU decode kernel serves the MTP block's cache), its MoE router.
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32,
                                       kv_lora_rank=24, qk_rope_head_dim=8, rope_interleave=True)),
    # GQA with q/k/v bias, per-head q/k norms and partial rotary embeddings (a full-attention cache).
    "glm4_moe": ("Glm4Moe", dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
                                 partial_rotary_factor=0.5)),
    # MLA with DSA's lightning indexer in every layer, the MTP block's included (``index_topk`` 7, under
    # the prompts' lengths: the selection is sparse).
    "deepseek_v32": ("DeepseekV32", dict(_MLA, **_DSA)),
    # GLM-5: the indexer's RoPE interleaved; the target's second layer shares the first's selection
    # (``indexer_types``, `_hf_config`), the MTP block has an indexer of its own.
    "glm_moe_dsa": ("GlmMoeDsa", dict(_MLA, **_DSA)),
}
PROMPTS = [[3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 180, 77, 23, 260],
           [8, 19, 140, 33, 210, 6, 91],
           [120, 121, 122, 45, 46, 47, 200, 201, 15, 16, 17, 18, 99]]
_MTP_SUFFIXES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight")


def _hf_config(family: str, num_layers: int, first_dense: int = 1, **overrides: object) -> object:
    prefix, extra = FAMILIES[family]
    if family == "glm_moe_dsa":  # full, shared, full: the MTP block (the third layer, or the only one) full
        extra = {**extra, "indexer_types": ["full", "shared", "full"][:num_layers]}
    cfg = getattr(transformers, f"{prefix}Config")(**{**_COMMON, **extra, "num_hidden_layers": num_layers,
                                                      "first_k_dense_replace": first_dense, **overrides})
    cfg._experts_implementation = "eager"  # a loop over the experts: float64 runs (grouped_mm does not)
    return cfg


def _hf(family: str, num_layers: int, **overrides: object) -> torch.nn.Module:
    return getattr(transformers, f"{FAMILIES[family][0]}ForCausalLM")(
        _hf_config(family, num_layers, **overrides)).eval()


def _write(root: Path, family: str, hf3: torch.nn.Module, own: dict[str, Tensor]) -> None:
    """Save the three-layer model ``hf3`` plus the MTP module's own weights ``own`` as a two-layer
    DeepSeek-V3 with one MTP layer."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf3.save_pretrained(tmp, safe_serialization=True)
        state: dict[str, Tensor] = {}
        for f in Path(tmp).glob("*.safetensors"):
            state.update(safetensors_torch.load_file(str(f)))
    state.update(own)
    _hf(family, 2).save_pretrained(root, safe_serialization=True)  # its config.json; its weights are replaced
    for f in root.glob("*.safetensors*"):
        f.unlink()
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"),
                                metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (root / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(root)


def _random_own(hf3: torch.nn.Module, seed: int) -> dict[str, Tensor]:
    """Seeded MTP glue weights; the embedding and head copies of the model's."""
    g = torch.Generator().manual_seed(seed)
    p = "model.layers.2."
    return {p + "enorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            p + "hnorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            p + "eh_proj.weight": 0.2 * torch.randn(HIDDEN, 2 * HIDDEN, generator=g),
            p + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            p + "shared_head.head.weight": hf3.lm_head.weight.detach().clone(),
            p + "embed_tokens.weight": hf3.model.embed_tokens.weight.detach().clone()}


Ckpt = tuple[str, Path, dict[str, Tensor]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def random_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Ckpt:
    """The family, the folder, and the weights in transformers' in-memory names (the reference's)."""
    family = request.param
    hf3 = _hf(family, 3)
    randomize(hf3, 11)
    own = _random_own(hf3, 12)
    root = tmp_path_factory.mktemp(f"{family}-mtp")
    _write(root, family, hf3, own)
    return family, root, {**hf3.state_dict(), **own}


# -- the float64 reference ----------------------------------------------------------------------
class Reference:
    """The target (transformers, two layers) and the MTP module (its glue in plain float64 torch
    ops, its decoder block transformers' one-layer model of the family), all float64."""

    def __init__(self, family: str, state: dict[str, Tensor], *, dense_block: bool = False) -> None:
        """``dense_block``: the MTP block (DSA) has no indexer of its own and attends to its whole
        context: the reference block is a full-indexer layer whose ``index_topk`` covers every
        position (its indexer's weights, left as built, then select everything)."""
        target = _hf(family, 2)
        target.load_state_dict({k: v for k, v in state.items() if not k.startswith("model.layers.2.")}, strict=True)
        self.target = target.double()
        block = getattr(transformers, f"{FAMILIES[family][0]}Model")(
            _hf_config(family, 1, first_dense=0, **({"index_topk": 512} if dense_block else {})))
        p = "model.layers.2."
        own = {p + s for s in _MTP_SUFFIXES}
        weights = {"layers.0." + k[len(p):]: v for k, v in state.items() if k.startswith(p) and k not in own}
        weights["norm.weight"] = state[p + "shared_head.norm.weight"]
        weights["embed_tokens.weight"] = state["model.embed_tokens.weight"]
        missing = block.load_state_dict(weights, strict=not dense_block).missing_keys
        assert all(".indexer." in k for k in missing), missing
        self.block = block.eval().double()
        self.embed = state["model.embed_tokens.weight"].double()
        self.head = state[p + "shared_head.head.weight"].double()
        self.enorm, self.hnorm = state[p + "enorm.weight"].double(), state[p + "hnorm.weight"].double()
        self.eh_proj = state[p + "eh_proj.weight"].double()
        self.eps = self.target.config.rms_norm_eps

    def target_hidden(self, ids: list[int]) -> Tensor:
        """The model's hidden states after its final norm, [len(ids), hidden]."""
        with torch.no_grad():
            return self.target.model(torch.tensor([ids])).last_hidden_state[0]

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def outputs(self, next_ids: list[int], hidden: Tensor) -> Tensor:
        """The module's normed outputs g at positions 0 .. T-1 for tokens ``next_ids`` (token p + 1)
        and hidden states ``hidden`` [T, hidden] (the embedding at position 0 zeroed)."""
        e = self.embed[torch.tensor(next_ids)]
        e[0] = 0.0
        x = torch.cat((self._norm(e, self.enorm), self._norm(hidden.double(), self.hnorm)), dim=-1) @ self.eh_proj.T
        with torch.no_grad():
            return self.block(inputs_embeds=x[None]).last_hidden_state[0]

    def logits(self, g: Tensor) -> Tensor:
        return g @ self.head.T

    def chain(self, ids: list[int], depth: int) -> list[int]:
        """``depth`` greedy drafts after ``ids``: the module over the model's hidden states of
        positions 0 .. n-2, then each further position reads the last draft and the output before it."""
        n = len(ids)
        h = self.target_hidden(ids)[: n - 1]
        next_ids = list(ids[1:])
        drafts: list[int] = []
        for _ in range(depth):
            g = self.outputs(next_ids, h)
            d = int(self.logits(g[-1]).argmax())
            drafts.append(d)
            next_ids.append(d)
            h = torch.cat((h, g[-1:]))
        return drafts


def _predictor(root: Path) -> tuple[MoEForCausalLM, MultiTokenPredictor]:
    checkpoint = load_checkpoint(root, torch.float32)
    target = load_ours(root)
    assert isinstance(target, MoEForCausalLM) and target.config.num_layers == 2
    assert mtp_layers(target.config.num_layers, checkpoint.weights) == 1
    return target, load_mtp(target, checkpoint.architecture, checkpoint.weights)


def test_predictor_logits_match_float64(random_ckpt: Ckpt) -> None:
    """Every position's logits, computed in chunks (3, 9, then one at a time: the block's cache
    read back in both attention forms), equal the float64 reference's within FP32_TOLERANCE."""
    family, root, state = random_ckpt
    ref = Reference(family, state)
    target, predictor = _predictor(root)
    ids = PROMPTS[0]
    hidden = ref.target_hidden(ids)[:-1]
    expected = ref.logits(ref.outputs(ids[1:], hidden))
    attn = DenseAttention.for_model(predictor.block, initial_capacity=2)
    got = []
    with torch.inference_mode():
        chunks = [(0, 3), (3, 12)] + [(i, i + 1) for i in range(12, len(ids) - 1)]
        for a, b in chunks:
            g = predictor(torch.tensor(ids[a + 1 : b + 1]), torch.arange(a, b), hidden[a:b].float(), attn)
            got.append(predictor.compute_logits(g))
    diff = (torch.cat(got).double() - expected).abs().max().item()
    print(f"MTP logits fp32 vs float64: max abs diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE
    # The target's own hidden states (what the engine hands over) equal the reference's too.
    with torch.inference_mode():
        ours = target(torch.tensor(ids), torch.arange(len(ids)), DenseAttention.for_model(target))
    assert (ours.double() - ref.target_hidden(ids)).abs().max().item() < FP32_TOLERANCE


def test_the_drafter_chains_drafts_as_the_reference(random_ckpt: Ckpt) -> None:
    """`MTPDrafter` fed the model's hidden states of a prompt (as the runner hands them over, in
    two chunks) drafts 4 tokens: the float64 reference's chain."""
    from helios.engine.scheduler import RequestState

    family, root, state = random_ckpt
    ref = Reference(family, state)
    _, predictor = _predictor(root)
    drafter = MTPDrafter(predictor, torch.float32, num_pages=16, page_size=4, max_active=2, max_model_len=64)
    ids = PROMPTS[0]
    seq = RequestState(EngineRequest("r", tuple(ids), SamplingParams(temperature=0.0), max_tokens=8), list(ids),
                       len(ids), None, 0)
    hidden = ref.target_hidden(ids).float()
    drafter.capture(seq, 0, hidden[:7])
    assert drafter.num_states == 1 and drafter.forward_tokens == 7  # positions 0..6: their next tokens are known
    drafter.capture(seq, 7, hidden[7:-1])
    assert drafter.forward_tokens == len(ids) - 1
    # The draft chain after the prompt: the module's output at position n - 2 gives draft 1.
    drafts = drafter.propose("r", ids, 4)
    assert list(drafts) == ref.chain(ids, 4)
    assert drafter.forward_tokens == len(ids) - 1 + 3 and drafter.draft_tokens == 4
    # Two requests announced (`prefetch`, as the scheduler does before a step's decode rounds):
    # the first `propose` drafts for both, one forward per further depth (3 at depth 4, not 6);
    # the second request's drafts are then served as computed, no forward. Each is the reference's.
    other = PROMPTS[1]
    seq2 = RequestState(EngineRequest("s", tuple(other), SamplingParams(temperature=0.0), max_tokens=8), list(other),
                        len(other), None, 0)
    drafter.capture(seq2, 0, ref.target_hidden(other).float()[:-1])
    longer = [*ids, drafts[0]]  # "r" one token further: its hidden state at n - 2 comes first
    seq.token_ids.append(drafts[0])
    drafter.capture(seq, len(ids) - 1, ref.target_hidden(longer).float()[len(ids) - 1 : len(ids)])
    forwards = drafter.forwards
    drafter.prefetch("r", longer, 4)
    drafter.prefetch("s", other, 4)
    assert list(drafter.propose("r", longer, 4)) == ref.chain(longer, 4)
    assert drafter.forwards == forwards + 3
    assert list(drafter.propose("s", other, 3)) == ref.chain(other, 3)  # a shorter round: a prefix
    assert drafter.forwards == forwards + 3
    drafter.check_integrity(live=["r", "s"])
    drafter.release("r")
    drafter.release("s")
    drafter.check_integrity(live=[])
    assert drafter.num_states == 0


def test_glm5_mtp_layer_without_an_indexer(tmp_path: Path) -> None:
    """A GLM-5 checkpoint whose MTP layer is of the "shared" kind (no indexer tensors: it would reuse
    a previous layer's selection, and its block has none) loads as a block attending to its whole
    context: its logits equal a float64 full-context reference's; through the engine, greedy
    output with it drafting equals plain decoding."""
    hf3 = _hf("glm_moe_dsa", 3, indexer_types=["full", "shared", "shared"])
    randomize(hf3, 13)
    own = _random_own(hf3, 14)
    _write(tmp_path, "glm_moe_dsa", hf3, own)
    state = {**hf3.state_dict(), **own}
    assert not any(k.startswith("model.layers.2.self_attn.indexer.") for k in state)
    ref = Reference("glm_moe_dsa", state, dense_block=True)
    _, predictor = _predictor(tmp_path)
    assert not isinstance(predictor.block, DeepseekV32ForCausalLM)
    assert predictor.cache_specs() == (LatentAttentionSpec(24 + 8),)
    ids = PROMPTS[0]
    hidden = ref.target_hidden(ids)[:-1]
    expected = ref.logits(ref.outputs(ids[1:], hidden))
    with torch.inference_mode():
        g = predictor(torch.tensor(ids[1:]), torch.arange(len(ids) - 1), hidden.float(),
                      DenseAttention.for_model(predictor.block))
        diff = (predictor.compute_logits(g).double() - expected).abs().max().item()
    print(f"GLM-5 MTP layer without an indexer, fp32 vs float64: max abs diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    plain, _ = _engine(tmp_path, mtp=False)
    want = drive_mtp(plain, None, _requests("g", max_tokens=20))
    core, drafter = _engine(tmp_path, mtp=True)
    assert drive_mtp(core, drafter, _requests("g", max_tokens=20)) == want
    assert core.stats().draft_steps > 0


# -- the engine ---------------------------------------------------------------------------------
def _engine(root: Path, *, mtp: bool, num_pages: int = 64, mode: str = "ngram",
            depth: int = 3, chunk: int = 5) -> tuple[EngineCore, MTPDrafter | None]:
    return mtp_engine(*_predictor(root), mtp=mtp, num_pages=num_pages, mode=mode, depth=depth, chunk=chunk)


def _requests(prefix: str, max_tokens: int = 36) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=max_tokens,
                          ignore_eos=True) for i, p in enumerate(PROMPTS)]


def test_engine_greedy_output_identical(random_ckpt: Ckpt) -> None:
    """Three requests batched, prefill chunks of 5, 36 greedy tokens each: identical with the MTP
    drafter and without speculation; the stats report the learned drafter and its draft steps; a
    prompt served again from the prefix cache starts from the MTP pool's own cached pages."""
    _, root, _ = random_ckpt
    plain, _ = _engine(root, mtp=False)
    want = drive_mtp(plain, None, _requests("r"))
    assert plain.stats().learned_drafter is False and plain.stats().draft_steps == 0
    core, drafter = _engine(root, mtp=True)
    assert drafter is not None
    got = drive_mtp(core, drafter, _requests("r"))
    assert got == want and all(len(t) == 36 for t in got.values())
    stats = core.stats()
    spec = stats.speculative
    assert stats.learned_drafter is True and stats.draft_steps == drafter.forward_tokens > 0
    assert spec is not None and spec.model_draft_rounds > 0 and spec.verification_drafts > 0
    assert drafter.draft_tokens >= spec.model_draft_rounds
    print(f"random MTP: {spec.model_draft_rounds} rounds, {spec.model_accepted_drafts} accepted, "
          f"{stats.draft_steps} draft steps")
    # The first prompt again: the target reuses its cached pages, so does the MTP pool.
    again = drive_mtp(core, drafter, [EngineRequest("again", tuple(PROMPTS[0]), SamplingParams(temperature=0.0),
                                                 max_tokens=36, ignore_eos=True)])
    assert again["again"] == want["r0"]
    assert core.stats().reused_tokens >= 16 and drafter.cache_misses == 0


def test_engine_drafts_jointly(random_ckpt: Ckpt) -> None:
    """Steps of 16 tokens: the three requests' rounds draft together (the scheduler announces them,
    `Proposer.prefetch`; the first `propose` drafts for all, one forward per depth), and the greedy
    output is still plain decoding's."""
    _, root, _ = random_ckpt
    plain, _ = _engine(root, mtp=False, chunk=16)
    want = drive_mtp(plain, None, _requests("j", max_tokens=16))
    core, drafter = _engine(root, mtp=True, chunk=16)
    assert drafter is not None
    assert drive_mtp(core, drafter, _requests("j", max_tokens=16)) == want
    spec = core.stats().speculative
    assert spec is not None
    print(f"joint MTP drafting: {spec.model_draft_rounds} rounds, {drafter.joint_rounds} drafted with an earlier "
          f"request's, {drafter.forwards} forwards for {drafter.forward_tokens} positions")
    assert drafter.joint_rounds > 0 and drafter.forwards < drafter.forward_tokens


def test_preempted_and_aborted_requests_release_mtp_state(random_ckpt: Ckpt) -> None:
    """A pool of 16 pages for three requests of up to 55 tokens: preemptions (recomputed requests
    start their MTP state over); one request aborted midway. Outputs equal the plain engine's."""
    _, root, _ = random_ckpt
    plain, _ = _engine(root, mtp=False, num_pages=16)
    want = drive_mtp(plain, None, _requests("p"), abort_at={"p1": 10})
    core, drafter = _engine(root, mtp=True, num_pages=16)
    got = drive_mtp(core, drafter, _requests("p"), abort_at={"p1": 10})
    assert core.scheduler.num_preemptions > 0
    assert got["p0"] == want["p0"] and got["p2"] == want["p2"]
    # The aborted one is a prefix of the same output (it may have committed a few more before the abort).
    full = drive_mtp(_engine(root, mtp=False)[0], None, [_requests("q")[1]])["q1"]
    assert got["p1"] == full[: len(got["p1"])] and len(got["p1"]) >= 10


# -- acceptance ---------------------------------------------------------------------------------
def _cycle_model(seed: int) -> tuple[torch.nn.Module, dict[str, Tensor], list[int]]:
    """A checkpoint whose greedy output follows a cycle through every token 3..VOCAB-1, and whose MTP
    layer predicts it (see the module docstring): the three-layer model, the MTP glue weights, the
    successor table."""
    hf3 = _hf("deepseek_v3", 3)
    randomize(hf3, seed)
    g = torch.Generator().manual_seed(seed + 1)
    # every layer's output (attention, MLPs, experts) scaled down
    successor, embed, head = follow_cycle(hf3, g, ("o_proj.weight", "down_proj.weight", "experts.down_proj"), 0.05)
    p = "model.layers.2."
    eh = 0.02 * torch.randn(HIDDEN, 2 * HIDDEN, generator=g)
    eh[:, :HIDDEN] += torch.eye(HIDDEN)  # the embedding half: the next token's embedding goes through
    own = {p + "enorm.weight": torch.ones(HIDDEN), p + "hnorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
           p + "eh_proj.weight": eh, p + "shared_head.norm.weight": torch.ones(HIDDEN),
           p + "shared_head.head.weight": head.clone(), p + "embed_tokens.weight": embed.clone()}
    return hf3, own, successor


def test_mtp_drafts_are_accepted(tmp_path: Path) -> None:
    """One stream, adaptive depth up to 4: the MTP layer's drafts are accepted (the target's output
    walks the cycle it predicts), and the output is identical to plain decoding; a seeded sampled
    request's too."""
    hf3, own, successor = _cycle_model(21)
    _write(tmp_path, "deepseek_v3", hf3, own)
    prompt = [5, 77, 140, 33, 9, 200, 61]
    request = [EngineRequest("c", tuple(prompt), SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)]
    plain, _ = _engine(tmp_path, mtp=False)
    want = drive_mtp(plain, None, request)["c"]
    walk = [successor[prompt[-1]]]
    while len(walk) < 40:
        walk.append(successor[walk[-1]])
    assert want == walk  # the construction works: greedy decoding follows the cycle
    core, drafter = _engine(tmp_path, mtp=True, mode="adaptive", depth=4)
    t0 = time.perf_counter()
    got = drive_mtp(core, drafter, request)["c"]
    assert got == want
    spec = core.stats().speculative
    assert spec is not None
    print(f"cycle MTP: {spec.model_draft_rounds} rounds, {spec.model_accepted_drafts} accepted of "
          f"{spec.verification_drafts} drafts, {core.stats().draft_steps} draft steps, "
          f"{time.perf_counter() - t0:.2f} s")
    assert spec.model_draft_rounds > 0 and spec.model_accepted_drafts > 0
    assert spec.model_accepted_drafts == spec.accepted_drafts  # the n-gram lookups had nothing to draft
    assert spec.verification_rounds < 40 - 10  # drafts saved at least 10 target steps
    # A seeded sampled request, hot enough to leave the cycle now and then: the drafts go through the
    # sampler's rejection rule (accepted with the draw's probability), some accepted, some not; its
    # tokens equal plain decoding's with the same seed.
    sampled = [EngineRequest("s", tuple(prompt), SamplingParams(temperature=30.0, seed=3), max_tokens=40,
                             ignore_eos=True)]
    want = drive_mtp(_engine(tmp_path, mtp=False)[0], None, sampled)["s"]
    core, drafter = _engine(tmp_path, mtp=True, mode="adaptive", depth=4)
    assert drive_mtp(core, drafter, sampled)["s"] == want
    spec = core.stats().speculative
    assert spec is not None and 0 < spec.model_accepted_drafts < spec.verification_drafts  # accepted and rejected
    print(f"cycle MTP, seeded T=30: {spec.model_accepted_drafts} accepted of {spec.verification_drafts}; "
          f"{sum(b != successor[a] for a, b in zip([prompt[-1], *want], want, strict=False))} of 40 tokens "
          "not their predecessor's successor")


# -- loading ------------------------------------------------------------------------------------
def test_runtime_loads_the_mtp_drafter(random_ckpt: Ckpt, tmp_path: Path) -> None:
    """`runtime.load_mtp_drafter` builds the drafter from a folder with an MTP layer (what
    ``[speculative] mtp``, on by default, loads at start); a folder without one gives None; a stored
    embedding copy that differs from the model's is refused with a warning (no drafter); the
    config key takes booleans only."""
    import attrs

    from helios.config import ConfigError, HeliosConfig, SpeculativeSection, load_config
    from helios.runtime import has_mtp, load_model, load_mtp_drafter

    family, root, state = random_ckpt
    cfg = HeliosConfig()
    assert cfg.speculative.mtp is True
    loaded = load_model(root, weights="float32", dtype="float32")
    assert has_mtp(loaded.checkpoint)
    drafter = load_mtp_drafter(cfg, loaded, num_pages=8, max_model_len=64, fingerprint=b"f")
    assert isinstance(drafter, MTPDrafter) and drafter.kv.num_pages == 8
    # The same model with its MTP tensors dropped.
    plain = tmp_path / "plain"
    hf2 = _hf(family, 2)
    hf2.load_state_dict({k: v for k, v in state.items() if k in hf2.state_dict()}, strict=True)
    _write(plain, family, hf2, {})
    bare = load_model(plain, weights="float32", dtype="float32")
    assert not has_mtp(bare.checkpoint)
    assert load_mtp_drafter(cfg, bare, num_pages=8, max_model_len=64, fingerprint=b"f") is None
    # An MTP layer whose embedding is not the model's.
    odd = tmp_path / "odd"
    hf3 = _hf(family, 3)
    hf3.load_state_dict({k: v for k, v in state.items() if k in hf3.state_dict()}, strict=True)
    own = {k: v for k, v in state.items() if k.startswith("model.layers.2.") and k not in hf3.state_dict()}
    own["model.layers.2.embed_tokens.weight"] = own["model.layers.2.embed_tokens.weight"] + 1.0
    _write(odd, family, hf3, own)
    assert load_mtp_drafter(cfg, load_model(odd, weights="float32", dtype="float32"), num_pages=8,
                            max_model_len=64, fingerprint=b"f") is None
    assert attrs.evolve(cfg, speculative=SpeculativeSection(mtp=False)).speculative.mtp is False
    bad = tmp_path / "bad.toml"
    bad.write_text('[speculative]\nmtp = "yes"\n')
    with pytest.raises(ConfigError, match=r"speculative\.mtp must be true or false"):
        load_config(bad)


# -- GGUF files ---------------------------------------------------------------------------------
_CONVERTED_AS = {
    # llama.cpp writes the MTP layer (``blk.2.nextn.*``) for deepseek2 files from its GLM-4.7-Flash
    # converter (DeepSeek-V3's drops it): the same MLA + MoE layout, so the DeepSeek-V3 folder is
    # converted as that architecture, its router named as the released configs name it.
    "deepseek_v3": ("deepseek2", {"architectures": ["Glm4MoeLiteForCausalLM"], "scoring_func": "sigmoid"}),
    "glm4_moe": ("glm4moe", {}),
    "deepseek_v32": ("deepseek32", {"scoring_func": "sigmoid"}),
    "glm_moe_dsa": ("glm-dsa", {"scoring_func": "sigmoid"}),
}


def _llama_cpp_gguf(folder: Path, family: str, out: Path) -> Path:
    """``folder`` converted by llama.cpp's own ``convert_hf_to_gguf.py`` (F32, a stand-in vocabulary of
    the same size; skipped without the converter's tree), as ``out``; checks that it wrote the MTP
    layer as llama.cpp's loaders read it."""
    import shutil
    import subprocess
    import sys

    import gguf

    from tests.parity.test_gguf_families_parity import _LLAMA_CPP, _RUNNER

    if not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")
    arch, overrides = _CONVERTED_AS[family]
    src = out.parent / f"{out.stem}-hf"
    shutil.copytree(folder, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **overrides}))
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(src), str(out), "f32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields[f"{arch}.block_count"].contents() == 3
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in reader.tensors}
    nextn = ("eh_proj", "enorm", "hnorm", "shared_head_norm", "shared_head_head", "embed_tokens")
    assert {f"blk.2.nextn.{s}.weight" for s in nextn} | {"blk.2.attn_norm.weight", "blk.2.ffn_gate_inp.weight"} <= names
    return out


def test_gguf_mtp_layer_equals_the_folders(random_ckpt: Ckpt, tmp_path: Path) -> None:
    """The folder converted by llama.cpp (its ``blk.2`` block and ``blk.2.nextn.*`` tensors) loads the
    same MTP module: the logits at every position equal the folder's bit for bit (the file holds
    its float32 values) and the float64 reference's within FP32_TOLERANCE; `runtime.has_mtp` and
    `runtime.load_mtp_drafter` take the file as they take the folder."""
    from helios.config import HeliosConfig
    from helios.runtime import has_mtp, load_model, load_mtp_drafter

    family, root, state = random_ckpt
    path = _llama_cpp_gguf(root, family, tmp_path / f"{family}.gguf")
    checkpoint = load_checkpoint(path, torch.float32)
    assert mtp_layers(2, checkpoint.weights) == 1
    target = load_ours(path)
    assert isinstance(target, MoEForCausalLM) and target.config.num_layers == 2
    predictor = load_mtp(target, checkpoint.architecture, checkpoint.weights)
    folder_target, folder_predictor = _predictor(root)
    ref = Reference(family, state)
    ids = PROMPTS[0]
    logits = []
    with torch.inference_mode():
        for model, mtp in ((target, predictor), (folder_target, folder_predictor)):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention.for_model(model))[:-1]
            g = mtp(torch.tensor(ids[1:]), torch.arange(len(ids) - 1), hidden, DenseAttention.for_model(mtp.block))
            logits.append(mtp.compute_logits(g))
    expected = ref.logits(ref.outputs(ids[1:], ref.target_hidden(ids)[:-1]))
    diff = (logits[0].double() - expected).abs().max().item()
    print(f"{family} GGUF MTP logits vs float64: max abs diff {diff:.3g}")
    assert torch.equal(logits[0], logits[1])
    assert diff < FP32_TOLERANCE
    loaded = load_model(path, weights="float32", dtype="float32")
    assert has_mtp(loaded.checkpoint)
    drafter = load_mtp_drafter(HeliosConfig(), loaded, num_pages=8, max_model_len=64, fingerprint=b"f")
    assert isinstance(drafter, MTPDrafter)


def test_gguf_mtp_drafts_are_accepted(tmp_path: Path) -> None:
    """The cycling checkpoint (`test_mtp_drafts_are_accepted`) as llama.cpp converts it: through the
    engine, greedy output with its MTP layer drafting equals plain greedy decoding, with drafts
    accepted."""
    hf3, own, successor = _cycle_model(21)
    _write(tmp_path / "hf", "deepseek_v3", hf3, own)
    path = _llama_cpp_gguf(tmp_path / "hf", "deepseek_v3", tmp_path / "cycle.gguf")
    prompt = [5, 77, 140, 33, 9, 200, 61]
    request = [EngineRequest("c", tuple(prompt), SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)]
    want = drive_mtp(_engine(path, mtp=False)[0], None, request)["c"]
    walk = [successor[prompt[-1]]]
    while len(walk) < 40:
        walk.append(successor[walk[-1]])
    assert want == walk
    core, drafter = _engine(path, mtp=True, mode="adaptive", depth=4)
    assert drive_mtp(core, drafter, request)["c"] == want
    stats = core.stats()
    spec = stats.speculative
    assert spec is not None and stats.learned_drafter and stats.draft_steps > 0
    print(f"cycle MTP from GGUF: {spec.model_draft_rounds} rounds, {spec.model_accepted_drafts} accepted of "
          f"{spec.verification_drafts} drafts")
    assert spec.model_accepted_drafts > 0 and spec.verification_rounds < 40 - 10
