"""aiomp inside a user's own pytest-asyncio suite.

The rest of the suite runs each async test on asyncio, uvloop and trio through
conftest's plain runner. Services test their code with pytest-asyncio instead, whose
runner, loop scoping and async fixtures differ; these tests are written that way (strict
mode: ``@pytest.mark.asyncio``).

Not covered, because it does not work: a Pool held by a pytest-asyncio *yield fixture*.
pytest-asyncio runs a fixture's setup and teardown in different tasks (its issue 1191,
open), and the Pool's task group must be left by the task that entered it; anyio's
pytest plugin runs both in one task.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiomp
from tests import _funcs_pool


@pytest.mark.asyncio
async def test_pool_in_a_test() -> None:
    async with aiomp.Pool(2) as pool:
        assert await pool.apply(_funcs_pool.square, (7,)) == 49
        assert await pool.map(_funcs_pool.square, range(20)) == [x * x for x in range(20)]


@pytest.mark.asyncio
async def test_pool_call_cancelled_by_asyncio_timeout() -> None:
    """A call that times out is cancelled (its worker killed), and the pool serves on."""
    from tests import _funcs

    async with aiomp.Pool(2) as pool:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.apply(_funcs.block_forever)
        assert await pool.apply(_funcs_pool.square, (3,)) == 9


@pytest.mark.asyncio
async def test_queue_carries_an_array_through_a_child() -> None:
    from tests import _funcs

    q, back = aiomp.Queue(4), aiomp.Queue(4)
    async with aiomp.spawn(_funcs.shm_echo_many, 1, args=(q, back), grace_period=0.3) as ctx:
        a = np.arange(100_000, dtype=np.float64)
        await q.put(a)
        b = await back.get()
        assert np.array_equal(a, b) and aiomp.is_shared(b)
        del b
        q.close()
    assert len(ctx.results) == 1
