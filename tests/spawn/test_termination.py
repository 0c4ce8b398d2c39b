"""Spawning: a failure or a cancellation terminates the other children: failures in the
body or the join, cancelled bodies and joins, body exceptions, SIGTERM ignored, a second cancel.

How children are met and bounded: see ``tests/spawn/test_results.py``.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._procs import gone
from tests.children import common as funcs
from tests.spawn._spawns import FAILED, GRACE, METHODS, TIMEOUT, exitcodes

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


# -- one failure ends the rest -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_failure_terminates_others_and_cancels_body(start_method: str, gate: Gate) -> None:
    reached = False
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            async with aiomp.spawn(
                funcs.fail_or_block,
                3,
                args=(1, gate.address),
                start_method=start_method,
                grace_period=GRACE,
            ) as ctx:
                await gate.ready(3)
                gate.release(1)
                await anyio.sleep_forever()
                reached = True
    assert not reached
    assert type(info.value) is aiomp.ProcessRaisedException
    assert info.value.error_index == 1
    codes = exitcodes(ctx)
    assert codes[1] in FAILED
    assert codes[0] == codes[2] == -signal.SIGTERM


@pytest.mark.anyio
async def test_failure_in_join_terminates_others(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.fail_or_block, 3, args=(2, gate.address), grace_period=GRACE)
        await gate.ready(3)
        gate.release(2)
        with pytest.raises(aiomp.ProcessException) as info:
            await ctx.join()
    assert type(info.value) is aiomp.ProcessRaisedException
    assert info.value.error_index == 2
    codes = exitcodes(ctx)
    assert codes[2] in FAILED
    assert codes[0] == codes[1] == -signal.SIGTERM


@pytest.mark.anyio
async def test_failure_after_body_finished(gate: Gate) -> None:
    """The body ends first; leaving the block joins, sees the failure, terminates the rest."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            async with aiomp.spawn(
                funcs.fail_or_block, 2, args=(0, gate.address), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                gate.release(0)
    assert type(info.value) is aiomp.ProcessRaisedException
    codes = exitcodes(ctx)
    assert codes[0] in FAILED
    assert codes[1] == -signal.SIGTERM


@pytest.mark.anyio
async def test_terminate_then_join_reports_the_signal(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE)
        await gate.ready(2)
        await ctx.terminate()
        assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]
        with pytest.raises(aiomp.ProcessException) as info:
            await ctx.join()
        await ctx.terminate()  # nothing left: a no-op
    assert type(info.value) is aiomp.ProcessExitedException
    assert info.value.signal_name == "SIGTERM"


# -- cancellation and exceptions in the body -----------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_cancelled_body_terminates_children(start_method: str, gate: Gate) -> None:
    reached = False
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with aiomp.spawn(
                funcs.ready_then_block,
                2,
                args=(gate.address,),
                start_method=start_method,
                grace_period=GRACE,
            ) as ctx:
                await gate.ready(2)
                scope.cancel()
                await anyio.sleep_forever()
            reached = True  # the cancellation must go on past the block
    assert scope.cancelled_caught
    assert not reached
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]
    assert all(gone(pid) for pid in ctx.pids())


@pytest.mark.anyio
async def test_body_timeout_terminates_children(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with anyio.move_on_after(0.2) as scope:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]


@pytest.mark.anyio
async def test_cancelled_join_terminates_children(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE)
        await gate.ready(2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.join)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]
    assert all(gone(pid) for pid in ctx.pids())


@pytest.mark.anyio
async def test_join_timed_out_by_caller_terminates_children(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.ready_then_block, 1, args=(gate.address,), grace_period=GRACE)
        await gate.ready(1)
        with anyio.move_on_after(0.05) as scope:
            await ctx.join()
    assert scope.cancelled_caught
    assert exitcodes(ctx) == [-signal.SIGTERM]


