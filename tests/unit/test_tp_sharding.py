"""What one tensor-parallel rank loads (`helios.models.tp`): the sharded config, the rows and columns
`ShardedWeights` cuts per Hugging Face name, the vocabulary and token shares. No process group: the
collectives are exercised by tests/parity/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.models.config import ModelConfig
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoEConfig
from helios.models.quant import GroupQuantized
from helios.models.tp import ParallelContext, ShardedWeights, check_divisible, shard_config

LLAMA = ModelConfig(arch="qwen2", vocab_size=11, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=2, attention_bias=True)
MOE = MoEConfig(arch="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=2, moe_layers=(False, True),
                router=RouterSpec(num_experts=4, top_k=2), moe_intermediate_size=4, qk_norm=True)


def _numbered(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def test_shard_config_divides_heads_and_widths() -> None:
    cfg = shard_config(LLAMA, ParallelContext(1, 2))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim) == (2, 1, 3, 2)
    assert cfg.vocab_size == 11  # the embedding stays whole
    moe = shard_config(MOE, ParallelContext(0, 2))
    assert (moe.moe_intermediate_size, moe.router.num_experts) == (2, 4)
    ep = shard_config(MOE, ParallelContext(0, 2, expert_parallel=True))
    assert ep.moe_intermediate_size == 4  # whole experts, split by count instead


def test_refusals_name_the_counts() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide 4 query heads / 2 KV heads"):
        check_divisible(LLAMA, ParallelContext(0, 4))
    with pytest.raises(ValueError, match="does not divide intermediate_size 6"):
        check_divisible(attrs_evolve(LLAMA, num_heads=4, num_kv_heads=4), ParallelContext(0, 4))


def attrs_evolve(cfg: ModelConfig, **changes: int) -> ModelConfig:
    import attrs

    return attrs.evolve(cfg, **changes)


def test_rank_one_of_two_cuts_its_rows_and_columns() -> None:
    tensors = {
        "model.embed_tokens.weight": _numbered(11, 8),
        "lm_head.weight": _numbered(11, 8),
        "model.layers.0.self_attn.q_proj.weight": _numbered(8, 8),
        "model.layers.0.self_attn.q_proj.bias": _numbered(8),
        "model.layers.0.self_attn.k_proj.weight": _numbered(4, 8),
        "model.layers.0.self_attn.v_proj.bias": _numbered(4),
        "model.layers.0.self_attn.o_proj.weight": _numbered(8, 8),
        "model.layers.0.mlp.gate_proj.weight": _numbered(6, 8),
        "model.layers.0.mlp.down_proj.weight": _numbered(8, 6),
        "model.layers.0.input_layernorm.weight": _numbered(8),
    }
    shard = ShardedWeights(tensors, LLAMA, ParallelContext(1, 2))
    assert set(shard) == set(tensors)
    assert torch.equal(shard["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.q_proj.weight"][4:])
    assert torch.equal(shard["model.layers.0.self_attn.q_proj.bias"], tensors["model.layers.0.self_attn.q_proj.bias"][4:])
    assert torch.equal(shard["model.layers.0.self_attn.k_proj.weight"], tensors["model.layers.0.self_attn.k_proj.weight"][2:])
    assert torch.equal(shard["model.layers.0.self_attn.v_proj.bias"], tensors["model.layers.0.self_attn.v_proj.bias"][2:])
    assert torch.equal(shard["model.layers.0.self_attn.o_proj.weight"],
                       tensors["model.layers.0.self_attn.o_proj.weight"][:, 4:])
    assert torch.equal(shard["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.gate_proj.weight"][3:])
    assert torch.equal(shard["model.layers.0.mlp.down_proj.weight"],
                       tensors["model.layers.0.mlp.down_proj.weight"][:, 3:])
    # The vocabulary: ceil(11 / 2) = 6 rows a rank, rank 1 the last 5.
    assert ParallelContext(1, 2).vocab_range(11) == (6, 11, 6)
    assert torch.equal(shard["lm_head.weight"], tensors["lm_head.weight"][6:])
    assert shard["model.embed_tokens.weight"] is tensors["model.embed_tokens.weight"]
    assert shard["model.layers.0.input_layernorm.weight"] is tensors["model.layers.0.input_layernorm.weight"]
    assert shard["model.layers.0.self_attn.o_proj.weight"].is_contiguous()


def test_experts_split_by_columns_or_by_count() -> None:
    names = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    tensors = {n: (_numbered(8, 4) if "down" in n else _numbered(4, 8)) for n in names}
    tensors["model.layers.1.mlp.gate.weight"] = _numbered(4, 8)
    tp = ShardedWeights(tensors, MOE, ParallelContext(1, 2))
    assert len(tp) == len(tensors)
    assert torch.equal(tp["model.layers.1.mlp.experts.0.up_proj.weight"], _numbered(4, 8)[2:])
    assert torch.equal(tp["model.layers.1.mlp.experts.3.down_proj.weight"], _numbered(8, 4)[:, 2:])
    assert tp["model.layers.1.mlp.gate.weight"] is tensors["model.layers.1.mlp.gate.weight"]
    ep = ShardedWeights(tensors, MOE, ParallelContext(1, 2, expert_parallel=True))
    assert sorted({n.split(".")[5] for n in ep if ".experts." in n}) == ["2", "3"]
    assert ep["model.layers.1.mlp.experts.2.gate_proj.weight"] is tensors["model.layers.1.mlp.experts.2.gate_proj.weight"]
    with pytest.raises(KeyError):
        ep["model.layers.1.mlp.experts.0.gate_proj.weight"]


def test_quantized_sources_are_dequantized_then_cut() -> None:
    """A GGUF source (here Q4_0-style codes) of a sharded tensor: its dequantized rows (shards are
    dense); a replicated one is handed over as it is (the model dequantizes it as with one rank)."""
    codes = GroupQuantized((torch.arange(8 * 32) % 16).to(torch.uint8).reshape(8, 32), torch.rand(8, 1),
                           torch.zeros(8, 1), 4)
    tensors = {"model.layers.0.self_attn.q_proj.weight": codes, "model.layers.0.input_layernorm.weight": codes}
    shard = ShardedWeights(tensors, LLAMA, ParallelContext(1, 2))
    assert torch.equal(shard["model.layers.0.self_attn.q_proj.weight"], codes.dequantize()[4:])
    assert shard["model.layers.0.input_layernorm.weight"] is codes


def test_token_and_expert_shares() -> None:
    assert [ParallelContext(r, 2).token_range(1) for r in range(2)] == [(0, 0), (0, 1)]
    assert [ParallelContext(r, 2).token_range(5) for r in range(2)] == [(0, 2), (2, 5)]
    assert ParallelContext(1, 2, expert_parallel=True).expert_range(8) == (4, 8)
    assert ParallelContext(1, 2).expert_range(8) == (0, 8)


def test_parallel_section_and_torchrun_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[parallel]`` parses with plain messages for bad values; under torchrun WORLD_SIZE is the size,
    and a configured size must agree with it."""
    from helios.config import ConfigError, load_config
    from helios.runtime import parallel_world

    monkeypatch.delenv("HELIOS_CONFIG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert load_config().parallel.tensor_parallel_size == 1
    path = tmp_path / "h.toml"
    path.write_text("[parallel]\ntensor_parallel_size = 2\nexpert_parallel = true\n")
    cfg = load_config(path)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel, cfg.parallel.backend) == (2, True, "auto")
    assert parallel_world(cfg) == 2
    for text, message in (("tensor_parallel_size = true", "a positive integer"),
                          ("tensor_parallel_size = 0", "a positive integer"),
                          ('expert_parallel = "yes"', "true or false"),
                          ('backend = "mpi"', "one of auto, gloo, nccl")):
        path.write_text(f"[parallel]\n{text}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parallel_world(load_config()) == 4
    path.write_text("[parallel]\ntensor_parallel_size = 2\n")
    with pytest.raises(ConfigError, match="torchrun started 4 processes"):
        parallel_world(load_config(path))
