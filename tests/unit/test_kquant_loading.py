"""GGUF K-quant / Q5_x / Q8_0 files loaded in their block form (issue 26): a tiny GGUF written with
``gguf.GGUFWriter`` whose projections are Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 / Q8_0 blocks loads as
`kquant.KQuantLinear` (the embedding and head as blocks too), its logits equal those of a float32
dense model built from ``gguf.quants.dequantize`` of the same bytes (the independent reference), the
packed-weight cache round-trip gives the same logits bit for bit, and ``weights = "auto"`` keeps
the blocks.

Tolerance: both models compute in float32 from the same float32 weights (the kernel decodes each
weight exactly, `cpu_kernels` docstring), so they differ only by the order of float32 sums. Each
matmul's error is below (K / 32 + 6) 2**-24 sum |x w| in the kernel and of the same order in torch's
GEMM; through two layers of norms, attention and SwiGLU that stays far below 1e-4 relative to the
logits' scale here (measured: 1e-6 to 3e-6), which is the bound asserted.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.gguf_loader import GGUFFile, unpermute_rotary_rows
from helios.loaders.weight_cache import PackedWeightCache
from helios.models import cpu_kernels, packing
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention
from helios.models.kquant import BlockQuantized, KQuantLinear
from helios.models.llama import LlamaForCausalLM
from helios.models.quant import DenseLinear, WeightFormat, build_linear, q8_0_blocks
from helios.runtime import choose_weights, kept_weights
from tests.unit.test_kquant import random_blocks
from tests.unit.tiny_gguf import Q

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 300
HEAD_DIM = HIDDEN // HEADS
BLOCKS = WeightFormat("int4", requantize=False, keep_blocks=True)
# Per layer: each projection part's type (q, k, v mixed in one fused projection, like llama.cpp's
# Q4_K_M files, whose 896-column Qwen projections fall back to Q5_0 / Q8_0).
LAYER_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q6_K, "ffn_gate": Q.Q5_K,
     "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q5_0,
     "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_K},
]


def write_kquant_gguf(path: Path, *, arch: str = "qwen2", embed: Q = Q.Q6_K, output: Q | None = None,
                      seed: int = 0) -> Path:
    """A tiny random model of ``arch`` (qwen2: q/k/v biases, no row permutation; qwen3: per-head q/k
    norms; llama: permuted q/k rows) with valid random block bytes; ``output`` None ties the head to the embedding."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny-kquant")
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = [chr(0x100 + i) for i in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"t{i}" for i in range(VOCAB - len(tokens))]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3] + [1] * (VOCAB - 259))
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 258)
    counter = iter(range(1, 1 << 20))

    def blocks(name: str, qtype: Q, rows: int, cols: int) -> None:
        data = random_blocks(int(qtype), rows, cols, seed * 1000 + next(counter))
        writer.add_tensor(name, data, raw_dtype=qtype)

    def dense(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, array.astype(np.float32))

    blocks("token_embd.weight", embed, VOCAB, HIDDEN)
    if output is not None:
        blocks("output.weight", output, VOCAB, HIDDEN)
    dense("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    for layer in range(LAYERS):
        dense(f"blk.{layer}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        dense(f"blk.{layer}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        for part, (rows, cols) in shapes.items():
            blocks(f"blk.{layer}.{part}.weight", LAYER_TYPES[layer][part], rows, cols)
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                dense(f"blk.{layer}.{part}.bias", 0.1 * rng.standard_normal(shapes[part][0]))
        if arch == "qwen3":
            for part in ("attn_q_norm", "attn_k_norm"):
                dense(f"blk.{layer}.{part}.weight", 1 + 0.1 * rng.standard_normal(HEAD_DIM))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_model(path: Path) -> LlamaForCausalLM:
    """The float32 dense model of the file's weights as the gguf package dequantizes them (its own
    reader and ``gguf.quants.dequantize``; no Helios kernel), q/k rows un-permuted for llama files."""
    file = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        target = file.architecture.gguf_name(file.config, t.name)
        if target is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if target.rotary_heads is not None:
            array = unpermute_rotary_rows(array, target.rotary_heads)
        tensors[target.name] = torch.from_numpy(np.array(array))
    model = LlamaForCausalLM(file.config, torch.float32, weights=WeightFormat("dense", torch.float32))
    model.load_weights(tensors)
    return model


def blocks_model(path: Path, dtype: torch.dtype = torch.float32, fmt: WeightFormat = BLOCKS) -> LlamaForCausalLM:
    ckpt = load_checkpoint(path)
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=dtype, weights=fmt, q8_head=True))
    assert isinstance(model, LlamaForCausalLM)
    model.load_weights(ckpt.weights)
    return model


