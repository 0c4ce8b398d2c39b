"""Spawning: bad input refused clearly before any process starts: start methods, nprocs,
unpicklable or interactive functions, an unguarded main module, args.

How children are met and bounded: see ``tests/spawn/test_results.py``.
"""

from __future__ import annotations

import multiprocessing
import pickle
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._run import run_python
from tests.children import common as funcs
from tests.spawn._spawns import TIMEOUT

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


# -- bad input, refused before any process starts (R13) ------------------------------------


def _no_process_started() -> None:
    assert multiprocessing.active_children() == []


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["threads", "Spawn", ""])
async def test_unknown_start_method(start_method: str) -> None:
    with pytest.raises(ValueError, match="start_method"):
        await aiomp.spawn(funcs.echo, 1, start_method=start_method)
    with pytest.raises(ValueError, match="start_method"):
        async with aiomp.spawn(funcs.echo, 1, start_method=start_method):
            pytest.fail("the body must not run")
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("nprocs", [0, -1])
async def test_nprocs_below_one(nprocs: int) -> None:
    with pytest.raises(ValueError, match="nprocs"):
        await aiomp.spawn(funcs.echo, nprocs)
    with pytest.raises(ValueError, match="nprocs"):
        async with aiomp.start_processes(funcs.echo, nprocs):
            pytest.fail("the body must not run")
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("nprocs", [2.0, "2", None, True])
async def test_nprocs_of_the_wrong_type_is_a_type_error(nprocs: object) -> None:
    # Issue 25 item 13: as Python's pools (and aiomp.Pool's counts), a TypeError.
    with pytest.raises(TypeError, match="nprocs"):
        await aiomp.spawn(funcs.echo, nprocs)
    _no_process_started()


def _local_function(rank: int) -> int:
    return rank


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_unpicklable_function(start_method: str) -> None:
    """Issue 29: a lambda or a local function travels by value (tests/first); one that
    cannot be pickled even so (it holds a lock) is refused before any process starts."""
    lock = threading.Lock()

    def local(rank: int) -> int:
        with lock:
            return rank

    for fn in (lambda rank: lock, local):
        with pytest.raises(pickle.PicklingError, match="cannot be pickled") as info:
            await aiomp.spawn(fn, 1, start_method=start_method)
        assert "even by value" in str(info.value) and "lock" in str(info.value)
    _no_process_started()


@pytest.mark.anyio
async def test_function_from_interactive_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's or REPL's ``__main__`` has no file for children to import: its
    functions travel by value (issue 29; they were refused before)."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    fn = types.FunctionType(_local_function.__code__, {}, "notebook_fn")
    fn.__module__ = "__main__"
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(fn, 1)
        await ctx.join()


_STDIN_SCRIPT = textwrap.dedent("""
    import pickle

    import anyio

    import aiomp

    def work(rank):
        return rank

    async def main():
        ctx = await aiomp.spawn(work, 1)
        await ctx.join()
        print("joined")

    anyio.run(main)
""")


def test_function_from_a_script_read_from_stdin() -> None:
    """Regression (issue 11): a function defined in ``python -`` was not detected; the
    child died with ``FileNotFoundError: '<stdin>'`` and the parent saw "exit code 1".
    Issue 29: such a function travels by value (it was refused)."""
    out = run_python("-", input=_STDIN_SCRIPT, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["joined"]


_UNGUARDED = textwrap.dedent("""
    import anyio

    import aiomp

    def work(rank):
        return rank

    async def main():
        async with aiomp.spawn(work, 4, grace_period=1):
            pass

    anyio.run(main)  # no `if __name__ == "__main__":` guard
""")


def test_unguarded_main_module_gets_a_one_line_hint(tmp_path: Path) -> None:
    """Regression (issue 11): a script without the ``__main__`` guard made every spawned
    child re-run it; multiprocessing's "bootstrapping phase" error came out of each child
    in 115 to 346 lines, and the parent said only "exit code 1". Now each child reports
    one line and the parent's exception carries it."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, text=True, capture_output=True, timeout=TIMEOUT
    )
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert len(lines) < 60, out.stderr
    assert "bootstrapping phase" not in out.stderr
    assert lines[-1].startswith("RuntimeError: this child re-ran the parent's main module")
    assert 'protect the entry point with `if __name__ == "__main__":`' in lines[-1]
    assert any(line.startswith("aiomp.ProcessRaisedException: process ") for line in lines)


@pytest.mark.anyio
async def test_coroutine_object_instead_of_function() -> None:
    coro = funcs.async_echo(0)
    with pytest.raises(TypeError, match="coroutine"):
        await aiomp.spawn(coro, 1)  # type: ignore[arg-type]
    assert coro.cr_frame is None  # closed by aiomp: no "never awaited" warning later
    _no_process_started()


@pytest.mark.anyio
async def test_not_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        await aiomp.spawn(42, 1)  # type: ignore[arg-type]
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("args", [[1, 2], 1, "ab", None])
async def test_args_must_be_a_tuple(args: object) -> None:
    with pytest.raises(TypeError, match="tuple"):
        await aiomp.spawn(funcs.echo, 1, args=args)  # type: ignore[arg-type]
    _no_process_started()


@pytest.mark.anyio
async def test_unpicklable_args() -> None:
    with pytest.raises((TypeError, pickle.PicklingError)):
        await aiomp.spawn(funcs.echo, 2, args=(threading.Lock(),))
    _no_process_started()
