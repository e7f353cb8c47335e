"""A GGUF reader: metadata decoded to Python values, tensor data memory-mapped.

The ``gguf`` package's `GGUFReader` builds a numpy view for every part of every metadata field
(about 5 s for a vocabulary of 49k tokens and 49k merges); this reads the same header with
`struct` and `numpy.frombuffer` in well under 0.1 s. Tensor data is not read here: `GGUFTensorInfo`
says where each tensor's bytes are, and `GGUFContents.tensor_bytes` returns them as a uint8 tensor
over the memory map (no copy; the kernel pages the file in as it is read).

Format (version 2 and 3, little-endian): magic ``GGUF``, uint32 version, uint64 tensor count,
uint64 metadata count; metadata key/value pairs (string key, uint32 value type, value); tensor
infos (name, uint32 n_dims, uint64 dims innermost first, uint32 ggml type, uint64 offset); then,
aligned to ``general.alignment`` (32 by default), the tensor data.

With ``header_cache`` (a directory: the packed-weight cache's), the parsed header is kept there as
JSON (``<hash>.gguf-header.json``) and a later read takes it from there: about 0.06 s instead of
0.2-0.9 s for Qwen2.5's 152k tokens and 151k merges (decoding 300k strings one by one). The entry is
keyed by the file's identity (resolved path, size, modification time) and this module's source, its
body carries a SHA-256 checked on load, and the mapped file's own counts, version and size must
agree with it; a missing, stale, corrupt or disagreeing entry is a miss: the header is parsed from
the file (and a bad entry replaced), never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)

# ggml tensor types (ggml.h) and (elements per block, bytes per block) for the ones Helios knows by
# heart (the K-quant and Q5 ones too: importing the gguf package for them took 0.05-0.1 s of every
# start); `block_layout` asks the gguf package about any other.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
GGML_Q5_0, GGML_Q5_1, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 6, 7, 12, 13, 14
GGML_I32 = 26
_BLOCKS = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_I32: (1, 4), GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34),
           GGML_BF16: (1, 2), GGML_Q5_0: (32, 22), GGML_Q5_1: (32, 24), GGML_Q4_K: (256, 144),
           GGML_Q5_K: (256, 176), GGML_Q6_K: (256, 210)}

# Metadata value types: uint8, int8, uint16, int16, uint32, int32, float32, bool, string, array,
# uint64, int64, float64.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}


_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or it is truncated."""


@attrs.frozen
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first (numpy/torch order): [rows, cols] for a matrix
    ggml_type: int
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


