"""The documentation site builds, covers every public name, and describes the tree as it is
(issue 42, Documentation).

- ``python -m sphinx -W -b html docs OUT`` passes: warnings are errors, so a broken
  cross-reference, a docstring that is not valid reStructuredText or a page left out of
  every toctree fails the suite (and CI, which runs it). Nothing reaches the network.
- The API reference (``docs/api/``) has an autodoc entry for every name in
  ``aiomp.__all__``, ``aiomp.cuda.__all__`` and ``aiomp.ray.__all__``.
- The guides are code: every ```python block of docs/index.md, docs/getting-started.md and
  docs/guides/*.md compiles (a fragment may ``await`` at top level), and every block that
  is a whole program (it has an ``if __name__ == "__main__":``) runs as written, as a
  file, as the README's blocks do (tests/meta/test_readme.py).
- The tree in docs/architecture.md names every package and top-level module of ``aiomp/``,
  and every module of each package in that package's description, and lists no package or
  top-level module that is not there. A module added without a word in the tree fails here,
  naming it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiomp

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

pytestmark = pytest.mark.leaks_ok  # Sphinx runs in its own interpreter

#: The pages whose python blocks are code (design.md and architecture.md quote fragments).
GUIDES = [DOCS / "index.md", DOCS / "getting-started.md", *sorted((DOCS / "guides").glob("*.md"))]
#: Packages a block may need that the suite does not: without one, its block skips.
OPTIONAL = ("torch", "ray", "cupy", "fastapi", "uvicorn")

#: ``.. autofunction:: aiomp.spawn``, ``.. automodule:: aiomp.cuda``, ...
_AUTO = re.compile(r"^\.\. auto\w+:: (aiomp(?:\.[\w]+)+)\s*$", re.MULTILINE)


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, f"the docs build failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "index.html").is_file()


def _public_names() -> set[str]:
    names = {f"aiomp.{name}" for name in aiomp.__all__}
    for module in ("aiomp.cuda", "aiomp.ray"):
        names |= {f"{module}.{name}" for name in importlib.import_module(module).__all__}
    return names


def test_the_api_reference_covers_every_public_name() -> None:
    documented = set()
    for page in (DOCS / "api").glob("*.rst"):
        documented |= set(_AUTO.findall(page.read_text()))
    missing = sorted(_public_names() - documented)
    assert missing == [], (
        "public names without an autodoc entry in docs/api/*.rst (add one to the page of "
        f"their job): {', '.join(missing)}"
    )


def _tree_block() -> str:
    text = (DOCS / "architecture.md").read_text()
    section = text.split("## Tree", 1)[1]
    return section.split("```", 2)[1]


def _described() -> dict[str, str]:
    """Each entry of the tree block (``_loop/``, ``cuda.py``) with its description."""
    entries: dict[str, str] = {}
    current = None
    for line in _tree_block().splitlines():
        m = re.match(r"^  (\S+)\s*(.*)$", line)
        if m:
            current = m.group(1)
            entries[current] = m.group(2)
        elif current is not None and line.strip():
            entries[current] += " " + line.strip()
    return entries


def _tree() -> dict[str, list[str]]:
    """Each package (``_loop/``) and top-level module (``cuda.py``) of aiomp/ with, for a
    package, its modules' names (``__init__`` aside)."""
    tree: dict[str, list[str]] = {}
    for path in sorted((REPO / "aiomp").iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            modules = sorted(p.stem for p in path.glob("*.py") if p.stem != "__init__")
            tree[f"{path.name}/"] = modules
        elif path.suffix == ".py":
            tree[path.name] = []
    return tree


def test_the_architecture_tree_matches_the_package() -> None:
    described, tree = _described(), _tree()
    problems = [f"{name} is missing from the tree" for name in tree if name not in described]
    problems += [
        f"{name} is in the tree but not in aiomp/" for name in described if name not in tree
    ]
    for package, modules in tree.items():
        text = described.get(package)
        if text is None:
            continue
        words = set(re.findall(r"\w+", text))
        problems += [
            f"{package}{module}.py is not named in {package}'s description"
            for module in modules
            if module not in words
        ]
    assert problems == [], "docs/architecture.md, section Tree:\n" + "\n".join(problems)


def _python_blocks() -> list[tuple[str, int, str]]:
    """``(page, line number, code)`` of each python block of the guides."""
    blocks = []
    for page in GUIDES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = i + 1
                while lines[end].strip() != "```":
                    end += 1
                code = "\n".join(lines[i + 1 : end]) + "\n"
                blocks.append((str(page.relative_to(REPO)), i + 2, code))
                i = end
            i += 1
    return blocks


_BLOCKS = [pytest.param(p, n, c, id=f"{p}:{n}") for p, n, c in _python_blocks()]
_MAIN = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
_PROGRAMS = [b for b in _BLOCKS if _MAIN.search(str(b.values[2]))]


def test_the_guides_have_programs() -> None:
    assert len(_PROGRAMS) >= 8


@pytest.mark.parametrize("page, line, code", _BLOCKS)
def test_a_guide_block_compiles(page: str, line: int, code: str) -> None:
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    compile(code, f"{page}:{line}", "exec", flags=flags)


@pytest.mark.slow
@pytest.mark.parametrize("page, line, code", _PROGRAMS)
def test_a_guide_program_runs_as_written(page: str, line: int, code: str, tmp_path: Path) -> None:
    for name in OPTIONAL:
        if re.search(rf"^\s*(import|from) {name}\b", code, re.M) and (
            importlib.util.find_spec(name) is None
        ):
            pytest.skip(f"the block at {page}:{line} needs {name}, not installed")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, (
        f"the block at {page}:{line} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
