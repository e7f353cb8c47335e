"""Packaging metadata: the license in PEP 639's SPDX form, so setuptools builds without the
deprecation warning that the TOML-table form draws (it stops being accepted on 2027-02-18)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_expression_and_setuptools_reads_it() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", ()))  # PEP 639: not both
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", req)
    assert match and int(match.group(1)) >= 77, req  # the first setuptools with the SPDX form
