"""A tiny random Idefics3 (SmolVLM) checkpoint in a Hugging Face folder, and a real Helios server on it.

The checkpoint is built with transformers (no hub): a 2-layer Llama text model and a 2-layer SigLIP
encoder (32-pixel tiles of 4-pixel patches, scale factor 2: 16 image tokens per tile, images resized
to at most 96 pixels on their longest edge), a byte-level tokenizer holding Idefics3's special tokens,
the processor's config files, and a ChatML-style chat template that renders an image block as
``<image>`` (as SmolVLM's own template does). The server is `HeliosApp` with the real
`runtime.build_runtime` on that folder, served by hypercorn's trio worker in a thread on a real socket.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helios.app import HeliosApp
from helios.config import (
    CacheSection,
    EngineSection,
    HeliosConfig,
    ModelConfigSection,
    ServerConfig,
    SpeculativeSection,
    VisionSection,
)
from tests.serving.harness import AppServer

SPECIAL = ["<|endoftext|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
VOCAB = 256 + len(SPECIAL)  # exactly the tokenizer: no id without text
TILE, LONGEST, SEQ_LEN = 32, 96, 16
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<image>{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_backend() -> Any:
    """A byte-level BPE tokenizer (one token per byte, no merges) holding Idefics3's special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    spelled = {b: chr(b) for b in keep}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={spelled[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return backend


def hf_processor() -> Any:
    """transformers' Idefics3 processor with the checkpoint's settings (the reference)."""
    transformers = pytest.importorskip("transformers")
    pil_idefics3 = pytest.importorskip("transformers.models.idefics3.image_processing_pil_idefics3")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer_backend())
    image_processor = pil_idefics3.Idefics3ImageProcessorPil(size={"longest_edge": LONGEST},
                                                             max_image_size={"longest_edge": TILE})
    return transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                          image_seq_len=SEQ_LEN)


def idefics3_config(vocab_size: int, image_token_id: int) -> Any:
    """The tiny Idefics3Config: a 2-layer Llama text model and a 2-layer SigLIP encoder (32-pixel
    tiles of 4-pixel patches), pixel-shuffle scale 2."""
    transformers = pytest.importorskip("transformers")
    return transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rms_norm_eps=1e-5),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           patch_size=4, image_size=TILE),
        scale_factor=2, image_token_id=image_token_id)


def randomize(model: torch.nn.Module, scale: float) -> None:
    """Seeded random weights: norm weights near 1, everything else of standard deviation ``scale``."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))


def build_checkpoint(root: Path) -> Path:
    """Write the tiny checkpoint into ``root`` (created) and return it."""
    transformers = pytest.importorskip("transformers")
    root.mkdir(parents=True, exist_ok=True)
    processor = hf_processor()
    tokenizer = processor.tokenizer
    model = transformers.Idefics3ForConditionalGeneration(
        idefics3_config(VOCAB, tokenizer.convert_tokens_to_ids("<image>")))
    randomize(model, 0.5)
    model.save_pretrained(root)
    processor.save_pretrained(root)
    tokenizer_backend().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE, "add_bos_token": False}))
    return root


def png(width: int, height: int, seed: int) -> bytes:
    """A noisy RGB PNG."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def serving_config(path: Path, *, chunk: int = 4096, vision: VisionSection | None = None,
                   max_model_len: int = 1024, speculative: str = "off") -> HeliosConfig:
    return HeliosConfig(
        speculative=SpeculativeSection(mode=speculative),
        server=ServerConfig(aliases=["vlm"], default_max_tokens=16, frontend_workers=2, access_log=False),
        model=ModelConfigSection(path=str(path), dtype="float32", weights="float32", weight_cache=False,
                                 max_model_len=max_model_len, threads=1),
        engine=EngineSection(page_size=16, kv_pages=256, prefill_chunk_size=chunk, max_active=8),
        cache=CacheSection(prefix_caching=True, host_memory_gib=0.0),
        vision=vision or VisionSection(),
    )


class VisionServer(AppServer):
    """HeliosApp with the real build_runtime, on a real socket (hypercorn's trio worker in a thread)."""

    def __init__(self, config: HeliosConfig) -> None:
        super().__init__(HeliosApp(config), "vision")

    @property
    def core(self) -> Any:
        return self.app.runtime.core

    @property
    def tower(self) -> Any:
        return self.app.runtime.vision
