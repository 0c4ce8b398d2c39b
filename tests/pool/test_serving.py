"""Serving that survives real traffic (issue 40): a bad row fails only its own caller, a
batch goes when a worker is free and fills while none is, ``wait_ready`` before
traffic, ``max_pending`` sheds load, and a worker's death is in the log.

On asyncio, uvloop and trio. No sleeps: a worker the test must hold meets it at a
:class:`Gate`; every await is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import Any

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common
from tests.children import serve as funcs
from tests.pool import _pools as pools
from tests.pool._pools import settled
from tests.pool.test_batched import gather

TIMEOUT = 30
pool = functools.partial(pools.pool, grace_period=0.5)

pytestmark = pytest.mark.anyio


# -- 1. a bad row fails alone ----------------------------------------------------------


async def test_a_bad_row_fails_only_its_own_caller(anyio_backend: object) -> None:
    """issue 40 item 1: 2 bad rows of 8 took down all 8 callers. Now the failed batch's
    rows run again (halves, down to single rows): only the two bad callers fail, each
    with its own row's exception and the worker's traceback."""
    xs = [0, 1, 2, -3, 4, 5, -6, 7]
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            b = p.batched(funcs.fails_on_negative, max_batch_size=8, max_delay=60)
            got = await gather(b, xs)
    for x, r in zip(xs, got, strict=True):
        if x < 0:
            assert isinstance(r, ValueError), r
            assert str(r) == f"negative rows [{x}]"  # run on its own
            assert "in fails_on_negative" in str(r.__cause__)
        else:
            assert r[0] == 2 * x, r


async def test_a_bad_stacked_row_fails_alone(anyio_backend: object) -> None:
    """issue 40 item 1, stack=True: the halves are stacked again from the callers' rows."""
    import numpy as np

    xs = [np.full(3, float(i)) for i in range(6)]
    xs[4][0] = np.nan
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            b = p.batched(funcs.finite_or_raise, max_batch_size=6, max_delay=60, stack=True)
            got = await gather(b, xs)
    for i, r in enumerate(got):
        if i == 4:
            assert isinstance(r, ValueError) and "1 row(s) not finite" in str(r), r
        else:
            assert isinstance(r, np.ndarray) and (r == 2.0 * i).all(), r


# -- 2. a batch goes when a worker is free, and fills while none is ---------------------


async def test_a_lone_call_on_an_idle_pool_does_not_wait_for_max_delay(
    anyio_backend: object,
) -> None:
    """issue 40 item 2: a lone call waited the whole max_delay. With max_delay=60 the
    call must come back well within the test's timeout: it goes to the free worker."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await p.wait_ready()
            b = p.batched(funcs.double_all, max_batch_size=32, max_delay=60)
            for x in range(3):
                assert await b(x) == (2 * x, 1)


async def test_a_batch_keeps_filling_while_every_worker_is_busy(
    anyio_backend: object, gate: Gate
) -> None:
    """issue 40 item 2: with the only worker busy, calls arriving one by one went out in
    batches of max_delay's worth (2 rows). Now they fill one batch (max_delay=0 even),
    up to max_batch_size, until the worker is free."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p, anyio.create_task_group() as tg:
            b = p.batched(funcs.double_all, max_batch_size=8, max_delay=0)
            results: dict[int, Any] = {}

            async def call(x: int) -> None:
                results[x] = await b(x)

            tg.start_soon(p.apply, common.gate_wait, (0, gate.address))
            await gate.ready(1)
            for x in range(20):
                tg.start_soon(call, x)
                await settled()  # one at a time
            gate.release()
    sizes = sorted(r[1] for r in results.values())
    assert sizes == [4] * 4 + [8] * 16, sizes  # batches of 8, 8 (full, queued) and 4
    assert all(results[x][0] == 2 * x for x in range(20))


async def test_leaving_the_pool_runs_the_open_batch(anyio_backend: object, gate: Gate) -> None:
    """issue 40 (the dispatcher): callers waiting in an open batch (the only worker busy)
    from outside the pool's block when it is left normally: the batch is queued as the
    pool drains, and they get their results."""
    results: dict[int, Any] = {}
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as outer:
            async with pool() as p:
                b = p.batched(funcs.double_all, max_batch_size=8, max_delay=60)

                async def call(x: int) -> None:
                    results[x] = await b(x)

                async def release_once_leaving() -> None:
                    await settled()  # the pool's exit waits for the gate's task
                    gate.release()

                outer.start_soon(p.apply, common.gate_wait, (0, gate.address))
                await gate.ready(1)
                for x in range(3):
                    outer.start_soon(call, x)
                await settled()
                outer.start_soon(release_once_leaving)
    assert results == {0: (0, 3), 1: (2, 3), 2: (4, 3)}


async def test_a_broken_pool_fails_the_open_batch(anyio_backend: object) -> None:
    """issue 40 (the dispatcher): calls waiting for a worker that will never come (the
    initializer raises) fail with BrokenPoolError rather than wait forever."""
    with anyio.fail_after(TIMEOUT):
        async with pool(initializer=common.pool_init_fail) as p:
            b = p.batched(funcs.double_all, max_delay=60)
            for r in await gather(b, [1, 2, 3]):
                assert isinstance(r, aiomp.BrokenPoolError), r


# -- 3. wait_ready ---------------------------------------------------------------------


