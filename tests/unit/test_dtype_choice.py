"""`dtype = "auto"` on both kinds of CPU: float32 without native bf16 (AVX2-only), bfloat16 with
AVX512-BF16 or AMX, and on CUDA. $HELIOS_CPU_CAPABILITY forces the detected capability, so every
case runs on any machine; the detector itself is checked against cpuinfo texts."""

from __future__ import annotations

import pytest
import torch

from helios.runtime import (
    CPU_CAPABILITIES,
    CPU_CAPABILITY_ENV,
    choose_dtype,
    cpu_capability,
    detect_cpu_capability,
)

EXPLICIT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_ON_CPU = {"avx2": torch.float32, "avx512_bf16": torch.bfloat16, "amx": torch.bfloat16}


def _cpuinfo(flags: str) -> str:
    core = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n"
    return "".join(core.format(n=n, flags=flags) for n in range(2))


def test_every_capability_has_an_auto_dtype() -> None:
    assert set(AUTO_ON_CPU) == set(CPU_CAPABILITIES)


@pytest.mark.parametrize(("capability", "expected"), sorted(AUTO_ON_CPU.items()))
def test_auto_on_cpu_follows_the_forced_capability(monkeypatch: pytest.MonkeyPatch, capability: str,
                                                   expected: torch.dtype) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    assert cpu_capability() == capability
    assert choose_dtype("auto", "cpu") == expected


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(monkeypatch: pytest.MonkeyPatch, capability: str,
                                                   device: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    assert choose_dtype("auto", device) == torch.bfloat16


@pytest.mark.parametrize("capability", CPU_CAPABILITIES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(EXPLICIT))
def test_explicit_dtypes_pass_through(monkeypatch: pytest.MonkeyPatch, capability: str, device: str,
                                      name: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, capability)
    assert choose_dtype(name, device) == EXPLICIT[name]


@pytest.mark.parametrize("value", ["avx512", "AVX2", "bf16", "sse4"])
def test_an_invalid_forced_capability_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                      value: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, value)
    with pytest.raises(ValueError, match=rf"HELIOS_CPU_CAPABILITY='{value}' is not one of avx2, avx512_bf16, amx"):
        choose_dtype("auto", "cpu")


def test_an_explicit_dtype_does_not_consult_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "bogus")
    assert choose_dtype("float32", "cpu") == torch.float32


def test_an_unknown_dtype_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        choose_dtype("fp8", "cpu")


@pytest.mark.parametrize("value", ["", "  "])
def test_unset_or_blank_means_detect(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(CPU_CAPABILITY_ENV, value)
    assert cpu_capability() == detect_cpu_capability()
    monkeypatch.delenv(CPU_CAPABILITY_ENV)
    assert cpu_capability() == detect_cpu_capability()
    assert detect_cpu_capability() in CPU_CAPABILITIES


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu sse2 avx avx2 fma", "avx2"),  # e.g. Zen 2, Skylake client
    ("avx2 avx512f avx512bw avx512vl avx512_vnni", "avx2"),  # AVX512 without BF16: Skylake-SP, Ice Lake
    ("avx2 avx512f avx512bw avx512_bf16", "avx512_bf16"),  # Cooper Lake, Zen 4
    ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "amx"),  # Sapphire Rapids
])
def test_detector_reads_cpuinfo_flags(flags: str, expected: str) -> None:
    assert detect_cpu_capability(_cpuinfo(flags)) == expected


def test_detector_reads_only_the_flags_line() -> None:
    text = "model name\t: avx512_bf16 amx_bf16 marketing name\nflags\t\t: sse2 avx2\nbugs\t\t: amx_bf16\n"
    assert detect_cpu_capability(text) == "avx2"
    assert detect_cpu_capability("") == "avx2"
    assert detect_cpu_capability("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n") == "avx2"  # aarch64
