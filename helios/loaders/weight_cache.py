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
import struct
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
            state, metadata, computed = _read(path)
        except (OSError, SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            return self._discard(path, f"unreadable ({exc})")
        if metadata.get("key") != key:
            return self._discard(path, "written for another checkpoint or format")
        try:
            crcs = json.loads(metadata["crc32"])
            kinds = json.loads(metadata["kinds"])
        except (KeyError, ValueError) as exc:
            return self._discard(path, f"bad metadata ({exc})")
        try:
            aliases = json.loads(metadata.get("aliases", "{}"))
        except ValueError as exc:
            return self._discard(path, f"bad metadata ({exc})")
        if set(crcs) != set(state) or not all(isinstance(v, str) and v in state for v in aliases.values()):
            return self._discard(path, "tensor list does not match its checksums")
        for name, tensor in state.items():
            if (computed[name] if name in computed else _crc32(tensor)) != crcs[name]:
                return self._discard(path, f"checksum mismatch in {name}")
        for alias, name in aliases.items():  # tied weights: one tensor again, as it was stored
            state[alias] = state[name]
        return CachedWeights(state, kinds, path)

    def store(self, key: str, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> Path | None:
        """Write an entry (atomically: a temporary file renamed into place). Returns its path, or None
        when the directory is not writable (the cache is an optimisation: failures are logged)."""
        path = self.path_for(key)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tensors, aliases = _unaliased(state)
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
                    "crc32": json.dumps({name: _crc32(t) for name, t in tensors.items()}, sort_keys=True),
                    "aliases": json.dumps(aliases, sort_keys=True)}
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


def _unaliased(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors to write, each once, and the names that are the same tensor as a written one
    (tied weights: a model whose output head is its embedding keeps one tensor under both names;
    safetensors refuses to write shared memory twice). The cache gives the alias the same tensor back."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    for name, t in state.items():
        t = t.detach().cpu()
        identity = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        tensors[name] = t.contiguous()
    return tensors, aliases


ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment, which its packed-weight kernels assume


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str], dict[str, int]]:
    """The entry's tensors, each in its own 64-byte-aligned allocation, its metadata, and the
    CRC-32 of each tensor's bytes as read.

    safetensors aligns tensor data in the file to 8 bytes only, and the tensors it returns can sit at
    those offsets; torch's CPU int8/int4 weight-only kernels (``_weight_int8pack_mm``,
    ``_weight_int4pack_mm_for_cpu``) read their operands with aligned vector loads and crash on such a
    pointer. So each tensor is read from the file straight into a new (aligned) torch allocation, and
    its CRC taken while its bytes are fresh: one copy out of the page cache, instead of mapping the
    file and copying the misaligned tensors (almost all of them) out of the map (0.3-1.5 s for the
    471 MiB of Qwen2.5-0.5B's entry). A file of a dtype this does not know is read through
    safetensors (copied where misaligned; its CRCs computed by the caller)."""
    with path.open("rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        (header_len,) = struct.unpack("<Q", _read_exactly(fh, 8))
        if header_len > size - 8:
            raise ValueError("header runs past the end of the file")
        header = json.loads(_read_exactly(fh, header_len))
        metadata = {str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()}
        specs = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
        if sys.byteorder != "little" or any(spec["dtype"] not in _DTYPES for _, spec in specs):
            return (*_read_with_safetensors(path), {})
        base = 8 + header_len
        tensors: dict[str, Tensor] = {}
        crcs: dict[str, int] = {}
        for name, spec in specs:
            start, end = (int(x) for x in spec["data_offsets"])
            tensor = torch.empty([int(d) for d in spec["shape"]], dtype=_DTYPES[spec["dtype"]])
            nbytes = tensor.numel() * tensor.element_size()
            if end - start != nbytes or start < 0 or base + end > size:
                raise ValueError(f"tensor {name}: data offsets {start}..{end} do not fit its shape or the file")
            crc = 0
            if nbytes:
                view = tensor.view(-1).view(torch.uint8).numpy().data  # a writable memoryview of its bytes
                fh.seek(base + start)
                got = 0
                while got < nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise ValueError(f"tensor {name}: the file ends early")
                    got += n
                crc = zlib.crc32(view)
            crcs[name] = crc
            tensors[name] = tensor
    return tensors, metadata, crcs


def _read_exactly(fh: Any, count: int) -> bytes:
    data = fh.read(count)
    if len(data) != count:
        raise ValueError("the file ends early")
    return bytes(data)


def _read_with_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = dict(handle.metadata() or {})
    tensors = load_file(str(path))
    return {name: t if t.data_ptr() % ALIGNMENT == 0 else t.clone() for name, t in tensors.items()}, metadata


# safetensors dtype names -> torch dtypes (those `_read` reads itself).
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _crc32(tensor: Tensor) -> int:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.data)