@torch.inference_mode()
def logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Float32 logits of every prompt position, then of two decode steps (the one-row path)."""
    attn = DenseAttention.for_model(model, initial_capacity=len(ids) + 4)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
    rows = [model.compute_logits(hidden)]
    for step in range(2):
        token = int(rows[-1][-1].argmax())
        hidden = model(torch.tensor([token]), torch.tensor([len(ids) + step]), attn)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


PROMPT = [257, 12, 200, 31, 99, 4, 150, 258, 7, 77, 120]
VARIANTS = {  # arch, embedding type, output type (None: tied)
    "qwen2-q5_0-embed-q8_0-head": ("qwen2", Q.Q5_0, Q.Q8_0),
    "qwen2-tied-q6_k": ("qwen2", Q.Q6_K, None),
    "llama-q8_0-embed-q4_k-head": ("llama", Q.Q8_0, Q.Q4_K),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_weights_load_as_kquant_and_match_the_dequantized_reference(tmp_path: Path, variant: str) -> None:
    arch, embed, output = VARIANTS[variant]
    path = write_kquant_gguf(tmp_path / "tiny.gguf", arch=arch, embed=embed, output=output)
    model = blocks_model(path)
    for layer in model.layers:
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert isinstance(getattr(layer, attr), KQuantLinear), (attr, getattr(layer, attr))
    assert model.embed_format == f"{embed.name} blocks"
    if output == Q.Q8_0:
        assert model.head_format == "q8_0"  # the Q8_0 codes and `q8_linear`: float32, exact
    else:
        assert model.head_format == f"{(output or embed).name} blocks"
    assert model.embed_tokens.shape[0] == 0 and model.lm_head.shape[0] == 0  # no dense copies kept
    kept = kept_weights(model)
    assert "8 kquant" in kept and "dense" not in kept, kept
    model.pack_cpu_weights()  # what loading does next: nothing dense to pack (a blocks head has no dense copy)
    assert model.lm_head.shape[0] == 0
    got = logits(model, PROMPT)
    want = logits(reference_model(path), PROMPT)
    assert got.dtype == torch.float32
    scale = float(want.abs().max())
    error = float((got - want).abs().max())
    assert error <= 1e-4 * scale, (error, scale)


def test_the_packed_cache_round_trip_gives_the_same_logits_bit_for_bit(tmp_path: Path) -> None:
    path = write_kquant_gguf(tmp_path / "tiny.gguf", embed=Q.Q5_0, output=Q.Q8_0)
    fmt = WeightFormat("int4", requantize=False, keep_blocks=True, unpack_above=4)
    for dtype in (torch.float32, torch.bfloat16):
        model = blocks_model(path, dtype, fmt)
        want = logits(model, PROMPT)  # 11 prompt rows: the dequantize-per-call path; decode: the kernel
        state, kinds = model.packed_state()
        cache = PackedWeightCache(tmp_path / "packed")
        key = f"tiny:{dtype}"
        assert cache.store(key, state, kinds) is not None
        hit = cache.load(key)
        assert hit is not None
        ckpt = load_checkpoint(path)
        fresh = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=dtype, weights=fmt, q8_head=True))
        assert isinstance(fresh, LlamaForCausalLM)
        fresh.load_packed_state(hit.state, hit.kinds)
        assert fresh.embed_format == model.embed_format and fresh.head_format == model.head_format
        for a, b in zip(model.layers, fresh.layers, strict=True):
            assert isinstance(b.gate_up_proj, KQuantLinear)
            assert (a.gate_up_proj.types, a.gate_up_proj.unpack_above, a.gate_up_proj.unpack_dtype) == \
                (b.gate_up_proj.types, b.gate_up_proj.unpack_above, b.gate_up_proj.unpack_dtype)
        fresh.pack_cpu_weights()
        assert torch.equal(logits(fresh, PROMPT), want), dtype


def test_a_k_quant_head_kept_as_blocks_comes_back_from_the_packed_cache(tmp_path: Path) -> None:
    """An untied Q6_K head stays blocks (no float32 copy beside it): the cached state has none, and
    loading it must not ask for one (it did with bfloat16 activations, so every start of such a
    file rebuilt the cache entry)."""
    path = write_kquant_gguf(tmp_path / "tiny.gguf", embed=Q.Q5_0, output=Q.Q6_K)
    fmt = WeightFormat("int4", requantize=False, keep_blocks=True, unpack_above=4)
    for dtype in (torch.bfloat16, torch.float32):
        model = blocks_model(path, dtype, fmt)
        want = logits(model, PROMPT)
        state, kinds = model.packed_state()
        assert kinds["lm_head_blocks"].startswith(f"blocks:{int(Q.Q6_K)}:"), kinds["lm_head_blocks"]
        assert not any(name.startswith("lm_head_fp32") for name in state)
        cache = PackedWeightCache(tmp_path / "packed")
        assert cache.store(f"tiny:{dtype}", state, kinds) is not None
        hit = cache.load(f"tiny:{dtype}")
        assert hit is not None
        ckpt = load_checkpoint(path)
        fresh = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=dtype, weights=fmt, q8_head=True))
        assert isinstance(fresh, LlamaForCausalLM)
        fresh.load_packed_state(hit.state, hit.kinds)
        assert fresh.head_format == model.head_format
        fresh.pack_cpu_weights()
        assert torch.equal(logits(fresh, PROMPT), want), dtype


def test_auto_keeps_blocks_without_a_dense_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELIOS_CPU_CAPABILITY", "avx512_bf16")
    choice = choose_weights("auto", "auto", "cpu", int4_codes=False, block_codes=True, projection_params=10**9)
    assert choice.format.keep_blocks and choice.format.dense_dtype is None
    assert choice.format.unpack_above is not None
    assert "GGUF blocks" in choice.reason and "GGUF blocks" in choice.format.describe()
    assert choice.format.cache_tag() != WeightFormat("int4", requantize=False).cache_tag()
    # without block codes: as before
    plain = choose_weights("auto", "auto", "cpu", int4_codes=False)
    assert not plain.format.keep_blocks and plain.format.kind == "dense"


def test_q8_0_codes_turn_back_into_their_blocks_exactly() -> None:
    from helios.loaders.gguf_loader import unpack_blocks

    raw = random_blocks(8, 6, 64, 3)
    codes = unpack_blocks(torch.from_numpy(raw).reshape(-1), 8, (6, 64))
    blocks = q8_0_blocks(codes)
    assert torch.equal(blocks.blocks, torch.from_numpy(raw))
    assert torch.equal(blocks.dequantize(), codes.dequantize())
    # Q8_0 parts beside blocks join one KQuantLinear only under keep_blocks
    other = BlockQuantized(torch.from_numpy(random_blocks(6, 4, 64, 4)), 6, (4, 64))
    assert isinstance(build_linear([other, codes], BLOCKS, torch.float32), KQuantLinear)
    assert not isinstance(build_linear([other, codes], WeightFormat("int4", requantize=False), torch.float32),
                          KQuantLinear)


def test_llama_rows_of_blocks_are_unpermuted(tmp_path: Path) -> None:
    path = write_kquant_gguf(tmp_path / "tiny.gguf", arch="llama", embed=Q.Q8_0, output=Q.Q4_K)
    file = GGUFFile(path)
    source = file.weight_thunks()["model.layers.0.self_attn.q_proj.weight"]()
    assert isinstance(source, BlockQuantized) and source.name == "Q4_K"
    dense = file.tensor_thunks(torch.float32)["model.layers.0.self_attn.q_proj.weight"]()
    raw = torch.from_numpy(file.read_tensor("blk.0.attn_q.weight"))
    assert torch.equal(source.dequantize(), dense)
    assert torch.equal(dense, unpermute_rotary_rows(raw, HEADS))


def _mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address`` (Linux /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                    reason="no /proc/self/smaps or MADV_HUGEPAGE here (not Linux)")
@pytest.mark.parametrize("variant", ["qwen2-tied-q6_k", "qwen2-q5_0-embed-q8_0-head"])
def test_blocks_move_into_one_huge_page_arena_with_the_same_logits(tmp_path: Path, variant: str) -> None:
    """`packing.blocks_into_huge_pages`: every block tensor (projection segments, the block embedding
    and head, a Q8_0 head's codes and scales) copied into one mapping advised for huge pages (its
    VmFlags carry ``hg``), 64-byte aligned, the tied embedding and head still one tensor, the
    projections' parameters the same objects, and the logits the same bits."""
    arch, embed, output = VARIANTS[variant]
    path = write_kquant_gguf(tmp_path / "tiny.gguf", arch=arch, embed=embed, output=output)
    model = blocks_model(path, torch.bfloat16)
    model.pack_cpu_weights()
    want = logits(model, PROMPT)
    params = [p for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks]
    ids = [id(p) for p in params]
    moved = packing.blocks_into_huge_pages(model)
    assert [id(p) for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks] == ids
    tensors = [p.detach() for p in params]
    if model._embed_blocks is not None:
        tensors.append(model._embed_blocks.blocks)
    if model._lm_head_blocks is not None:
        tensors.append(model._lm_head_blocks.blocks)
    if output is None:
        assert model._lm_head_blocks is not None and model._embed_blocks is not None
        assert model._lm_head_blocks.blocks.data_ptr() == model._embed_blocks.blocks.data_ptr()
    if model._lm_head_q8 is not None:
        tensors.extend(model._lm_head_q8)
    distinct = {t.data_ptr(): t for t in tensors}
    assert moved == sum((t.numel() * t.element_size() + 63) // 64 * 64 for t in distinct.values())
    lo = min(distinct)
    assert all(p % 64 == 0 for p in distinct) and max(p + t.numel() * t.element_size()
                                                      for p, t in distinct.items()) - lo <= moved
    assert "hg" in _mapping_flags(lo)
    assert torch.equal(logits(model, PROMPT), want)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                    reason="no /proc/self/smaps or MADV_HUGEPAGE here (not Linux)")
