"""The README is code: every ```python block in it runs as written, as a file.

Each block is written to a file of its own in a temporary directory and run with this
interpreter, the way a user who pastes it into ``example.py`` runs it. A block that needs
an optional package (torch, ray, cupy) is skipped with a reason when that package is
missing; a block must finish in well under a minute and exit 0.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OPTIONAL = ("torch", "ray", "cupy", "tqdm", "fastapi", "uvicorn")


def python_blocks(path: Path = README) -> list[tuple[int, str]]:
    """``(line number, code)`` of each python block in the README (or another Markdown
    file, ``path``)."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = start
            while lines[end].strip() != "```":
                end += 1
            blocks.append((start + 1, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_the_readme_has_python_blocks() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize(
    "line, code", [pytest.param(n, c, id=f"line{n}") for n, c in python_blocks()]
)
def test_a_readme_block_runs_as_written(line: int, code: str, tmp_path: Path) -> None:
    for name in OPTIONAL:
        if re.search(rf"^\s*(import|from) {name}\b", code, re.M) and (
            importlib.util.find_spec(name) is None
        ):
            pytest.skip(f"the block at README line {line} needs {name}, not installed")
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, (
        f"README block at line {line} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    assert len((proc.stdout + proc.stderr).splitlines()) < 60
