"""How a Pool's tasks travel to its workers (``aiomp._pool`` / ``aiomp._worker``).

A plain function is pickled by reference and sent to each worker once (a ``DEF``), then
named by number; any other callable travels by value with every task. These tests pin
what that must not change: a function the worker cannot load fails its tasks with the
error the worker met, every time, and the pool goes on; a replacement worker is taught
the functions again; partials, builtins and bound methods see their current state.
"""

from __future__ import annotations

import functools
import operator
import sys
import types
from collections.abc import Callable, Iterator

import anyio
import pytest

import aiomp
from aiomp import _pool
from tests import _funcs as funcs

pytestmark = [pytest.mark.anyio,
              pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])]

TIMEOUT = 20


def pool(processes: int = 1) -> aiomp.Pool:
    return aiomp.Pool(processes, start_method="forkserver", grace_period=0.3)


@pytest.fixture
def ghost() -> Iterator[Callable[[], int]]:
    """A function of a module that exists only in this process: it pickles here, by
    reference, and cannot be unpickled in a worker."""
    mod = types.ModuleType("aiomp_test_ghost_module")

    def ghost_fn() -> int:
        return 1

    ghost_fn.__module__ = mod.__name__
    ghost_fn.__qualname__ = ghost_fn.__name__ = "ghost_fn"
    mod.ghost_fn = ghost_fn  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield ghost_fn
    del sys.modules[mod.__name__]


async def test_a_function_the_worker_cannot_load_fails_each_of_its_tasks(
        ghost: Callable[[], int]) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            for _ in range(2):  # the second task names the function the worker failed on
                with pytest.raises(ModuleNotFoundError, match="aiomp_test_ghost_module") as info:
                    await p.apply(ghost)
                assert "could not be unpickled in the worker" in str(info.value.__cause__)
            assert await p.apply(funcs.pool_square, (3,)) == 9


async def test_a_function_is_sent_to_each_worker_once() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pool_pid)
            for _ in range(3):
                assert await p.apply(funcs.pool_pid) == pid
            assert await p.map(funcs.pool_square, range(4)) == [0, 1, 4, 9]
            (w,) = p._workers
            assert w.fids == {_pool._fn_info(funcs.pool_pid).fid,
                              _pool._fn_info(funcs.pool_square).fid}


async def test_a_replacement_worker_is_taught_the_function_again() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            assert await p.apply(funcs.pool_square, (2,)) == 4
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.pool_exit, (3,))
            assert await p.apply(funcs.pool_square, (5,)) == 25


async def test_other_callables_travel_with_their_current_state() -> None:
    class Box:
        value = 1

        def get(self) -> int:
            return self.value

    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            assert await p.apply(functools.partial(funcs.pool_add, 1), (2,)) == 3
            assert await p.apply(functools.partial(funcs.pool_add, 1, c=10), (2,)) == 13
            assert await p.apply(operator.add, (2, 3)) == 5
            assert await p.apply((7).__add__, (1,)) == 8
            assert await p.apply(funcs.pool_add, (1, 2), {"c": 3}) == 6
            assert await p.starmap(funcs.pool_add, [(1, 2), (3, 4)]) == [3, 7]
            with pytest.raises(Exception, match=r"local object|Can't pickle"):
                await p.apply(Box().get)  # a local class: not by reference, and says so
