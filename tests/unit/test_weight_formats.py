"""Weight formats: the `[model] weights` option, what `auto` decides on each kind of CPU, the quantized
matmuls against float64 on random weights, Q4_1 -> int4 packing exactness, and the packed-weight cache.

Bounds on the matmuls are derived from the dtype and format that actually run (`tests.numerics`):
float32 is accumulation noise; the bf16 paths allow a few roundings of bf16's unit roundoff (2**-8)
of sum |x| |w| (plus, for int4, of the scale and zero terms that are rounded to bf16; for int8, half
a quantization step per weight), so they hold on AVX2-only and AVX512-BF16 machines alike."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helios.config import WEIGHT_FORMATS, ConfigError, load_config
from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.gguf_loader import GGUFFile, unpack_blocks
from helios.loaders.gguf_reader import GGML_Q4_0, GGML_Q4_1, GGML_Q8_0
from helios.loaders.weight_cache import PackedWeightCache, cache_key
from helios.models.dense_attention import DenseAttention
from helios.models.llama import LlamaForCausalLM
from helios.models.quant import (
    DenseLinear,
    GroupQuantized,
    Int4Linear,
    Int8Linear,
    WeightFormat,
    build_linear,
    onednn_linear_works,
    pack_onednn,
    quantize_int4,
)
from helios.runtime import AUTO_DENSE_ABOVE, CPU_CAPABILITY_ENV, choose_weights, load_model
from tests.numerics import unit_roundoff
from tests.unit.tiny_gguf import Q, write_tiny_gguf

BF16_U = unit_roundoff(torch.bfloat16)


# -- the config option ----------------------------------------------------------------------------


def test_weights_default_to_auto_with_the_cache_on() -> None:
    cfg = load_config(None, {})
    assert cfg.model.weights == "auto"
    assert cfg.model.weight_cache is True


@pytest.mark.parametrize("value", WEIGHT_FORMATS)
def test_every_weight_format_is_accepted_from_toml_and_overrides(tmp_path: Path, value: str) -> None:
    toml = tmp_path / "helios.toml"
    toml.write_text(f'[model]\nweights = "{value}"\nweight_cache = false\n')
    cfg = load_config(toml)
    assert (cfg.model.weights, cfg.model.weight_cache) == (value, False)
    assert load_config(None, {"model": {"weights": value}}).model.weights == value


@pytest.mark.parametrize("value", ["int3", "fp8", "", "Int4", 4, None])
def test_a_bad_weight_format_is_a_clear_error(tmp_path: Path, value: object) -> None:
    toml = tmp_path / "helios.toml"
    toml.write_text("[model]\nweights = " + ('"' + value + '"' if isinstance(value, str) else "4") + "\n")
    if value is None:  # TOML has no null: the override path
        with pytest.raises(ConfigError, match=r"model\.weights must be one of auto, float32, bfloat16, int8, int4"):
            load_config(None, {"model": {"weights": "none"}})
        return
    with pytest.raises(ConfigError, match=r"model\.weights must be one of auto, float32, bfloat16, int8, int4, got "):
        load_config(toml)


def test_weight_cache_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match=r"model\.weight_cache must be true or false, got 'yes'"):
        load_config(None, {"model": {"weight_cache": "yes"}})


# -- what auto decides ----------------------------------------------------------------------------


@pytest.fixture
def amx_granted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("helios.runtime.amx_tile_granted", lambda: True)


@pytest.mark.parametrize("capability", ["avx2", "avx512_bf16", "amx"])
def test_auto_keeps_int4_codes_and_a_dense_copy_in_the_native_dtype(monkeypatch: pytest.MonkeyPatch,
                                                                    amx_granted: None, capability: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    choice = choose_weights("auto", "auto", "cpu", int4_codes=True, projection_params=1000)
    # Activations in bf16 only where the CPU multiplies bf16 natively.
    assert choice.dtype == (torch.float32 if capability == "avx2" else torch.bfloat16)
    fmt = choice.format
    assert (fmt.kind, fmt.requantize, fmt.dense_dtype) == ("int4", False, choice.dtype)
    assert capability in choice.reason
    # Decode-sized steps run the int4 kernel, prefill-sized ones the dense copy.
    weight = quantize_int4(torch.randn(64, 128))
    module = build_linear([weight], fmt, choice.dtype)
    assert isinstance(module, Int4Linear) and module.dense is not None
    module.dense.zero_()  # tell the paths apart
    with torch.no_grad():
        assert module(torch.randn(1, 128).to(choice.dtype)).abs().sum() > 0
        assert module(torch.randn(512, 128).to(choice.dtype)).abs().sum() == 0
    # A dense source stays dense: auto never re-quantizes a checkpoint's weights.
    assert isinstance(build_linear([torch.randn(64, 128)], fmt, choice.dtype), DenseLinear)


def test_auto_does_not_use_amx_the_kernel_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "amx")
    monkeypatch.setattr("helios.runtime.amx_tile_granted", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    choice = choose_weights("auto", "auto", "cpu", int4_codes=True)
    assert "avx512_bf16" in choice.reason and "tile state" in choice.reason
    assert choice.dtype == torch.bfloat16
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # oneDNN kept below AMX too
    monkeypatch.setattr("helios.runtime.amx_tile_granted", lambda: True)
    assert "tile state" not in choose_weights("auto", "auto", "cpu", int4_codes=True).reason


def test_the_amx_check_is_false_where_the_cpu_has_no_tiles() -> None:
    from helios.runtime import amx_tile_granted

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_tile" in flags:
        pytest.skip("this CPU has AMX tiles; whether the kernel grants them is what the check reports")
    assert amx_tile_granted() is False


@pytest.mark.parametrize("capability", ["avx2", "avx512_bf16", "amx"])
def test_auto_without_int4_codes_is_dense_in_the_auto_dtype(monkeypatch: pytest.MonkeyPatch, amx_granted: None,
                                                            capability: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    choice = choose_weights("auto", "auto", "cpu", int4_codes=False)
    expected = torch.float32 if capability == "avx2" else torch.bfloat16
    assert (choice.format.kind, choice.format.dtype, choice.dtype) == ("dense", expected, expected)
    assert "no Q4_0/Q4_1" in choice.reason


def test_auto_drops_the_dense_copy_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "avx512_bf16")
    monkeypatch.setattr("helios.runtime._available_memory", lambda: 1000)
    choice = choose_weights("auto", "auto", "cpu", int4_codes=True, projection_params=10_000)
    assert choice.format.kind == "int4" and choice.format.dense_dtype is None
    monkeypatch.setattr("helios.runtime._available_memory", lambda: 10**12)
    assert choose_weights("auto", "auto", "cpu", int4_codes=True, projection_params=10_000).format.dense_dtype \
        == torch.bfloat16


def test_auto_falls_back_to_dense_when_the_int4_probe_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "avx512_bf16")
    monkeypatch.setattr("helios.runtime.quantized_kernel_works", lambda kind: False)
    choice = choose_weights("auto", "auto", "cpu", int4_codes=True)
    assert choice.format.kind == "dense" and "int4 kernel does not work" in choice.reason
    with pytest.raises(ValueError, match="weights = int4: torch's int4 weight-only matmul does not work"):
        choose_weights("int4", "auto", "cpu", int4_codes=True)


def test_the_probe_finds_both_kernels_in_this_build() -> None:
    from helios.runtime import quantized_kernel_works

    assert quantized_kernel_works("int4") and quantized_kernel_works("int8")


@pytest.mark.parametrize("capability", ["avx2", "avx512_bf16"])
def test_an_explicit_dtype_keeps_its_meaning_under_auto(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        choice = choose_weights("auto", name, "cpu", int4_codes=True)
        assert (choice.format.kind, choice.format.dtype, choice.dtype) == ("dense", dtype, dtype)


@pytest.mark.parametrize("capability", ["avx2", "avx512_bf16"])
def test_explicit_formats(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    native = torch.float32 if capability == "avx2" else torch.bfloat16
    assert choose_weights("float32", "auto", "cpu", int4_codes=True).format == WeightFormat("dense", torch.float32)
    assert choose_weights("bfloat16", "auto", "cpu", int4_codes=True).dtype == torch.bfloat16
    assert choose_weights("bfloat16", "float32", "cpu", int4_codes=True).dtype == torch.float32
    for kind in ("int4", "int8"):
        choice = choose_weights(kind, "auto", "cpu", int4_codes=False)
        assert (choice.format.kind, choice.format.requantize, choice.format.dense_dtype) == (kind, True, None)
        assert choice.dtype == native
    with pytest.raises(ValueError, match="unknown weights 'int2'"):
        choose_weights("int2", "auto", "cpu", int4_codes=True)


def test_cuda_is_dense_and_refuses_the_cpu_kernels() -> None:
    assert choose_weights("auto", "auto", "cuda", int4_codes=True).format == WeightFormat("dense", torch.bfloat16)
    with pytest.raises(ValueError, match="weights = int4 runs on the CPU only"):
        choose_weights("int4", "auto", "cuda:0", int4_codes=True)


def test_load_model_logs_its_choice(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "avx2")
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level(logging.INFO, logger="helios.runtime"):
        loaded = load_model(path)
    assert loaded.checkpoint.int4_codes
    assert any("weights int4" in r.message and "avx2" in r.message for r in caplog.records)


# -- quantized matmuls against float64 --------------------------------------------------------------


def _q4_1_weight(rows: int, cols: int, seed: int) -> GroupQuantized:
    """Random weights through llama.cpp's own Q4_1 quantizer, unpacked by Helios."""
    rng = np.random.default_rng(seed)
    blocks = gguf.quants.quantize((0.1 * rng.standard_normal((rows, cols)) + 0.02).astype(np.float32), Q.Q4_1)
    return unpack_blocks(torch.from_numpy(np.ascontiguousarray(blocks)).reshape(-1), GGML_Q4_1, (rows, cols))


