"""Contract tests for spawning (``aiomp.spawn`` / ``start_processes`` / ``ProcessContext``)
that succeed: results by rank, async functions, joins, start methods, large args, daemons.

README "Spawning" and R7-R10 (docs/architecture.md), R12-R14, through the public API only, on
asyncio, uvloop and trio. Children never get slept on: each one that must be waited for
meets the test at a :class:`Gate` (a unix socket), and every await on a child is bounded
by ``anyio.fail_after``.
"""

from __future__ import annotations

import functools
import os

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common as funcs
from tests.spawn._spawns import GRACE, METHODS, TIMEOUT, exitcodes

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


# -- success -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_with_returns_results_by_rank() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 3, args=(1, "a"), grace_period=GRACE) as ctx:
            assert isinstance(ctx, aiomp.ProcessContext)
            assert len(ctx.pids()) == 3
        assert ctx.results == [(0, (1, "a")), (1, (1, "a")), (2, (1, "a"))]
        assert exitcodes(ctx) == [0, 0, 0]
        assert await ctx.join() is True  # callable again once done
        assert await ctx.join(timeout=0) is True


@pytest.mark.anyio
async def test_start_processes_is_spawn() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.start_processes(funcs.echo, 2, args=("x",), grace_period=GRACE) as ctx:
            pass
        assert ctx.results == [(0, ("x",)), (1, ("x",))]
        ctx = await aiomp.start_processes(funcs.echo, 1, grace_period=GRACE)
        assert await ctx.join() is True
        assert ctx.results == [(0, ())]


@pytest.mark.anyio
async def test_async_fn_runs_on_a_fresh_loop() -> None:
    try:
        import uvloop  # noqa: F401

        loop_module = "uvloop"
    except ImportError:
        loop_module = "asyncio.unix_events"
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.async_echo, 2, args=("x",), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [(0, ("x",), loop_module), (1, ("x",), loop_module)]


@pytest.mark.anyio
async def test_partial_of_async_fn_is_async() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            functools.partial(funcs.async_echo), 1, args=("y",), grace_period=GRACE
        ) as ctx:
            pass
    assert ctx.results[0][:2] == (0, ("y",))  # type: ignore[index]


@pytest.mark.anyio
async def test_await_spawn_then_join_with_timeout(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.wait_then_return, 2, args=(gate.address,), grace_period=GRACE)
        assert isinstance(ctx, aiomp.ProcessContext)
        pids = await gate.ready(2)
        assert ctx.pids() == [pids[0], pids[1]]
        assert [p.pid for p in ctx.processes] == ctx.pids()
        with pytest.raises(RuntimeError, match="join"):
            ctx.results  # noqa: B018 - not filled before join() returns True

        assert await ctx.join(timeout=0) is False  # both ranks are held at the gate
        assert await ctx.join(timeout=0.05) is False  # and a timeout terminates nothing
        gate.release(0)
        assert await ctx.join(timeout=0.05) is False  # rank 1 still is
        gate.release(1)
        assert await ctx.join() is True
        assert ctx.results == [0, 10]
        assert await ctx.join(timeout=0.05) is True


@pytest.mark.anyio
async def test_concurrent_joins_all_return(gate: Gate) -> None:
    results: list[bool] = []

    async def join(ctx: aiomp.ProcessContext) -> None:
        results.append(await ctx.join())

    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.wait_then_return, 2, args=(gate.address,), grace_period=GRACE)
        await gate.ready(2)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(join, ctx)
            await anyio.wait_all_tasks_blocked()
            gate.release()
    assert results == [True, True, True]
    assert ctx.results == [0, 10]


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("fn", [funcs.echo, funcs.async_echo], ids=["sync", "async"])
async def test_start_methods(start_method: str, fn: object) -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            fn,
            2,
            args=(b"abc",),
            start_method=start_method,  # type: ignore[arg-type]
            grace_period=GRACE,
        ) as ctx:
            pass
    assert [r[:2] for r in ctx.results] == [(0, (b"abc",)), (1, (b"abc",))]  # type: ignore[index]


@pytest.mark.anyio
async def test_fork_runs_unpicklable_functions() -> None:
    offset = 5

    def local(rank: int) -> int:
        return rank + offset

    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(local, 2, start_method="fork", grace_period=GRACE) as ctx:
            pass
        assert ctx.results == [5, 6]
        async with aiomp.spawn(
            lambda rank: -rank, 2, start_method="fork", grace_period=GRACE
        ) as ctx:
            pass
        assert ctx.results == [0, -1]


@pytest.mark.anyio
async def test_large_args_travel() -> None:
    data = os.urandom(256 * 1024)  # larger than a datagram: goes through a memfd
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 2, args=(data,), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [(0, (data,)), (1, (data,))]


@pytest.mark.anyio
async def test_daemon() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 1, daemon=True, grace_period=GRACE) as ctx:
            assert ctx.processes[0].daemon
    assert ctx.results == [(0, ())]


@pytest.mark.anyio
@pytest.mark.parametrize("code", [0, None])
async def test_sys_exit_zero_is_success(code: object) -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.sys_exit, 2, args=(code,), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [None, None]
    assert exitcodes(ctx) == [0, 0]
