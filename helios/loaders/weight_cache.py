"""A disk cache of built model weights (packed int4, int8, dense copies), so a warm start skips the
conversion from the checkpoint.

One safetensors file per (checkpoint, weight format, activation dtype), under
``<model cache dir>/packed/``. The key covers the checkpoint's identity (resolved path, size and
modification time of the file, or of every file of a model directory), the format, the dtype, the
torch version and ATen CPU capability (the int4 layout is torch's own) and `LAYOUT_VERSION` (this
module's and the model's layout). The file name is a hash of the key; the key itself is stored in
the file and compared on load, and every tensor carries a CRC-32 of its bytes, checked on load. A
missing, unreadable, truncated or mismatching entry is a miss: the caller rebuilds the weights from
the checkpoint (a corrupt entry is deleted), never serves them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
MAX_DISK_SHARE = 0.5  # an entry is written only while it takes at most this share of the free space
_FORMAT_TAG = "helios-packed-weights"


@attrs.frozen
class CachedWeights:
    state: dict[str, Tensor]
    kinds: dict[str, str]
    path: Path


def checkpoint_identity(source: str | Path) -> str:
    """Resolved path, size and mtime (ns) of a checkpoint file, or of each file of a model directory."""
    path = Path(source).expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    parts = [str(path)]
    for file in files:
        stat = file.stat()
        parts.append(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def cache_key(source: str | Path, format_tag: str, dtype: torch.dtype) -> str:
    return "|".join([
        _FORMAT_TAG, str(LAYOUT_VERSION), checkpoint_identity(source), format_tag, str(dtype),
        torch.__version__, torch.backends.cpu.get_cpu_capability(),
    ])


class PackedWeightCache:
    """``load(key)`` -> `CachedWeights` or None (miss); ``store(key, state, kinds)`` writes an entry."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path_for(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def load(self, key: str) -> CachedWeights | None:
        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            state, metadata = _read(path)
        except (OSError, SafetensorError, ValueError) as exc:
            return self._discard(path, f"unreadable ({exc})")
        if metadata.get("key") != key:
            return self._discard(path, "written for another checkpoint or format")
        try:
            crcs = json.loads(metadata["crc32"])
            kinds = json.loads(metadata["kinds"])
        except (KeyError, ValueError) as exc:
            return self._discard(path, f"bad metadata ({exc})")
        if set(crcs) != set(state):
            return self._discard(path, "tensor list does not match its checksums")
        for name, tensor in state.items():
            if _crc32(tensor) != crcs[name]:
                return self._discard(path, f"checksum mismatch in {name}")
        return CachedWeights(state, kinds, path)

    def store(self, key: str, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> Path | None:
        """Write an entry (atomically: a temporary file renamed into place). Returns its path, or None
        when the directory is not writable (the cache is an optimisation: failures are logged)."""
        path = self.path_for(key)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tensors = {name: t.detach().contiguous().cpu() for name, t in state.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
        except OSError as exc:
            log.warning("packed-weight cache directory %s is not usable: %s", self.directory, exc)
            return None
        if size > free * MAX_DISK_SHARE:
            log.info("packed weights (%.0f MiB) not cached: %s has %.0f MiB free", size / 2**20, self.directory,
                     free / 2**20)
            return None
        metadata = {"key": key, "kinds": json.dumps(dict(kinds), sort_keys=True),
                    "crc32": json.dumps({name: _crc32(t) for name, t in tensors.items()}, sort_keys=True)}
        try:
            save_file(tensors, str(partial), metadata=metadata)
            os.replace(partial, path)
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            log.warning("could not write the packed-weight cache entry %s: %s", path, exc)
            partial.unlink(missing_ok=True)
            return None
        return path

    def _discard(self, path: Path, why: str) -> CachedWeights | None:
        """Log and delete a bad entry; the caller rebuilds (returns None, the miss)."""
        log.warning("packed-weight cache entry %s is %s; rebuilding from the checkpoint", path, why)
        path.unlink(missing_ok=True)
        return None


ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment, which its packed-weight kernels assume


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The entry's tensors, each in its own 64-byte-aligned allocation.

    safetensors aligns tensor data in the file to 8 bytes only, and the tensors it returns can sit at
    those offsets; torch's CPU int8/int4 weight-only kernels (``_weight_int8pack_mm``,
    ``_weight_int4pack_mm_for_cpu``) read their operands with aligned vector loads and crash on such a
    pointer, so a misaligned tensor is copied once here."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = dict(handle.metadata() or {})
    tensors = load_file(str(path))
    return {name: t if t.data_ptr() % ALIGNMENT == 0 else t.clone() for name, t in tensors.items()}, metadata


def _crc32(tensor: Tensor) -> int:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.data)
