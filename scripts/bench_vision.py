"""Image preprocessing + vision encoder time per image on the CPU, SmolVLM-256M-Instruct geometry.

    .venv/bin/python scripts/bench_vision.py [--threads 2] [--dtype bfloat16] [--sizes 512x512,1024x768]

The tower is `helios.models.vision.idefics3.Idefics3Tower` with SmolVLM-256M-Instruct's shapes (SigLIP
base: 12 layers, hidden 768, 12 heads, MLP 3072, 16-pixel patches, 512-pixel tiles, pixel-shuffle
scale 4 -> 64 tokens per tile, text hidden 576) and the checkpoint's processor settings (longest edge
2048, Lanczos, splitting on). The weights are random: no model hub is reachable from this machine, and
the time of these dense kernels does not depend on the values. A 512x512 image is first scaled up to
2048x2048 by the processor, so it costs 4x4 tiles + the global view = 17 tiles (1088 tokens); a
1024x768 image 3x4 + 1 = 13 tiles (832 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.models.vision.base import PreparedImage
from helios.models.vision.idefics3 import Idefics3Tower, Idefics3VisionSpec
from helios.runtime import cpu_flags

SMOLVLM_256M_CONFIG = {
    "model_type": "idefics3", "scale_factor": 4, "image_token_id": 49190,
    "text_config": {"hidden_size": 576},
    "vision_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "patch_size": 16, "image_size": 512},
}
SMOLVLM_256M_PREPROCESSOR = {
    "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 512}, "resample": 1, "rescale_factor": 1 / 255,
    "size": {"longest_edge": 2048},
}


def _tower(dtype: torch.dtype) -> Idefics3Tower:
    spec = Idefics3VisionSpec.from_hf(SMOLVLM_256M_CONFIG, SMOLVLM_256M_PREPROCESSOR, {"image_seq_len": 64})
    tower = Idefics3Tower(spec, dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in tower.named_parameters():
            is_norm = "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.02 * torch.randn_like(param) if is_norm else 0.02 * torch.randn_like(param))
    return tower.eval()


def _image(width: int, height: int) -> Image.Image:
    g = torch.Generator().manual_seed(width * 7919 + height)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sizes", default="512x512,1024x768")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    tower = _tower(dtype)
    tower.encode(PreparedImage(  # warm-up: one tile through every kernel
        pixel_values=torch.zeros(1, 3, 512, 512), pixel_attention_mask=torch.ones(1, 512, 512, dtype=torch.bool),
        rows=0, cols=0))
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {args.threads}; {args.dtype}; "
          "random weights (SmolVLM-256M-Instruct geometry)")
    print("| image | tiles | tokens | preprocess ms | encoder + connector ms | total ms | ms per tile |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        image = _image(width, height)
        prep_times, enc_times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            prepared = tower.prepare(image)
            t1 = time.perf_counter()
            features = tower.encode(prepared)
            t2 = time.perf_counter()
            prep_times.append((t1 - t0) * 1e3)
            enc_times.append((t2 - t1) * 1e3)
        tiles = prepared.pixel_values.shape[0]
        prep, enc = statistics.median(prep_times), statistics.median(enc_times)
        print(f"| {width}x{height} | {tiles} | {features.shape[0]} | {prep:.0f} | {enc:.0f} | {prep + enc:.0f} | "
              f"{(prep + enc) / tiles:.0f} |")


if __name__ == "__main__":
    main()
