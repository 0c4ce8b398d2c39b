"""The shape of ``aiomp/_data`` (issue 39, "Simpler while you are in it"), checked on its
source with the helpers of ``tests/meta/test_layout.py``: its imports run one way, type-only
ones included, and its index (the package's docstring) names every module."""

from __future__ import annotations

import ast
import re

from tests.meta.test_layout import cycles, edges, modules

#: The package whose modules import one another one way, type-only imports included.
DATA = "aiomp._data"


def test_the_data_package_imports_one_way() -> None:
    """Five modules of ``aiomp/_data`` imported each other in a circle through their ``if
    TYPE_CHECKING:`` imports (the epochs named the loader to reach back into it). Inside
    the package type-only imports count too: no cycle, and no module of it imports the
    loader's (an epoch is given what it reads of its loader when it is made)."""
    graph = {
        m: {t for t in targets if t.startswith(DATA + ".")}
        for m, targets in edges(typed=True).items()
        if m.startswith(DATA + ".")
    }
    assert cycles(graph) == []
    assert sorted(m for m, targets in graph.items() if f"{DATA}.loader" in targets) == []


def test_the_data_index_names_every_module() -> None:
    """``aiomp/_data/__init__.py``'s docstring lists every module of the package, one
    ``- ``name``: ...`` line each, and no module that is not there."""
    doc = ast.get_docstring(modules()[DATA]) or ""
    listed = set(re.findall(r"^- ``(\w+)``", doc, re.MULTILINE))
    actual = {m.rpartition(".")[2] for m in modules() if m.startswith(DATA + ".")}
    assert listed == actual