@attrs.frozen(eq=False)
class GGUFContents:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _buffer: Any  # the mmap (kept open while any tensor view of it lives)

    def tensor_bytes(self, info: GGUFTensorInfo) -> Tensor:
        """The raw bytes of one tensor, a read-only uint8 view of the memory map (do not write to it)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
            return torch.frombuffer(self._buffer, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapping (``MADV_DONTNEED``: the mapping is
        read-only and file-backed, so a later read just faults the page in again from the page
        cache). Once the weights are built, the pages of tensors that were copied (fused projections,
        unpacked codes) would otherwise stay in the process's resident set beside their copies."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is not None and hasattr(self._buffer, "madvise"):
            try:
                self._buffer.madvise(advice)
            except (OSError, ValueError):
                pass


def read_gguf(path: str | Path, header_cache: str | Path | None = None) -> GGUFContents:
    """Parse the header of a GGUF file and map its tensor data; with ``header_cache`` (a
    directory), take the parsed header from there when a verified entry exists, and store it there
    otherwise."""
    path = Path(path)
    with path.open("rb") as fh:
        identity = _identity(path, os.fstat(fh.fileno()))
        try:
            buffer = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{path} is empty") from None
    cache = _HeaderCache(Path(header_cache), identity) if header_cache is not None else None
    if cache is not None:
        cached = cache.load(path, buffer)
        if cached is not None:
            return cached
    try:
        contents = _parse(path, buffer)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise GGUFFormatError(f"{path}: truncated or malformed GGUF header ({exc})") from None
    if cache is not None:
        cache.store(contents)
    return contents


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml tensor type."""
    known = _BLOCKS.get(ggml_type)
    if known is not None:
        return known
    import gguf  # only for the less common types

    try:
        return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)])  # type: ignore[return-value]
    except (KeyError, ValueError):
        raise GGUFFormatError(f"unknown ggml tensor type {ggml_type}") from None


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buf = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFFormatError("string runs past the end of the file")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (vocabularies and merges: the bulk of a GGUF header)."""
        buf, pos, end_of_file = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out = []
        for _ in range(count):
            (length,) = length_at(buf, pos)
            pos += 8
            if pos + length > end_of_file:
                raise GGUFFormatError("string runs past the end of the file")
            out.append(str(buf[pos:pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind == _STRING:
                return self.strings(count)
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind])
                array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += array.nbytes
                return [bool(v) for v in array] if item_kind == _BOOL else array.tolist()
            return [self.value(item_kind) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return self.unpack(fmt)


def _parse(path: Path, buffer: Any) -> GGUFContents:
    cursor = _Cursor(buffer)
    if len(buffer) < 24 or bytes(buffer[:4]) != b"GGUF":
        raise GGUFFormatError(f"{path} is not a GGUF file")
    cursor.pos = 4
    version, tensor_count, kv_count = cursor.unpack("<IQQ")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    raw_infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", buffer, cursor.pos)
        cursor.pos += 8 * n_dims
        ggml_type, offset = cursor.unpack("<IQ")
        raw_infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, offset in raw_infos:
        per_block, block_bytes = block_layout(ggml_type)
        elements = int(np.prod(shape)) if shape else 1
        if elements % per_block:
            raise GGUFFormatError(f"{path}: tensor {name} has {elements} elements, not whole blocks of {per_block}")
        nbytes = elements // per_block * block_bytes
        start = data_start + offset
        if start + nbytes > len(buffer):
            raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
    return GGUFContents(path, version, metadata, tensors, buffer)


_HEADER_TAG = "helios-gguf-header"
_HEADER_VERSION = 1


def _identity(path: Path, stat: os.stat_result) -> str:
    """What a header entry is for: the file (resolved path, size, mtime in ns) and the reader that
    parsed it (this module's source, so a change to how values are decoded is a miss)."""
    try:
        reader = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:
        reader = "unreadable"
    return "|".join([_HEADER_TAG, str(_HEADER_VERSION), reader, str(path.expanduser().resolve()),
                     str(stat.st_size), str(stat.st_mtime_ns)])


class _HeaderCache:
    """One GGUF file's header entry in ``directory``: a first line of JSON (format, key, SHA-256 of
    the rest), then the header as JSON (version, metadata, tensor infos)."""

    def __init__(self, directory: Path, key: str) -> None:
        self.key = key
        self.path = directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.gguf-header.json"

    def load(self, gguf_path: Path, buffer: Any) -> GGUFContents | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("GGUF header cache entry %s is unreadable (%s); parsing the file", self.path, exc)
            return None
        try:
            first, _, body = data.partition(b"\n")
            head = json.loads(first)
            if head.get("format") != _HEADER_TAG or head.get("key") != self.key:
                return self._discard("written for another file or reader")
            if head.get("sha256") != hashlib.sha256(body).hexdigest():
                return self._discard("corrupt (checksum mismatch)")
            header = json.loads(body)
            version, metadata = int(header["version"]), header["metadata"]
            tensors = {name: GGUFTensorInfo(name, tuple(int(d) for d in shape), int(kind), int(offset), int(nbytes))
                       for name, shape, kind, offset, nbytes in header["tensors"]}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self._discard(f"malformed ({exc})")
        if not isinstance(metadata, dict):
            return self._discard("malformed (metadata is not an object)")
        # The mapped file must agree with the entry (the key already covers its size and mtime).
        if len(buffer) < 24 or bytes(buffer[:4]) != b"GGUF" \
                or struct.unpack_from("<IQQ", buffer, 4) != (version, len(tensors), len(metadata)) \
                or any(info.offset + info.nbytes > len(buffer) for info in tensors.values()):
            return self._discard("does not match the file")
        return GGUFContents(gguf_path, version, metadata, tensors, buffer)

    def store(self, contents: GGUFContents) -> None:
        """Write the entry (atomically: a temporary file renamed into place), only when its JSON
        gives back exactly these values (a NaN, say, would not compare equal: not cached). The cache
        is an optimisation: a failure to write is logged, nothing more."""
        header = {"version": contents.version, "metadata": contents.metadata,
                  "tensors": [[i.name, list(i.shape), i.ggml_type, i.offset, i.nbytes]
                              for i in contents.tensors.values()]}
        try:
            body = json.dumps(header, ensure_ascii=False).encode("utf-8")
            exact = json.loads(body)["metadata"] == contents.metadata
        except (TypeError, ValueError):
            exact = False
        if not exact:
            log.info("GGUF header of %s not cached: its values do not survive JSON", contents.path)
            return
        head = json.dumps({"format": _HEADER_TAG, "key": self.key, "sha256": hashlib.sha256(body).hexdigest()})
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with partial.open("wb") as fh:
                fh.write(head.encode("utf-8") + b"\n" + body)
            os.replace(partial, self.path)
        except OSError as exc:
            log.warning("could not write the GGUF header cache entry %s: %s", self.path, exc)
            _unlink(partial)

    def _discard(self, why: str) -> GGUFContents | None:
        log.warning("GGUF header cache entry %s is %s; parsing the file", self.path, why)
        _unlink(self.path)
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
