"""The architecture registry: lookups from a config.json and a GGUF header, the one-line errors for
architectures nobody registered (from both loaders), and a test-only architecture registered from
here that both loaders and `runtime.load_model` find and build."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.gguf_loader import GGUFFile
from helios.models import registry
from helios.models.config import ModelConfig
from helios.models.interface import AttentionContext, CacheSpec
from helios.models.llama import LlamaForCausalLM
from helios.models.registry import Architecture, BuildOptions, GGUFSource, GGUFTensor, UnsupportedArchitecture
from helios.runtime import load_model

LLAMA_CONFIG = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2}


# -- lookups -------------------------------------------------------------------------------------------


def test_builtin_entries() -> None:
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(registry.names())
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert registry.get(name).name == name


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_hf_model_type_lookup(model_type: str) -> None:
    arch = registry.for_hf_config({**LLAMA_CONFIG, "model_type": model_type})
    assert arch.name == model_type
    config = arch.parse_hf_config({**LLAMA_CONFIG, "model_type": model_type})
    assert isinstance(config, ModelConfig) and config.arch == model_type
    model = arch.build(config, BuildOptions())
    assert isinstance(model, LlamaForCausalLM) and model.vocab_size == 100


def test_hf_architectures_lookup() -> None:
    """A config.json whose model_type nobody knows is found by its ``architectures`` entry."""
    raw = {**LLAMA_CONFIG, "model_type": "my-finetune", "architectures": ["Qwen2ForCausalLM"]}
    arch = registry.for_hf_config(raw)
    assert arch.name == "qwen2"
    config = arch.parse_hf_config(raw)
    assert isinstance(config, ModelConfig) and config.arch == "qwen2" and config.attention_bias
    assert registry.for_hf_config({"architectures": ["MistralForCausalLM"]}).name == "mistral"


@pytest.mark.parametrize(("general", "name"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_lookup(general: str, name: str) -> None:
    assert registry.for_gguf(general).name == name


def test_llama_gguf_names_unpermute_only_llama_files() -> None:
    config = ModelConfig.from_hf_config({**LLAMA_CONFIG, "model_type": "llama"})
    llama, qwen2 = registry.get("llama"), registry.get("qwen2")
    assert llama.gguf_name(config, "blk.1.attn_q.weight") == GGUFTensor("model.layers.1.self_attn.q_proj.weight", 4)
    assert llama.gguf_name(config, "blk.1.attn_k.bias") == GGUFTensor("model.layers.1.self_attn.k_proj.bias", 2)
    assert llama.gguf_name(config, "blk.1.attn_v.weight") == GGUFTensor("model.layers.1.self_attn.v_proj.weight")
    assert llama.gguf_name(config, "rope_freqs.weight") is None
    assert qwen2.gguf_name(config, "blk.0.attn_q.weight") == GGUFTensor("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(NotImplementedError):
        llama.gguf_name(config, "blk.0.ffn_gate_exps.weight")


# -- unknown architectures: one line, naming the supported ones ---------------------------------------------


def test_unknown_hf_architecture_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "model_type": "foo",
                                                      "architectures": ["FooForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert message == ("unsupported architecture 'foo' (model_type 'foo', architectures FooForCausalLM); "
                       "supported: deepseek_v3, deepseek_v32, deepseek_v4, gemma3_text, gemma4_text, glm4_moe, glm_moe_dsa, gpt_oss, kimi_k2, kimi_linear, llama, mimo_v2_flash, minimax_m2, mistral, nemotron_h, qwen2, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next")
    assert isinstance(info.value, ValueError)


def test_unknown_gguf_architecture_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "foo.gguf"
    writer = gguf.GGUFWriter(str(path), "foo")
    writer.add_uint32("foo.block_count", 1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    assert message == ("unsupported architecture 'foo' (GGUF general.architecture); supported: "
                       "deepseek2, deepseek32, deepseek4, gemma3, gemma4, glm-dsa, glm4moe, gpt-oss, kimi-linear, llama, mimo2, minimax-m2, nemotron_h, nemotron_h_moe, qwen2, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next")


# -- a test-only architecture, registered from outside ---------------------------------------------------


@attrs.frozen(kw_only=True)
class BigramConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int = 64

    def projection_params(self) -> int:
        return 0


class BigramLM(nn.Module):
    """logits = head(embed(token)): no layers, nothing cached."""

    def __init__(self, config: BigramConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache_specs(self) -> Sequence[CacheSpec]:
        return ()

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        h = self.embed[input_ids]
        return h if keep is None else h.index_select(0, keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return (hidden @ self.head.t()).float()

    def decode_weight_bytes(self) -> int:
        return 0

    def load_weights(self, tensors: Mapping[str, Any]) -> None:
        assert set(tensors) == {"embed.weight", "head.weight"}, sorted(tensors)
        with torch.no_grad():
            self.embed.copy_(tensors["embed.weight"])
            self.head.copy_(tensors["head.weight"])

    def packed_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        return {"embed": self.embed.detach(), "head": self.head.detach()}, {}

    def load_packed_state(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None:
        with torch.no_grad():
            self.embed.copy_(state["embed"])
            self.head.copy_(state["head"])

    def pack_cpu_weights(self) -> int:
        return 0

    @property
    def head_format(self) -> str:
        return "float32"

    @property
    def head_bf16_rows(self) -> int | None:
        return None


def _bigram_from_hf(config: Mapping[str, Any]) -> BigramConfig:
    return BigramConfig(arch="bigram", vocab_size=int(config["vocab_size"]), hidden_size=int(config["dim"]))


def _bigram_from_gguf(source: GGUFSource) -> BigramConfig:
    meta = source.metadata
    return BigramConfig(arch="bigram", vocab_size=int(source.tensor_shapes["token_embd.weight"][0]),
                        hidden_size=int(meta["bigram.embedding_length"]))


_BIGRAM_GGUF_NAMES = {"token_embd.weight": "embed.weight", "output.weight": "head.weight"}


def _bigram_gguf_tensor(config: Any, gguf_name: str) -> GGUFTensor | None:
    if gguf_name not in _BIGRAM_GGUF_NAMES:
        raise NotImplementedError(gguf_name)
    return GGUFTensor(_BIGRAM_GGUF_NAMES[gguf_name])


def _build_bigram(config: Any, options: BuildOptions) -> BigramLM:
    assert isinstance(config, BigramConfig)
    return BigramLM(config, options.dtype)


BIGRAM = Architecture(name="bigram", hf_model_types=("bigram",), hf_architectures=("BigramLM",),
                      gguf_architectures=("bigram",), config_from_hf=_bigram_from_hf,
                      config_from_gguf=_bigram_from_gguf, gguf_tensor=_bigram_gguf_tensor, build=_build_bigram)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB, DIM = 256 + len(SPECIAL), 8


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((VOCAB, DIM)).astype(np.float32),
            rng.standard_normal((VOCAB, DIM)).astype(np.float32))


def _write_hf_directory(root: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "bigram", "vocab_size": VOCAB, "dim": DIM}))
    embed, head = _weights()
    save_file({"embed.weight": torch.from_numpy(embed), "head.weight": torch.from_numpy(head)},
              str(root / "model.safetensors"))
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    spelled = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={spelled[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return root


def _write_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "bigram")
    writer.add_uint32("bigram.embedding_length", DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([chr(0x100 + i) for i in range(256)] + list(SPECIAL))
    writer.add_token_types([1] * 256 + [3] * len(SPECIAL))
    writer.add_token_merges([])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 256)
    embed, head = _weights()
    writer.add_tensor("token_embd.weight", embed)
    writer.add_tensor("output.weight", head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def bigram() -> Any:
    with registry.registered(BIGRAM) as arch:
        yield arch
    assert "bigram" not in registry.names()


def test_registered_architecture_is_found_by_every_lookup(bigram: Architecture) -> None:
    assert "bigram" in registry.names() and registry.get("bigram") is bigram
    assert registry.for_hf_config({"model_type": "bigram"}) is bigram
    assert registry.for_hf_config({"model_type": "x", "architectures": ["BigramLM"]}) is bigram
    assert registry.for_gguf("bigram") is bigram
    with pytest.raises(UnsupportedArchitecture, match=r"supported: bigram, deepseek_v3, deepseek_v32, deepseek_v4, gemma3_text, gemma4_text, glm4_moe, glm_moe_dsa, gpt_oss, kimi_k2, kimi_linear, llama, mimo_v2_flash, minimax_m2, mistral, nemotron_h, qwen2, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next$"):
        registry.for_hf_config({"model_type": "foo"})


def test_registration_conflicts_and_removal(bigram: Architecture) -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(bigram)
    with pytest.raises(ValueError, match="which 'llama' already serves"):
        registry.register(attrs.evolve(bigram, name="other", hf_model_types=("llama",), hf_architectures=(),
                                       gguf_architectures=(), config_from_gguf=None, gguf_tensor=None))
    with pytest.raises(KeyError):
        registry.unregister("no-such-architecture")


def test_hf_directory_of_a_registered_architecture(tmp_path: Path, bigram: Architecture) -> None:
    ckpt = load_checkpoint(_write_hf_directory(tmp_path / "hf"))
    assert ckpt.architecture is bigram
    assert ckpt.config == BigramConfig(arch="bigram", vocab_size=VOCAB, hidden_size=DIM)
    assert set(ckpt.tensors) == {"embed.weight", "head.weight"}
    model = bigram.build(ckpt.config, BuildOptions())
    model.load_weights(ckpt.tensors)
    embed, head = _weights()
    assert torch.equal(model.embed, torch.from_numpy(embed)) and torch.equal(model.head, torch.from_numpy(head))


def test_gguf_of_a_registered_architecture(tmp_path: Path, bigram: Architecture) -> None:
    path = _write_gguf(tmp_path / "bigram.gguf")
    assert GGUFFile(path).architecture is bigram
    ckpt = load_checkpoint(path)
    assert ckpt.architecture is bigram
    assert ckpt.config == BigramConfig(arch="bigram", vocab_size=VOCAB, hidden_size=DIM)
    embed, head = _weights()
    assert torch.equal(ckpt.tensors["embed.weight"], torch.from_numpy(embed))
    assert torch.equal(ckpt.tensors["head.weight"], torch.from_numpy(head))


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_runtime_builds_a_registered_architecture(tmp_path: Path, bigram: Architecture, form: str) -> None:
    path = _write_hf_directory(tmp_path / "hf") if form == "hf" else _write_gguf(tmp_path / "bigram.gguf")
    loaded = load_model(path, weights="float32", dtype="float32", cache_dir=tmp_path / "packed")
    assert isinstance(loaded.model, BigramLM)
    embed, head = _weights()
    assert torch.equal(loaded.model.head, torch.from_numpy(head))
    again = load_model(path, weights="float32", dtype="float32", cache_dir=tmp_path / "packed")  # the cache entry
    assert isinstance(again.model, BigramLM) and torch.equal(again.model.embed, torch.from_numpy(embed))
