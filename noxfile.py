"""nox sessions: tests, lint (ruff, mypy, import-linter layer contracts), fuzz, bench, soak."""

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
def fuzz(session: nox.Session) -> None:
    """The property-based fuzz suite at nightly size: $HELIOS_FUZZ_EXAMPLES examples per test (default
    10,000; the hostile-input test of fuzz/test_fuzz_http.py runs that many per route). The normal
    suite runs the same tests with small counts.

    nox -s fuzz -- [pytest arguments, e.g. -k hostile]
    """
    session.install(*INSTALL, ".[test]")
    examples = os.environ.get("HELIOS_FUZZ_EXAMPLES", "10000")
    session.run("python", "-m", "pytest", "-q", "fuzz", "--timeout", "0", *session.posargs,
                env={"HELIOS_FUZZ_EXAMPLES": examples})


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Start Helios on a free port, drive it with `helios bench`, optionally beside a baseline.

    nox -s bench -- [--baseline-url URL] [--streams 1,8,32] [--max-tokens 256] [--prompt-tokens 512]
    """
    session.install(*INSTALL, ".")
    port = os.environ.get("HELIOS_BENCH_PORT", "8011")
    session.run("python", "-m", "helios.clients.benchserve", "--port", port, *session.posargs)


@nox.session(python="3.11")
def soak(session: nox.Session) -> None:
    """Start Helios on a small configuration and drive it with seeded mixed load (tests/server/soak.py).

    nox -s soak -- [--duration 600 | --requests N] [--seed S] [--workers 3] [--burst-every 6] [--burst-size 20] [--keep]
    Exits 1 when a pass criterion fails (docs/operations.md, Soak); the CI-sized run is tests/server/test_soak.py.
    """
    session.install(*INSTALL, ".", "pytest")
    session.run("python", "-m", "tests.server.soak", *session.posargs)
