"""The import layering of ``aiomp/``, checked on its source with ``ast`` (no imports run).

(a) No module uses another aiomp module's private (underscore) name: neither
``_mod._name`` nor ``from ._mod import _name``. What one module needs of another is that
module's public surface.
(b) The *child* modules of the layer table in ``docs/architecture.md`` import, at module
level, only the standard library and other child modules: a child process loads them all
before it runs a line of the user's code (see *Light children* there).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "aiomp"
ARCHITECTURE = REPO / "docs" / "architecture.md"

#: Private names a module may use from another, ``(module using it, "module.name")``, each
#: with the reason. Empty: every cross-module use goes through a public name.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(tree: ast.Module) -> set[str]:
    """``"module.name"`` for each private name of a sibling module this tree uses."""
    aliases: dict[str, str] = {}  # local name -> sibling module
    uses: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if node.module is None:  # from . import _mod [as m]
                    aliases[alias.asname or alias.name] = alias.name
                elif _is_private(alias.name):  # from ._mod import _name
                    uses.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _is_private(node.attr)
        ):
            uses.add(f"{aliases[node.value.id]}.{node.attr}")
    return uses


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level names imported when the module loads: ``"numpy"``, ``"._shm"``.

    Imports inside functions are lazy and not counted; nor is an ``if TYPE_CHECKING:``
    block (it never runs).
    """
    found: set[str] = set()
    body: list[ast.stmt] = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body[:0] = node.orelse
        elif isinstance(node, ast.If | ast.Try | ast.With):
            body[:0] = [*node.body, *getattr(node, "orelse", [])]
            for handler in getattr(node, "handlers", []):
                body[:0] = handler.body
            body[:0] = getattr(node, "finalbody", [])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add((node.module or "").split(".")[0])
            elif node.module is None:
                found |= {f".{alias.name}" for alias in node.names}
            else:
                found.add(f".{node.module.split('.')[0]}")
    return found


def child_modules() -> set[str]:
    """The modules the layer table of docs/architecture.md marks ``(*child*)``."""
    table = [line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("|")]
    return {m.group(1) for line in table for m in re.finditer(r"`(\w+)` \(\*child\*\)", line)}


def test_no_private_names_across_modules() -> None:
    offences = {
        (name, use)
        for name, tree in _modules().items()
        for use in _private_uses(tree)
        if (name, use) not in ALLOWED_PRIVATE
    }
    assert offences == set(), "use or add a public name in the owning module"


def test_allow_list_is_current() -> None:
    """An entry whose rename has landed must go, so the list only ever shrinks."""
    used = {(name, use) for name, tree in _modules().items() for use in _private_uses(tree)}
    assert ALLOWED_PRIVATE - used == set()


def test_the_layer_table_names_every_module() -> None:
    table = "\n".join(
        line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("|")
    )
    named = set(re.findall(r"`(\w+)`", table))
    assert {p.stem for p in PACKAGE.glob("*.py")} <= named
    assert child_modules(), "the table marks no module (*child*)"


@pytest.mark.parametrize("module", sorted(child_modules()))
def test_child_modules_import_only_the_standard_library(module: str) -> None:
    tree = _modules()[f"{module}.py"]
    children = child_modules()
    bad = sorted(
        name
        for name in _module_level_imports(tree)
        if not (
            name.lstrip(".") in children
            if name.startswith(".")
            else name in sys.stdlib_module_names or name == "__future__"
        )
    )
    assert bad == [], f"aiomp/{module}.py is child-side; import these lazily: {bad}"


def test_the_check_sees_a_heavy_import() -> None:
    """The control: a module-level ``import numpy`` or a parent-side sibling is caught."""
    tree = ast.parse("import os\nimport numpy\nfrom . import _pool\ndef f():\n    import anyio\n")
    assert _module_level_imports(tree) == {"os", "numpy", "._pool"}
    tree = ast.parse("from . import _lease as L\nfrom ._x import _y\nL._lock(1)\nL.hold(1)\n")
    assert _private_uses(tree) == {"_lease._lock", "_x._y"}
