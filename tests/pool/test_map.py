"""``Pool.map``'s critical path: when its chunks go out, and what a cancelled caller sends.

See docs/decisions/0029-map-chunks.md. Workers are never slept on; every await
is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import math

import anyio
import anyio.lowlevel
import pytest

from tests.children import common as funcs
from tests.pool._pools import pool

TIMEOUT = 20

pytestmark = pytest.mark.anyio

asyncio_loops = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)


@asyncio_loops
async def test_map_sends_its_chunks_before_it_first_yields() -> None:
    """Regression: ``map`` yielded to the loop (a checkpoint) before sending its first
    chunk, so a worker waiting for work waited one more loop iteration on every map's
    critical path. A callback scheduled just before the call runs at its first yield:
    the chunks must already be with the worker by then."""
    seen: list[int] = []
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            await p.apply(funcs.pool_square, (2,))  # the worker is ready
            loop = asyncio.get_running_loop()
            loop.call_soon(lambda: seen.append(p.statistics().running))
            assert await p.map(funcs.pool_square, range(40)) == [x * x for x in range(40)]
    assert seen and seen[0] >= 1, seen


async def test_map_in_a_cancelled_scope_sends_nothing() -> None:
    """A map called where a cancellation is pending raises it and starts no chunk: a
    cancelled scope, and a deadline already past (seen on asyncio before the scope's
    own callback has run)."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            await p.apply(funcs.pool_square, (2,))
            before = p.statistics().completed
            with anyio.CancelScope() as scope:
                scope.cancel()
                await p.map(funcs.pool_square, range(40))
            assert scope.cancelled_caught
            with anyio.move_on_after(-1) as late:
                await p.map(funcs.pool_square, range(40))
            assert late.cancelled_caught
            s = p.statistics()
            assert (s.running, s.queued, s.completed) == (0, 0, before)
            assert await p.map(funcs.pool_square, range(3)) == [0, 1, 4]


async def test_map_results_are_in_order_whatever_the_chunking() -> None:
    """Each chunk's results land in their place in a list made when the first comes."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            for n, chunksize in ((1, None), (7, None), (100, 3), (101, None), (50, 50)):
                got = await p.map(funcs.pool_square, range(n), chunksize)
                assert got == [x * x for x in range(n)], (n, chunksize)
            assert await p.map(funcs.pool_square, []) == []
            items = list(range(33))
            assert await p.map(funcs.pool_square, items, math.ceil(33 / 4)) == [
                x * x for x in items
            ]
