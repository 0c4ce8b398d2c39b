"""The habits CI enforces: strict types, lint and formatting, as part of the suite.

The README's test command installs the ``dev`` extra, so these run wherever the suite
does; without the tools (a bare ``pip install -e .[test]``) they skip.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ["aiomp", "tests", "benchmarks", "examples"]

pytestmark = pytest.mark.leaks_ok  # the tools run in their own interpreters


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def _run(*argv: str) -> None:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, f"{' '.join(argv[1:])} failed:\n{done.stdout}{done.stderr}"


def test_mypy_strict() -> None:
    _run(_tool("mypy"), "aiomp")


def test_ruff_check() -> None:
    _run(_tool("ruff"), "check", *TREES)


def test_ruff_format() -> None:
    _run(_tool("ruff"), "format", "--check", *TREES)
