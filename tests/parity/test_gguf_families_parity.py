"""GGUF parity of the families llama.cpp converts under its own architecture names: ``gpt-oss``
(`helios.models.gpt_oss`), ``minimax-m2`` (`helios.models.minimax_m2`), ``mimo2``
(`helios.models.mimo_v2_flash`) and ``gemma4`` (`helios.models.gemma4`, text).

Each test takes a tiny seeded transformers model (the families' parity-test models), saves it,
writes a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes that architecture (its names,
metadata keys, layouts and tensor types: F32 for 1-D tensors, norms, routers and non-``.weight``
tensors, the output type elsewhere; gpt-oss's MXFP4 experts as ggml MXFP4 blocks), loads it through
`load_checkpoint` and the registry, and checks float32 logits within `FP32_TOLERANCE` of
transformers' and 32 greedy tokens equal to transformers' ``generate``. The files hold the
reference's weights exactly (F32, or the reference rounded to BF16 / the MXFP4 values), so the
float32 tolerance stands for every variant.

Where the converter cannot say what the transformers model does, the reference model is the one a
GGUF can describe, and the test says so: gpt-oss's YaRN with ``truncate`` (llama.cpp floors / ceils
the correction range), one rotary share for both MiMo layer kinds and no MiMo routed scaling, Gemma 4's
proportional RoPE without ``factor``.

`test_real_converter_writes_the_same_file` runs llama.cpp's own converter (the tree under
``$HELIOS_PEERS``, default ``~/.cache/helios-peers``, ``llama-src/vendor/llama.cpp``; skipped
without it) on the same saved folders, with a stand-in vocabulary, and checks that it writes the
tensors (names, types, shapes, bytes) and ``<arch>.*`` metadata these writers write, and that Helios
loads its file at parity too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from helios.loaders.checkpoint import load_checkpoint
from helios.models.architecture import BuildOptions
from helios.models.dense_attention import DenseAttention, greedy_generate
from tests.numerics import FP32_TOLERANCE
from tests.parity.test_moe_parity import VOCAB, add_test_vocab
from tests.parity.tiny import hf_logits, write_byte_tokenizer

transformers = pytest.importorskip("transformers")

PROMPT = [3, 250, 17, 99, 101, 5, 64, 200, 31, 7, 140, 271, 12, 44, 9, 77, 150, 23, 8, 111]  # 20 > windows
Q = gguf.GGMLQuantizationType


# -- the converter's rules ---------------------------------------------------------------------------

_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _stored_type(name: str, array: np.ndarray, outtype: Q) -> Q:
    """The type ``convert_hf_to_gguf.py`` stores a tensor in (``ModelBase.prepare_tensors``): F32
    for 1-D tensors, ``*_norm.weight``, routers and names not ending in ``.weight``; the output
    type otherwise."""
    if array.ndim <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_ALWAYS) or not name.endswith(".weight"):
        return Q.F32
    return outtype


def _write(path: Path, arch: str, metadata: Mapping[str, Any], tensors: Iterator[tuple[str, Any]],
           outtype: Q = Q.F32) -> None:
    """A GGUF of ``arch``: ``metadata`` (keys without the ``<arch>.`` prefix), the test vocabulary,
    and ``tensors`` (name, float array, or name, (raw bytes, ggml type) for pre-packed blocks)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_array(full, list(value))
    add_test_vocab(writer)
    for name, value in tensors:
        if isinstance(value, tuple):
            raw, kind = value
            writer.add_tensor(name, raw, raw_dtype=kind)
            continue
        array = np.ascontiguousarray(value, dtype=np.float32)
        kind = _stored_type(name, array, outtype)
        if kind == Q.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _np(t: Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def _layer(name: str) -> tuple[str, str] | None:
    """``model.layers.{i}.rest`` -> (i, rest)."""
    if not name.startswith("model.layers."):
        return None
    _, _, index, rest = name.split(".", 3)
    return index, rest


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_ATTENTION = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output"}


def _renamed(tensors: Mapping[str, Tensor], table: Mapping[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors under llama.cpp's names (``table``: layer suffix -> GGUF suffix);
    names not in it are left to the caller (a KeyError otherwise)."""
    for name, tensor in tensors.items():
        if name in _GLOBAL:
            yield _GLOBAL[name], _np(tensor)
            continue
        index, rest = _layer(name) or ("", name)
        yield f"blk.{index}.{table[rest]}", _np(tensor)


def _attention_table(*, bias: bool = False) -> dict[str, str]:
    table = {f"{hf}.weight": f"{g}.weight" for hf, g in _ATTENTION.items()}
    if bias:
        table.update({f"{hf}.bias": f"{g}.bias" for hf, g in _ATTENTION.items()})
    return table


def _stack_experts(tensors: dict[str, Tensor], pattern: str, parts: Mapping[str, str],
                   count: int) -> Iterator[tuple[str, np.ndarray]]:
    """Per-expert tensors (``pattern`` with {i}, {e}, {part}) stacked [E, rows, cols] per layer and
    part, as the converters' ``modify_tensors`` merge them; removed from ``tensors``."""
    layers = sorted({int(_layer(n)[0]) for n in tensors if _layer(n) and ".experts." in n})  # type: ignore[index]
    for i in layers:
        for part, gguf_part in parts.items():
            names = [pattern.format(i=i, e=e, part=part) for e in range(count)]
            yield f"blk.{i}.{gguf_part}", np.stack([_np(tensors.pop(n)) for n in names])


# -- MiniMax-M2 --------------------------------------------------------------------------------------


def _minimax(hp: Mapping[str, Any], tensors: dict[str, Tensor]) -> tuple[str, dict[str, Any], Iterator[Any]]:
    """``MiniMaxM2Model``: TextModel's keys plus ``expert_feed_forward_length`` and
    ``rope.dimension_count`` (``rotary_dim``); the w1/w3/w2 experts stacked as gate/up/down."""
    meta = _base_metadata(hp)
    meta.update({"expert_feed_forward_length": hp["intermediate_size"], "rope.dimension_count": hp["rotary_dim"]})
    table = {**_attention_table(), "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
             "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"}

    def generate() -> Iterator[tuple[str, np.ndarray]]:
        yield from _stack_experts(tensors, "model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight",
                                  {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight",
                                   "w3": "ffn_up_exps.weight"}, hp["num_local_experts"])
        yield from _renamed(tensors, table)

    return "minimax-m2", meta, generate()


def _base_metadata(hp: Mapping[str, Any]) -> dict[str, Any]:
    """``TextModel.set_gguf_parameters`` for these configs (no rope scaling types but YaRN)."""
    rope = hp.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    meta: dict[str, Any] = {"block_count": hp["num_hidden_layers"], "context_length": hp["max_position_embeddings"],
                            "embedding_length": hp["hidden_size"], "feed_forward_length": hp["intermediate_size"],
                            "attention.head_count": hp["num_attention_heads"],
                            "attention.head_count_kv": hp["num_key_value_heads"]}
    if rope.get("rope_type") == "yarn":
        meta.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                     "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
                     "rope.scaling.yarn_beta_slow": float(rope["beta_slow"])})
    if rope.get("rope_theta") is not None:
        meta["rope.freq_base"] = float(rope["rope_theta"])
    local = (hp.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        meta["rope.freq_base_swa"] = float(local)
    meta["attention.layer_norm_rms_epsilon"] = float(hp["rms_norm_eps"])
    experts = hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")
    if experts is not None:
        meta["expert_count"] = experts
    used = hp.get("num_experts_per_tok") or hp.get("top_k_experts")
    if used is not None:
        meta["expert_used_count"] = used
    if hp.get("head_dim") is not None:
        meta["attention.key_length"] = meta["attention.value_length"] = hp["head_dim"]
    return meta


# -- gpt-oss -----------------------------------------------------------------------------------------


def _gpt_oss(hp: Mapping[str, Any], tensors: dict[str, Tensor]) -> tuple[str, dict[str, Any], Iterator[Any]]:
    """``GptOssModel``: TextModel's keys plus ``attention.sliding_window`` and
    ``expert_feed_forward_length``; sinks as ``attn_sinks.weight``; the experts split into gate
    (even columns of gate_up) and up (odd), stored [E, I, hidden], down transposed to [E, hidden, I];
    MXFP4 experts (``*_blocks`` / ``*_scales``) repacked into ggml MXFP4 blocks."""
    meta = _base_metadata(hp)
    meta.update({"attention.sliding_window": hp["sliding_window"],
                 "expert_feed_forward_length": hp["intermediate_size"]})
    table = {**_attention_table(bias=True), "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"}

    def generate() -> Iterator[tuple[str, Any]]:
        for name in sorted(tensors):
            split = _layer(name)
            if split is None or ".experts." not in name or name not in tensors:
                continue
            i, rest = split
            value = tensors.pop(name)
            if rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2I]
                rows = value.transpose(1, 2)
                yield f"blk.{i}.ffn_gate_exps.weight", _np(rows[:, ::2])
                yield f"blk.{i}.ffn_up_exps.weight", _np(rows[:, 1::2])
            elif rest == "mlp.experts.gate_up_proj_bias":
                yield f"blk.{i}.ffn_gate_exps.bias", _np(value[..., ::2])
                yield f"blk.{i}.ffn_up_exps.bias", _np(value[..., 1::2])
            elif rest == "mlp.experts.down_proj":
                yield f"blk.{i}.ffn_down_exps.weight", _np(value.transpose(1, 2))
            elif rest == "mlp.experts.down_proj_bias":
                yield f"blk.{i}.ffn_down_exps.bias", _np(value)
            elif rest == "mlp.experts.gate_up_proj_blocks":
                scales = tensors.pop(name.replace("_blocks", "_scales"))
                yield f"blk.{i}.ffn_gate_exps.weight", (_ggml_mxfp4(value[:, ::2], scales[:, ::2]), Q.MXFP4)
                yield f"blk.{i}.ffn_up_exps.weight", (_ggml_mxfp4(value[:, 1::2], scales[:, 1::2]), Q.MXFP4)
            elif rest == "mlp.experts.down_proj_blocks":
                scales = tensors.pop(name.replace("_blocks", "_scales"))
                yield f"blk.{i}.ffn_down_exps.weight", (_ggml_mxfp4(value, scales), Q.MXFP4)
            else:
                raise KeyError(name)
        yield from _renamed(tensors, table)

    return "gpt-oss", meta, generate()


def _ggml_mxfp4(blocks: Tensor, scales: Tensor) -> np.ndarray:
    """OpenAI's MXFP4 ([..., groups, 16] bytes holding codes 2j (low nibble) and 2j + 1 (high), an
    E8M0 scale per group) as ggml's MXFP4 blocks: the scale byte, then 16 bytes whose byte j holds
    code j (low nibble) and code j + 16 (high); [..., groups * 17] bytes."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., groups, 32], in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales.unsqueeze(-1), packed), dim=-1)
    return out.flatten(-2).contiguous().numpy()


# -- MiMo-V2-Flash -----------------------------------------------------------------------------------

_MIMO_NEXTN = 3  # MimoV2Model writes three multi-token-prediction blocks into block_count


def _mimo_hub_config(hp: Mapping[str, Any]) -> dict[str, Any]:
    """The released ``config.json`` spelling of a transformers 5 MiMo-V2-Flash config (what
    llama.cpp's converter reads: ``hybrid_layer_pattern``, ``swa_*``, ``layernorm_epsilon``, one
    ``partial_rotary_factor``); ``sliding_window`` is the attended positions, as in transformers 5."""
    rope = hp["rope_parameters"]
    factors = {rope[kind]["partial_rotary_factor"] for kind in ("full_attention", "sliding_attention")}
    assert len(factors) == 1, "a GGUF carries one rotary share for both layer kinds"
    pattern = [int(t == "sliding_attention") for t in hp["layer_types"]]
    return {"architectures": ["MiMoV2FlashForCausalLM"], "vocab_size": hp["vocab_size"],
            "hidden_size": hp["hidden_size"], "intermediate_size": hp["intermediate_size"],
            "moe_intermediate_size": hp["moe_intermediate_size"], "num_hidden_layers": hp["num_hidden_layers"],
            "num_attention_heads": hp["num_attention_heads"], "num_key_value_heads": hp["num_key_value_heads"],
            "head_dim": hp["head_dim"], "v_head_dim": hp["v_head_dim"],
            "swa_num_attention_heads": hp["num_attention_heads"],
            "swa_num_key_value_heads": 2 * hp["num_key_value_heads"], "swa_head_dim": hp["head_dim"],
            "swa_v_head_dim": hp["v_head_dim"], "hybrid_layer_pattern": pattern,
            "moe_layer_freq": [int(t == "sparse") for t in hp["mlp_layer_types"]],
            "sliding_window": hp["sliding_window"], "partial_rotary_factor": factors.pop(),
            "rope_theta": rope["full_attention"]["rope_theta"],
            "swa_rope_theta": rope["sliding_attention"]["rope_theta"], "layernorm_epsilon": hp["rms_norm_eps"],
            "attention_value_scale": hp["attention_value_scale"], "n_routed_experts": hp["n_routed_experts"],
            "num_experts_per_tok": hp["num_experts_per_tok"], "n_group": hp["n_group"],
            "topk_group": hp["topk_group"], "routed_scaling_factor": None, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "norm_topk_prob": True,
            "max_position_embeddings": hp["max_position_embeddings"], "tie_word_embeddings": False,
            "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False}


def _mimo(hp: Mapping[str, Any], tensors: dict[str, Tensor]) -> tuple[str, dict[str, Any], Iterator[Any]]:
    """``MimoV2Model`` on the hub config (`_mimo_hub_config`): block_count and the per-layer arrays
    extended by the MTP blocks (sliding), ``value_length`` = ``v_head_dim``, one
    ``rope.dimension_count``, ``attention.value_scale``, ``nextn_predict_layers``; no
    ``expert_weights_scale``."""
    hub = _mimo_hub_config(hp)
    pattern = hub["hybrid_layer_pattern"] + [1] * _MIMO_NEXTN
    meta: dict[str, Any] = {
        "block_count": hub["num_hidden_layers"] + _MIMO_NEXTN, "context_length": hub["max_position_embeddings"],
        "embedding_length": hub["hidden_size"], "feed_forward_length": hub["intermediate_size"],
        "attention.head_count": hub["num_attention_heads"],
        "attention.head_count_kv": [hub["swa_num_key_value_heads"] if s else hub["num_key_value_heads"]
                                    for s in pattern],
        "rope.freq_base": float(hub["rope_theta"]), "rope.freq_base_swa": float(hub["swa_rope_theta"]),
        "expert_count": hub["n_routed_experts"], "expert_used_count": hub["num_experts_per_tok"],
        "expert_group_count": hub["n_group"], "expert_group_used_count": hub["topk_group"],
        "expert_gating_func": 2, "attention.key_length": hub["head_dim"],
        "attention.value_length": hub["v_head_dim"], "attention.sliding_window": hub["sliding_window"],
        "attention.sliding_window_pattern": pattern, "expert_feed_forward_length": hub["moe_intermediate_size"],
        "rope.dimension_count": int(hub["head_dim"] * hub["partial_rotary_factor"]),
        "attention.layer_norm_rms_epsilon": float(hub["layernorm_epsilon"]),
        "attention.value_scale": float(hub["attention_value_scale"]), "nextn_predict_layers": _MIMO_NEXTN}
    table = {**_attention_table(), "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.attention_sink_bias": "attn_sinks.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}

    def generate() -> Iterator[tuple[str, np.ndarray]]:
        yield from _stack_experts(tensors, "model.layers.{i}.mlp.experts.{e}.{part}.weight",
                                  {p: f"ffn_{p.split('_')[0]}_exps.weight" for p in ("gate_proj", "up_proj", "down_proj")},
                                  hub["n_routed_experts"])
        yield from _renamed(tensors, table)

    return "mimo2", meta, generate()


# -- Gemma 4 -----------------------------------------------------------------------------------------


def _gemma4(hp: Mapping[str, Any], tensors: dict[str, Tensor]) -> tuple[str, dict[str, Any], Iterator[Any]]:
    """``Gemma4Model`` (on ``Gemma3Model``): the norms as stored (no + 1), per-layer-type head dims
    (``key_length`` global, ``key_length_swa``), a per-layer ``head_count_kv`` when the global layers
    have their own kv heads, a per-layer ``feed_forward_length`` with double-wide MLPs, the global
    proportional RoPE as ``rope_freqs`` (1 rotated, 1e30 not), the router and expert scales as
    ``.scale`` tensors."""
    sliding = [t == "sliding_attention" for t in hp["layer_types"]]
    full = hp["rope_parameters"]["full_attention"]
    assert "factor" not in full, "llama.cpp's converter drops proportional RoPE's factor"
    per_layer = hp.get("per_layer_config") or {}
    full_idx = str(sliding.index(False))
    head_full = hp.get("global_head_dim") or per_layer[full_idx]["head_dim"]
    kv_full = hp.get("num_global_key_value_heads") or per_layer.get(full_idx, {}).get("num_key_value_heads")
    meta = _base_metadata(hp)
    meta["rope.freq_base"] = float(full["rope_theta"])
    if hp.get("final_logit_softcapping"):
        meta["final_logit_softcapping"] = float(hp["final_logit_softcapping"])
    meta["attention.sliding_window"] = hp["sliding_window"]
    shared = hp["num_kv_shared_layers"]
    meta.update({"attention.shared_kv_layers": shared,
                 "embedding_length_per_layer_input": hp.get("hidden_size_per_layer_input") or 0,
                 "attention.sliding_window_pattern": sliding, "attention.key_length": head_full,
                 "attention.value_length": head_full, "attention.key_length_swa": hp["head_dim"],
                 "attention.value_length_swa": hp["head_dim"]})
    if hp.get("moe_intermediate_size") is not None:
        meta["expert_feed_forward_length"] = hp["moe_intermediate_size"]
    layers = hp["num_hidden_layers"]
    if hp.get("use_double_wide_mlp"):
        meta["feed_forward_length"] = [hp["intermediate_size"] * (1 if i < layers - shared else 2)
                                       for i in range(layers)]
    if kv_full is not None:
        meta["attention.head_count_kv"] = [hp["num_key_value_heads"] if s else kv_full for s in sliding]
    meta.update({"rope.dimension_count": head_full, "rope.dimension_count_swa": hp["head_dim"]})
    rotated = int(head_full * full["partial_rotary_factor"] / 2)
    table = {**_attention_table(), "input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "pre_feedforward_layernorm.weight": "ffn_norm.weight",
             "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
             "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
             "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
             "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
             "layer_scalar": "layer_output_scale.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
             "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
             "experts.down_proj": "ffn_down_exps.weight", "per_layer_input_gate.weight": "inp_gate.weight",
             "per_layer_projection.weight": "proj.weight", "post_per_layer_input_norm.weight": "post_norm.weight"}
    extra_global = {"model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}

    def generate() -> Iterator[tuple[str, np.ndarray]]:
        yield "rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (head_full // 2 - rotated), dtype=np.float32)
        for name in list(tensors):
            if name in extra_global:
                yield extra_global[name], _np(tensors.pop(name))
        yield from _renamed(tensors, table)

    return "gemma4", meta, generate()


# -- the models --------------------------------------------------------------------------------------

Converter = Callable[[Mapping[str, Any], dict[str, Tensor]], tuple[str, dict[str, Any], Iterator[Any]]]


def _model(case: str) -> torch.nn.Module:
    """The reference model of a case: a family's parity-test model, as a GGUF can describe it."""
    if case.startswith("gpt-oss"):
        from tests.parity import test_gpt_oss_parity as t

        rope = {**t.YARN, "truncate": True}  # llama.cpp's YaRN rounds the correction range
        return t._tiny_hf_model("yarn", rope_parameters=rope)
    if case.startswith("minimax"):
        from tests.parity import test_minimax_m2_parity as m

        return m._tiny_hf_model("partial")
    if case.startswith("mimo"):
        from tests.parity import test_mimo_v2_flash_parity as mi

        share = {"rope_type": "default", "partial_rotary_factor": 0.5}
        return mi._tiny_hf_model(routed_scaling_factor=1.0, rope_parameters={
            "full_attention": {**share, "rope_theta": 50000.0}, "sliding_attention": {**share, "rope_theta": 1000.0}})
    from tests.parity import test_gemma4_parity as g

    variant = case.split("-")[1]
    config = g._hf_config(variant)
    config.rope_parameters["full_attention"].pop("factor", None)  # the converter does not write it
    return g._tiny_hf_model(variant, config)


_CONVERTERS: dict[str, Converter] = {"gpt-oss": _gpt_oss, "minimax": _minimax, "mimo": _mimo, "gemma4": _gemma4}


def _family(case: str) -> str:
    return next(f for f in _CONVERTERS if case == f or case.startswith(f"{f}-"))


def _saved(case: str, root: Path) -> torch.nn.Module:
    """The reference model saved under ``root`` as its checkpoint is (for ``-mxfp4``: experts as
    OpenAI's MXFP4 blocks, the reference holding their values), with a tokenizer of VOCAB tokens."""
    model = _model(case)
    model.save_pretrained(root, safe_serialization=True)
    write_byte_tokenizer(root)
    # the converters count the vocabulary (Gemma crops its embedding to it): all VOCAB tokens
    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    (root / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                     "added_tokens": []}))
    if case.endswith("-mxfp4"):
        _mxfp4_experts(model, root)
    if case.endswith("-bf16"):  # the reference holds what a BF16 file stores
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 and "gate.weight" not in name:
                    p.copy_(p.to(torch.bfloat16).float())
    return model