@pytest.mark.anyio
async def test_join_in_cancelled_scope_terminates_children(gate: Gate) -> None:
    """Regression: a join() cancelled before its first wait left the children running."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.ready_then_block, 1, args=(gate.address,), grace_period=GRACE)
        await gate.ready(1)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ctx.join()
    assert scope.cancelled_caught
    assert exitcodes(ctx) == [-signal.SIGTERM]


@pytest.mark.anyio
async def test_async_with_in_cancelled_scope_terminates_children(gate: Gate) -> None:
    reached = False
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with aiomp.spawn(
                funcs.ready_then_block, 1, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await anyio.sleep_forever()
            reached = True
    assert scope.cancelled_caught
    assert not reached
    # Each child was terminated whether or not it had got as far as the gate.
    assert all(code is not None and code < 0 for code in exitcodes(ctx))


@pytest.mark.anyio
async def test_body_exception_propagates_unwrapped(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(KeyError) as info:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                raise KeyError("from the body")
    assert type(info.value) is KeyError
    assert info.value.args == ("from the body",)
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]


class _Stop(BaseException):
    """A BaseException other than KeyboardInterrupt, which asyncio would re-raise out of
    its loop from any task (so only trio can carry a real one through a nursery)."""


@pytest.mark.anyio
@pytest.mark.parametrize("leaf", [KeyError, _Stop, KeyboardInterrupt])
async def test_body_exception_group_propagates_as_raised(
    anyio_backend: object, leaf: type[BaseException], gate: Gate
) -> None:
    """Regression (issue 9.4): a group raised by the body (a KeyboardInterrupt in the
    user's own nursery) came out of the block wrapped in another "Exceptions from Trio
    nursery" layer under trio. It leaves the block as the body raised it."""
    if leaf is KeyboardInterrupt and anyio_backend[0] != "trio":  # type: ignore[index]
        pytest.skip("asyncio re-raises a task's KeyboardInterrupt out of its loop")

    async def fail() -> None:
        raise leaf("from the user's task")

    with anyio.fail_after(TIMEOUT):
        with pytest.raises(BaseExceptionGroup) as info:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(fail)
                        await anyio.sleep_forever()
                except BaseExceptionGroup as group:
                    raised = group
                    raise
    assert info.value is raised
    assert [type(e) for e in info.value.exceptions] == [leaf]
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]


