"""Idefics3 / SmolVLM model family: configuration reading, geometry of SmolVLM-256M, weight-name checks.

The numerics against transformers are in tests/parity/test_idefics3_parity.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from PIL import Image

from helios.models.vision.base import PreparedImage
from helios.models.vision.idefics3 import Idefics3Tower, Idefics3VisionSpec
from helios.models.vision.idefics3_processor import Idefics3ImageSettings
from helios.models.vision.registry import load_vision_tower

SMOLVLM_CONFIG: dict[str, Any] = {
    "model_type": "idefics3", "scale_factor": 4, "image_token_id": 49190, "text_config": {"hidden_size": 576},
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "patch_size": 16, "image_size": 512},
}
SMOLVLM_PREPROCESSOR: dict[str, Any] = {"max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048},
                                        "resample": 1, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
TINY_CONFIG: dict[str, Any] = {
    "model_type": "idefics3", "scale_factor": 2, "image_token_id": 7, "text_config": {"hidden_size": 16},
    "vision_config": {"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "patch_size": 4, "image_size": 16},
}
TINY_PREPROCESSOR: dict[str, Any] = {"max_image_size": {"longest_edge": 16}, "size": {"longest_edge": 32}}


def test_smolvlm_256m_geometry() -> None:
    spec = Idefics3VisionSpec.from_hf(SMOLVLM_CONFIG, SMOLVLM_PREPROCESSOR, {"image_seq_len": 64})
    assert spec.patches_per_tile == 1024 and spec.image.image_seq_len == 64
    from helios.models.vision.idefics3 import Idefics3Profile

    profile = Idefics3Profile(spec)
    assert profile.max_image_tokens_per_image == 17 * 64
    square = profile.cost(512, 512)  # scaled up to 2048 x 2048 first
    assert (square.tokens, square.patches, square.grid) == (17 * 64, 17 * 1024, (4, 4))
    landscape = profile.cost(1024, 768)
    assert (landscape.tokens, landscape.grid) == (13 * 64, (3, 4))
    assert landscape.prompt_text.count("<image>") == landscape.tokens
    assert landscape.prompt_text.startswith("<fake_token_around_image><row_1_col_1><image>")
    assert landscape.prompt_text.endswith("\n\n<fake_token_around_image><global-img>" + "<image>" * 64
                                          + "<fake_token_around_image>")


def test_image_seq_len_is_derived_or_checked() -> None:
    derived = Idefics3VisionSpec.from_hf(SMOLVLM_CONFIG, SMOLVLM_PREPROCESSOR, {})
    assert derived.image.image_seq_len == 64
    with pytest.raises(ValueError, match="image_seq_len 81"):
        Idefics3VisionSpec.from_hf(SMOLVLM_CONFIG, SMOLVLM_PREPROCESSOR, {"image_seq_len": 81})
    with pytest.raises(ValueError, match="image_token_id"):
        Idefics3VisionSpec.from_hf({k: v for k, v in SMOLVLM_CONFIG.items() if k != "image_token_id"},
                                   SMOLVLM_PREPROCESSOR)
    with pytest.raises(ValueError, match="only longest_edge"):
        Idefics3ImageSettings.from_json({"size": {"height": 10, "width": 10}})


def test_settings_key_follows_every_setting() -> None:
    base = Idefics3ImageSettings()
    keys = {base.key()} | {Idefics3ImageSettings(**{**{"tile_size": 364}, name: value}).key() for name, value in
                           [("resample", 3), ("do_image_splitting", False), ("longest_edge", 1000),
                            ("image_mean", (0.4, 0.5, 0.5)), ("rescale_factor", 0.5)]}
    assert len(keys) == 6


def _tiny_weights(tower: Idefics3Tower) -> dict[str, torch.Tensor]:
    vc = tower.spec.vision
    d, inter = vc.hidden_size, vc.intermediate_size
    w: dict[str, torch.Tensor] = {
        "model.vision_model.embeddings.patch_embedding.weight": torch.randn(d, 3, 4, 4),
        "model.vision_model.embeddings.patch_embedding.bias": torch.randn(d),
        "model.vision_model.embeddings.position_embedding.weight": torch.randn(16, d),
        "model.vision_model.post_layernorm.weight": torch.ones(d),
        "model.vision_model.post_layernorm.bias": torch.zeros(d),
        "model.connector.modality_projection.proj.weight": torch.randn(16, 4 * d),
    }
    base = "model.vision_model.encoder.layers.0."
    for part in ("q_proj", "k_proj", "v_proj", "out_proj"):
        w[f"{base}self_attn.{part}.weight"] = torch.randn(d, d)
        w[f"{base}self_attn.{part}.bias"] = torch.randn(d)
    for norm in ("layer_norm1", "layer_norm2"):
        w[f"{base}{norm}.weight"], w[f"{base}{norm}.bias"] = torch.ones(d), torch.zeros(d)
    w[f"{base}mlp.fc1.weight"], w[f"{base}mlp.fc1.bias"] = torch.randn(inter, d), torch.randn(inter)
    w[f"{base}mlp.fc2.weight"], w[f"{base}mlp.fc2.bias"] = torch.randn(d, inter), torch.randn(d)
    return w


def test_tower_weights_and_encode_shapes() -> None:
    spec = Idefics3VisionSpec.from_hf(TINY_CONFIG, TINY_PREPROCESSOR)
    weights = _tiny_weights(Idefics3Tower(spec))
    tower = load_vision_tower("idefics3", TINY_CONFIG, TINY_PREPROCESSOR, {}, weights, dtype=torch.bfloat16)
    assert tower.image_token_id == 7
    image = Image.new("RGB", (40, 20), (200, 10, 10))
    prepared = tower.prepare(image)
    assert isinstance(prepared, PreparedImage)
    assert prepared.nbytes == prepared.pixel_values.nbytes + prepared.pixel_attention_mask.nbytes
    features = tower.encode(prepared)
    assert features.dtype == torch.bfloat16
    assert features.shape == (tower.profile.cost(40, 20).tokens, 16)
    with pytest.raises(ValueError, match="missing vision weight"):
        Idefics3Tower(spec).load_weights({k: v for k, v in weights.items() if "fc2.bias" not in k})
    with pytest.raises(ValueError, match="unexpected vision weights"):
        Idefics3Tower(spec).load_weights({**weights, "model.vision_model.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="expected shape"):
        Idefics3Tower(spec).load_weights({**weights, "model.vision_model.post_layernorm.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown vision family"):
        load_vision_tower("qwen2_5_vl", TINY_CONFIG, TINY_PREPROCESSOR, {}, weights)


def test_hf_folder_splits_text_and_vision_weights(tmp_path: Any) -> None:
    """A SmolVLM folder: text_config (with the outer tie_word_embeddings) is the Llama config, the
    text weights lose their ``model.text_model.`` prefix, the rest is the vision side."""
    import json

    import tokenizers
    from safetensors.torch import save_file

    from helios.loaders.checkpoint import load_checkpoint

    config = {**TINY_CONFIG, "model_type": "smolvlm", "architectures": ["SmolVLMForConditionalGeneration"],
              "tie_word_embeddings": True,
              "text_config": {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 12,
                              "tie_word_embeddings": False}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    spec = Idefics3VisionSpec.from_hf(TINY_CONFIG, TINY_PREPROCESSOR)
    weights = _tiny_weights(Idefics3Tower(spec))
    text = {"model.text_model.embed_tokens.weight": torch.randn(12, 16), "model.text_model.norm.weight": torch.ones(16)}
    save_file({**weights, **text}, str(tmp_path / "model.safetensors"))
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    backend.add_special_tokens([tokenizers.AddedToken("<image>", special=True, normalized=False)])
    backend.save(str(tmp_path / "tokenizer.json"))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.tie_word_embeddings and ckpt.config.hidden_size == 16 and ckpt.config.arch == "llama"
    assert set(ckpt.tensors) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert ckpt.vision is not None and ckpt.vision.family == "idefics3"
    assert set(ckpt.vision.tensors) == set(weights)
    assert ckpt.vision.processor == {"image_seq_len": 4}
    tower = load_vision_tower(ckpt.vision.family, ckpt.vision.config, ckpt.vision.preprocessor,
                              ckpt.vision.processor, ckpt.vision.tensors)
    assert tower.profile.cost(16, 16).tokens == (2 * 2 + 1) * 4  # scaled up to 32 px: 2 x 2 tiles + global