def test_the_server_moves_the_blocks_between_engine_steps(tmp_path: Path) -> None:
    """``load_model(defer_huge_pages=True)`` (the server's): the model is served from its loaded tensors
    while a thread fills the huge-page arena; the engine's `between_steps` task then swaps the modules
    onto it (once, True from then on) and the logits stay the same bits. ``False`` moves them at load."""
    from helios.engine.core import EngineConfig, EngineCore
    from helios.runtime import load_model

    path = write_kquant_gguf(tmp_path / "tiny.gguf", arch="qwen2", embed=Q.Q6_K, output=None)
    now = load_model(path)
    assert now.huge_pages is None and now.finish_huge_pages()
    assert isinstance(now.model, LlamaForCausalLM)
    want = logits(now.model, PROMPT)
    loaded = load_model(path, defer_huge_pages=True)
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM) and loaded.huge_pages is not None
    before = [p.data_ptr() for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks]
    assert before and loaded.huge_pages.total > 0
    assert torch.equal(logits(model, PROMPT), want)  # served before the swap
    assert loaded.huge_pages.ready.wait(30)
    core = EngineCore(model, EngineConfig(page_size=16, num_pages=8, max_active=2), loaded.choice.dtype)
    core.between_steps.append(loaded.finish_huge_pages)
    core.run_between_steps()
    assert core.between_steps == [] and loaded.huge_pages.done and loaded.finish_huge_pages()
    after = [p.data_ptr() for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks]
    assert all(a != b for a, b in zip(after, before, strict=True))
    assert "hg" in _mapping_flags(min(after))
    assert torch.equal(logits(model, PROMPT), want)