@pytest.mark.parametrize("onednn", [False, True], ids=["torch", "onednn"])
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int4", "int8"])
def test_quantized_matmul_against_float64(kind: str, act: torch.dtype, rows: int, onednn: bool) -> None:
    """Each format against the checkpoint's weights in float64. ``onednn``: the dense matmuls (the
    dense formats, and the quantized ones' dense copy, used above 4 rows here) run from the
    oneDNN-packed weight (`pack_onednn`) where the probe enables it for that dtype."""
    torch.manual_seed(rows)
    source = _q4_1_weight(96, 160, seed=rows)
    w64 = source.dequantize().double()  # the checkpoint's weights (exactly gguf.quants' dequantization)
    dense_copy = {"dense_dtype": act, "dense_above": 4} if onednn else {}
    fmt = WeightFormat("dense", getattr(torch, kind)) if kind in ("float32", "bfloat16") \
        else WeightFormat(kind, **dense_copy)  # type: ignore[arg-type]
    module = build_linear([source], fmt, act)
    if onednn:
        stored = fmt.dtype if fmt.kind == "dense" else act
        assert pack_onednn(module) == onednn_linear_works(stored)
        if module.onednn is None:
            pytest.skip(f"oneDNN's prepacked linear is not used for {stored} on this machine")
        if kind in ("int4", "int8") and rows > 4:
            kind = str(act).removeprefix("torch.")  # the dense copy answers: its bound, not the codes'
    x = torch.randn(rows, 160).to(act)
    with torch.no_grad():
        got = module(x).double()
    assert got.dtype == torch.float64 and module(x).dtype == act
    ax = x.double().abs()
    if kind == "float32" and act == torch.float32:
        bound = 1e-5 * (ax @ w64.abs().t())
    else:
        # Roundings of bf16 (x into the kernel or the dense dtype, each weight or int4's scale and
        # zero, the output) at the scale of each product; int8 adds half a step per weight.
        per_weight = w64.abs()
        if kind == "int4":
            scale, zero = source.int4_scales_and_zeros()
            per_weight = per_weight + (8 * scale.abs() + zero.abs()).double().repeat_interleave(32, dim=1)
        bound = 4 * BF16_U * (ax @ per_weight.t())
        if kind == "int8":
            assert isinstance(module, Int8Linear)
            half_step = module.scales.double() / 2
            bound = bound + ax.sum(dim=1, keepdim=True) * half_step[None, :] * 1.01
    err = (got - x.double() @ w64.t()).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