@pytest.mark.anyio
async def test_body_exception_wins_over_child_failure(gate: Gate) -> None:
    """An exception the body raises (here while a child failure cancels it) leaves the block."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(KeyError) as info:
            async with aiomp.spawn(
                funcs.fail_or_block, 2, args=(0, gate.address), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                gate.release(0)
                try:
                    await anyio.sleep_forever()
                finally:
                    raise KeyError("cleanup failed")
    assert type(info.value) is KeyError
    codes = exitcodes(ctx)
    assert codes[0] in FAILED
    assert codes[1] == -signal.SIGTERM


# -- grace period and escalation (R7) ------------------------------------------------------


@pytest.mark.anyio
async def test_sigterm_ignored_escalates_to_sigkill(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    grace = 0.3
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with aiomp.spawn(
                funcs.ignore_sigterm_then_block, 2, args=(gate.address,), grace_period=grace
            ) as ctx:
                await gate.ready(2)
                start = time.monotonic()
                scope.cancel()
                await anyio.sleep_forever()
        elapsed = time.monotonic() - start
    assert elapsed >= grace
    assert elapsed < grace + 2
    assert exitcodes(ctx) == [-signal.SIGKILL, -signal.SIGKILL]
    assert all(gone(pid) for pid in ctx.pids())
    for pid in ctx.pids():  # torch's lines, which ported torch tests look for
        assert f"Terminating process {pid} via signal SIGTERM" in caplog.text
        assert f"Terminating process {pid} via signal SIGKILL" in caplog.text


@pytest.mark.anyio
async def test_terminating_survivors_is_logged_as_torch_logs(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12: WARNING ``Terminating process <pid> via signal SIGTERM`` on the ``aiomp``
    logger for each survivor of a failure, once, and nothing for the one that failed."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessExitedException):
            async with aiomp.spawn(
                funcs.fail_or_block, 3, args=(1, gate.address), grace_period=GRACE
            ) as ctx:
                await gate.ready(3)
                os.kill(gate.pids[1], signal.SIGKILL)
                await anyio.sleep_forever()
    lines = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if "Terminating process" in r.getMessage()
    ]
    pids = ctx.pids()
    assert sorted(lines) == sorted(
        ("aiomp", "WARNING", f"Terminating process {pid} via signal SIGTERM")
        for pid in (pids[0], pids[2])
    )


# -- termination cannot be broken (issue 18) ------------------------------------------------


@pytest.mark.anyio
async def test_second_cancel_cannot_break_termination(
    anyio_backend: object, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 18.1): a second native cancellation during the grace period broke
    out of the "shielded" termination: SIGKILL never came, both SIGTERM-ignoring children
    were left running, and interpreter exit then hung in multiprocessing's join.

    asyncio and uvloop: ``Task.cancel()`` twice, 0.3 s apart (a double Ctrl-C under
    ``asyncio.run``); the second cuts the grace period short. trio: the enclosing scope
    is cancelled twice (trio's second Ctrl-C is tested in a subprocess below).
    """
    grace = 2.0
    started = anyio.Event()
    ctxs: list[aiomp.ProcessContext] = []

    async def supervised() -> None:
        async with aiomp.spawn(
            funcs.ignore_sigterm_then_block, 2, args=(gate.address,), grace_period=grace
        ) as ctx:
            ctxs.append(ctx)
            await gate.ready(2)
            started.set()
            await anyio.sleep_forever()

    with anyio.fail_after(TIMEOUT):
        if anyio_backend[0] == "trio":  # type: ignore[index]
            async with anyio.create_task_group() as tg:
                tg.start_soon(supervised)
                await started.wait()
                start = time.monotonic()
                tg.cancel_scope.cancel()
                await anyio.sleep(0.3)  # handshake-free: the interval between two Ctrl-Cs
                tg.cancel_scope.cancel()
        else:
            import asyncio

            task = asyncio.get_running_loop().create_task(supervised())
            await started.wait()
            start = time.monotonic()
            task.cancel()
            await anyio.sleep(0.3)  # handshake-free: the interval between two Ctrl-Cs
            task.cancel()
            await asyncio.wait([task])
            assert task.cancelled()
        elapsed = time.monotonic() - start
    ctx = ctxs[0]
    assert exitcodes(ctx) == [-signal.SIGKILL, -signal.SIGKILL]
    assert all(gone(pid) for pid in ctx.pids())
    assert elapsed < grace + 1
    assert caplog.text.count("via signal SIGKILL") == 2


@pytest.mark.anyio
async def test_cancelled_terminate_still_kills_and_reaps(anyio_backend: object, gate: Gate) -> None:
    """Issue 18.1, ``ctx.terminate()``: a cancellation that reaches it (a native asyncio
    cancel) means "SIGKILL now"; every child is reaped before the cancellation goes on."""
    if anyio_backend[0] == "trio":  # type: ignore[index]
        pytest.skip("trio's cancel scopes cannot reach a shielded terminate()")
    import asyncio

    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.ignore_sigterm_then_block, 2, args=(gate.address,), grace_period=30
        )
        await gate.ready(2)
        task = asyncio.get_running_loop().create_task(ctx.terminate())
        await anyio.wait_all_tasks_blocked()  # terminate() sent SIGTERM and now waits
        task.cancel()
        await asyncio.wait([task])
    assert task.cancelled()
    assert exitcodes(ctx) == [-signal.SIGKILL, -signal.SIGKILL]
    assert all(gone(pid) for pid in ctx.pids())
