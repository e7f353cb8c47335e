"""DeepSeek V4 (transformers 5.24 ``deepseek_v4``: sliding-window + compressed sparse / heavily
compressed attention, hyper-connections, hash-routed MoE) is not implemented: a checkpoint's
config must be refused with one line, never served by the DeepSeek-V3 code
(docs/architecture.md, "DeepSeek V4: not supported")."""

from __future__ import annotations

import pytest

from helios.models import registry
from helios.models.architecture import UnsupportedArchitecture

transformers = pytest.importorskip("transformers")


def test_deepseek_v4_config_is_refused_in_one_line() -> None:
    cfg = transformers.DeepseekV4Config(vocab_size=272, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention"])
    config = cfg.to_dict()
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    with pytest.raises(UnsupportedArchitecture, match=r"^unsupported architecture 'deepseek_v4'") as info:
        registry.for_hf_config(config)
    assert "\n" not in str(info.value)