def test_int8_requantization_moves_each_weight_by_at_most_half_a_step() -> None:
    w = torch.randn(40, 64)
    module = Int8Linear.quantize(w)
    back = module.weight.double() * module.scales.double()[:, None]
    assert bool(((back - w.double()).abs() <= module.scales.double()[:, None] / 2 + 1e-7).all())


# -- Q4_1 -> int4 packing exactness -------------------------------------------------------------------


@pytest.mark.parametrize(("qtype", "kind"), [(Q.Q4_0, GGML_Q4_0), (Q.Q4_1, GGML_Q4_1), (Q.Q8_0, GGML_Q8_0)])
def test_unpacked_blocks_dequantize_exactly_as_gguf(qtype: Q, kind: int) -> None:
    rng = np.random.default_rng(3)
    array = (0.3 * rng.standard_normal((24, 96)) + rng.uniform(-0.2, 0.2, (24, 1))).astype(np.float32)
    blocks = np.ascontiguousarray(gguf.quants.quantize(array, qtype))
    expected = gguf.quants.dequantize(blocks, qtype).reshape(array.shape)
    ours = unpack_blocks(torch.from_numpy(blocks).reshape(-1), kind, array.shape)
    assert ours.bits == (8 if qtype == Q.Q8_0 else 4)
    assert torch.equal(ours.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype_kind", [(Q.Q4_1, GGML_Q4_1), (Q.Q4_0, GGML_Q4_0)])
def test_int4_packing_keeps_the_checkpoint_weights_exactly(qtype_kind: tuple[Q, int]) -> None:
    """Packed codes with the float32 (scale, zero = offset + 8 scale) reproduce the GGUF dequantization
    bit for bit (the kernel's float32 path times the identity); the fast path uses the same codes
    with scale and zero rounded to bf16, and nothing else."""
    qtype, kind = qtype_kind
    rng = np.random.default_rng(4)
    array = (0.2 * rng.standard_normal((64, 128)) + rng.uniform(-0.3, 0.3, (64, 1))).astype(np.float32)
    blocks = np.ascontiguousarray(gguf.quants.quantize(array, qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(array.shape))
    source = unpack_blocks(torch.from_numpy(blocks).reshape(-1), kind, array.shape)
    module = Int4Linear.pack(source)
    scale, zero = source.int4_scales_and_zeros()
    exact = torch.stack((scale, zero), -1).transpose(0, 1).contiguous()
    unpacked = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(128), module.packed, 32, exact).t()
    assert torch.equal(unpacked, expected)
    assert torch.equal(module.scales_and_zeros, exact.to(torch.bfloat16))


# -- the packed-weight cache --------------------------------------------------------------------------


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.tensor([5, 77, 140, 3, 259, 12])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), DenseAttention.for_model(model)))


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = LlamaForCausalLM.load_weights

    def counting(self: LlamaForCausalLM, tensors: object) -> None:
        calls.append(1)
        real(self, tensors)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", counting)
    return calls


