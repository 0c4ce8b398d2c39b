"""One behaviour suite over every kind of worker: a fake kind (threads, no processes)
and the three start methods of the process kind here; Ray actors in
``test_worker_kinds_ray.py``, which runs these same tests. What the Pool promises does
not depend on the kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

import aiomp
from aiomp._pool.protocol import RemoteTraceback
from tests.children import contract as funcs
from tests.contract._fake_kind import fake_pool

#: The fake kind's worker threads, and the thread caches of trio and anyio that other
#: tests filled, linger in this process: the fork kind's start would warn of them (a
#: warning tests/spawn and tests/pool check where it matters).
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning"),
]

TIMEOUT = 60
GRACE = 0.3


def _process(method: str) -> Callable[[], Any]:
    return lambda: aiomp.Pool(2, start_method=method, grace_period=GRACE)


KINDS = {
    "fake": lambda: fake_pool(2, GRACE),
    "spawn": _process("spawn"),
    "forkserver": _process("forkserver"),
    "fork": _process("fork"),
}


@pytest.fixture(params=list(KINDS))
def make_pool(request: pytest.FixtureRequest, anyio_backend: Any) -> Callable[[], Any]:
    kind = request.param
    if kind != "fake" and anyio_backend[0] != "asyncio":
        pytest.skip("the process kinds run under every loop in tests/test_pool*.py")
    return KINDS[kind]


async def test_apply_and_map(make_pool: Callable[[], Any]) -> None:
    with anyio.fail_after(TIMEOUT):
        async with make_pool() as pool:
            assert await pool.apply(funcs.square, (7,)) == 49
            assert await pool.map(funcs.square, range(10)) == [x * x for x in range(10)]


async def test_an_error_comes_with_its_traceback(make_pool: Callable[[], Any]) -> None:
    with anyio.fail_after(TIMEOUT):
        async with make_pool() as pool:
            with pytest.raises(LookupError, match="refused this") as info:
                await pool.apply(funcs.refuse, ("this",))
            assert isinstance(info.value.__cause__, RemoteTraceback)
            assert "refuse" in str(info.value.__cause__)


async def test_a_timeout_stops_the_task_and_the_pool_serves_on(
    make_pool: Callable[[], Any],
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with make_pool() as pool:
            with pytest.raises(TimeoutError):
                await pool.apply(funcs.nap, (30,), timeout=0.2)
            assert await pool.apply(funcs.square, (3,)) == 9


async def test_a_cancelled_call_stops_its_task(make_pool: Callable[[], Any]) -> None:
    with anyio.fail_after(TIMEOUT):
        async with make_pool() as pool:
            with anyio.move_on_after(0.2) as scope:
                await pool.apply(funcs.nap, (30,))
            assert scope.cancelled_caught
            assert await pool.apply(funcs.square, (4,)) == 16


async def test_a_worker_that_dies_fails_its_task_and_is_replaced(
    make_pool: Callable[[], Any],
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with make_pool() as pool:
            with pytest.raises(aiomp.BrokenWorkerError):
                await pool.apply(funcs.die, (3,))
            assert await pool.apply(funcs.square, (5,)) == 25
            assert pool.statistics().replaced >= 1


async def test_leaving_waits_for_the_tasks_then_calls_are_refused(
    make_pool: Callable[[], Any],
) -> None:
    with anyio.fail_after(TIMEOUT):
        results: list[int] = []
        async with make_pool() as pool:

            async def one(x: int) -> None:
                results.append(await pool.apply(funcs.square, (x,)))

            async with anyio.create_task_group() as tg:
                for x in range(4):
                    tg.start_soon(one, x)
        assert sorted(results) == [0, 1, 4, 9]
        with pytest.raises(RuntimeError, match="closed"):
            await pool.apply(funcs.square, (1,))
