"""DeepSeek V4's MTP layer as the learned drafter (`helios.models.mtp.DeepseekV4MTP`, through
`helios.engine.mtp`).

The checkpoints: the tiny seeded DeepSeek V4 of the parity tests (`tiny.tiny_deepseek_v4`: five
layers, sliding / CSA / HCA, ``hc_mult`` 3) is built with a sixth layer, a sliding-window layer
routed by its gate as DeepSeek's releases make the MTP block, and saved; the folder then holds the
five layers as the model and the sixth's tensors as ``mtp.0.*`` in DeepSeek's release names
(``attn.*``, ``ffn.*``, ``attn_norm``, ``hc_attn_*`` ...), with the module's own weights, seeded:
``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``hc_head_*``, ``norm``, and copies of the embedding
(``emb.tok_emb``) and head (``head``).

- the module's logits at every position (Helios, float32, chunked: its block's cache read back)
  against a float64 reference written here: the model's residual streams before its HyperHead from
  transformers' ``DeepseekV4ForCausalLM`` (a hook on its ``hc_head``), the glue (``enorm``,
  ``hnorm``, ``e_proj``, ``h_proj``, the module's HyperHead and norm, the head) in plain float64
  torch ops, the block transformers' own ``DeepseekV4DecoderLayer`` (with its hyper-connections)
  under a sliding-window mask; the model's streams as Helios hands them over, too;
- drafts deeper than one feed the module's own output streams back: the logits of each depth
  against the reference's, and `MTPDrafter`'s chain of 4 drafts equal to the reference's;
- through the engine: 32 greedy tokens with the MTP drafter identical to plain decoding, on the
  random checkpoint and on one whose model mostly walks a fixed cycle of tokens that the MTP layer
  predicts (drafts accepted and rejected, counted);
- loading: ``[speculative] mtp`` loads the drafter from the folder (`runtime.load_mtp_drafter`);
  the ``model.mtp.*`` prefix loads the same module; an embedding or head copy that differs from
  the model's is refused as for the other families (no drafter, a warning); a compressed-attention
  MTP block is refused.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.mtp import MTPDrafter
from helios.engine.records import EngineRequest
from helios.loaders.checkpoint import load_checkpoint
from helios.models.deepseek_v4 import SLIDING, DeepseekV4ForCausalLM
from helios.models.dense_attention import DenseAttention
from helios.models.interface import DraftFeatureLM, SlidingWindowSpec
from helios.models.mtp import DeepseekV4MTP, load_mtp, mtp_layers
from tests.numerics import FP32_TOLERANCE
from tests.parity.tiny import (
    DEEPSEEK_V4_CONFIG,
    drive_mtp,
    follow_cycle,
    load_ours,
    mtp_engine,
    tiny_deepseek_v4,
    write_byte_tokenizer,
)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v4", allow_module_level=True)
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = DEEPSEEK_V4_CONFIG["vocab_size"]
HIDDEN = DEEPSEEK_V4_CONFIG["hidden_size"]
HC = DEEPSEEK_V4_CONFIG["hc_mult"]
N = DEEPSEEK_V4_CONFIG["num_hidden_layers"]
WINDOW = DEEPSEEK_V4_CONFIG["sliding_window"]
PROMPTS = [[3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 180, 77, 23, 260, 41, 8, 16],
           [8, 19, 140, 33, 210, 6, 91],
           [120, 121, 122, 45, 46, 47, 200, 201, 15, 16, 17, 18, 99]]
_HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")


def _six_layers() -> torch.nn.Module:
    """The tiny V4 with a sixth layer: sliding-window, top-k routed (the MTP block)."""
    return tiny_deepseek_v4(num_hidden_layers=N + 1, layer_types=[*DEEPSEEK_V4_CONFIG["layer_types"], SLIDING],
                            mlp_layer_types=[*DEEPSEEK_V4_CONFIG["mlp_layer_types"], "moe"])


def _random_own(hf6: torch.nn.Module, seed: int) -> dict[str, Tensor]:
    """The module's own weights (release names under ``mtp.0.``), seeded; the embedding and head
    copies of the model's."""
    g = torch.Generator().manual_seed(seed)
    return {"enorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            "hnorm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            "e_proj.weight": 0.2 * torch.randn(HIDDEN, HIDDEN, generator=g),
            "h_proj.weight": 0.2 * torch.randn(HIDDEN, HIDDEN, generator=g),
            "hc_head_fn": 0.2 * torch.randn(HC, HC * HIDDEN, generator=g),
            "hc_head_base": 0.2 * torch.randn(HC, generator=g),
            "hc_head_scale": torch.tensor([0.7]),
            "norm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=g),
            "emb.tok_emb.weight": hf6.model.embed_tokens.weight.detach().clone(),
            "head.weight": hf6.lm_head.weight.detach().clone()}