@pytest.mark.parametrize("weights", ["auto", "int4", "int8", "float32"])
def test_cache_miss_writes_and_hit_restores_the_same_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           weights: str) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    builds = _count_builds(monkeypatch)
    first = load_model(path, weights=weights, cache_dir=cache)
    assert builds == [1] and len(list(cache.glob("*.safetensors"))) == 1
    second = load_model(path, weights=weights, cache_dir=cache)
    assert builds == [1]  # the hit did not rebuild
    assert torch.equal(_logits(first.model), _logits(second.model))
    assert [type(m) for m in second.model.modules()] == [type(m) for m in first.model.modules()]


@pytest.mark.parametrize("weights", ["auto", "bfloat16", "float32"])
def test_load_model_packs_the_dense_gemms_for_onednn_and_keeps_the_logits(tmp_path: Path, weights: str) -> None:
    """`load_model` gives every dense projection (and a float32 head) a oneDNN-packed copy where the
    probe enables oneDNN for its dtype; the logits stay those of the unpacked model (float32
    accumulation both ways; only the summation order may differ)."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(path, weights=weights, cache_dir=tmp_path / "packed")
    model = loaded.model
    dense = [m for m in model.modules() if isinstance(m, DenseLinear) or getattr(m, "dense_above", 0) > 0]
    assert dense
    works = onednn_linear_works(loaded.choice.format.dense_dtype or loaded.choice.format.dtype or loaded.choice.dtype)
    for m in dense:
        assert (m.onednn is not None) == works
        if not isinstance(m, DenseLinear):
            assert (m.dense is None) == works  # the packed copy replaces a quantized projection's dense copy
    if not works:
        pytest.skip("oneDNN's prepacked linear is not used on this machine")
    # Saving the packed model again gives the dense copies back exactly (`to_dense()` of the packed
    # one), as a model built from the checkpoint without packing holds them.
    saved, _ = model.packed_state()
    ckpt = load_checkpoint(path, torch.float32)
    reference = LlamaForCausalLM(ckpt.config, dtype=loaded.choice.dtype, weights=loaded.choice.format)
    reference.load_weights(ckpt.weights)
    copies = {name: t for name, t in reference.state_dict().items() if name.endswith(".dense") and t is not None}
    assert bool(copies) == (weights == "auto")
    for name, tensor in copies.items():
        assert torch.equal(saved[name], tensor), name
    ids, positions = torch.tensor([1, 5, 9, 3, 7, 2, 8, 4]), torch.arange(8)
    with torch.no_grad():
        packed = model.compute_logits(model(ids, positions, DenseAttention.for_model(model)))
        for m in dense:
            m.onednn = None
        model._lm_head_onednn = None
        plain = model.compute_logits(model(ids, positions, DenseAttention.for_model(model)))
    tolerance = 1e-4 if loaded.choice.dtype == torch.float32 else 0.05
    assert torch.allclose(packed, plain, rtol=0, atol=tolerance * float(plain.abs().max()))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_cache_hit_gives_the_kernels_aligned_tensors(tmp_path: Path, weights: str) -> None:
    """safetensors places tensors at 8-byte offsets; torch's int8/int4 CPU kernels use aligned vector
    loads and crashed (SIGSEGV) on a restored weight at such an offset, so every restored tensor must sit
    at the allocator's 64-byte alignment."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    load_model(path, weights=weights, cache_dir=cache)
    hit = load_model(path, weights=weights, cache_dir=cache)
    tensors = [t for m in hit.model.modules() if isinstance(m, (Int4Linear, Int8Linear))
               for t in m.parameters()]
    assert tensors
    misaligned = [tuple(t.shape) for t in tensors if t.data_ptr() % 64]
    assert misaligned == []
    assert torch.isfinite(_logits(hit.model)).all()


