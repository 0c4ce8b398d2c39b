"""Functions children cannot import by name travel by value (issue 29, docs/design.md R13).

Lambdas, closures and local classes' methods, for ``spawn`` and ``Pool`` under every start
method; functions typed into ``python -c``, ``python -`` and a notebook-like ``__main__``
(subprocess drivers, under spawn and forkserver); a function of an importable module still
travels by reference; one that cannot be pickled at all is refused at the call.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import aiomp
from aiomp._wire import byvalue
from tests._run import run_python
from tests.children import pool as funcs

TIMEOUT = 60
#: Threads other tests left in this process (anyio's workers) make fork warn.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
METHODS = ["spawn", "forkserver", "fork"]


def _local_callables() -> list[object]:
    offset = 100

    def closure(x: int) -> int:
        return x + offset

    class Local:
        def __init__(self, k: int) -> None:
            self.k = k

        def times(self, x: int) -> int:
            return self.k * x

    return [lambda x: x + 1, closure, Local(3).times]


EXPECTED = [3, 102, 6]  # of each callable above, at 2


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_pool_runs_lambdas_closures_and_local_methods(start_method: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=start_method, grace_period=0.5) as pool:
            for fn, expected in zip(_local_callables(), EXPECTED, strict=True):
                assert await pool.apply(fn, (2,)) == expected
                assert await pool.map(fn, [2, 2]) == [expected, expected]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_spawn_runs_lambdas_closures_and_local_methods(
    start_method: str, tmp_path: Path
) -> None:
    offset = 100

    def closure(rank: int, out: Path) -> None:
        (out / str(rank + offset)).touch()

    class Local:
        def __init__(self, k: int) -> None:
            self.k = k

        def mark(self, rank: int, out: Path) -> None:
            (out / str(rank * self.k - 1)).touch()

    with anyio.fail_after(TIMEOUT):
        for fn in (closure, lambda rank, out: (out / str(-rank)).touch(), Local(7).mark):
            ctx = await aiomp.spawn(fn, 2, args=(tmp_path,), start_method=start_method)
            await ctx.join()
    assert sorted(int(p) for p in os.listdir(tmp_path)) == [-1, 0, 6, 100, 101]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_unpicklable_function_refused_before_any_process_starts(start_method: str) -> None:
    lock = threading.Lock()

    def holds(rank: int) -> None:
        with lock:
            pass

    with pytest.raises(pickle.PicklingError, match="cannot be pickled") as info:
        await aiomp.spawn(holds, 1, start_method=start_method)
    assert "lock" in str(info.value)
    assert multiprocessing.active_children() == []
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=start_method, grace_period=0.5) as pool:
            with pytest.raises(pickle.PicklingError, match="cannot be pickled"):
                await pool.apply(holds, (1,))
            assert pool.statistics().completed == 0  # nothing was sent
    with pytest.raises(pickle.PicklingError, match="initializer"):
        aiomp.Pool(1, initializer=holds, initargs=(0,))


def test_importable_functions_still_travel_by_reference() -> None:
    with byvalue.dumps(funcs.square_and_pid) as msg:
        assert b"cloudpickle" not in msg.body
        assert pickle.loads(msg.body) is funcs.square_and_pid
    with byvalue.dumps(lambda: 1) as msg:
        assert b"cloudpickle" in msg.body


def test_a_pool_sends_a_by_value_function_once_per_worker() -> None:
    """The worker keeps a function it received: a lambda's ``DEF`` is made once (an id),
    not carried by every task."""
    from aiomp._pool.tasks import fn_info

    fn = lambda x: x  # noqa: E731
    info = fn_info(fn)
    assert info.fid and b"cloudpickle" in info.define


# -- functions typed where children cannot import them ------------------------------------

_BODY = """
import asyncio
import aiomp

def typed_here(x):
    return x * FACTOR

FACTOR = 7

async def main():
    for method in ("spawn", "forkserver"):
        async with aiomp.Pool(1, start_method=method, grace_period=0.5) as pool:
            print(method, await pool.apply(typed_here, (6,)), await aiomp.run_sync(typed_here, 1))
        ctx = await aiomp.spawn(typed_here, 1, start_method=method)
        await ctx.join()

asyncio.run(main())
"""
_EXPECTED = ["spawn 42 7", "forkserver 42 7"]


def _run(argv: list[str], stdin: str | None = None) -> list[str]:
    return run_python(*argv, input=stdin, timeout=TIMEOUT * 2).stdout.splitlines()


def test_functions_typed_into_python_c() -> None:
    assert _run(["-c", _BODY]) == _EXPECTED


def test_functions_typed_into_python_stdin() -> None:
    assert _run(["-"], stdin=_BODY) == _EXPECTED


def test_functions_typed_into_a_notebook_like_main() -> None:
    """A notebook: cells executed one by one into a ``__main__`` with no file, by a kernel
    that was itself started by module name."""
    driver = textwrap.dedent(f"""
        import sys, types
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile({_BODY!r}, "<ipython-input-1>", "exec"), main.__dict__)
    """)
    assert _run(["-c", driver]) == _EXPECTED


@pytest.mark.anyio
async def test_a_worker_keeps_a_bounded_number_of_functions() -> None:
    """A closure made per call (a request handler's) gets an id and a ``DEF`` of its own:
    the worker keeps at most ``MAX_FNS`` of them, the oldest dropped on both sides alike,
    so that it neither grows without bound nor loses a function the parent still names."""
    from aiomp._pool import protocol as P

    def make(k: int) -> Callable[[], int]:
        return lambda: k

    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, grace_period=0.5) as pool:
            first = make(-1)
            assert await pool.apply(first) == -1
            fns = [make(k) for k in range(P.MAX_FNS + 5)]
            for k, fn in enumerate(fns):
                assert await pool.apply(fn) == k
            (handle,) = pool._engine.live_handles()
            assert len(handle.fns) == P.MAX_FNS  # type: ignore[attr-defined]
            assert await pool.apply(first) == -1  # dropped, and sent again
            assert await pool.apply(fns[-1]) == P.MAX_FNS + 4  # kept
