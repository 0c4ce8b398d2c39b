"""The shape of ``aiomp/``, checked on its source with ``ast`` (no module is imported).

- The layers: a module imports only from its own layer or lower ones (:data:`LAYERS`,
  lowest first), and no two modules import each other, directly or through others.
  Every import counts, lazy ones inside functions included: they are edges of the design
  even where they break a cycle at run time.
- The child side (:data:`CHILD`): what every child loads before the user's code imports,
  at module level, only the standard library and other child-side modules. Modules of
  ``aiomp._loop`` that child-side modules import count as child-side too.
- Only ``aiomp/_loop/`` tells asyncio from trio: no other module's code imports trio or
  sniffio (lazily included), looks them up by name (``sys.modules``), or uses the anyio
  and asyncio internals (:func:`loop_mentions`). Docstrings, comments and messages for
  users (strings that are no bare name) may say "trio".
- Sizes: at most :data:`MAX_MODULE_LINES` lines a module, :data:`MAX_CLASS_LINES` a class.
- No module uses another module's private (underscore) names.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "aiomp"

#: The layers, lowest first: each entry a package or module directly under ``aiomp``.
LAYERS: list[set[str]] = [
    {"_errors", "_lifecycle"},
    {"_loop"},
    {"_wire"},
    {"_memory"},
    {"_arrays", "_cuda", "cuda"},
    {"_queue"},
    {"_output"},
    {"_process"},
    {"_child"},
    {"_spawn"},
    {"_pool"},
    {"ray", "_first", "_data"},
    {"__init__"},
]

#: What every child loads before the user's code: packages (all their modules) and single
#: modules, by dotted name.
CHILD: set[str] = {
    "aiomp._errors",
    "aiomp._lifecycle",
    "aiomp._loop",  # the package's __init__ only: the running-loop probe
    "aiomp._wire",
    "aiomp._memory",
    "aiomp._queue",
    "aiomp._child",
    "aiomp._pool.protocol",
    "aiomp._pool.worker_main",
    "aiomp._pool.worker_loop",
    "aiomp._pool.health",
    "aiomp._process.mp_private",
    "aiomp._process.start",
}
#: Packages all of whose modules are child-side (the rest of CHILD are single modules).
CHILD_PACKAGES: set[str] = {"aiomp._wire", "aiomp._memory", "aiomp._queue", "aiomp._child"}

#: The event loop libraries that only ``aiomp/_loop/`` may import or look up by name.
LOOP_LIBRARIES: set[str] = {"trio", "sniffio"}
#: Private names of asyncio and anyio (and the fields of anyio's cancel scopes) that only
#: ``aiomp/_loop/`` may use; any other private name reached through asyncio or anyio
#: counts too.
LOOP_INTERNALS: set[str] = {
    "_get_running_loop",
    "_current_tasks",
    "_task_states",
    "_cancel_called",
    "_deadline",
    "_parent_scope",
    "_shield",
}
#: The libraries whose private names are internals.
INTERNALS_OF: set[str] = {"asyncio", "anyio"}

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 400

#: Private names a module may use from another, ``(module using it, "module.name")``, each
#: with the reason. Empty: every cross-module use goes through a public name.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()

#: Modules over a size limit while the redesign is under way: their tests are expected
#: to fail, strictly (one that passes fails, so its entry must go).
SPLIT_IN_PROGRESS: set[str] = set()


@cache
def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def is_package(name: str) -> bool:
    return (REPO / name.replace(".", "/") / "__init__.py").exists()


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    for i, members in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"{name}: LAYERS places no {top!r}; add it to the table")


def imports(name: str, tree: ast.AST) -> Iterator[tuple[ast.stmt, ast.alias, str]]:
    """``(statement, imported name, aiomp module)`` for each import of an aiomp module in
    ``tree``; ``from m import x`` imports ``m.x`` where that is a module, else ``m``."""
    known = modules()
    here = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aiomp":
                    yield node, alias, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                target = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "aiomp":
                target = node.module or ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node, alias, sub if sub in known else target


def module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module loads: not those inside functions or
    classes' methods, nor an ``if TYPE_CHECKING:`` block."""
    found: list[ast.stmt] = []
    body: list[ast.stmt] = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body[:0] = node.orelse
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.ClassDef):
            body[:0] = [*node.body, *getattr(node, "orelse", [])]
            for handler in getattr(node, "handlers", []):
                body[:0] = handler.body
            body[:0] = getattr(node, "finalbody", [])
        else:
            found.append(node)
    return found


def outside_imports(tree: ast.Module) -> set[str]:
    """Top-level names of the non-aiomp modules imported at module level."""
    found: set[str] = set()
    for node in module_level(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names if not a.name.startswith("aiomp")}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top = (node.module or "").split(".")[0]
            if top != "aiomp":
                found.add(top)
    return found


