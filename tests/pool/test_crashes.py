"""``aiomp.Pool``'s contract when a worker crashes, a task times out or a caller is
cancelled, through the public API (split from test_pool.py; the same conventions).

A worker that dies fails only the tasks it held and is replaced; a timed-out or cancelled
task is cancelled in its worker (async) or its worker is killed (sync); leaving the pool's
block terminates what still runs.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import aiomp
from tests._gate import Gate
from tests._procs import dead
from tests.children import common as funcs
from tests.pool._pools import BACKENDS, FAST, asyncio_only, cases, pool, settled

TIMEOUT = 20

pytestmark = pytest.mark.anyio


# -- crashes -----------------------------------------------------------------------------

CRASHES = {
    "exit": (funcs.pool_exit, (3,), 3, None),
    "sigkill": (funcs.pool_kill_self, (signal.SIGKILL,), -signal.SIGKILL, "SIGKILL"),
    "sigsegv": (funcs.pool_kill_self, (signal.SIGSEGV,), -signal.SIGSEGV, "SIGSEGV"),
}


@pytest.mark.parametrize(
    "crash, anyio_backend",
    cases(*[("exit", b) for b in BACKENDS], ("sigkill", "asyncio"), ("sigsegv", "asyncio")),
)
async def test_crash_fails_only_its_tasks_and_the_pool_goes_on(crash: str, gate: Gate) -> None:
    fn, args, code, sig = CRASHES[crash]
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            survivor: list[object] = []

            async def bystander() -> None:
                survivor.append(await p.apply(funcs.pool_gate, (0, gate.address, "ok")))

            tg.start_soon(bystander)
            await gate.ready(1)
            with pytest.raises(aiomp.BrokenWorkerError) as info:
                await p.apply(fn, args)
            err = info.value
            assert isinstance(err, aiomp.ProcessExitedException)
            assert (err.exit_code, err.signal_name) == (code, sig)
            assert err.pid not in (gate.pids[0], None) and dead(err.pid)
            assert fn.__name__ in str(err)
            gate.release(0)
        assert survivor and survivor[0][0] == "ok"  # type: ignore[index]


@asyncio_only
async def test_crash_is_replaced_and_the_pool_goes_on() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pool_pid)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.map(funcs.pool_exit, [5])
            assert dead(pid)
            new = await p.apply(funcs.pool_pid)
            assert new != pid and p.pids() == [new]
            stats = p.statistics()
            assert (stats.workers, stats.replaced) == (1, 1)
            assert await p.map(funcs.pool_square, range(5)) == [0, 1, 4, 9, 16]


@asyncio_only
async def test_crash_fails_every_task_its_worker_held(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=3) as p, anyio.create_task_group() as tg:
            errors: list[BaseException] = []

            async def held(n: int) -> None:
                try:
                    await p.apply(funcs.pool_async_gate, (n, gate.address))
                except aiomp.BrokenWorkerError as exc:
                    errors.append(exc)

            tg.start_soon(held, 0)
            tg.start_soon(held, 1)
            await gate.ready(2)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.pool_async_exit, (9,))
        assert len(errors) == 2 and all(e.exit_code == 9 for e in errors)  # type: ignore[attr-defined]


# -- timeout and cancellation ------------------------------------------------------------


async def test_timeout_terminates_a_sync_task_and_replaces_its_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(TimeoutError):
                await p.apply(funcs.pool_block, (0, gate.address), timeout=0.5)
            old = (await gate.ready(1))[0]  # it said ready before it was killed
            assert dead(old)
            assert await p.apply(funcs.pool_pid) != old
            assert p.statistics().replaced == 1


async def test_timeout_cancels_an_async_task_in_its_worker(gate: Gate, tmp_path: Path) -> None:
    marker = tmp_path / "cancelled"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            # The worker's event loop first: starting it (importing asyncio) can take
            # longer than the timeout below on a busy machine, and a task cancelled
            # before it starts never reaches the gate (it failed so at a load of 15).
            assert await p.apply(funcs.pool_async_square, (2,)) == 4
            with pytest.raises(TimeoutError):
                await p.apply(funcs.pool_async_block, (0, gate.address, str(marker)), timeout=0.5)
            await gate.ready(1)
            assert marker.read_text() == "cancelled"  # its coroutine saw CancelledError
            assert await p.apply(funcs.pool_pid) == gate.pids[0]  # and the worker lives on
            assert p.statistics().replaced == 0


@asyncio_only
async def test_async_task_that_ignores_cancellation_is_killed(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            # Cancelled once it runs (a timeout could pass before it starts on a busy
            # machine, and then it would never reach the gate).
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.pool_async_block_ignoring_cancel, (0, gate.address))
                await gate.ready(1)
                tg.cancel_scope.cancel()
            assert dead(gate.pids[0])
            assert await p.apply(funcs.pool_pid) != gate.pids[0]


async def test_cancelling_a_caller_kills_its_running_task(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:

            async def call() -> None:
                await p.apply(funcs.pool_block, (0, gate.address))

            tg.start_soon(call)
            pid = (await gate.ready(1))[0]
            tg.cancel_scope.cancel()
        assert dead(pid)  # terminated before the cancellation went on
        assert p.statistics().replaced == 1


async def test_cancelled_queued_task_never_starts(gate: Gate, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, funcs.pool_gate, (0, gate.address))
            await gate.ready(1)
            with anyio.CancelScope() as scope:

                async def queued() -> None:
                    await p.apply(funcs.pool_append, (str(marker), "ran"))

                async with anyio.create_task_group() as inner:
                    inner.start_soon(queued)
                    await settled()
                    assert p.statistics().queued == 1
                    scope.cancel()
            assert p.statistics().queued == 0
            gate.release(0)
            assert await p.apply(funcs.pool_square, (2,)) == 4
        assert not marker.exists()
        assert p.statistics().replaced == 0


@asyncio_only
async def test_cancelling_map_stops_its_chunks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            with anyio.move_on_after(0.5):
                await p.starmap(
                    funcs.pool_block, [(i, gate.address) for i in range(6)], chunksize=1
                )
            pids = await gate.ready(2)  # the two that ran; the other four never started
            assert all(dead(pid) for pid in pids.values())
            stats = p.statistics()
            assert (stats.running, stats.queued, stats.replaced) == (0, 0, 2)
            assert await p.map(funcs.pool_square, range(4)) == [0, 1, 4, 9]


async def test_cancelling_the_pool_block_terminates_every_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with pool(2) as p, anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.pool_block, (0, gate.address))
                await gate.ready(1)
                pids = p.pids()
                scope.cancel()
        assert scope.cancelled_caught
    assert len(pids) == 2 and all(dead(pid) for pid in pids)


@asyncio_only
async def test_error_in_the_pool_block_terminates_every_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(KeyError):  # the body's error itself, not a group
            async with pool(2) as p:
                await p.apply(funcs.pool_square, (1,))
                pids = p.pids()
                raise KeyError("body")
    assert all(dead(pid) for pid in pids)


@asyncio_only
async def test_cancelled_while_starting_leaves_nothing() -> None:
    for method in ("spawn", FAST):
        with anyio.fail_after(TIMEOUT):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with pool(2, start_method=method) as p:
                    await p.apply(funcs.pool_square, (1,))
            assert scope.cancelled_caught


@asyncio_only
async def test_cancelled_while_leaving_terminates_running_tasks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            errors: list[BaseException] = []

            async def outside(p: aiomp.Pool) -> None:
                try:
                    await p.apply(funcs.pool_block, (0, gate.address))
                except aiomp.BrokenWorkerError as exc:
                    errors.append(exc)

            with anyio.move_on_after(0.5) as scope:
                async with pool(1) as p:
                    tg.start_soon(outside, p)
                    await gate.ready(1)
                    # leaving normally waits for the running task: the deadline cancels that
            assert scope.cancelled_caught
        assert dead(gate.pids[0])
        assert len(errors) == 1 and "shutting down" in str(errors[0])


async def test_leaving_normally_waits_for_running_tasks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            results: list[object] = []

            async def outside(p: aiomp.Pool) -> None:
                results.append(await p.apply(funcs.pool_gate, (0, gate.address, "done")))

            async def release_once_all_wait() -> None:
                await settled()  # the pool is waiting to close
                gate.release(0)

            async with pool(1) as p:
                tg.start_soon(outside, p)
                await gate.ready(1)
                tg.start_soon(release_once_all_wait)
            assert results and results[0][0] == "done"  # type: ignore[index]
            with pytest.raises(RuntimeError, match="closed"):
                await p.apply(funcs.pool_square, (1,))
