"""`helios models` and `helios serve NAME`'s catalog handling, in process (no server starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helios import cli
from helios.loaders import catalog


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "models"
    monkeypatch.setenv("HELIOS_CACHE_DIR", str(directory))
    monkeypatch.delenv("HELIOS_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return directory


def test_models_lists_the_catalog_and_the_cache(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache.mkdir()
    qwen = catalog.CATALOG["qwen2.5-coder:0.5b"]
    with (cache / qwen.file_name).open("wb") as fh:
        fh.truncate(qwen.size)  # sparse, the right size: cached
    (cache / catalog.CATALOG["gemma3:270m"].file_name).write_bytes(b"GGUF")  # wrong size: not cached
    (cache / "mine.gguf").write_bytes(b"GGUF" * 1000)
    (cache / ".SmolLM2-135M-Instruct.Q4_1.gguf.123.partial").write_bytes(b"GG")
    (cache / "packed").mkdir()
    (cache / "packed" / "x.bin").write_bytes(b"0" * 2000)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "CACHED", "PATH"]
    rows = {line.split()[0]: line for line in out[1:5]}
    assert list(rows) == list(catalog.names())
    assert "(default)" in rows["smollm2:135m"] and "98.4 MB" in rows["smollm2:135m"]
    assert rows["qwen2.5-coder:0.5b"].split()[-2:] == ["yes", str(cache / qwen.file_name)]
    assert rows["gemma3:270m"].split()[-2] == "no"
    assert rows["qwen2.5-coder:1.5b"].split()[1:4] == ["1.1", "GB", "no"]
    assert out[5] == ""
    assert out[6].startswith(f"cache {cache}: 5 entries")
    listing = "\n".join(out[7:])
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" in listing and "491.4 MB  qwen2.5-coder:0.5b" in listing
    assert "gemma3:270m (wrong size)" in listing
    assert "mine.gguf" in listing and "not in the catalog" in listing
    assert "a download in progress or interrupted" in listing
    assert "packed/" in listing and "packed-weight cache" in listing


def test_models_with_an_empty_cache(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"cache {cache}: empty" in out and out.count(" no ") == 4


def test_serve_unknown_name_is_one_line_listing_the_known_names(cache: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "llama:7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("helios: unknown model 'llama:7b'")
    assert all(name in err for name in catalog.names())
    assert not cache.exists()  # nothing fetched


def test_serve_a_catalog_name_fetches_it_before_serving(cache: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def ensure_entry(entry: catalog.CatalogEntry, *_: object, **__: object) -> Path:
        asked.append(entry.name)
        raise RuntimeError("no network")

    monkeypatch.setattr(catalog, "ensure_entry", ensure_entry)
    assert cli.main(["serve", "gemma3:270m"]) == 1
    assert asked == ["gemma3:270m"]
    assert capsys.readouterr().err.strip() == "helios: cannot fetch gemma3:270m: no network"


def test_serve_config_path_may_be_a_catalog_name(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "helios.toml"
    config.write_text('[model]\npath = "qwen2.5-coder:9b"\n')
    assert cli.main(["serve", "--config", str(config)]) == 2
    assert "unknown model 'qwen2.5-coder:9b'" in capsys.readouterr().err