def type_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements inside ``if TYPE_CHECKING:`` blocks: they never
    run, so they make no edge of the import graph (annotations may name any module)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                found |= {id(n) for n in ast.walk(stmt)}
    return found


@cache
def edges(typed: bool = False) -> dict[str, set[str]]:
    """Who imports whom, among aiomp's modules: every import that runs, lazy ones
    included, ``if TYPE_CHECKING:`` blocks too where ``typed``."""
    graph: dict[str, set[str]] = {}
    for name, tree in modules().items():
        skip = set() if typed else type_only(tree)
        graph[name] = {
            target
            for node, _, target in imports(name, tree)
            if target != name and id(node) not in skip
        }
    return graph


@cache
def child_side() -> set[str]:
    """CHILD with its packages expanded, and the ``aiomp._loop`` modules they import."""
    names = {
        m for m in modules() if m in CHILD or any(m.startswith(p + ".") for p in CHILD_PACKAGES)
    }
    todo = list(names)
    while todo:
        name = todo.pop()
        level = {id(n) for n in module_level(modules()[name])}
        for node, _, target in imports(name, modules()[name]):
            if id(node) in level and target.startswith("aiomp._loop") and target not in names:
                names.add(target)
                todo.append(target)
    return names


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module of ``graph`` (by
    default the import graph, :func:`edges`)."""
    graph = edges() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(name: str, tree: ast.Module) -> set[str]:
    """``"module.name"`` for each private name of another aiomp module this one uses:
    ``from m import _name`` or ``m._name`` where ``_name`` is no module."""
    known = modules()
    aliases: dict[str, str] = {}  # local name -> aiomp module
    uses: set[str] = set()
    for node, alias, target in imports(name, tree):
        if isinstance(node, ast.Import):
            if alias.asname:
                aliases[alias.asname] = alias.name
        elif target.endswith(f".{alias.name}"):  # from m import module
            aliases[alias.asname or alias.name] = target
        elif is_private(alias.name):
            uses.add(f"{target}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and is_private(node.attr)
            and f"{aliases[node.value.id]}.{node.attr}" not in known
            and aliases[node.value.id] != name
        ):
            uses.add(f"{aliases[node.value.id]}.{node.attr}")
    return uses


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def dotted(node: ast.expr) -> list[str]:
    """``a.b.c`` as ``["a", "b", "c"]``; empty where the chain does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return [node.id, *parts] if isinstance(node, ast.Name) else []


def loop_mentions(tree: ast.Module) -> set[str]:
    """Where code tells the loops apart the way only ``aiomp/_loop/`` may: an import of
    :data:`LOOP_LIBRARIES` (lazy ones included), their names as code or as a bare-name
    string (what ``sys.modules`` or ``import_module`` is given), and a private name of
    :data:`INTERNALS_OF` (:data:`LOOP_INTERNALS`, or any reached through those modules).
    Docstrings, comments and strings that are no bare name (messages) are not code."""
    skip = docstrings(tree)
    found: set[str] = set()
    libraries: set[str] = set()  # local names bound to asyncio or anyio (or their modules)

    def note(text: str, where: ast.AST) -> None:
        found.add(f"{text} (line {getattr(where, 'lineno', '?')})")

    def check_module(name: str, where: ast.AST) -> None:
        parts = name.split(".")
        private = parts[0] in INTERNALS_OF and any(is_private(p) for p in parts)
        if private or parts[0] in LOOP_LIBRARIES or set(parts) & LOOP_INTERNALS:
            note(name, where)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check_module(alias.name, node)
                if alias.name.split(".")[0] in INTERNALS_OF:
                    libraries.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            check_module(node.module, node)
            for alias in node.names:
                check_module(f"{node.module}.{alias.name}", node)
                if node.module.split(".")[0] in INTERNALS_OF:
                    libraries.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in LOOP_LIBRARIES | LOOP_INTERNALS:
            note(node.id, node)
        elif isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain and chain[0] in libraries and any(is_private(p) for p in chain[1:]):
                note(".".join(chain), node)
            elif node.attr in LOOP_LIBRARIES | LOOP_INTERNALS:
                note(node.attr, node)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skip
            and re.fullmatch(r"[\w.]+", node.value)
            and set(node.value.split(".")) & (LOOP_LIBRARIES | LOOP_INTERNALS)
        ):
            note(repr(node.value), node)
    return found


def each_or_the_rest(expected_to_fail: set[str]) -> list[object]:
    """Test parameters: ``"the rest"`` (every module not listed), then each listed module
    as a strict xfail."""
    xfail = pytest.mark.xfail(strict=True, reason="split in progress")
    return ["the rest", *(pytest.param(m, marks=xfail) for m in sorted(expected_to_fail))]