def test_a_cached_model_follows_the_current_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "avx512_bf16")
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    load_model(path, cache_dir=cache)
    monkeypatch.setitem(AUTO_DENSE_ABOVE, "avx512_bf16", 3)
    again = load_model(path, cache_dir=cache)
    layers = [m for m in again.model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.dense_above == 3 for m in layers)


def test_each_format_and_checkpoint_version_has_its_own_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    builds = _count_builds(monkeypatch)
    load_model(path, weights="int4", cache_dir=cache)
    load_model(path, weights="int8", cache_dir=cache)
    assert len(builds) == 2 and len(list(cache.glob("*.safetensors"))) == 2
    write_tiny_gguf(path, seed=1)  # a new file at the same path: new size/mtime, new key
    os.utime(path, ns=(1, 1))
    changed = load_model(path, weights="int4", cache_dir=cache)
    assert len(builds) == 3
    fresh = load_model(path, weights="int4", cache_dir=None)
    assert torch.equal(_logits(changed.model), _logits(fresh.model))


@pytest.mark.parametrize("damage", ["flip_a_data_byte", "truncate", "garbage", "empty"])
def test_a_corrupt_entry_is_rebuilt_never_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture, damage: str) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    reference = _logits(load_model(path, weights="auto", cache_dir=cache).model)
    (entry,) = cache.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "flip_a_data_byte":
        data[-100] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"\x07" * len(data))
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    builds = _count_builds(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="helios.loaders.weight_cache"):
        again = load_model(path, weights="auto", cache_dir=cache)
    assert builds == [1]
    assert any("rebuilding from the checkpoint" in r.message for r in caplog.records)
    assert torch.equal(_logits(again.model), reference)
    # The rebuilt entry replaced the bad one and is served next time.
    load_model(path, weights="auto", cache_dir=cache)
    assert builds == [1]


