"""aiomp inside a user's own pytest-asyncio suite.

The rest of the suite runs each async test on asyncio, uvloop and trio through
conftest's plain runner. Services test their code with pytest-asyncio instead, whose
runner, loop scoping and async fixtures differ; these tests are written that way (strict
mode: ``@pytest.mark.asyncio``).

A Pool held by a pytest-asyncio *yield fixture* is entered in one task and left in
another (pytest-asyncio runs a fixture's setup and teardown in different tasks, its issue
1191): see *Hosted task group* in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio

import aiomp
from tests.children import pool as pool_funcs


@pytest_asyncio.fixture
async def pool() -> AsyncIterator[aiomp.Pool]:
    async with aiomp.Pool(2) as p:
        yield p


@pytest.mark.asyncio
async def test_pool_in_a_yield_fixture(pool: aiomp.Pool) -> None:
    """A Pool entered in the fixture's setup task and left in its teardown task closes
    cleanly: no "exit cancel scope in a different task" error, no worker left alive."""
    assert await pool.apply(pool_funcs.square, (7,)) == 49


@pytest.mark.asyncio
async def test_pool_entered_and_left_in_different_tasks() -> None:
    """What a fixture does, spelled out: enter in one task, use and leave in others. The
    workers are reaped by the time ``__aexit__`` returns."""
    p = aiomp.Pool(2)
    await asyncio.create_task(p.__aenter__())
    assert await asyncio.create_task(p.apply(pool_funcs.square, (5,))) == 25
    await asyncio.create_task(p.__aexit__(None, None, None))
    with pytest.raises(RuntimeError, match="closed"):
        await p.apply(pool_funcs.square, (5,))


@pytest.mark.asyncio
async def test_pool_in_a_test() -> None:
    async with aiomp.Pool(2) as pool:
        assert await pool.apply(pool_funcs.square, (7,)) == 49
        assert await pool.map(pool_funcs.square, range(20)) == [x * x for x in range(20)]


@pytest.mark.asyncio
async def test_pool_call_cancelled_by_asyncio_timeout() -> None:
    """A call that times out is cancelled (its worker killed), and the pool serves on."""
    from tests.children import common as funcs

    async with aiomp.Pool(2) as pool:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.apply(funcs.block_forever)
        assert await pool.apply(pool_funcs.square, (3,)) == 9


@pytest.mark.asyncio
async def test_queue_carries_an_array_through_a_child() -> None:
    from tests.children import memory as funcs_shm

    q, back = aiomp.Queue(4), aiomp.Queue(4)
    async with aiomp.spawn(funcs_shm.shm_echo_many, 1, args=(q, back), grace_period=0.3) as ctx:
        a = np.arange(100_000, dtype=np.float64)
        await q.put(a)
        b = await back.get()
        assert np.array_equal(a, b) and aiomp.is_shared(b)
        del b
        q.close()
    assert len(ctx.results) == 1


@pytest_asyncio.fixture
async def spawned() -> AsyncIterator[None]:
    """A spawn held by a yield fixture: its teardown runs in another task."""
    from tests.children import common as funcs

    with pytest.raises(RuntimeError, match="left by another task"):
        async with aiomp.spawn(funcs.block_forever, 1, grace_period=0.3):
            yield


@pytest.mark.asyncio
async def test_spawn_in_a_yield_fixture_says_why_at_teardown(spawned: None) -> None:
    """spawn cannot be hosted like the Pool (a child's failure cancels its block): left by
    pytest-asyncio's teardown task, it terminates its children, closes all and says why;
    the fixture above checks the message, the leak check the rest."""
