"""A user's mypy catches misuse of the public API: ``tests/meta/typing_user.py`` under ``--strict``.

``apply``/``map`` are generic in the function's return type, and a wrong argument (a
non-tuple ``args``, an ``nprocs`` that is not an int) is an error in the user's editor,
not at run time. Skipped when mypy is not installed (it is in the ``dev`` extra).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed"),
    pytest.mark.timeout(600),  # a cold mypy run on a loaded 2-core machine
]

REPO = Path(__file__).resolve().parents[2]
USER = REPO / "tests" / "meta" / "typing_user.py"
_EXPECT = re.compile(r"#\s*(reveal|error):\s*(.+?)\s*$")
_REPORT = re.compile(r"^[^:]+:(\d+): (note|error): (.*?)(?:  \[([\w-]+)\])?$")


def _expected() -> dict[int, tuple[str, str]]:
    """``{line: (kind, what)}`` from the ``# reveal:`` / ``# error:`` comments."""
    out = {}
    with USER.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):  # comments only, not the docstring
            m = _EXPECT.match(tok.string) if tok.type == tokenize.COMMENT else None
            if m:
                out[tok.start[0]] = (m.group(1), m.group(2))
    return out


@pytest.fixture(scope="module")
def mypy_report() -> dict[int, list[tuple[str, str]]]:
    """Run mypy once; ``{line: [(kind, what)]}``. Its cache is the repository's, which
    test_lint's ``mypy aiomp`` has filled (the two never run at once: conftest puts them
    on one xdist worker): a cold one cost 20-50 s here, analysing aiomp and its
    dependencies again."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(USER)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    report: dict[int, list[tuple[str, str]]] = {}
    for line in proc.stdout.splitlines():
        m = _REPORT.match(line)
        if m is None:
            continue
        lineno, level, text, code = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if level == "error":
            report.setdefault(lineno, []).append(("error", code or text))
        elif text.startswith("Revealed type is "):
            report.setdefault(lineno, []).append(("reveal", text.split('"')[1]))
    assert proc.returncode in (0, 1) and report, proc.stdout + proc.stderr
    return report


def test_the_user_file_states_expectations() -> None:
    kinds = {kind for kind, _ in _expected().values()}
    assert kinds == {"reveal", "error"}


@pytest.mark.parametrize("lineno", sorted(_expected()))
def test_mypy_says_what_the_comment_says(
    lineno: int, mypy_report: dict[int, list[tuple[str, str]]]
) -> None:
    kind, what = _expected()[lineno]
    assert (kind, what) in mypy_report.get(lineno, []), (
        f"typing_user.py:{lineno}: expected {kind} {what!r}, mypy said {mypy_report.get(lineno)}"
    )


def test_no_other_errors(mypy_report: dict[int, list[tuple[str, str]]]) -> None:
    """Correct use type-checks cleanly: only the lines marked ``# error:`` fail."""
    expected = {n for n, (kind, _) in _expected().items() if kind == "error"}
    errors = {n for n, items in mypy_report.items() if any(k == "error" for k, _ in items)}
    assert errors == expected