def test_an_intact_entry_that_does_not_fit_the_model_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Checksums pass but the tensors are not this model's (say, a layout change without a new
    LAYOUT_VERSION): rebuilt from the checkpoint, not a start-up failure."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "packed"
    first = load_model(path, weights="int4", cache_dir=cache)
    key = first.cache_key
    entry = PackedWeightCache(cache).load(key)
    assert entry is not None
    state = dict(entry.state)
    del state["layers.1.down_proj.packed"]
    PackedWeightCache(cache).store(key, state, entry.kinds)
    builds = _count_builds(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="helios.runtime"):
        again = load_model(path, weights="int4", cache_dir=cache)
    assert builds == [1] and any("does not fit this model" in r.message for r in caplog.records)
    assert torch.equal(_logits(again.model), _logits(first.model))


def test_an_entry_for_another_key_is_not_served(tmp_path: Path) -> None:
    cache = PackedWeightCache(tmp_path)
    state = {"a": torch.arange(6, dtype=torch.float32)}
    written = cache.store("key-1", state, {"layers.0.qkv_proj": "dense"})
    assert written is not None
    loaded = cache.load("key-1")
    assert loaded is not None and torch.equal(loaded.state["a"], state["a"])
    written.rename(cache.path_for("key-2"))  # same bytes under another key's name
    assert cache.load("key-2") is None and not cache.path_for("key-2").exists()


def test_tied_weights_are_stored_once_and_come_back_as_one_tensor(tmp_path: Path) -> None:
    """A model whose output head is its embedding holds one tensor under two names; safetensors
    refuses to write shared memory twice, so the entry holds it once and names the alias."""
    cache = PackedWeightCache(tmp_path)
    embed = torch.arange(4096, dtype=torch.uint8).reshape(64, 64)
    state = {"embed.blocks": embed, "head.blocks": embed, "norm": torch.ones(64)}
    written = cache.store("key-1", state, {"head": "blocks"})
    assert written is not None
    loaded = cache.load("key-1")
    assert loaded is not None and set(loaded.state) == set(state)
    assert loaded.state["head.blocks"] is loaded.state["embed.blocks"]
    assert torch.equal(loaded.state["embed.blocks"], embed) and torch.equal(loaded.state["norm"], state["norm"])


def test_the_key_follows_the_file_format_and_dtype(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    key = cache_key(path, "int4:-:-:1", torch.bfloat16)
    assert key == cache_key(path, "int4:-:-:1", torch.bfloat16)
    assert key != cache_key(path, "int8:-:-:1", torch.bfloat16)
    assert key != cache_key(path, "int4:-:-:1", torch.float32)
    os.utime(path, ns=(10**9, 10**9))
    assert key != cache_key(path, "int4:-:-:1", torch.bfloat16)


def test_gguf_file_reads_what_the_writer_wrote(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    file = GGUFFile(path)
    assert file.metadata["general.test_flag"] is True
    assert file.metadata["general.test_floats"] == [0.5, -1.25]
    assert isinstance(file.read_source("blk.0.attn_q.weight"), GroupQuantized)


def test_an_entry_reads_back_exactly_aligned_in_every_dtype(tmp_path: Path) -> None:
    """`weight_cache._read` reads each tensor straight into its own allocation: the bytes, dtypes and
    shapes safetensors itself reads, every tensor 64-byte aligned, the CRCs of the bytes read."""
    from helios.loaders import weight_cache

    cache = PackedWeightCache(tmp_path)
    state = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 3).half(),
             "u8": torch.arange(13, dtype=torch.uint8), "i8": torch.arange(-5, 6, dtype=torch.int8),
             "i32": torch.arange(9, dtype=torch.int32).view(3, 3), "i64": torch.tensor(7), "b": torch.tensor([True, False]),
             "empty": torch.empty(0, 4)}
    written = cache.store("k", state, {})
    assert written is not None
    tensors, metadata, crcs = weight_cache._read(written)
    reference, reference_metadata = weight_cache._read_with_safetensors(written)
    assert metadata == reference_metadata and set(tensors) == set(state) == set(crcs)
    for name, tensor in tensors.items():
        assert tensor.dtype == state[name].dtype and tensor.shape == state[name].shape, name
        assert torch.equal(tensor, reference[name]) and torch.equal(tensor, state[name]), name
        assert tensor.data_ptr() % weight_cache.ALIGNMENT == 0 or tensor.numel() == 0, name
        assert crcs[name] == weight_cache._crc32(state[name]), name
    loaded = cache.load("k")
    assert loaded is not None and all(torch.equal(loaded.state[n], state[n]) for n in state)
