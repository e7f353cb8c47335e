"""nox sessions: tests, lint (ruff, mypy, import-linter layer contracts), bench."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

INSTALL = ("-c", "constraints.txt", "-e")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    session.install(*INSTALL, ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install(*INSTALL, ".[lint,test]")
    session.run("ruff", "check", "helios", "tests", "fuzz", "noxfile.py")
    session.run("mypy", "helios")
    session.run("lint-imports")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Start Helios on a free port, drive it with `helios bench`, optionally beside a baseline.

    nox -s bench -- [--baseline-url URL] [--streams 1,8,32] [--max-tokens 256] [--prompt-tokens 512]
    """
    session.install(*INSTALL, ".")
    port = os.environ.get("HELIOS_BENCH_PORT", "8011")
    session.run("python", "-m", "helios.benchserve", "--port", port, *session.posargs)