def test_nothing_moves_where_transparent_huge_pages_are_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel's setting at ``[never]`` a huge-page copy would gain nothing: no move."""
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(packing, "THP_SETTING", str(setting))
    model = blocks_model(write_kquant_gguf(tmp_path / "tiny.gguf"), torch.bfloat16)
    before = [p.data_ptr() for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks]
    assert before and packing.HugePageMove(model).total == 0
    assert packing.blocks_into_huge_pages(model) == 0
    assert [p.data_ptr() for m in model.modules() if isinstance(m, KQuantLinear) for p in m.blocks] == before
    setting.write_text("always [madvise] never\n")
    assert packing.HugePageMove(model).total > 0


@pytest.mark.parametrize(("arch", "dtype", "streams", "kv_dtype"),
                         [("qwen2", torch.float32, 1, "auto"), ("qwen2", torch.bfloat16, 1, "auto"),
                          ("qwen2", torch.bfloat16, 9, "auto"), ("qwen3", torch.bfloat16, 3, "int8"),
                          ("qwen3", torch.float32, 9, "auto"), ("llama", torch.bfloat16, 9, "auto")])
def test_decode_plan_is_the_layers_fused_path(tmp_path: Path, arch: str, dtype: torch.dtype, streams: int,
                                              kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A k-quant file's all-decode steps run every layer in one call (`cpu_kernels.KqDecodePlan`:
    q/k/v bias for qwen2, per-head q/k norms for qwen3, q/k/v segments of several types), and the
    greedy tokens, logprobs and top logprobs are bit for bit those of the layers' own fused path:
    float32 and bfloat16, 1 to 9 rows (9 bfloat16 rows: the tiles path where it is active), float and
    int8 K/V. A dense projection in one layer leaves the whole model on the layers' path."""
    from helios.models import llama
    from tests.unit.test_engine import check_decode_plan

    model = blocks_model(write_kquant_gguf(tmp_path / "tiny.gguf", arch=arch, embed=Q.Q8_0, output=Q.Q6_K), dtype)
    prompts = [[(p * (i + 3)) % VOCAB for p in PROMPT] for i in range(streams)]
    check_decode_plan(model, llama, dtype, prompts, kv_dtype, monkeypatch)
    layers = model._decoder_layers()
    assert llama.build_decode_plan(model.config, layers) is not None
    module = layers[1].o_proj
    assert isinstance(module, KQuantLinear)
    layers[1].set_projection("o_proj", DenseLinear(module.dequantize(dtype)))
    assert llama.build_decode_plan(model.config, layers) is None
