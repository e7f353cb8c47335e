"""Idefics3 / SmolVLM against transformers: the image processor bit for bit, the prompt expansion and
image cost, and the numerics (encoder, connector, merged embeddings, logits) on random tiny weights.

The tiny model is built here (no hub): an ``Idefics3Config`` with a 2-layer Llama text model and a
2-layer SigLIP encoder (32-pixel tiles of 4-pixel patches, scale factor 2: 16 tokens per tile), saved
with ``save_pretrained`` next to a byte-level tokenizer holding Idefics3's special tokens and the
processor's config files, then loaded back through `helios.runtime.load_model`. The processor checks
also run with the real SmolVLM-256M-Instruct settings (512-pixel tiles, longest edge 2048, Lanczos).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from helios.models.dense_attention import DenseAttention
from helios.models.vision.base import PreparedImage
from helios.models.vision.idefics3 import Idefics3Tower
from helios.models.vision.idefics3_processor import Idefics3ImageProcessor, Idefics3ImageSettings
from helios.runtime import LoadedModel, load_model
from tests.numerics import FP32_TOLERANCE
from tests.serving.tiny_vlm import LONGEST, SEQ_LEN, TILE, idefics3_config, randomize, tokenizer_backend

transformers = pytest.importorskip("transformers")
pil_idefics3 = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")

VOCAB = 300  # a few ids past the tokenizer's 297
SMOLVLM = dict(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, resample=1)


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise (so resampling filters see both), in ``mode``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 1, height)[:, None, None]
    x = torch.linspace(0, 1, width)[None, :, None]
    channels = [x, y, x * y, 1 - x * y * 0.6]  # the alpha channel fades towards a corner
    base = torch.cat([c.expand(height, width, 1) for c in channels], dim=2) * 200
    noise = torch.randint(0, 56, (height, width, 4), generator=g)
    rgba = Image.fromarray((base + noise).clamp(0, 255).to(torch.uint8).numpy(), "RGBA")
    return rgba if mode == "RGBA" else rgba.convert(mode)


def _palette_with_transparency() -> Image.Image:
    image = _image(45, 30, "P", seed=3)
    image.info["transparency"] = 7
    return image


# (name, image) pairs: sizes and aspect ratios, tiny and large ones, and the modes converted to RGB.
IMAGES: list[tuple[str, Any]] = [
    ("square-512", lambda: _image(512, 512)),
    ("landscape-1024x768-rgba", lambda: _image(1024, 768, "RGBA", 1)),
    ("portrait-333x517-cmyk", lambda: _image(333, 517, "CMYK", 2)),
    ("tiny-1x1", lambda: _image(1, 1)),
    ("tiny-37x5-l", lambda: _image(37, 5, "L", 4)),
    ("thin-700x3000-p", lambda: _image(700, 3000, "P", 5)),
    ("wide-5000x300-la", lambda: _image(5000, 300, "LA", 6)),
    ("large-2500x1900", lambda: _image(2500, 1900, seed=7)),
    ("palette-transparency", _palette_with_transparency),
    ("odd-513x511-i", lambda: _image(513, 511, "I", 8)),
]


def _reference(image: Image.Image, **kwargs: Any) -> Any:
    processor = pil_idefics3.Idefics3ImageProcessorPil(**kwargs)
    return processor(images=[image], return_tensors="pt", return_row_col_info=True)


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
@pytest.mark.parametrize("name,make", IMAGES, ids=[name for name, _ in IMAGES])
def test_processor_bit_exact_smolvlm_settings(name: str, make: Any, split: bool) -> None:
    image = make()
    ref = _reference(image, **SMOLVLM, do_image_splitting=split)
    ours = Idefics3ImageProcessor(Idefics3ImageSettings(longest_edge=2048, tile_size=512, image_seq_len=64,
                                                        do_image_splitting=split)).prepare(image)
    assert torch.equal(ref["pixel_values"][0], ours.pixel_values)
    assert torch.equal(ref["pixel_attention_mask"][0].bool(), ours.pixel_attention_mask)
    assert (ref["rows"][0][0], ref["cols"][0][0]) == (ours.rows, ours.cols)


@pytest.mark.parametrize("kwargs", [
    dict(resample=3, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711]),
    dict(resample=2, do_normalize=False),
    dict(do_rescale=False, do_normalize=False),
    dict(do_resize=False),
], ids=["bicubic-clip-mean", "bilinear-no-normalize", "raw", "no-resize"])
def test_processor_bit_exact_other_settings(kwargs: dict[str, Any]) -> None:
    full = {"size": {"longest_edge": LONGEST}, "max_image_size": {"longest_edge": TILE}, **kwargs}
    settings = Idefics3ImageSettings.from_json(full, {"image_seq_len": SEQ_LEN})
    for seed, (w, h) in enumerate([(70, 45), (20, 100), (32, 32), (129, 8)]):
        image = _image(w, h, "RGBA", seed)
        ref = _reference(image, **full)
        ours = Idefics3ImageProcessor(settings).prepare(image)
        assert torch.equal(ref["pixel_values"][0].float(), ours.pixel_values), (w, h)
        assert (ref["rows"][0][0], ref["cols"][0][0]) == (ours.rows, ours.cols)


def _processor(seq_len: int, **image_kwargs: Any) -> Any:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer_backend())
    image_processor = pil_idefics3.Idefics3ImageProcessorPil(**image_kwargs)
    return transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len)


@pytest.mark.parametrize("split", [True, False], ids=["split", "nosplit"])
def test_prompt_text_and_cost_match_the_processor(split: bool) -> None:
    """The expansion of one ``<image>`` and the token count, from the size alone, for SmolVLM's
    geometry: what transformers' processor substitutes and counts after processing the image."""
    processor = _processor(64, **SMOLVLM, do_image_splitting=split)
    ours = Idefics3ImageProcessor(Idefics3ImageSettings(longest_edge=2048, tile_size=512, image_seq_len=64,
                                                        do_image_splitting=split))
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    for w, h in [(512, 512), (1024, 768), (37, 5), (700, 3000), (5000, 300), (1, 1), (640, 480)]:
        image = _image(w, h)
        inputs = processor.image_processor(images=[[image]], return_row_col_info=True)
        expected_text = processor.replace_image_token(inputs, 0)
        cost = ours.cost(w, h, patches_per_tile=1024)
        assert cost.prompt_text == expected_text, (w, h)
        encoded = processor(text="hi <image>", images=[image])
        assert cost.tokens == encoded["input_ids"][0].count(image_token), (w, h)
        assert cost.grid == (inputs["rows"][0][0], inputs["cols"][0][0])
        assert cost.patches == (cost.tokens // 64) * 1024


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 400), st.booleans())
def test_geometry_matches_the_processor(width: int, height: int, split: bool) -> None:
    """The grid computed from the size alone equals the one the processor makes (small geometry)."""
    kwargs = {"size": {"longest_edge": LONGEST}, "max_image_size": {"longest_edge": TILE},
              "do_image_splitting": split}
    ref = _reference(Image.new("RGB", (width, height), (10, 20, 30)), **kwargs)
    plan = Idefics3ImageProcessor(Idefics3ImageSettings.from_json(kwargs, {"image_seq_len": SEQ_LEN})) \
        .plan(width, height)
    assert (plan.rows, plan.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    assert plan.tiles == ref["pixel_values"].shape[1]


# --- the tiny model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, LoadedModel]:
    root = tmp_path_factory.mktemp("idefics3")
    processor = _processor(SEQ_LEN, size={"longest_edge": LONGEST}, max_image_size={"longest_edge": TILE})
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    hf_model = transformers.Idefics3ForConditionalGeneration(idefics3_config(VOCAB, image_token_id))
    randomize(hf_model, 0.15)
    hf_model.eval()
    hf_model.save_pretrained(root)
    processor.save_pretrained(root)
    tokenizer_backend().save(str(root / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": template, "add_bos_token": False}))
    loaded = load_model(root, weights="float32", dtype="float32")
    return hf_model, processor, loaded


def _tower(loaded: LoadedModel) -> Idefics3Tower:
    assert isinstance(loaded.vision, Idefics3Tower)
    return loaded.vision


def test_loading(tiny: tuple[Any, Any, LoadedModel]) -> None:
    hf_model, processor, loaded = tiny
    tower = _tower(loaded)
    assert loaded.checkpoint.vision is not None and loaded.checkpoint.vision.family == "idefics3"
    assert loaded.checkpoint.config.vocab_size == VOCAB and loaded.checkpoint.config.num_layers == 2
    assert tower.image_token_id == hf_model.config.image_token_id
    assert loaded.checkpoint.tokenizer.token_to_id("<image>") == tower.image_token_id
    assert tower.profile.spec.image == Idefics3ImageSettings(longest_edge=LONGEST, tile_size=TILE,
                                                             image_seq_len=SEQ_LEN)
    assert tower.profile.max_image_tokens_per_image == (3 * 3 + 1) * SEQ_LEN
    assert tower.profile.image_token == "<image>"
    # Helios's own tokenizer reads the expansion as transformers does: one id per <image>, the
    # framing tokens as their special ids.
    for w, h in [(96, 64), (10, 10)]:
        cost = tower.profile.cost(w, h)
        ids = loaded.checkpoint.tokenizer.encode(cost.prompt_text, add_special_tokens=False)
        assert ids == processor.tokenizer(cost.prompt_text, add_special_tokens=False)["input_ids"]
        assert ids.count(tower.image_token_id) == cost.tokens


def test_encoder_connector_and_features(tiny: tuple[Any, Any, LoadedModel]) -> None:
    hf_model, processor, loaded = tiny
    tower = _tower(loaded)
    for seed, (w, h) in enumerate([(96, 64), (40, 40), (17, 90), (32, 32)]):
        image = _image(w, h, seed=seed)
        inputs = processor(text="<image>", images=[image], return_tensors="pt")
        prepared = tower.prepare(image)
        assert torch.equal(inputs["pixel_values"][0], prepared.pixel_values)
        pixels = inputs["pixel_values"][0]
        with torch.no_grad():
            patch_mask = torch.ones(pixels.shape[0], TILE // 4, TILE // 4, dtype=torch.bool)
            ref_states = hf_model.model.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask) \
                .last_hidden_state
            ref_connected = hf_model.model.connector(ref_states)
            ref_features = hf_model.model.get_image_features(
                inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
            states = tower.encode_patches(prepared)
            connected = tower.connect(ref_states)
            features = tower.encode(prepared)
        assert (states - ref_states).abs().max() < FP32_TOLERANCE
        assert (connected - ref_connected).abs().max() < FP32_TOLERANCE
        assert (features - ref_features).abs().max() < FP32_TOLERANCE
        cost = tower.profile.cost(w, h)
        assert features.shape == (cost.tokens, 64)
        assert cost.tokens == int((inputs["input_ids"][0] == tower.image_token_id).sum())


def test_padded_tiles(tiny: tuple[Any, Any, LoadedModel]) -> None:
    """Tiles whose real area is smaller than the tile (padding masked out, positions bucketed over
    the real area), as transformers batches images of different sizes."""
    hf_model, _, loaded = tiny
    tower = _tower(loaded)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(3, 3, TILE, TILE, generator=g)
    mask = torch.zeros(3, TILE, TILE, dtype=torch.bool)
    mask[0] = True
    mask[1, :20, :28] = True  # 5 x 7 patches
    mask[2, :9, :32] = True  # 3 x 8 patches (a partly real patch row counts)
    pixels = pixels * mask[:, None]
    prepared = PreparedImage(pixel_values=pixels, pixel_attention_mask=mask, rows=0, cols=0)
    with torch.no_grad():
        expected = hf_model.model.get_image_features(pixels[None], mask[None].long()).pooler_output[0]
        got = tower.encode(prepared)
    # Rows of padded patches attend over the real keys in both; every row is compared.
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < FP32_TOLERANCE


def _prompt(processor: Any, images: list[Image.Image]) -> Any:
    text = "Look:" + "".join(" <image> and" for _ in images) + " what?"
    return processor(text=text, images=images, return_tensors="pt")


@pytest.mark.parametrize("sizes", [[(96, 64)], [(40, 40), (17, 90)]], ids=["one-image", "two-images"])
def test_merged_embeddings_and_logits(tiny: tuple[Any, Any, LoadedModel], sizes: list[tuple[int, int]]) -> None:
    hf_model, processor, loaded = tiny
    tower, model = _tower(loaded), loaded.model
    images = [_image(w, h, seed=10 + i) for i, (w, h) in enumerate(sizes)]
    inputs = _prompt(processor, images)
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        features = torch.cat([tower.encode(tower.prepare(image)) for image in images])
        rows = (ids == tower.image_token_id).nonzero().flatten()
        assert rows.numel() == features.shape[0] == sum(tower.profile.cost(w, h).tokens for w, h in sizes)
        ref_embeds = hf_model.model.inputs_merger(
            inputs["input_ids"], hf_model.model.get_input_embeddings()(inputs["input_ids"]),
            hf_model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
            .pooler_output[0] if len(images) == 1 else torch.cat(list(hf_model.model.get_image_features(
                inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output)))[0]
        ours_embeds = model.embed_tokens[ids].index_copy(0, rows, features)
        assert (ours_embeds - ref_embeds).abs().max() < FP32_TOLERANCE
        expected = hf_model(**inputs).logits[0]
        hidden = model(ids, torch.arange(ids.numel()), DenseAttention.for_model(model), embeds=(rows, features))
        got = model.compute_logits(hidden)
        # Without the image features the logits differ: the image reaches the answer.
        plain = model.compute_logits(model(ids, torch.arange(ids.numel()), DenseAttention.for_model(model)))
    diff = float((got - expected).abs().max())
    print(f"{sizes}: {ids.numel()} tokens, max abs logit diff {diff:.3g}")
    assert diff < FP32_TOLERANCE
    assert float((plain[-1] - got[-1]).abs().max()) > 1e-3


def test_chunked_prefill_splits_an_image(tiny: tuple[Any, Any, LoadedModel]) -> None:
    """Feeding the prompt in chunks whose boundary falls inside the image's rows gives the same
    last logits: each chunk takes the feature rows of its own placeholder tokens."""
    _, processor, loaded = tiny
    tower, model = _tower(loaded), loaded.model
    image = _image(96, 64, seed=20)
    ids = _prompt(processor, [image])["input_ids"][0]
    with torch.no_grad():
        features = tower.encode(tower.prepare(image))
        rows = (ids == tower.image_token_id).nonzero().flatten()
        whole = model(ids, torch.arange(ids.numel()), DenseAttention.for_model(model), embeds=(rows, features))
        attn = DenseAttention.for_model(model)
        cut = int(rows[len(rows) // 2]) + 1
        parts = []
        for start, end in ((0, cut), (cut, ids.numel())):
            inside = (rows >= start) & (rows < end)
            parts.append(model(ids[start:end], torch.arange(start, end), attn,
                               embeds=(rows[inside] - start, features[inside])))
    assert (torch.cat(parts) - whole).abs().max() < FP32_TOLERANCE


def test_bfloat16_tower(tiny: tuple[Any, Any, LoadedModel]) -> None:
    """The tower in bfloat16 (what ``dtype = auto`` picks on AVX512-BF16 CPUs) stays within a few
    bf16 roundings of the float32 reference, relative to the features' magnitude."""
    from helios.models.vision.registry import load_vision_tower
    from tests.numerics import tolerance_for

    hf_model, processor, loaded = tiny
    v = loaded.checkpoint.vision
    tower = load_vision_tower(v.family, v.config, v.preprocessor, v.processor, v.tensors, dtype=torch.bfloat16)
    image = _image(96, 64, seed=30)
    inputs = processor(text="<image>", images=[image], return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]) \
            .pooler_output[0]
        got = tower.encode(tower.prepare(image))
    assert got.dtype == torch.bfloat16
    scale = float(expected.abs().max())
    diff = float((got.float() - expected).abs().max())
    print(f"bf16 features: max abs diff {diff:.3g} at scale {scale:.3g}")
    # Weights, pixels and every layer's output are rounded to bf16 (measured: ~2.3 roundings here).
    assert diff < tolerance_for(torch.bfloat16, scale, roundings=8)