async def test_wait_ready_returns_once_every_worker_has_run_the_initializer(
    anyio_backend: object, gate: Gate
) -> None:
    """issue 40 item 3: `async with Pool(...)` returns at once; wait_ready returns only
    once both workers' (slow) initializers have run."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=funcs.init_at_gate, initargs=(gate.address,)) as p:
            done = anyio.Event()

            async def waiter() -> None:
                await p.wait_ready()
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                pids = await gate.ready(2)  # both initializers run, held at the gate
                await settled()
                assert not done.is_set()
                gate.release(*pids)
            assert p.statistics().idle == 2
            await p.wait_ready()  # and again: at once


async def test_wait_ready_raises_the_initializers_error(anyio_backend: object) -> None:
    """issue 40 item 3: a model that cannot load: BrokenPoolError whose __cause__ is the
    initializer's own exception, with the worker's traceback."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=common.pool_init_fail) as p:
            with pytest.raises(aiomp.BrokenPoolError) as info:
                await p.wait_ready()
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "the initializer refuses" in str(cause)
    assert "in pool_init_fail" in str(cause.__cause__)


async def test_wait_ready_outside_async_with_raises() -> None:
    p = pool()
    with pytest.raises(RuntimeError, match="not started"):
        await p.wait_ready()
    with anyio.fail_after(TIMEOUT):
        async with p:
            pass
    with pytest.raises(RuntimeError, match="closed"):
        await p.wait_ready()


# -- 4. max_pending --------------------------------------------------------------------


async def test_max_pending_refuses_at_once_and_accepts_again(
    anyio_backend: object, gate: Gate
) -> None:
    """issue 40 item 4: a burst queued without limit. With max_pending=2, the third task
    not started is refused at once (PoolOverloadedError) and never runs; a batch that
    cannot be queued waits for room while later callers are refused; once the queue
    drains, calls are accepted again."""
    with anyio.fail_after(TIMEOUT):
        async with pool(max_pending=2) as p:
            await p.wait_ready()
            b = p.batched(funcs.double_all, max_batch_size=2, max_delay=0)
            got: dict[str, Any] = {}
            async with anyio.create_task_group() as tg:

                async def keep(name: str, call: Any, *args: Any) -> None:
                    got[name] = await call(*args)

                tg.start_soon(p.apply, common.gate_wait, (0, gate.address))  # running
                await gate.ready(1)
                tg.start_soon(keep, "a", p.apply, common.pool_square, (2,))  # pending 1
                tg.start_soon(keep, "b", p.apply, common.pool_square, (3,))  # pending 2
                await settled()
                assert p.statistics().queued == 2
                with pytest.raises(aiomp.PoolOverloadedError) as info:
                    await p.apply(common.pool_square, (4,))
                assert info.value.max_pending == 2
                with pytest.raises(aiomp.PoolOverloadedError):
                    await p.map(common.pool_square, range(3))
                tg.start_soon(keep, "x", b, 1)  # a full batch of two: waits for room
                tg.start_soon(keep, "y", b, 2)
                await settled()
                with pytest.raises(aiomp.PoolOverloadedError):
                    await b(3)  # no batch to join
                gate.release()
            assert got == {"a": 4, "b": 9, "x": (2, 2), "y": (4, 2)}
            assert await p.apply(common.pool_square, (5,)) == 25  # accepted again
            assert p.statistics().completed == 5  # the refused calls never ran


async def test_max_pending_zero_refuses_what_no_worker_can_start(
    anyio_backend: object, gate: Gate
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(max_pending=0) as p:
            await p.wait_ready()
            assert await p.apply(common.pool_square, (3,)) == 9  # a free worker: runs
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, common.gate_wait, (0, gate.address))
                await gate.ready(1)
                with pytest.raises(aiomp.PoolOverloadedError):
                    await p.apply(common.pool_square, (4,))
                gate.release()


def test_max_pending_is_checked() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        aiomp.Pool(1, max_pending=-1)
    with pytest.raises(TypeError, match="max_pending"):
        aiomp.Pool(1, max_pending="8")  # type: ignore[arg-type]


def test_overloaded_error_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(aiomp.PoolOverloadedError("full", 8)))
    assert isinstance(err, aiomp.PoolOverloadedError) and err.max_pending == 8
    assert str(err) == "full" and isinstance(err, RuntimeError)


# -- 5. a worker's death is in the log ----------------------------------------------------


async def test_a_workers_death_is_logged_at_warning(
    anyio_backend: object, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 40 item 5: the callers got BrokenWorkerError, the log nothing. Now one
    WARNING on the `aiomp` logger names the worker's pid, its signal and the task it ran;
    the pool's own kills (a timeout) and exits are not warned about."""
    caplog.set_level(logging.INFO, logger="aiomp")
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            pid = await p.apply(os.getpid)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(os.kill, (pid, signal.SIGKILL))
            with pytest.raises(TimeoutError):
                await p.apply(common.block_forever, timeout=0.5)
    deaths = [
        r
        for r in caplog.records
        if r.name == "aiomp" and r.levelno == logging.WARNING and "terminated" in r.getMessage()
    ]
    assert len(deaths) == 1, [r.getMessage() for r in deaths]
    message = deaths[0].getMessage()
    assert f"pid {pid}" in message and "SIGKILL" in message, message
    assert "while it ran kill" in message, message


# -- 7. a batcher made again and again ---------------------------------------------------


async def test_a_batcher_made_again_warns(anyio_backend: object) -> None:
    """issue 40 item 7: `pool.batched(...)` made in each request handler batches nothing:
    a second live one for the same function and settings warns."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            first = p.batched(funcs.double_all)
            with pytest.warns(RuntimeWarning, match="made again"):
                second = p.batched(funcs.double_all)
            assert await first(1) == (2, 1) and await second(2) == (4, 1)
            p.batched(funcs.double_all, max_batch_size=4)  # other settings: fine