def _write(root: Path, hf6: torch.nn.Module, own: dict[str, Tensor], *, prefix: str = "mtp.0.") -> None:
    """``hf6`` saved as the five-layer model, its sixth layer (DeepSeek's per-layer names, as
    transformers saves them) and ``own`` as MTP module 0 under ``prefix``."""
    hf6.save_pretrained(root, safe_serialization=True)
    saved = root / "model.safetensors"
    state = safetensors_torch.load_file(str(saved))
    block = f"model.layers.{N}."
    tensors = {k: v for k, v in state.items() if not k.startswith(block)}
    tensors.update({prefix + k[len(block):]: v for k, v in state.items() if k.startswith(block)})
    tensors.update({prefix + k: v for k, v in own.items()})
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(saved), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config.update(num_hidden_layers=N, layer_types=config["layer_types"][:N],
                  mlp_layer_types=config["mlp_layer_types"][:N], num_nextn_predict_layers=1)
    (root / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(root)


Ckpt = tuple[Path, torch.nn.Module, dict[str, Tensor]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Ckpt:
    hf6 = _six_layers()
    own = _random_own(hf6, 12)
    root = tmp_path_factory.mktemp("deepseek-v4-mtp")
    _write(root, hf6, own)
    return root, hf6, own


# -- the float64 reference ----------------------------------------------------------------------
class Reference:
    """The model (transformers, five layers) and the MTP module (its glue in plain float64 torch
    ops, its block transformers' ``DeepseekV4DecoderLayer``), float64 (transformers' hyper-connection
    and norm modules compute their own steps in float32 inside)."""

    def __init__(self, hf6: torch.nn.Module, own: dict[str, Tensor]) -> None:
        target = tiny_deepseek_v4()
        state = {k: v for k, v in hf6.state_dict().items() if not k.startswith(f"model.layers.{N}.")}
        target.load_state_dict(state, strict=True)
        self.target = target.double()
        self.target.config._experts_implementation = "eager"  # a loop over the experts: float64 runs
        self._streams: list[Tensor] = []
        self.target.model.hc_head.register_forward_hook(lambda _m, args, _out: self._streams.append(args[0]))
        six = copy.deepcopy(hf6).double()
        six.config._experts_implementation = "eager"
        self.layer = six.model.layers[N]
        self.rotary = six.model.rotary_emb
        self.own = {k: v.double() for k, v in own.items()}
        self.eps, self.hc_eps = hf6.config.rms_norm_eps, hf6.config.hc_eps

    def target_streams(self, ids: list[int]) -> Tensor:
        """The model's residual streams after its last layer, before its HyperHead [T, hc, hidden]."""
        self._streams.clear()
        with torch.no_grad():
            self.target(torch.tensor([ids]))
        return self._streams[0][0]

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def outputs(self, next_ids: list[int], streams: Tensor) -> Tensor:
        """The block's output streams at positions 0 .. T-1 [T, hc, hidden] for tokens ``next_ids``
        (token p + 1) and input streams [T, hc, hidden] (the model's, or the module's own)."""
        o = self.own
        e = o["emb.tok_emb.weight"][torch.tensor(next_ids)]
        e[0] = 0.0
        x = self._norm(streams.double(), o["hnorm.weight"]) @ o["h_proj.weight"].T
        x = x + (self._norm(e, o["enorm.weight"]) @ o["e_proj.weight"].T)[:, None, :]
        t = len(next_ids)
        positions = torch.arange(t)[None]
        gap = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        mask = torch.zeros(t, t, dtype=torch.float64).masked_fill(~((gap >= 0) & (gap < WINDOW)), float("-inf"))
        tables = {kind: self.rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
        with torch.no_grad():
            return self.layer(x[None], position_embeddings=tables, position_ids=positions,
                              attention_mask=mask[None, None], input_ids=None)[0]

    def logits(self, streams: Tensor) -> Tensor:
        """The module's HyperHead (pre weights from the RMS-normed flattened streams), its norm, the head."""
        o = self.own
        flat = streams.flatten(-2)
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(flat @ o["hc_head_fn"].T * o["hc_head_scale"] + o["hc_head_base"]) + self.hc_eps
        collapsed = (pre[..., None] * streams).sum(dim=-2)
        return self._norm(collapsed, o["norm.weight"]) @ o["head.weight"].T

    def chain(self, ids: list[int], depth: int) -> tuple[list[int], list[Tensor]]:
        """``depth`` greedy drafts after ``ids`` and each one's logits: the module over the model's
        streams of positions 0 .. n-2, then each further position reads the last draft and the
        module's output streams before it."""
        n = len(ids)
        streams = self.target_streams(ids)[: n - 1]
        next_ids = list(ids[1:])
        drafts: list[int] = []
        logits: list[Tensor] = []
        for _ in range(depth):
            out = self.outputs(next_ids, streams)
            logits.append(self.logits(out[-1]))
            drafts.append(int(logits[-1].argmax()))
            next_ids.append(drafts[-1])
            streams = torch.cat((streams, out[-1:]))
        return drafts, logits


def _predictor(root: Path) -> tuple[DeepseekV4ForCausalLM, DeepseekV4MTP]:
    checkpoint = load_checkpoint(root, torch.float32)
    target = load_ours(root, architecture="deepseek_v4")
    assert isinstance(target, DeepseekV4ForCausalLM) and target.config.num_layers == N
    assert mtp_layers(N, checkpoint.weights) == 1
    predictor = load_mtp(target, checkpoint.architecture, checkpoint.weights)
    assert isinstance(predictor, DeepseekV4MTP)
    return target, predictor


def test_mtp_logits_match_float64(ckpt: Ckpt) -> None:
    """Every position's logits, in chunks (4, 9, then one at a time: the block's sliding-window
    cache read back), equal the float64 reference's within FP32_TOLERANCE; the model's streams as
    the runner reads them (`DraftFeatureLM.forward_with_features`) equal the reference's, and its
    hidden states are `forward`'s."""
    root, hf6, own = ckpt
    ref = Reference(hf6, own)
    target, predictor = _predictor(root)
    assert predictor.cache_specs() == (SlidingWindowSpec(1, 32, WINDOW),)
    ids = PROMPTS[0]
    streams = ref.target_streams(ids)
    with torch.inference_mode():
        assert isinstance(target, DraftFeatureLM)
        attn = DenseAttention.for_model(target)
        hidden, features = target.forward_with_features(torch.tensor(ids), torch.arange(len(ids)), attn)
        plain = target(torch.tensor(ids), torch.arange(len(ids)), DenseAttention.for_model(target))
    assert features.shape == (len(ids), HC * HIDDEN) and torch.equal(hidden, plain)
    assert (features.double() - streams.flatten(1)).abs().max().item() < FP32_TOLERANCE
    expected = ref.logits(ref.outputs(ids[1:], streams[:-1]))
    attn = DenseAttention.for_model(predictor.block, initial_capacity=2)
    got = []
    with torch.inference_mode():
        for a, b in [(0, 4), (4, 13)] + [(i, i + 1) for i in range(13, len(ids) - 1)]:
            out = predictor(torch.tensor(ids[a + 1 : b + 1]), torch.arange(a, b), features[a:b], attn)
            assert out.shape == (b - a, HC * HIDDEN)
            got.append(predictor.compute_logits(out))
    diff = (torch.cat(got).double() - expected).abs().max().item()
    print(f"V4 MTP logits fp32 vs float64: max abs diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_deeper_drafts_feed_back_the_module_streams(ckpt: Ckpt) -> None:
    """Depths 1..4: the predictor's own output streams fed back (as `MTPDrafter` does) give the
    reference's logits at every depth; fed the collapsed hidden state instead they would not (the
    streams differ from each other); `MTPDrafter` fed the model's streams (in two chunks) drafts the
    reference's chain, then a batched round for two requests (`prefetch`) drafts each one's."""
    from helios.engine.scheduler import RequestState

    root, hf6, own = ckpt
    ref = Reference(hf6, own)
    _, predictor = _predictor(root)
    ids = PROMPTS[0]
    n = len(ids)
    drafts, ref_logits = ref.chain(ids, 4)
    features = ref.target_streams(ids).float().flatten(1)
    attn = DenseAttention.for_model(predictor.block)
    worst = 0.0
    with torch.inference_mode():
        out = predictor(torch.tensor(ids[1:]), torch.arange(n - 1), features[: n - 1], attn)[-1:]
        assert out.view(HC, HIDDEN).std(dim=0).max().item() > 0.1  # three distinct streams
        for depth, want in enumerate(ref_logits):
            logits = predictor.compute_logits(out)[0]
            worst = max(worst, (logits.double() - want).abs().max().item())
            assert int(logits.argmax()) == drafts[depth]
            out = predictor(torch.tensor([drafts[depth]]), torch.tensor([n - 1 + depth]), out, attn)
    print(f"V4 MTP chain of 4 fp32 vs float64: max abs logit diff {worst:.3g}; drafts {drafts}")
    assert worst < FP32_TOLERANCE
    drafter = MTPDrafter(predictor, torch.float32, num_pages=16, page_size=4, max_active=2, max_model_len=64)
    seq = RequestState(EngineRequest("r", tuple(ids), SamplingParams(temperature=0.0), max_tokens=8), list(ids), n,
                       None, 0)
    drafter.capture(seq, 0, features[:7])
    drafter.capture(seq, 7, features[7:-1])
    assert drafter.forward_tokens == n - 1
    assert list(drafter.propose("r", ids, 4)) == drafts
    assert drafter.forward_tokens == n - 1 + 3 and drafter.draft_tokens == 4
    other = PROMPTS[1]
    seq2 = RequestState(EngineRequest("s", tuple(other), SamplingParams(temperature=0.0), max_tokens=8), list(other),
                        len(other), None, 0)
    drafter.capture(seq2, 0, ref.target_streams(other).float().flatten(1)[:-1])
    longer = [*ids, drafts[0]]
    seq.token_ids.append(drafts[0])
    drafter.capture(seq, n - 1, ref.target_streams(longer).float().flatten(1)[n - 1 : n])
    forwards = drafter.forwards
    drafter.prefetch("r", longer, 3)
    drafter.prefetch("s", other, 3)
    assert list(drafter.propose("r", longer, 3)) == ref.chain(longer, 3)[0]
    assert list(drafter.propose("s", other, 3)) == ref.chain(other, 3)[0]
    assert drafter.forwards == forwards + 2 and drafter.joint_rounds == 1  # one forward per further depth
    drafter.release("r")
    drafter.release("s")
    drafter.check_integrity(live=[])


# -- the engine ---------------------------------------------------------------------------------
def _requests(prefix: str, max_tokens: int = 32) -> list[EngineRequest]:
    return [EngineRequest(f"{prefix}{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=max_tokens,
                          ignore_eos=True) for i, p in enumerate(PROMPTS)]


def test_engine_greedy_output_identical(ckpt: Ckpt) -> None:
    """Three requests batched, prefill chunks of 5, 32 greedy tokens each (past the sliding window
    of 16): identical with the MTP drafter and without speculation; the drafter ran and drafted;
    a prompt served again from the prefix cache starts from the MTP pool's own cached pages."""
    root, _, _ = ckpt
    target, predictor = _predictor(root)
    want = drive_mtp(*mtp_engine(target, predictor, mtp=False), _requests("r"))
    core, drafter = mtp_engine(target, predictor, mtp=True)
    assert drafter is not None
    got = drive_mtp(core, drafter, _requests("r"))
    assert got == want and all(len(t) == 32 for t in got.values())
    stats = core.stats()
    spec = stats.speculative
    assert spec is not None
    print(f"random V4 MTP: {spec.model_draft_rounds} rounds, {drafter.draft_tokens} drafts, "
          f"{spec.model_accepted_drafts} accepted, {stats.draft_steps} draft steps")
    assert stats.learned_drafter and stats.draft_steps == drafter.forward_tokens > 0
    assert spec.model_draft_rounds > 0 and drafter.draft_tokens >= spec.model_draft_rounds
    again = drive_mtp(core, drafter, [EngineRequest("again", tuple(PROMPTS[0]), SamplingParams(temperature=0.0),
                                                    max_tokens=32, ignore_eos=True)])
    assert again["again"] == want["r0"]
    assert core.stats().reused_tokens >= 16 and drafter.cache_misses == 0


def _cycle_checkpoint(root: Path, scale: float) -> list[int]:
    """A checkpoint whose model's greedy output mostly follows a cycle through the tokens 3..VOCAB-1
    and whose MTP layer predicts that cycle: the head maps each token's embedding to its successor,
    every layer's output (the MTP block's too) is scaled by ``scale`` (small: the streams stay
    near the embedding; large enough that the model leaves the cycle now and then), ``e_proj`` passes
    the next token's embedding through. The successor table."""
    hf6 = _six_layers()
    g = torch.Generator().manual_seed(31)
    successor, _, _ = follow_cycle(hf6, g, ("o_b_proj.weight", "down_proj.weight", "experts.down_proj"), scale)
    own = _random_own(hf6, 32)
    own["e_proj.weight"] = torch.eye(HIDDEN) + 0.02 * torch.randn(HIDDEN, HIDDEN, generator=g)
    own["h_proj.weight"] = 0.02 * torch.randn(HIDDEN, HIDDEN, generator=g)
    own["enorm.weight"] = torch.ones(HIDDEN)
    own["norm.weight"] = torch.ones(HIDDEN)
    _write(root, hf6, own)
    return successor


def test_cycle_drafts_accepted_and_rejected(tmp_path: Path) -> None:
    """The cycling checkpoint (`_cycle_checkpoint`), three requests, 32 greedy tokens, up to 4 drafts
    a round: the output with the MTP drafter equals plain decoding's; its drafts are accepted where
    the model follows the cycle and rejected where it leaves it (both counted)."""
    successor = _cycle_checkpoint(tmp_path, 0.8)
    target, predictor = _predictor(tmp_path)
    requests = _requests("c")
    want = drive_mtp(*mtp_engine(target, predictor, mtp=False), requests)
    on_cycle = sum(b == successor[a] for r, p in zip(requests, PROMPTS, strict=True)
                   for a, b in zip([p[-1], *want[r.request_id]], want[r.request_id], strict=False))
    core, drafter = mtp_engine(target, predictor, mtp=True, mode="adaptive", depth=4)
    assert drive_mtp(core, drafter, _requests("c")) == want
    spec = core.stats().speculative
    assert spec is not None and drafter is not None
    rejected = spec.verification_drafts - spec.accepted_drafts
    print(f"cycle V4 MTP: {on_cycle} of {3 * 32} tokens follow the cycle; {spec.model_draft_rounds} rounds, "
          f"{spec.model_accepted_drafts} accepted, {rejected} rejected of {spec.verification_drafts} drafts, "
          f"{spec.verification_rounds} verification rounds")
    assert spec.model_accepted_drafts == spec.accepted_drafts  # the n-gram lookups drafted nothing accepted
    assert spec.model_accepted_drafts > 0 and rejected > 0
    assert spec.verification_rounds < 3 * 32 - 10  # drafts saved target steps


# -- loading ------------------------------------------------------------------------------------
def test_runtime_loads_the_v4_mtp_drafter(ckpt: Ckpt, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`runtime.has_mtp` / `load_mtp_drafter` (what ``[speculative] mtp`` loads) take the V4 folder;
    the same module under ``model.mtp.0.`` gives the same logits; a folder whose MTP embedding copy
    (then: head copy) differs from the model's gives no drafter and a warning, as for the other
    families; a compressed-attention MTP block is refused."""
    from helios.config import HeliosConfig
    from helios.runtime import has_mtp, load_model, load_mtp_drafter

    root, hf6, own = ckpt
    cfg = HeliosConfig()
    loaded = load_model(root, weights="float32", dtype="float32")
    assert has_mtp(loaded.checkpoint)
    drafter = load_mtp_drafter(cfg, loaded, num_pages=8, max_model_len=64, fingerprint=b"f")
    assert isinstance(drafter, MTPDrafter) and isinstance(drafter.predictor, DeepseekV4MTP)
    # The ``model.`` prefix kept: the same module.
    prefixed = tmp_path / "prefixed"
    _write(prefixed, hf6, own, prefix="model.mtp.0.")
    ids = PROMPTS[2]
    logits = []
    with torch.inference_mode():
        for folder in (root, prefixed):
            target, predictor = _predictor(folder)
            _, features = target.forward_with_features(torch.tensor(ids), torch.arange(len(ids)),
                                                       DenseAttention.for_model(target))
            out = predictor(torch.tensor(ids[1:]), torch.arange(len(ids) - 1), features[:-1],
                            DenseAttention.for_model(predictor.block))
            logits.append(predictor.compute_logits(out))
    assert torch.equal(logits[0], logits[1])
    for name in ("emb.tok_emb.weight", "head.weight"):
        odd = tmp_path / name.split(".")[0]
        _write(odd, hf6, {**own, name: own[name] + 1.0})
        checkpoint = load_checkpoint(odd, torch.float32)
        with pytest.raises(ValueError, match=f"mtp.0.{name} differs from the model's"):
            load_mtp(load_ours(odd), checkpoint.architecture, checkpoint.weights)
        caplog.clear()
        bad = load_model(odd, weights="float32", dtype="float32")
        assert has_mtp(bad.checkpoint)
        assert load_mtp_drafter(cfg, bad, num_pages=8, max_model_len=64, fingerprint=b"f") is None
        assert "MTP layer is not used" in caplog.text
    compressed = tmp_path / "compressed"
    _write(compressed, hf6, {**own, "attn.compressor.ape": torch.zeros(4, 64)})
    checkpoint = load_checkpoint(compressed, torch.float32)
    with pytest.raises(ValueError, match="compressed-attention MTP block"):
        load_mtp(load_ours(compressed), checkpoint.architecture, checkpoint.weights)


# -- GGUF: llama.cpp's MTP-only file ------------------------------------------------------------
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""The FP4 (E2M1) values of DeepSeek V4's expert codes, by 4-bit code."""


def _fp4(rows: int, cols: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """A random MXFP4 [rows, cols] weight in DeepSeek's release form (packed uint8 [rows, cols / 2],
    element 2i in the low nibble; one E8M0 exponent byte per 32 elements) and its float32 value."""
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    exponents = torch.randint(118, 122, (rows, cols // 32), generator=g, dtype=torch.uint8)
    value = _E2M1[codes.long()] * torch.exp2(exponents.float() - 127.0).repeat_interleave(32, dim=1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), exponents, value


MtpFile = tuple[Path, Path, torch.nn.Module, dict[str, Tensor]]


@pytest.fixture(scope="module")
def mtp_gguf(tmp_path_factory: pytest.TempPathFactory) -> MtpFile:
    return _mtp_gguf(tmp_path_factory.mktemp("deepseek-v4-mtp-gguf"))


def _mtp_gguf(tmp: Path) -> MtpFile:
    """The tiny V4 with an MTP layer as a folder (`_write`) and as llama.cpp's ``convert_hf_to_gguf.py
    --mtp`` converts DeepSeek's release: an MTP-only ``deepseek4`` file (skipped without the
    converter's tree). The release form the converter reads: the module under ``mtp.0.*`` (its kv
    norm ``attn.kv_norm``, its routed experts MXFP4 codes with their exponents, no embedding or head
    copies: the converter knows none) beside ``embed`` / ``norm`` / ``head``; it writes the experts
    as ggml MXFP4 and ``eh_proj`` ([e_proj | h_proj]) as Q8_0. So that the folder holds the values
    the file holds, the folder's MTP experts are those codes' values and its ``e_proj`` / ``h_proj``
    Q8_0 values (what ``gguf.quants`` rounds them to, unchanged by the converter's rounding). The
    (folder, file, model, module's own weights)."""
    import subprocess
    import sys

    import gguf
    import numpy as np

    from tests.parity.test_gguf_families_parity import _LLAMA_CPP, _RUNNER

    if not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")
    hf6 = _six_layers()
    own = _random_own(hf6, 41)
    g = torch.Generator().manual_seed(42)
    experts = hf6.model.layers[N].mlp.experts
    num_experts, width = experts.gate_up_proj.shape[0], experts.down_proj.shape[2]
    packed: dict[str, Tensor] = {}
    with torch.no_grad():
        for e in range(num_experts):
            for proj, (rows, cols) in (("w1", (width, HIDDEN)), ("w3", (width, HIDDEN)), ("w2", (HIDDEN, width))):
                codes, exponents, value = _fp4(rows, cols, g)
                packed[f"mtp.0.ffn.experts.{e}.{proj}.weight"] = codes
                packed[f"mtp.0.ffn.experts.{e}.{proj}.scale"] = exponents
                if proj == "w2":
                    experts.down_proj[e] = value
                else:
                    experts.gate_up_proj[e, (0 if proj == "w1" else width):][:width] = value
    eh = np.concatenate((own["e_proj.weight"].numpy(), own["h_proj.weight"].numpy()), axis=1)
    q8 = gguf.quants.dequantize(gguf.quants.quantize(eh, gguf.GGMLQuantizationType.Q8_0),
                                gguf.GGMLQuantizationType.Q8_0)
    own["e_proj.weight"], own["h_proj.weight"] = torch.from_numpy(np.ascontiguousarray(q8)).split(HIDDEN, dim=1)
    folder = tmp / "folder"
    _write(folder, hf6, own)
    saved = safetensors_torch.load_file(str(folder / "model.safetensors"))
    for name, codes in packed.items():  # the folder's experts are the codes' values
        if name.endswith(".weight"):
            exponents = packed[name.removesuffix("weight") + "scale"].float()
            unpacked = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(1).long()
            assert torch.equal(saved[name], _E2M1[unpacked] * torch.exp2(exponents - 127.0).repeat_interleave(32, 1))
    root = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "head.weight": "head.weight"}
    release = {new: saved[old] for old, new in root.items()}
    for name, value in saved.items():
        if name.startswith("mtp.0.") and ".ffn.experts." not in name and not name.endswith(("tok_emb.weight",
                                                                                            "0.head.weight")):
            release[name.replace(".attn.norm.", ".attn.kv_norm.")] = value
    release.update(packed)
    source = tmp / "release"
    source.mkdir()
    safetensors_torch.save_file({k: v.contiguous() for k, v in release.items()}, str(source / "model.safetensors"),
                                metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    rates = {SLIDING: 0, **config["compress_rates"]}
    config.update(compress_ratios=[*(rates[t] for t in config["layer_types"]), 0],
                  num_hash_layers=config["mlp_layer_types"].count("hash_moe"))
    (source / "config.json").write_text(json.dumps(config))
    path = tmp / "mtp-tiny-v4.gguf"
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(source), str(path), "f32", "--mtp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "deepseek4"
    assert (reader.fields["deepseek4.block_count"].contents(), reader.fields["deepseek4.nextn_predict_layers"].contents(),
            reader.fields["deepseek4.attention.compress_ratios"].contents()[-1]) == (N + 1, 1, 0)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert not any(name.startswith("blk.0.") for name in kinds)  # MTP-only: no decoder
    assert (kinds[f"blk.{N}.nextn.eh_proj.weight"], kinds[f"blk.{N}.ffn_gate_exps.weight"]) == ("Q8_0", "MXFP4")
    wanted = {f"blk.{N}.nextn.{s}.weight" for s in ("enorm", "hnorm", "shared_head_norm")} | {
        f"output_hc_{p}.weight" for p in ("fn", "base", "scale")} | {"token_embd.weight", "output.weight",
                                                                    "output_norm.weight", f"blk.{N}.attn_norm.weight"}
    assert wanted <= set(kinds)
    return folder, path, hf6, own


def _streams_and_logits(target: DeepseekV4ForCausalLM, predictor: DeepseekV4MTP, ids: list[int]) -> Tensor:
    with torch.inference_mode():
        _, features = target.forward_with_features(torch.tensor(ids), torch.arange(len(ids)),
                                                   DenseAttention.for_model(target))
        out = predictor(torch.tensor(ids[1:]), torch.arange(len(ids) - 1), features[:-1],
                        DenseAttention.for_model(predictor.block))
        return predictor.compute_logits(out)


def test_llama_cpp_mtp_only_gguf_logits(mtp_gguf: MtpFile, tmp_path: Path) -> None:
    """llama.cpp's MTP-only file (`_mtp_gguf`) over the folder's model, and over the same model as a
    ``deepseek4`` GGUF file: the module's logits equal the folder's module's bit for bit (the file
    holds the folder's values: MXFP4 experts, the Q8_0 ``eh_proj`` split into ``e_proj`` and
    ``h_proj``; its HyperHead at the root names, its norm as ``shared_head_norm``) and so the
    float64 reference's within FP32_TOLERANCE; over a model whose embedding differs from the file's
    copy it is refused."""
    from helios.models.mtp import mtp_only
    from tests.parity.test_deepseek_v4_parity import _write_gguf

    folder, path, hf6, own = mtp_gguf
    companion = load_checkpoint(path, torch.float32)
    assert companion.architecture.name == "deepseek_v4" and companion.config.num_layers == N
    assert mtp_only(N, companion.weights) and mtp_layers(N, companion.weights) == 1
    assert not mtp_only(N, load_checkpoint(folder, torch.float32).weights)
    target, folder_predictor = _predictor(folder)
    predictor = load_mtp(target, companion.architecture, companion.weights)
    assert isinstance(predictor, DeepseekV4MTP)
    ref = Reference(hf6, own)
    ids = PROMPTS[0]
    expected = ref.logits(ref.outputs(ids[1:], ref.target_streams(ids)[:-1]))
    got = _streams_and_logits(target, predictor, ids)
    diff = (got.double() - expected).abs().max().item()
    print(f"V4 MTP from llama.cpp's MTP-only GGUF vs float64: max abs logit diff {diff:.3g}")
    assert torch.equal(got, _streams_and_logits(target, folder_predictor, ids))
    assert diff < FP32_TOLERANCE and expected.abs().max().item() > 1.0
    # The model as a deepseek4 GGUF file of its own (no MTP block), the module from the MTP file.
    trunk_path = tmp_path / "tiny-v4.gguf"
    _write_gguf(trunk_path, _five_layers(hf6), mtp=False)
    trunk = load_ours(trunk_path, architecture="deepseek_v4")
    assert isinstance(trunk, DeepseekV4ForCausalLM)
    trunk_predictor = load_mtp(trunk, companion.architecture, companion.weights)
    assert isinstance(trunk_predictor, DeepseekV4MTP)
    assert (_streams_and_logits(trunk, trunk_predictor, ids).double() - expected).abs().max().item() < FP32_TOLERANCE
    # Another model's MTP file: refused.
    with torch.no_grad():
        target.embed_tokens.add_(1.0)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight differs from the model's"):
        load_mtp(target, companion.architecture, companion.weights)


def test_llama_cpp_mtp_only_gguf_drafts_through_the_engine(mtp_gguf: MtpFile) -> None:
    """Three batched requests, 32 greedy tokens each: identical with the MTP-only file's drafter and
    without speculation, with drafts proposed."""
    folder, path, _, _ = mtp_gguf
    companion = load_checkpoint(path, torch.float32)
    target = load_ours(folder)
    predictor = load_mtp(target, companion.architecture, companion.weights)
    want = drive_mtp(*mtp_engine(target, predictor, mtp=False), _requests("g"))
    core, drafter = mtp_engine(target, predictor, mtp=True)
    assert drafter is not None and drive_mtp(core, drafter, _requests("g")) == want
    stats = core.stats()
    spec = stats.speculative
    assert spec is not None and stats.learned_drafter and stats.draft_steps == drafter.forward_tokens > 0
    assert spec.model_draft_rounds > 0 and drafter.draft_tokens >= spec.model_draft_rounds
    print(f"V4 MTP from GGUF through the engine: {spec.model_draft_rounds} rounds, {drafter.draft_tokens} drafts, "
          f"{spec.model_accepted_drafts} accepted, {stats.draft_steps} draft steps")


def test_llama_cpp_mtp_only_gguf_as_draft_model(mtp_gguf: MtpFile, tmp_path: Path) -> None:
    """``[speculative] draft_model`` = the MTP-only file: recognised (`runtime.mtp_file`; the folder
    itself is a draft model, not an MTP file) and loaded as the MTP drafter over the folder's model
    and over the model's GGUF file; `runtime.build_runtime` serves the folder with it (``mtp =
    false`` notwithstanding); over a model whose embedding differs from the file's copy it stops
    the start (ConfigError)."""
    from helios.config import (
        ConfigError,
        EngineSection,
        HeliosConfig,
        ModelConfigSection,
        ServerConfig,
        SpeculativeSection,
    )
    from helios.runtime import _learned_kind, build_runtime, load_model, load_mtp_drafter, mtp_file
    from tests.parity.test_deepseek_v4_parity import _write_gguf

    folder, path, hf6, _ = mtp_gguf
    trunk_path = tmp_path / "tiny-v4.gguf"
    _write_gguf(trunk_path, _five_layers(hf6), mtp=False)
    cfg = HeliosConfig(speculative=SpeculativeSection(draft_model=str(path)))
    for model_path in (trunk_path, folder):
        loaded = load_model(model_path, weights="float32", dtype="float32")
        source = mtp_file(cfg, loaded.checkpoint)
        assert source is not None and _learned_kind(cfg, loaded.checkpoint) == "mtp"
        drafter = load_mtp_drafter(cfg, loaded, num_pages=8, max_model_len=64, fingerprint=b"f", source=source)
        assert isinstance(drafter, MTPDrafter) and isinstance(drafter.predictor, DeepseekV4MTP)
    as_draft = HeliosConfig(speculative=SpeculativeSection(draft_model=str(folder)))
    assert mtp_file(as_draft, loaded.checkpoint) is None and _learned_kind(as_draft, loaded.checkpoint) == "draft"
    served = HeliosConfig(server=ServerConfig(access_log=False),
                          model=ModelConfigSection(path=str(folder), dtype="float32", weights="float32",
                                                   weight_cache=False, threads=1),
                          engine=EngineSection(page_size=4, kv_pages=64, max_active=2),
                          speculative=SpeculativeSection(draft_model=str(path), mtp=False))
    threads = torch.get_num_threads()
    try:
        rt = build_runtime(served)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(rt.core.drafter, MTPDrafter) and isinstance(rt.core.drafter.predictor, DeepseekV4MTP)
    assert rt.info.speculative_learned == "mtp"
    with torch.no_grad():
        loaded.model.embed_tokens.add_(1.0)
    with pytest.raises(ConfigError, match=r"its MTP layer does not load: model\.embed_tokens\.weight differs"):
        load_mtp_drafter(cfg, loaded, num_pages=8, max_model_len=64, fingerprint=b"f", source=source)

def _five_layers(hf6: torch.nn.Module) -> torch.nn.Module:
    """The model of ``hf6`` (transformers, its first five layers)."""
    five = tiny_deepseek_v4()
    five.load_state_dict({k: v for k, v in hf6.state_dict().items() if not k.startswith(f"model.layers.{N}.")})
    return five


def test_mtp_only_tells_a_decoder_in_any_naming_apart() -> None:
    """`mtp_only` by tensor names: a module without decoder layer 0 is an MTP-only checkpoint; a
    decoder under transformers' names or DeepSeek's release names (``layers.0.``) is a whole model."""
    from helios.models.mtp import mtp_only

    module = ["mtp.0.eh_proj.weight", "mtp.0.enorm.weight", "model.embed_tokens.weight", "lm_head.weight"]
    assert mtp_only(N, module)
    assert not mtp_only(N, [*module, "model.layers.0.input_layernorm.weight"])
    assert not mtp_only(N, ["mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "layers.0.attn.wq_a.weight"])
    assert not mtp_only(N, ["model.embed_tokens.weight", "lm_head.weight"])


def test_one_gguf_with_model_and_mtp_block(mtp_gguf: MtpFile, tmp_path: Path) -> None:
    """One ``deepseek4`` file holding the model and the MTP block (llama.cpp's loader takes one; its
    converter writes none for V4): the model's file with the MTP-only file's ``blk.5`` tensors
    (dequantized to F32). `runtime.has_mtp` finds the module and it loads from the checkpoint
    itself; its HyperHead is the root one, the model's, as llama.cpp's MTP graph reads it: the
    logits equal the float64 reference's with the model's HyperHead in the module's place (and
    differ from the module's own by more than the tolerance)."""
    import gguf

    from helios.config import HeliosConfig
    from helios.runtime import has_mtp, load_model, load_mtp_drafter
    from tests.parity.test_deepseek_v4_parity import _write_gguf

    _, path, hf6, own = mtp_gguf
    reader = gguf.GGUFReader(str(path))
    block = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors
             if t.name.startswith(f"blk.{N}.")}
    both = tmp_path / "tiny-v4-with-mtp.gguf"
    _write_gguf(both, _five_layers(hf6), nextn_tensors=block)
    checkpoint = load_checkpoint(both, torch.float32)
    assert mtp_layers(N, checkpoint.weights) == 1
    target = load_ours(both, architecture="deepseek_v4")
    assert isinstance(target, DeepseekV4ForCausalLM)
    predictor = load_mtp(target, checkpoint.architecture, checkpoint.weights)
    assert isinstance(predictor, DeepseekV4MTP)
    ids = PROMPTS[1]
    got = _streams_and_logits(target, predictor, ids).double()
    head = {f"hc_head_{p}": getattr(hf6.model.hc_head, f"hc_{p}").detach() for p in ("fn", "base", "scale")}
    rooted, ref = Reference(hf6, {**own, **head}), Reference(hf6, own)
    streams = ref.outputs(ids[1:], ref.target_streams(ids)[:-1])
    diff = (got - rooted.logits(streams)).abs().max().item()
    print(f"V4 MTP from one GGUF with the model: max abs logit diff {diff:.3g} (the root HyperHead)")
    assert diff < FP32_TOLERANCE
    assert (got - ref.logits(streams)).abs().max().item() > 100 * FP32_TOLERANCE
    loaded = load_model(both, weights="float32", dtype="float32")
    assert has_mtp(loaded.checkpoint)
    drafter = load_mtp_drafter(HeliosConfig(), loaded, num_pages=8, max_model_len=64, fingerprint=b"f")
    assert isinstance(drafter, MTPDrafter)