def _mxfp4_experts(model: torch.nn.Module, root: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(root / "model.safetensors")
    cfg = model.config
    generator = torch.Generator().manual_seed(5)
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator, dtype=torch.uint8)
                scales = torch.randint(123, 126, (experts, rows, cols // 32), generator=generator, dtype=torch.uint8)
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                name = f"model.layers.{i}.mlp.experts.{proj}"
                del state[name]
                state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (root / "config.json").write_text(json.dumps(config))


def _convert(case: str, root: Path, path: Path, hf_model: torch.nn.Module) -> None:
    """``root``'s checkpoint as llama.cpp's converter writes it (this module's writers)."""
    tensors = dict(load_file(root / "model.safetensors"))
    hp = hf_model.config.to_dict()
    arch, meta, generated = _CONVERTERS[_family(case)](hp, tensors)
    _write(path, arch, meta, generated, Q.BF16 if case.endswith("-bf16") else Q.F32)


def _check_loads_at_parity(path: Path, hf_model: torch.nn.Module, arch: str) -> float:
    checkpoint = load_checkpoint(path, torch.float32)
    assert checkpoint.architecture.name == arch
    model = checkpoint.architecture.build(checkpoint.config, BuildOptions(dtype=torch.float32))
    model.load_weights(checkpoint.weights)  # the checkpoint's own forms, as the runtime loads them
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)),
                                         DenseAttention.for_model(model)))
    expected = hf_logits(hf_model, PROMPT)
    diff = (got - expected).abs().max().item()
    print(f"{path.name}: max abs logit diff {diff:.3g} (max |logit| {expected.abs().max():.3g})")
    assert expected.abs().max().item() > 1.0
    assert diff < FP32_TOLERANCE
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([PROMPT[:6]]), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False)[0, 6:].tolist()
    assert len(want) == 32
    assert greedy_generate(model, PROMPT[:6], max_new_tokens=32) == want
    return diff