def chosen(which: str, listed: set[str], among: Iterable[str]) -> list[str]:
    return sorted(set(among) - listed) if which == "the rest" else [which]


def test_no_upward_import() -> None:
    up = {
        f"{m} (layer {layer(m)})": sorted(t for t in targets if layer(t) > layer(m))
        for m, targets in edges().items()
    }
    assert {m: ts for m, ts in up.items() if ts} == {}


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_child_side_imports_only_the_standard_library() -> None:
    children = child_side()
    bad = {}
    for module in sorted(children):
        tree = modules()[module]
        level = {id(n) for n in module_level(tree)}
        found = {t for node, _, t in imports(module, tree) if id(node) in level}
        found -= children
        found |= {
            n
            for n in outside_imports(tree)
            if n not in sys.stdlib_module_names and n != "__future__"
        }
        if found:
            bad[module] = sorted(found)
    assert bad == {}, "child-side modules; import these lazily"


@pytest.mark.parametrize("which", each_or_the_rest(SPLIT_IN_PROGRESS))
def test_module_and_class_sizes(which: str) -> None:
    over = {}
    for module in chosen(which, SPLIT_IN_PROGRESS, modules()):
        tree = modules()[module]
        lines = max((getattr(n, "end_lineno", 0) or 0 for n in ast.walk(tree)), default=0)
        if lines > MAX_MODULE_LINES:
            over[module] = lines
        for node in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > MAX_CLASS_LINES:
                over[f"{module}.{node.name}"] = size
    assert over == {}, f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class"


def test_only_the_loop_package_tells_asyncio_from_trio() -> None:
    found = {
        module: sorted(mentions)
        for module, tree in modules().items()
        if not module.startswith("aiomp._loop") and (mentions := loop_mentions(tree))
    }
    assert found == {}, "move the branch into aiomp/_loop and bind its callable once"


def test_no_private_names_across_modules() -> None:
    offences = {
        (name, use)
        for name, tree in modules().items()
        for use in private_uses(name, tree)
        if (name, use) not in ALLOWED_PRIVATE
    }
    assert offences == set(), "use or add a public name in the owning module"


def test_allow_list_is_current() -> None:
    """An entry whose rename has landed must go, so the list only ever shrinks."""
    used = {(n, use) for n, tree in modules().items() for use in private_uses(n, tree)}
    assert ALLOWED_PRIVATE - used == set()


def test_the_tables_name_what_exists() -> None:
    """Every module has a layer; every name in the tables is a module of the package."""
    for name in modules():
        layer(name)
    known = set(modules())
    assert CHILD - known == set() and CHILD_PACKAGES <= CHILD
    assert SPLIT_IN_PROGRESS - known == set()


def test_the_checks_see_what_they_look_for() -> None:
    """The controls: a heavy or upward import, a private use, a cycle's edge, a mention."""
    source = (
        "import os\nimport numpy\nfrom .. import _pool\nfrom ..ray import _actor as A\n"
        "A._secret()\nfrom .._wire.transport import _Reader\n"
        "def f():\n    import anyio\n    import trio\n    return 'sniffio'\n"
    )
    loop_source = (
        '"""Docstrings may say trio."""\nimport sys\nimport asyncio as aio\n'
        "from anyio._backends._asyncio import CancelScope\n"
        "def f():\n    import trio.lowlevel\n    sys.modules.get('sniffio')\n"
        "    aio.tasks._current_tasks\n    aio.events.get_running_loop()\n"
        "    scope._cancel_called\n    raise RuntimeError('under trio, use q.sync')\n"
    )
    tree = ast.parse(source)
    assert outside_imports(tree) == {"os", "numpy"}
    assert {t for _, _, t in imports("aiomp._queue.queue", tree)} == {
        "aiomp._pool",
        "aiomp.ray._actor",
        "aiomp._wire.transport",
    }
    assert private_uses("aiomp._queue.queue", tree) == {
        "aiomp.ray._actor._secret",
        "aiomp._wire.transport._Reader",
    }
    assert {m.split()[0] for m in loop_mentions(tree)} == {"trio", "'sniffio'"}
    assert {m.split()[0] for m in loop_mentions(ast.parse(loop_source))} == {
        "anyio._backends._asyncio",
        "anyio._backends._asyncio.CancelScope",
        "trio.lowlevel",
        "'sniffio'",
        "aio.tasks._current_tasks",
        "_cancel_called",
    }
    assert layer("aiomp._pool.pool") > layer("aiomp._queue.queue") > layer("aiomp._loop")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    typed = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n")
    assert len(type_only(typed)) > 0
