"""The Pool's hosted task group (see *Hosted task group* in docs/architecture.md).

On asyncio and uvloop the pool's own tasks live in a task of their own, so a pool may be
left by another task than the one that entered it; a bug in one of those tasks breaks
the pool instead of cancelling the caller. On trio they stay in a nursery of the caller.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

import aiomp
from aiomp._pool import engine as _engine
from tests.children import pool as funcs

pytestmark = pytest.mark.anyio

TIMEOUT = 30


def on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("error", [None, ValueError("the body failed")])
async def test_enter_and_leave_in_different_tasks(error: Exception | None) -> None:
    """Enter in one task, call and leave in others; leaving with an exception terminates
    the workers and lets it go on."""
    if not on_asyncio():
        pytest.skip("trio: a nursery is left by the task that opened it, as trio requires")
    p = aiomp.Pool(2, grace_period=0.3)
    with anyio.fail_after(TIMEOUT):
        await asyncio.create_task(p.__aenter__())
        assert await asyncio.create_task(p.apply(funcs.square, (6,))) == 36
        exit_args = (None, None, None) if error is None else (type(error), error, None)
        assert not await asyncio.create_task(p.__aexit__(*exit_args))


async def test_a_failing_own_task_breaks_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in one of the pool's own tasks is not lost: on asyncio later calls fail with
    BrokenPoolError and leaving raises it; on trio it cancels the block, as a nursery
    does. Either way the workers are reaped (the leak check)."""

    async def broken_supervisor(self: _engine.Engine) -> None:
        raise RuntimeError("a bug in the supervisor")

    monkeypatch.setattr(_engine.Engine, "_supervise", broken_supervisor)
    hosted = on_asyncio()
    with anyio.fail_after(TIMEOUT), pytest.raises(BaseExceptionGroup) as caught:
        async with aiomp.Pool(1, grace_period=0.3) as p:
            if hosted:
                # The supervisor fails on the host's first turn: a call queued then fails
                # with the pool, one already on the worker with it.
                with pytest.raises((aiomp.BrokenPoolError, aiomp.BrokenWorkerError)):
                    while True:
                        await p.apply(funcs.square, (3,))
                with pytest.raises(aiomp.BrokenPoolError):
                    await p.apply(funcs.square, (3,))
            else:
                await anyio.sleep_forever()  # cancelled by the nursery
    assert caught.group_contains(RuntimeError, match="a bug in the supervisor")


async def test_entered_in_a_cancelled_scope() -> None:
    """A pool entered in a cancelled scope leaves no task and no worker behind."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with aiomp.Pool(1, grace_period=0.3):
            raise AssertionError("the block ran in a cancelled scope")
    if on_asyncio():
        names = [t.get_name() for t in asyncio.all_tasks()]
        assert "aiomp pool tasks" not in names


def test_a_task_cancelled_before_its_first_step_leaves_no_unawaited_coroutine() -> None:
    """``Started``: a task started in a group and cancelled before its first step (what
    ``asyncio.run`` does to the tasks left at its end) would leave its coroutine never
    awaited (anyio runs it inside a wrapper coroutine); once the group has exited, it is
    closed, and a coroutine that ran is left as it was."""
    import gc
    import warnings

    from aiomp._loop.taskhost import Started

    ran: list[str] = []

    async def job(name: str) -> None:
        ran.append(name)
        await anyio.sleep_forever()

    async def main() -> None:
        started = Started()
        try:
            async with anyio.create_task_group() as tg:
                started.start_soon(tg, lambda: job("first"))
                await anyio.lowlevel.checkpoint()  # the first one runs
                started.start_soon(tg, lambda: job("second"))
                # Cancelled natively, as asyncio.run does: the second before its first step.
                for task in asyncio.all_tasks():
                    if task is not asyncio.current_task():
                        task.cancel()
        except asyncio.CancelledError:
            pass
        finally:
            started.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert ran == ["first"]
    assert not [w for w in caught if "never awaited" in str(w.message)]