_ARCH = {"gpt-oss": "gpt_oss", "minimax": "minimax_m2", "mimo": "mimo_v2_flash", "gemma4": "gemma4"}
CASES = ["gpt-oss", "gpt-oss-mxfp4", "minimax", "minimax-bf16", "mimo", "gemma4-ple", "gemma4-moe"]


@pytest.mark.parametrize("case", CASES)
def test_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    hf_model = _saved(case, tmp_path / "hf")
    path = tmp_path / f"tiny-{case}.gguf"
    _convert(case, tmp_path / "hf", path, hf_model)
    if case.endswith("-mxfp4"):
        from helios.loaders.gguf_loader import GGUFFile

        assert GGUFFile(path).tensor_types["blk.0.ffn_gate_exps.weight"] == Q.MXFP4
    _check_loads_at_parity(path, hf_model, _ARCH[_family(case)])


def test_gguf_configs_say_what_transformers_does(tmp_path: Path) -> None:
    """What the GGUF configs recover that the files only imply: gpt-oss's layer pattern (llama.cpp's
    default), MiMo's per-kind kv heads past the MTP blocks, Gemma 4's k = v global layers, KV
    sharing, double-wide MLPs and the rotary share of its proportional RoPE."""
    from helios.models.gemma4 import Gemma4Config
    from helios.models.mimo_v2_flash import MiMoV2FlashConfig

    configs = {}
    for case in ("gpt-oss", "mimo", "gemma4-ple", "gemma4-moe"):
        hf_model = _saved(case, tmp_path / case)
        _convert(case, tmp_path / case, tmp_path / f"{case}.gguf", hf_model)
        configs[case] = (load_checkpoint(tmp_path / f"{case}.gguf", torch.float32).config, hf_model.config)
    gpt, hf = configs["gpt-oss"]
    assert gpt.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types)  # type: ignore[attr-defined]
    mimo, hf = configs["mimo"]
    assert isinstance(mimo, MiMoV2FlashConfig) and mimo.num_layers == hf.num_hidden_layers
    assert (mimo.num_kv_heads, mimo.sliding_kv_heads) == (hf.num_key_value_heads, 2 * hf.num_key_value_heads)
    ple, hf = configs["gemma4-ple"]
    assert isinstance(ple, Gemma4Config) and ple.double_wide_mlp and ple.kv_source == (None, None, 0, 1)
    assert ple.rope_global.partial == hf.rope_parameters["full_attention"]["partial_rotary_factor"]
    moe, hf = configs["gemma4-moe"]
    assert isinstance(moe, Gemma4Config) and moe.k_eq_v
    assert moe.global_kv_heads == hf.to_dict()["per_layer_config"]["1"]["num_key_value_heads"]
    assert moe.num_experts == hf.num_experts


