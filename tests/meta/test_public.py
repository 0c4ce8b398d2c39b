"""The public surface: ``aiomp.__all__``, public names, and what importing aiomp costs.

Only ``aiomp`` is public (*Layers* in docs/architecture.md): every name resolves from it,
prints and pickles under it, and importing it (or starting a sync child) loads none of the
heavy modules.
"""

from __future__ import annotations

import inspect
import json
import pickle
import queue
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._run import run_python
from tests.children import common as funcs

REPO = Path(__file__).resolve().parents[2]
#: What neither ``import aiomp`` nor a child running a sync function may load.
HEAVY = ("anyio", "asyncio", "cupy", "numpy", "trio", "typing", "uvloop")
#: Public names that are the standard library's own objects, re-exported.
REEXPORTED = {"Empty": queue.Empty, "Full": queue.Full}


def _resolve(name: str) -> object:
    """``getattr(aiomp, name)``, skipping names whose module is not written yet."""
    try:
        return getattr(aiomp, name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("aiomp"):
            pytest.skip(f"aiomp.{name}: {exc.name} does not exist yet")
        raise


def _heavy(modules: list[str] | set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_all_is_a_tuple_of_unique_names() -> None:
    assert isinstance(aiomp.__all__, tuple)
    assert len(set(aiomp.__all__)) == len(aiomp.__all__)
    assert all(isinstance(name, str) and not name.startswith("_") for name in aiomp.__all__)


@pytest.mark.parametrize("name", aiomp.__all__)
def test_public_name_resolves(name: str) -> None:
    value = _resolve(name)
    assert value is getattr(aiomp, name)  # cached, and the same object every time
    assert name in dir(aiomp)
    if name in REEXPORTED:
        assert value is REEXPORTED[name]
    elif isinstance(value, type):
        assert value.__module__ == "aiomp", f"{name} prints as {value.__module__}.{name}"
        assert value.__qualname__ == name


def test_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        aiomp.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(aiomp, "_WHERE_NOT")


@pytest.mark.parametrize("name", ["ProcessContext", "spawn", "start_processes"])
def test_spawning_names_are_public(name: str) -> None:
    value = getattr(aiomp, name)
    assert value.__module__ == "aiomp"
    assert pickle.loads(pickle.dumps(value)) is value  # pickles by its public name


def test_spawn_signature() -> None:
    """spawn's signature is the public contract (torch names); start_processes has the same one."""
    for fn in (aiomp.spawn, aiomp.start_processes):
        params = inspect.signature(fn).parameters
        assert list(params) == [
            "fn",
            "nprocs",
            "args",
            "start_method",
            "daemon",
            "grace_period",
            "output",
            "env",
            "rendezvous",
        ]
        assert params["output"].default == "prefix"  # the README's default
        assert params["env"].default is None and params["rendezvous"].default is False
        assert params["nprocs"].default == 1
        assert params["args"].default == ()
        assert params["start_method"].default == "spawn"
        assert params["daemon"].default is False
        assert params["grace_period"].default == 5.0
        assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[2:])


@pytest.mark.parametrize(
    "name",
    ["ProcessException", "ProcessRaisedException", "ProcessExitedException", "BrokenWorkerError"],
)
def test_error_tree(name: str) -> None:
    cls = getattr(aiomp, name)
    assert issubclass(cls, aiomp.ProcessException)
    assert issubclass(cls, Exception)


# -- what importing costs ------------------------------------------------------------------


def test_import_aiomp_is_light() -> None:
    """``import aiomp`` (and what a child imports first) loads neither anyio nor numpy."""
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import aiomp, aiomp._child.bootstrap\n"
        "aiomp.ProcessRaisedException, aiomp.ProcessExitedException\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = run_python("-c", code).stdout
    loaded = json.loads(out)
    assert "aiomp._child.bootstrap" in loaded
    assert _heavy(loaded) == []


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_sync_child_imports_no_heavy_module(start_method: str) -> None:
    with anyio.fail_after(20):
        async with aiomp.spawn(
            funcs.loaded_modules, 1, start_method=start_method, grace_period=0.5
        ) as ctx:
            pass
    modules = ctx.results[0]
    assert isinstance(modules, list)
    assert "aiomp._child.bootstrap" in modules and funcs.__name__ in modules
    assert _heavy(modules) == []


@pytest.mark.anyio
async def test_async_child_imports_asyncio() -> None:
    """The control for the test above: an async fn's child does load asyncio."""
    with anyio.fail_after(20):
        async with aiomp.spawn(funcs.async_loaded_modules, 1, grace_period=0.5) as ctx:
            pass
    modules = ctx.results[0]
    assert isinstance(modules, list)
    assert "asyncio" in modules
    assert "anyio" not in modules


def test_the_readme_demo_runs() -> None:
    """The README's first command runs examples/demo.py: it must keep working."""
    proc = run_python("examples/demo.py")
    lines = proc.stdout.splitlines()
    assert "frame 3 now holds 6" in lines[0]
    assert "ValueError: rank 1 could not read its shard" in lines[1]


def test_import_on_another_platform_says_what_is_missing() -> None:
    """Issue 11: on another OS, or a kernel without pidfd, ``import aiomp`` raises one
    clear ImportError instead of an AttributeError somewhere later."""

    for setup, expected in (
        ("import sys; sys.platform = 'darwin'", "Linux only"),
        ("import os; del os.pidfd_open", "needs pidfd_open"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", f"{setup}\nimport aiomp"],
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1
        assert "ImportError" in proc.stderr and expected in proc.stderr


def test_types_users_hold_are_public() -> None:
    """issue 42: the types a user holds and annotates are exported under aiomp; the old
    name QueueClosed is the same class as QueueClosedError."""
    import aiomp._child.info
    import aiomp._pool.batching
    import aiomp._pool.iterators
    import aiomp._spawn.api

    assert aiomp.SpawnHandle is aiomp._spawn.api.SpawnHandle
    assert aiomp.Batched is aiomp._pool.batching.Batched
    assert aiomp.ResultIterator is aiomp._pool.iterators.ResultIterator
    assert aiomp.WorkerInfo is aiomp._child.info.WorkerInfo
    assert aiomp.QueueClosed is aiomp.QueueClosedError
    assert "cuda" not in aiomp.__all__ and "ray" not in aiomp.__all__
