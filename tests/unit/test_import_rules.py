"""Import rules that import-linter cannot state: what importing the ASGI app loads, and that the
package graph has no circles (also an `acyclic_siblings` contract in pyproject.toml, run by
`nox -s lint`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_app_imports_no_torch() -> None:
    """`import helios.app` stays cheap: torch loads with the runtime, in the lifespan."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", "import helios.app, sys; assert 'torch' not in sys.modules, 'torch imported'"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_helios_has_no_import_circles() -> None:
    """No module imports itself through others (imports inside functions count; TYPE_CHECKING-only
    ones do not), and no two top-level packages of helios import each other."""
    graph = grimp.build_graph("helios", exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    circles = [chain for m in modules
               for imported in graph.find_modules_directly_imported_by(m)
               if (chain := graph.find_shortest_chain(importer=imported, imported=m)) is not None]
    assert not circles, circles[:5]
    packages = sorted(m for m in modules if m.count(".") == 1)
    both_ways = [(a, b) for i, a in enumerate(packages) for b in packages[i + 1:]
                 if graph.chain_exists(importer=a, imported=b, as_packages=True)
                 and graph.chain_exists(importer=b, imported=a, as_packages=True)]
    assert not both_ways, both_ways
