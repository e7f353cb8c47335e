"""Vision-language model families: image preprocessing, vision encoders, connectors (`base.VisionTower`)."""
