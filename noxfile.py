"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s bench``."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The full test suite, including moto-server and SeaweedFS integration tests."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff")
    paths = ["batchweave", "tests", "bench", "examples", "noxfile.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package."""
    session.install("-e", ".[test]")
    session.run("mypy")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """A smoke run of every benchmark at tiny sizes (``-- --full`` for the real sizes).

    Installs the ``bench`` extra too: ``bench/peers.py`` needs its psutil and peer systems.
    """
    session.install("-e", ".[test,bench]")
    full = "--full" in session.posargs
    for script in sorted(Path("bench").glob("[!_]*.py")):
        session.run("python", str(script), *([] if full else ["--smoke"]))


@nox.session(python=PYTHON)
def peers(session: nox.Session) -> None:
    """BatchWeave vs MosaicML Streaming, WebDataset and NATS JetStream (issue #8).

    Rewrites the ``## Peers`` section of docs/benchmarks.md and docs/img/peers_*.png. Needs the
    ``bench`` extra and the Debian ``nats-server`` package (its rows are skipped without it).
    ``-- --smoke`` for a tiny run; other arguments go to ``bench/peers.py``.
    """
    session.install("-e", ".[test,bench]", "torch==2.13.0")
    session.run("python", "bench/peers.py", *session.posargs)
