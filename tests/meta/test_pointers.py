"""The repository explains itself: no file points to a file that is not in it (issue 42,
item 3).

Code, tests and documents cited a design file outside the repository ("DESIGN.md"); a
maintainer with a clone could not follow them. Every pointer is checked on the tracked
files' text:

- a Markdown link to a relative path (``[text](docs/x.md)``, an anchor after ``#``
  ignored) names a file or folder that exists, relative to the linking file;
- a path written out in text (``docs/decisions/0001-....md``, ``tests/pool/x.py``,
  ``benchmarks/RESULTS.md``), starting at one of the repository's top folders and ending
  in a file name with an extension, exists relative to the repository's root (or, in a
  Markdown file, to that file); one written after a commit (``git show 5408468:benchmarks/
  x.py``, a file since deleted) exists in that commit;
- the old design file is cited by no one: its content is ``docs/design.md``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP = ("aiomp", "tests", "docs", "benchmarks", "examples", ".ci")
TEXT = (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yml", ".yaml", ".rst")

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TOPS = "|".join(re.escape(t) for t in TOP)
_PATH = re.compile(
    rf"(?<![\w./-])((?:\.\./)*(?:{_TOPS})/[\w./-]*?\.(?:py|md|sh|toml|txt|json|rst|csv))(?![\w/])"
)
#: A commit before a path (``5408468:`` or ``5408468^:``): the path is in that commit.
_COMMIT = re.compile(r"(?<![\w./-])([0-9a-f]{7,40}\^?):$")
#: The design file that lived outside the repository, cited by name.
_OUTSIDE = re.compile(r"\bDESIGN(?:\.md)?\b|REVIEW-architecture|\bSTYLE\.md\b|\.\./shared/")


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    files = [REPO / name for name in out.split("\0") if name]
    return [f for f in files if f.suffix in TEXT and f.is_file()]


def _exists(target: str, source: Path) -> bool:
    target = target.split("#", 1)[0]
    if not target:
        return True
    return (source.parent / target).exists() or (REPO / target).exists()


def _git_has(obj: str) -> bool:
    return (
        subprocess.run(["git", "cat-file", "-e", obj], cwd=REPO, capture_output=True).returncode
        == 0
    )


def _in_commit(target: str, commit: str) -> bool:
    """Whether ``target`` is in ``commit``; also true where this checkout lacks the commit
    (a shallow clone): a pointer into history is checked where the history is."""
    return not _git_has(f"{commit}^{{commit}}") or _git_has(f"{commit}:{target}")


def _dangling(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    found = []
    if path.suffix == ".md":
        for m in _LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL (https:, mailto:)
                continue
            if not _exists(target, path):
                found.append(f"link {target}")
    for m in _PATH.finditer(text):
        commit = _COMMIT.search(text, max(0, m.start() - 42), m.start())
        if commit and not _in_commit(m.group(1), commit.group(1)):
            found.append(f"path {commit.group(0)}{m.group(1)}")
        elif not commit and not _exists(m.group(1), path):
            found.append(f"path {m.group(1)}")
    for m in _OUTSIDE.finditer(text):
        found.append(f"outside the repository: {m.group(0)}")
    return found


def test_pointer_patterns_find_what_they_should() -> None:
    """The checker itself: a missing file is found, an existing one is not."""
    here = REPO / "tests" / "meta" / "x.md"
    assert _exists("docs/architecture.md", here)
    assert not _exists("docs/no-such-file.md", here)
    assert _PATH.findall("see docs/decisions/0001-x.md and tests/pool/y.py.") == [
        "docs/decisions/0001-x.md",
        "tests/pool/y.py",
    ]
    if _git_has("5408468^{commit}"):
        assert _in_commit("benchmarks/diagnostics/child_imports.py", "5408468")
        assert not _in_commit("benchmarks/no_such_file.py", "5408468")
    assert _COMMIT.search("git show 5408468^:", 0, 18)
    assert _OUTSIDE.findall('(DESIGN.md "Worker health") DESIGN R13') == ["DESIGN.md", "DESIGN"]


@pytest.mark.parametrize("path", _tracked(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_pointer_to_a_missing_file(path: Path) -> None:
    if path == Path(__file__):
        return  # its own examples
    assert _dangling(path) == []
