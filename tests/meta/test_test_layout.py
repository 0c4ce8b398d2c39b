"""The tests are capped as the package is: no module under tests/ over 500 lines.

A long test module is split by theme into modules of the same folder, with the helpers they
share in a small private module there (``tests/queue/_queues.py``) and the fixtures they
share in the folder's ``conftest.py``, rather than copied.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

#: As for aiomp/ (``tests/meta/test_layout.py``).
MAX_TEST_MODULE_LINES = 500


def lengths() -> dict[str, int]:
    """Lines of every Python module under tests/, by its path from the repository root."""
    return {
        path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
        for path in sorted(TESTS.rglob("*.py"))
    }


def test_no_test_module_over_the_cap() -> None:
    over = {name: n for name, n in lengths().items() if n > MAX_TEST_MODULE_LINES}
    assert over == {}, f"over {MAX_TEST_MODULE_LINES} lines: split by theme (see the docstring)"
