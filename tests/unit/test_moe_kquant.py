"""GGUF MoE expert tensors kept in their block form (issue 27, "Expert compute on the CPU"): a tiny
qwen3moe GGUF written with ``gguf.GGUFWriter`` whose stacked ``ffn_{gate,up,down}_exps`` tensors are
Q4_K / Q6_K / Q5_0 / Q8_0 blocks (valid random blocks, `tests.unit.test_kquant.random_blocks`; Q4_0 /
Q4_1 ones from ``gguf.quants.quantize``) loads, under a format
that keeps blocks (what ``weights = "auto"`` picks for such a file), with every routed expert's
gate/up and down as a `kquant.KQuantLinear` over that expert's bytes of the stack (no dequantization:
the expert bytes kept are the file's); its logits equal those of a float32 dense model built from
``gguf.quants.dequantize`` of the same bytes; the packed-weight cache round trip is bit for bit; a
decode step counts top_k of the experts' block bytes. Q4_0 experts take the int4 path instead.

Tolerance as in ``tests/unit/test_kquant_loading.py``: the kernel decodes each weight exactly, so the
two models differ only by the order of float32 sums (bound asserted: 1e-4 of the logits' scale).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.gguf_loader import GGUFFile
from helios.loaders.weight_cache import PackedWeightCache
from helios.models import cpu_kernels, moe
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention
from helios.models.kquant import BlockExperts, BlockQuantized, KQuantLinear
from helios.models.moe_decoder import MoEForCausalLM
from helios.models.quant import Int4Linear, StackedExperts, WeightFormat
from helios.runtime import AUTO_BLOCKS_UNPACK_ABOVE, choose_weights
from tests.unit.test_engine import check_decode_plan
from tests.unit.test_kquant import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 256, 4, 2, 4, 2, 64, 300
# Per layer: the gate / up / down expert stacks' types.
KQUANT_LAYERS = [(Q.Q4_K, Q.Q6_K, Q.Q5_0), (Q.Q8_0, Q.Q8_0, Q.Q4_K)]
INT4_LAYERS = [(Q.Q4_0, Q.Q4_0, Q.Q4_1), (Q.Q4_1, Q.Q4_1, Q.Q4_0)]
PROMPT = [257, 12, 200, 31, 99, 4, 150, 258, 7, 77, 120, 5, 61, 230, 18, 40, 3, 141, 90, 11]


def write_moe_gguf(path: Path, layer_types: list[tuple[Q, Q, Q]], seed: int = 0,
                   attention: tuple[Q | None, Q | None, Q | None, Q | None] | None = None) -> Path:
    """A tiny random qwen3moe model: float32 attention (``attention``: its q, k, v and o weights in
    these block types, None: float32), norms, router, embedding and head; the routed experts stacked [E, rows,
    cols] in ``layer_types``."""
    rng = np.random.default_rng(seed)
    arch = "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.name", "tiny-moe-kquant")
    for key, value in (("block_count", len(layer_types)), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM),
                       ("expert_feed_forward_length", INTER), ("expert_used_count", TOP_K),
                       ("expert_count", EXPERTS)):
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

    def dense(name: str, *shape: int, scale: float = 0.06, base: float = 0.0) -> None:
        writer.add_tensor(name, (base + scale * rng.standard_normal(shape)).astype(np.float32))

    dense("token_embd.weight", VOCAB, HIDDEN, scale=0.5)
    dense("output.weight", VOCAB, HIDDEN)
    dense("output_norm.weight", HIDDEN, scale=0.1, base=1.0)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    counter = iter(range(1, 1 << 20))
    for layer, types in enumerate(layer_types):
        blk = f"blk.{layer}."
        dense(blk + "attn_norm.weight", HIDDEN, scale=0.1, base=1.0)
        dense(blk + "ffn_norm.weight", HIDDEN, scale=0.1, base=1.0)
        dense(blk + "attn_q_norm.weight", HEAD_DIM, scale=0.1, base=1.0)
        dense(blk + "attn_k_norm.weight", HEAD_DIM, scale=0.1, base=1.0)
        for name, (rows, cols), qtype in zip(("attn_q", "attn_k", "attn_v", "attn_output"),
                                             ((q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, q)),
                                             attention or (None,) * 4, strict=True):
            if qtype is None:
                dense(f"{blk}{name}.weight", rows, cols)
            else:
                writer.add_tensor(f"{blk}{name}.weight", random_blocks(int(qtype), rows, cols, 7919 * layer + rows + cols),
                                  raw_dtype=qtype)
        dense(blk + "ffn_gate_inp.weight", EXPERTS, HIDDEN, scale=0.5)
        for part, qtype, (rows, cols) in zip(("gate", "up", "down"), types,
                                             ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)), strict=True):
            if qtype in cpu_kernels.KQUANT_LAYOUTS:  # valid random blocks (gguf quantizes no K-type)
                data = random_blocks(int(qtype), EXPERTS * rows, cols, seed * 1000 + next(counter))
                data = data.reshape(EXPERTS, rows, -1)
            else:
                data = gguf.quants.quantize((0.08 * rng.standard_normal((EXPERTS, rows, cols))).astype(np.float32),
                                            qtype)
            writer.add_tensor(f"{blk}ffn_{part}_exps.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_model(path: Path) -> MoEForCausalLM:
    """The float32 dense model of the file's weights as the gguf package dequantizes them (its own
    reader and ``gguf.quants.dequantize``; no Helios kernel), experts as dense stacks."""
    file = GGUFFile(path)
    tensors: dict[str, torch.Tensor] = {}
    for t in gguf.GGUFReader(path).tensors:
        target = file.architecture.gguf_name(file.config, t.name)
        assert target is not None and target.rotary_heads is None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        tensors[target.name] = torch.from_numpy(np.array(array))
    model = MoEForCausalLM(file.config, torch.float32, weights=WeightFormat("dense", torch.float32))
    model.load_weights(tensors)
    return model


def blocks_format(unpack_above: int | None = AUTO_BLOCKS_UNPACK_ABOVE) -> WeightFormat:
    """What ``weights = "auto"`` picks for a k-quant GGUF (no dense copy), with ``unpack_above``."""
    return WeightFormat("int4", requantize=False, keep_blocks=True, unpack_above=unpack_above)


def blocks_model(path: Path, fmt: WeightFormat, dtype: torch.dtype = torch.float32) -> MoEForCausalLM:
    ckpt = load_checkpoint(path)
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=dtype, weights=fmt))
    assert isinstance(model, MoEForCausalLM)
    model.load_weights(ckpt.weights)
    return model


@torch.inference_mode()
def logits(model: MoEForCausalLM) -> torch.Tensor:
    """Float32 logits of a 20-row prefill (about 10 rows per expert), a 32-row chunk (16 per
    expert), an 8-row chunk and a 1-row decode step."""
    attn = DenseAttention.for_model(model, initial_capacity=96)
    ids, rows, start = list(PROMPT), [], 0
    for chunk in (PROMPT, [(7 * i + 3) % VOCAB for i in range(32)], [(11 * i + 5) % VOCAB for i in range(8)], [42]):
        hidden = model(torch.tensor(chunk), torch.arange(start, start + len(chunk)), attn)
        rows.append(model.compute_logits(hidden).float())
        start += len(chunk)
        ids += chunk
    return torch.cat(rows)


def expert_modules(model: MoEForCausalLM) -> list[torch.nn.Module]:
    mods: list[torch.nn.Module] = []
    for layer in model._decoder_layers():
        gate_up, down = layer.routed_experts()
        assert not isinstance(gate_up, torch.Tensor) and not isinstance(down, torch.Tensor)
        mods += [*gate_up, *down]  # type: ignore[list-item]
    return mods


def exps_bytes(path: Path) -> list[int]:
    """Per layer: the bytes of its three stacked expert tensors in the file."""
    file = GGUFFile(path)
    return [sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
                if t.name.startswith(f"blk.{layer}.") and "_exps" in t.name)
            for layer in range(file.config.num_layers)]


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_gguf(tmp_path_factory.mktemp("moe-kquant") / "tiny-moe.gguf", KQUANT_LAYERS)


def test_the_loader_hands_stacked_blocks_per_expert(kquant_file: Path) -> None:
    file = GGUFFile(kquant_file)
    stacked = file.weight_thunks()["model.layers.0.mlp.experts.gate_proj"]()
    assert isinstance(stacked, StackedExperts) and stacked.shape == (EXPERTS, INTER, HIDDEN)
    reader = {t.name: t for t in gguf.GGUFReader(kquant_file).tensors}["blk.0.ffn_gate_exps.weight"]
    assert stacked.nbytes == int(reader.n_bytes)
    want = np.asarray(gguf.quants.dequantize(reader.data, reader.tensor_type), dtype=np.float32)
    assert torch.equal(stacked.dequantize(), torch.from_numpy(want.reshape(EXPERTS, INTER, HIDDEN)))
    # the float32 view of the same tensor (dense formats, tensor_thunks) is the dequantization
    assert torch.equal(file.tensor_thunks(torch.float32)["model.layers.0.mlp.experts.gate_proj"](),
                       stacked.dequantize())


@pytest.mark.parametrize("unpack_above", [AUTO_BLOCKS_UNPACK_ABOVE, 4, None])
def test_experts_are_kquant_and_match_the_dequantized_reference(kquant_file: Path, unpack_above: int | None) -> None:
    """``unpack_above`` 32 (auto's): every expert's rows go through the kernel (GEMV at 1 row,
    register tiles at 8 to 16); 4: the prefill and chunks dequantize per call; None: the kernel always."""
    model = blocks_model(kquant_file, blocks_format(unpack_above))
    mods = expert_modules(model)
    assert len(mods) == 2 * EXPERTS * len(KQUANT_LAYERS)
    assert all(isinstance(m, KQuantLinear) and m.dense is None and m.unpack_above == unpack_above for m in mods)
    first = model._decoder_layers()[0]
    gate_up, down = first.routed_experts()
    assert cast_kquant(gate_up[0]).types == (int(Q.Q4_K), int(Q.Q6_K)) and cast_kquant(gate_up[0]).outs == (INTER,
                                                                                                            INTER)
    assert cast_kquant(down[EXPERTS - 1]).types == (int(Q.Q5_0),)
    # load memory: the expert bytes kept are the file's blocks, no more
    for layer, size in zip(model._decoder_layers(), exps_bytes(kquant_file), strict=True):
        assert layer.routed_expert_bytes() == size
    got = logits(model)
    want = logits(reference_model(kquant_file))
    scale = float(want.abs().max())
    error = float((got - want).abs().max())
    assert error <= 1e-4 * scale, (error, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_one_call_per_expert(kquant_file: Path, dtype: torch.dtype,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts of a step run as one fused operator (`cpu_kernels.moe_kquant_mix`), or without it
    as one grouped kernel call per projection segment: the same logits, bit for bit, as one
    `KQuantLinear` call per expert (and each path is taken)."""
    model = blocks_model(kquant_file, blocks_format(None), dtype)
    mixes: list[bool] = []
    mix = BlockExperts.mix

    def counting_mix(self: BlockExperts, *args: torch.Tensor) -> torch.Tensor | None:
        result = mix(self, *args)
        mixes.append(result is not None)
        return result

    monkeypatch.setattr(BlockExperts, "mix", counting_mix)
    fused = logits(model)
    assert mixes and all(mixes)
    monkeypatch.setattr(BlockExperts, "mix", lambda *args: None)
    calls = []
    grouped = moe.grouped_linear

    def counting(*args: object) -> object:
        result = grouped(*args)  # type: ignore[arg-type]
        calls.append(result is not None)
        return result

    monkeypatch.setattr(moe, "grouped_linear", counting)
    assert torch.equal(logits(model), fused)
    assert calls and all(calls)
    monkeypatch.setattr(moe, "grouped_linear", lambda *args: None)
    assert torch.equal(logits(model), fused)


def test_tile_sized_groups_go_to_their_modules() -> None:
    """`grouped_linear` declines (None: one module call per group) when a group's rows would take the
    tiles path in its module (8 rows of Q4_K do not where `kquant_pair_before_tiles`), so a grouped result
    is always the bits of each module alone; a MoE layer's experts do not take the tiles (`tiles` False),
    so they group at any size."""
    from helios.models import kquant

    weights = [BlockQuantized(torch.from_numpy(random_blocks(12, 32, 256, seed=g)), 12, (32, 256)) for g in range(2)]
    mods = [KQuantLinear([w]) for w in weights]
    lo = kquant.TILE_ROWS[0]
    x = torch.randn(2 * lo, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    small = kquant.grouped_linear(mods, [lo - 1, lo - 1], x[: 2 * lo - 2])
    assert small is not None and torch.equal(small, torch.cat([mods[0](x[: lo - 1]), mods[1](x[lo - 1: 2 * lo - 2])]))
    # lo rows take the tiles in the module unless the pair dot path keeps this type (`kquant_pair_before_tiles`)
    tiles = kquant.tiles_take(x[:lo]) and not cpu_kernels.kquant_pair_before_tiles(lo, 12)
    both = kquant.grouped_linear(mods, [lo, lo], x)
    assert (both is None) == tiles
    if both is not None:
        assert torch.equal(both, torch.cat([mods[0](x[:lo]), mods[1](x[lo:])]))
    wide = torch.randn(2 * lo + 2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert (kquant.grouped_linear(mods, [lo + 1, lo + 1], wide) is None) == kquant.tiles_take(wide[:lo + 1])
    assert kquant.grouped_linear(mods, [lo, lo], x.float()) is not None
    for m in mods:
        m.tiles = False
    grouped = kquant.grouped_linear(mods, [lo, lo], x)
    assert grouped is not None and torch.equal(grouped, torch.cat([mods[0](x[:lo]), mods[1](x[lo:])]))
    assert torch.equal(mods[0](x[:lo]), cpu_kernels.kquant_linear(x[:lo], weights[0].blocks, 12, 32))


def test_an_expert_past_unpack_above_takes_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """An expert module (``tiles`` False) keeps the exact kernel up to ``unpack_above`` rows and
    takes the tiles path past it where it is active (its bits are `kquant_linear_tiles`'s), where it
    used to dequantize for the call; without the tiles, or past their rows, it still unpacks."""
    from helios.models import kquant

    weight = BlockQuantized(torch.from_numpy(random_blocks(12, 64, 256, seed=3)), 12, (64, 256))
    module = KQuantLinear([weight], unpack_above=8)
    module.tiles = False
    x = torch.randn(kquant.TILE_ROWS[1] + 1, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    calls: list[int] = []
    tiles = cpu_kernels.kquant_linear_tiles

    def counting(x: torch.Tensor, *args: object, **kwargs: bool) -> torch.Tensor:
        calls.append(x.shape[0])
        return tiles(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "kquant_linear_tiles", counting)
    assert torch.equal(module(x[:8]), cpu_kernels.kquant_linear(x[:8], weight.blocks, 12, 64))
    unpacked = torch.nn.functional.linear(x.float(), weight.dequantize()).to(torch.bfloat16)
    if cpu_kernels.kquant_tiles_active():
        assert torch.equal(module(x[:9]), tiles(x[:9], weight.blocks, 12, 64))
        assert calls == [9]
    else:
        assert torch.equal(module(x[:9]), unpacked[:9])
        assert calls == []
    assert torch.equal(module(x), unpacked)  # past the tiles' rows
    assert len(calls) <= 1


def test_a_moe_layers_block_experts_keep_the_exact_kernel(kquant_file: Path) -> None:
    model = blocks_model(kquant_file, blocks_format(32), torch.bfloat16)
    layer = model.layers[0]
    gate_up, down = layer.routed_experts()
    assert all(isinstance(m, KQuantLinear) and not m.tiles for m in (*gate_up, *down))
    assert all(m.tiles for m in (layer.qkv_proj, layer.o_proj) if isinstance(m, KQuantLinear))


def cast_kquant(module: object) -> KQuantLinear:
    assert isinstance(module, KQuantLinear)
    return module


def test_decode_bytes_count_top_k_of_the_experts_blocks(kquant_file: Path) -> None:
    """Against the dense reference (the same float32 attention, norms, embedding and head): a decode
    step reads top_k / num_experts of each layer's experts, their blocks here, their float32 there."""
    model = blocks_model(kquant_file, blocks_format())
    reference = reference_model(kquant_file)
    dense = 3 * EXPERTS * INTER * HIDDEN * 4  # one layer's float32 experts

    def read(size: int) -> int:  # what a step reads of a layer's experts of ``size`` bytes
        return size - size * (EXPERTS - TOP_K) // EXPERTS

    blocks = exps_bytes(kquant_file)
    assert all(layer.routed_expert_bytes() == dense for layer in reference._decoder_layers())
    want = sum(read(dense) - read(size) for size in blocks)
    assert reference.decode_weight_bytes() - model.decode_weight_bytes() == want
    assert abs(want - (len(blocks) * dense - sum(blocks)) * TOP_K / EXPERTS) <= len(blocks)


def test_packed_cache_round_trip_is_bit_exact(kquant_file: Path, tmp_path: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        fmt = blocks_format(4)  # the prefill dequantizes per call, decode takes the kernel
        model = blocks_model(kquant_file, fmt, dtype)
        model.pack_cpu_weights()  # what loading does next (the dense attention may take oneDNN)
        want = logits(model)
        state, kinds = model.packed_state()
        assert kinds["layers.0.experts_gate_up_0"].startswith("kquant:12+14:")
        assert kinds["layers.1.experts_down_3"].startswith("kquant:12:")
        cache = PackedWeightCache(tmp_path / "packed")
        key = f"tiny-moe:{dtype}"
        assert cache.store(key, state, kinds) is not None
        hit = cache.load(key)
        assert hit is not None
        ckpt = load_checkpoint(kquant_file)
        fresh = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=dtype, weights=fmt))
        assert isinstance(fresh, MoEForCausalLM)
        fresh.load_packed_state(hit.state, hit.kinds)
        for a, b in zip(expert_modules(model), expert_modules(fresh), strict=True):
            assert isinstance(a, KQuantLinear) and isinstance(b, KQuantLinear)
            assert (a.types, a.outs, a.unpack_above, a.unpack_dtype) == (b.types, b.outs, b.unpack_above,
                                                                         b.unpack_dtype)
            assert all(torch.equal(x, y) for x, y in zip(a.blocks, b.blocks, strict=True))
        fresh.pack_cpu_weights()
        assert torch.equal(logits(fresh), want), dtype


def test_auto_keeps_the_expert_blocks(kquant_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELIOS_CPU_CAPABILITY", "avx512_bf16")
    ckpt = load_checkpoint(kquant_file)
    assert ckpt.block_codes  # the expert stacks alone make it a block-codes checkpoint
    choice = choose_weights("auto", "auto", "cpu", int4_codes=ckpt.int4_codes, block_codes=ckpt.block_codes,
                            projection_params=ckpt.config.projection_params())
    assert choice.format.keep_blocks


def test_q4_0_and_q4_1_experts_take_the_int4_path(tmp_path: Path) -> None:
    path = write_moe_gguf(tmp_path / "tiny-moe-q4.gguf", INT4_LAYERS)
    model = blocks_model(path, blocks_format())
    assert all(isinstance(m, Int4Linear) for m in expert_modules(model))
    got, want = logits(model), logits(reference_model(path))
    # the int4 kernel takes bfloat16 activations and bfloat16 scales: close, not exact
    rel = float((got - want).abs().mean() / want.abs().mean())
    assert rel < 0.05, rel


def test_runtime_auto_and_the_weight_cache(kquant_file: Path, tmp_path: Path) -> None:
    """`runtime.load_model` with ``weights = "auto"``: expert blocks kept (bfloat16 or float32
    activations as the CPU picks), and the packed-weight cache gives the same logits bit for bit."""
    from helios.runtime import load_model

    loaded = load_model(kquant_file, weights="auto", cache_dir=tmp_path / "packed")
    model = loaded.model
    assert isinstance(model, MoEForCausalLM) and loaded.cache_key
    assert all(isinstance(m, KQuantLinear) and m.dense is None for m in expert_modules(model))
    got = logits(model)
    again = load_model(kquant_file, weights="auto", cache_dir=tmp_path / "packed").model
    assert isinstance(again, MoEForCausalLM)
    assert all(isinstance(m, KQuantLinear) for m in expert_modules(again))
    assert torch.equal(got, logits(again))


# q and k one Q4_K segment, v Q6_K (two segments, as Q4_K_M files mix them), o Q8_0
ATTENTION_TYPES = (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0)
# experts whose gate and up share a type (one gate/up segment: `kquant.BlockExperts`)
PLAN_LAYERS = [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q5_0)]


@pytest.mark.parametrize(("dtype", "streams", "kv_dtype"), [(torch.float32, 1, "auto"), (torch.bfloat16, 1, "auto"),
                                                            (torch.bfloat16, 3, "int8"), (torch.bfloat16, 9, "auto"),
                                                            (torch.float32, 9, "auto")])
def test_decode_plan_is_the_layers_fused_path(tmp_path: Path, dtype: torch.dtype, streams: int, kv_dtype: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-MoE file with k-quant attention: its all-decode steps run every layer in one call
    (`cpu_kernels.KqDecodePlan`), and the greedy tokens, logprobs and top logprobs are bit for bit
    those of the layers' own fused path, for float32 and bfloat16, 1 to 9 rows (9 bfloat16 rows:
    the tiles path where it is active), float and int8 K/V. A layer the plan does not take (a dense
    attention projection) leaves the whole model on the layers' path."""
    from helios.models import moe_decoder

    path = write_moe_gguf(tmp_path / "tiny-moe-attn.gguf", PLAN_LAYERS, attention=ATTENTION_TYPES)
    model = blocks_model(path, blocks_format(), dtype)
    assert all(isinstance(m, KQuantLinear) for layer in model._decoder_layers() for m in (layer.qkv_proj, layer.o_proj))
    assert len(cast_kquant(model._decoder_layers()[0].qkv_proj).types) == 2
    prompts = [[(p * (i + 3)) % VOCAB for p in PROMPT] for i in range(streams)]
    check_decode_plan(model, moe_decoder, dtype, prompts, kv_dtype, monkeypatch)
    # A dense o projection, or experts whose gate and up differ in type: no plan.
    for name, layers, attention in (("dense-o", PLAN_LAYERS, (Q.Q4_K, Q.Q4_K, Q.Q6_K, None)),
                                    ("split-gate-up", KQUANT_LAYERS, ATTENTION_TYPES)):
        other = blocks_model(write_moe_gguf(tmp_path / f"{name}.gguf", layers, attention=attention), blocks_format(),
                             dtype)
        assert moe_decoder.build_decode_plan(model.config, other._decoder_layers()) is None, name
    assert moe_decoder.build_decode_plan(model.config, model._decoder_layers()) is not None