# -- llama.cpp's own converter ------------------------------------------------------------------------

_LLAMA_CPP = Path(os.environ.get("HELIOS_PEERS", "~/.cache/helios-peers")).expanduser() / "llama-src/vendor/llama.cpp"

_RUNNER = '''
import sys
tree, model_dir, out, outtype, *flags = sys.argv[1:]
sys.path.insert(0, tree)
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", outtype, *flags]
import convert_hf_to_gguf as conv
import gguf

def stand_in_vocab(self):  # the converters' tokenizer checks know no test tokenizer
    n = int(self.hparams["vocab_size"])
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([])

find = conv.get_model_class
conv.get_model_class = lambda *a, **k: (lambda cls: type(cls.__name__, (cls,), {
    "set_vocab": stand_in_vocab, "model_arch": cls.model_arch}))(find(*a, **k))
conv.main()
'''


def _tensors_of(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), bytes(np.asarray(t.data).tobytes()))
            for t in reader.tensors}


def _metadata_of(path: Path, arch: str) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}


@pytest.mark.skipif(not (_LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter is not at {_LLAMA_CPP} (set HELIOS_PEERS)")
@pytest.mark.parametrize("case", CASES)
def test_real_converter_writes_the_same_file(tmp_path: Path, case: str) -> None:
    hf_model = _saved(case, tmp_path / "hf")
    if case.startswith("mimo"):
        # The converter reads the released config spelling; without a model_type transformers 5's
        # AutoConfig (which would rewrite it into its own keys) fails and the converter reads the
        # file itself, as it does for the release with an older transformers.
        (tmp_path / "hf" / "config.json").write_text(json.dumps(_mimo_hub_config(hf_model.config.to_dict())))
    theirs = tmp_path / "llama-cpp.gguf"
    outtype = "bf16" if case.endswith("-bf16") else "f32"
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(_LLAMA_CPP), str(tmp_path / "hf"), str(theirs), outtype],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ours = tmp_path / "ours.gguf"
    _convert(case, tmp_path / "hf", ours, hf_model)
    got, want = _tensors_of(ours), _tensors_of(theirs)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name][:2] == want[name][:2], name
        assert got[name][2] == want[name][2], f"{name}: bytes differ"
    arch = str(gguf.GGUFReader(str(theirs)).fields["general.architecture"].contents())
    ours_meta, theirs_meta = _metadata_of(ours, arch), _metadata_of(theirs, arch)
    assert sorted(ours_meta) == sorted(theirs_meta)
    for key, value in theirs_meta.items():
        assert ours_meta[key] == pytest.approx(value), key
    _check_loads_at_parity(theirs, hf_model, _ARCH[_family(case)])
