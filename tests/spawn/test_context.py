"""Contract tests for spawning: ``aiomp.spawn`` / ``start_processes`` / ``ProcessContext``.

README "Spawning" and R7-R10 (docs/architecture.md), R12-R14, through the public API only, on
asyncio, uvloop and trio. Children never get slept on: each one that must be waited for
meets the test at a :class:`Gate` (a unix socket), and every await on a child is bounded
by ``anyio.fail_after``.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._run import run_python
from tests.children import common as funcs
from tests.children import spawn as funcs_context

#: Bound on every await on a child. Generous: two shared cores, cold interpreters.
TIMEOUT = 20
GRACE = 0.5
METHODS = ["spawn", "forkserver", "fork"]
REPO = Path(__file__).resolve().parents[2]

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


def exitcodes(ctx: aiomp.ProcessContext) -> list[int | None]:
    return [p.exitcode for p in ctx.processes]


#: A failed child is terminated along with the others if it has not exited yet (as torch
#: does): its error has already arrived, so its exit status is either.
FAILED = (1, -signal.SIGTERM)


def gone(pid: int) -> bool:
    """Whether our child ``pid`` has exited and been reaped (a zombie has not been)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return True
    return ppid != os.getpid()  # the pid was reused by a process that is not ours


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


class _ExitClock:
    """When a process exits, as a thread blocked on its pidfd sees it: the time a join
    is measured from, so that the child's own interpreter shutdown is not in the bound."""

    def __init__(self, pid: int) -> None:
        self._fd = os.pidfd_open(pid)
        self.exited_at: float | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        select.select([self._fd], [], [])
        self.exited_at = time.monotonic()

    def since_exit(self) -> float:
        self._thread.join(TIMEOUT)
        os.close(self._fd)
        assert self.exited_at is not None
        return time.monotonic() - self.exited_at


@pytest.mark.anyio
async def test_join_notices_exit_quickly(gate: Gate) -> None:
    """A child's exit wakes join() at once: measured from the exit itself, not from the
    release that lets the child return (its interpreter's shutdown on a busy host took
    longer than the bound). Generous: latency is for benchmarks."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.wait_then_return, 1, args=(gate.address,), grace_period=GRACE)
        await gate.ready(1)
        clock = _ExitClock(ctx.pids()[0])
        gate.release()
        assert await ctx.join() is True
        assert clock.since_exit() < 1.0


@pytest.mark.anyio
async def test_raise_is_noticed_quickly(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.wait_then_raise, 1, args=(gate.address,), grace_period=GRACE)
        await gate.ready(1)
        clock = _ExitClock(ctx.pids()[0])
        gate.release()
        with pytest.raises(aiomp.ProcessRaisedException):
            await ctx.join()
        assert clock.since_exit() < 1.0


# -- child failures ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_raise(start_method: str) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            async with aiomp.spawn(
                funcs.raise_on, 2, args=(1,), start_method=start_method, grace_period=GRACE
            ) as ctx:
                pass
    exc = info.value
    assert type(exc) is aiomp.ProcessRaisedException
    assert exc.error_index == 1
    assert exc.pid == ctx.pids()[1]
    assert exc.msg == str(exc)
    assert "Traceback (most recent call last)" in exc.msg
    assert "ValueError: boom from rank 1" in exc.msg
    assert "in raise_on" in exc.msg
    assert exitcodes(ctx)[1] in FAILED
    with pytest.raises(RuntimeError):
        ctx.results  # noqa: B018


@pytest.mark.anyio
async def test_join_raises_the_same_failure_again() -> None:
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(funcs.raise_on, 1, args=(0,), grace_period=GRACE)
        with pytest.raises(aiomp.ProcessRaisedException) as first:
            await ctx.join()
        with pytest.raises(aiomp.ProcessRaisedException) as second:
            await ctx.join(timeout=1)
    assert second.value is first.value


RAISED = [
    pytest.param(funcs.async_raise, ["RuntimeError: async boom from rank 0"], id="async-raise"),
    # R9: Ctrl-C in a child, or a coroutine that ends cancelled, is never success
    pytest.param(funcs.raise_keyboard_interrupt, ["KeyboardInterrupt"], id="keyboard-interrupt"),
    pytest.param(funcs.async_cancel_self, ["CancelledError"], id="cancelled-coroutine"),
    pytest.param(
        funcs.return_unpicklable,
        ["could not be pickled", "Unpicklable refuses to be pickled"],
        id="unpicklable-result",
    ),
    pytest.param(
        funcs.raise_unpicklable,
        ["UnpicklableError: unpicklable boom from rank 0"],
        id="unpicklable-exception",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("fn", "texts"), RAISED)
async def test_child_failure_is_raised_with_its_text(fn: object, texts: list[str]) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            await (await aiomp.spawn(fn, 1, grace_period=GRACE)).join()  # type: ignore[arg-type]
    assert type(info.value) is aiomp.ProcessRaisedException
    for text in texts:
        assert text in info.value.msg


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_exit_code(start_method: str) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            async with aiomp.spawn(
                funcs.exit_on, 3, args=(2, 7), start_method=start_method, grace_period=GRACE
            ) as ctx:
                pass
    exc = info.value
    assert type(exc) is aiomp.ProcessExitedException
    assert str(exc) == "process 2 terminated with exit code 7"
    assert (exc.error_index, exc.pid, exc.exit_code, exc.signal_name) == (2, ctx.pids()[2], 7, None)


@pytest.mark.anyio
async def test_sys_exit_nonzero_is_failure() -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            await (await aiomp.spawn(funcs.sys_exit, 1, args=(3,), grace_period=GRACE)).join()
    assert type(info.value) is aiomp.ProcessExitedException
    assert str(info.value) == "process 0 terminated with exit code 3"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("start_method", "sig"),
    [
        ("spawn", signal.SIGSEGV),
        ("spawn", signal.SIGABRT),
        ("forkserver", signal.SIGSEGV),
        ("fork", signal.SIGABRT),
    ],
)
async def test_killed_by_signal(start_method: str, sig: signal.Signals) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessException) as info:
            async with aiomp.spawn(
                funcs.kill_self, 1, args=(int(sig),), start_method=start_method, grace_period=GRACE
            ) as ctx:
                pass
    exc = info.value
    assert type(exc) is aiomp.ProcessExitedException
    assert str(exc) == f"process 0 terminated with signal {sig.name}"
    assert (exc.error_index, exc.pid, exc.exit_code, exc.signal_name) == (
        0,
        ctx.pids()[0],
        -sig,
        sig.name,
    )


@pytest.mark.anyio
async def test_sigint_in_child_is_failure(gate: Gate) -> None:
    """R9: a child that a Ctrl-C interrupts has failed (in a terminal, the parent's keeper
    passes the Ctrl-C on to it: see test_descendants.py).

    Regression (issue 11, the loaded-machine flake: a timeout, then 4 leaked pipe fds):
    the child blocked in a ``signal.pause()`` loop, and a SIGINT that landed just before
    ``pause()`` started was handled at the C level while ``pause()`` slept on, so the
    child never raised (3 hangs in 400 tries under load). It now waits race-free.
    """
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs_context.ready_then_wait_for_signals, 2, args=(gate.address,), grace_period=GRACE
        )
        pids = await gate.ready(2)
        os.kill(pids[0], signal.SIGINT)
        with pytest.raises(aiomp.ProcessException) as info:
            await ctx.join()
    assert type(info.value) is aiomp.ProcessRaisedException
    assert info.value.error_index == 0
    assert "KeyboardInterrupt" in info.value.msg
    assert exitcodes(ctx)[1] == -signal.SIGTERM


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_child_killed_from_outside(start_method: str, gate: Gate) -> None:
    """A child that dies without a word (the OOM killer) fails the context at once."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.ready_then_block,
            2,
            args=(gate.address,),
            start_method=start_method,
            grace_period=GRACE,
        )
        pids = await gate.ready(2)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(aiomp.ProcessException) as info:
            await ctx.join()
    exc = info.value
    assert type(exc) is aiomp.ProcessExitedException
    assert str(exc) == "process 1 terminated with signal SIGKILL"
    assert (exc.error_index, exc.pid, exc.exit_code, exc.signal_name) == (
        1,
        pids[1],
        -signal.SIGKILL,
        "SIGKILL",
    )
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGKILL]


def _same_error(a: aiomp.ProcessException, b: aiomp.ProcessException) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert vars(a) == vars(b)


def test_errors_pickle() -> None:
    """R10: every attribute survives a pickle round trip, under the public name."""
    errors = [
        aiomp.ProcessException("process 0 failed", 0, 11),
        aiomp.ProcessRaisedException("process 1 raised: ...", 1, 12),
        aiomp.ProcessExitedException(
            "process 2 terminated with signal SIGSEGV", 2, 13, -11, "SIGSEGV"
        ),
        aiomp.ProcessExitedException("process 3 terminated with exit code 7", 3, None, 7),
    ]
    for exc in errors:
        data = pickle.dumps(exc)
        assert b"aiomp._errors" not in data
        _same_error(pickle.loads(data), exc)
    exited = pickle.loads(pickle.dumps(errors[2]))
    assert (exited.msg, exited.error_index, exited.pid, exited.exit_code, exited.signal_name) == (
        "process 2 terminated with signal SIGSEGV",
        2,
        13,
        -11,
        "SIGSEGV",
    )


@pytest.mark.anyio
async def test_raised_errors_pickle() -> None:
    caught: list[aiomp.ProcessException] = []
    with anyio.fail_after(TIMEOUT):
        for fn, args in ((funcs.raise_on, (0,)), (funcs.exit_on, (0, 3))):
            with pytest.raises(aiomp.ProcessException) as info:
                await (await aiomp.spawn(fn, 1, args=args, grace_period=GRACE)).join()
            caught.append(info.value)
    for exc in caught:
        copy = pickle.loads(pickle.dumps(exc))
        _same_error(copy, exc)
        assert copy.pid == exc.pid is not None


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


_DOUBLE_SIGINT_PARENT = textwrap.dedent("""
    import asyncio
    import signal
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    # As run from a terminal: a test run started in the background inherits SIGINT
    # ignored, and then neither asyncio nor trio would install its Ctrl-C handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def main():
        address = "\\0" + sys.argv[1]  # abstract socket: argv cannot hold the NUL
        async with aiomp.spawn(_funcs.ignore_sigterm_then_block, 2, args=(address,),
                               grace_period=float(sys.argv[3])):
            await anyio.sleep_forever()

    if __name__ == "__main__":
        if sys.argv[2] == "trio":
            import trio

            trio.run(main)
        else:
            factory = None
            if sys.argv[2] == "uvloop":
                import uvloop

                factory = uvloop.new_event_loop
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(main())
""")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_double_sigint_kills_children_and_exits(loop: str, gate: Gate) -> None:
    """Regression (issue 18.1): a second Ctrl-C during the grace period aborted the
    termination (under trio the KeyboardInterrupt was raised inside the wait); children
    that ignore SIGTERM were never killed and the parent hung at exit in multiprocessing's
    join of its non-daemon children. Now the second Ctrl-C means "SIGKILL now"."""
    grace = 2.0
    parent = subprocess.Popen(
        [sys.executable, "-c", _DOUBLE_SIGINT_PARENT, gate.address[1:], loop, str(grace)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    pidfds: list[int] = []
    try:
        pids = gate.ready_sync(2, timeout=TIMEOUT)
        pidfds = [os.pidfd_open(pid) for pid in pids.values()]
        start = time.monotonic()
        os.kill(parent.pid, signal.SIGINT)
        time.sleep(0.3)  # handshake-free: the user's second Ctrl-C comes a moment later
        os.kill(parent.pid, signal.SIGINT)
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        exited: set[int] = set()
        while len(exited) < len(pidfds) and time.monotonic() < start + grace + 1:
            exited.update(fd for fd, _ in poller.poll(50))
        assert len(exited) == 2, "children outlived a double Ctrl-C"
        _, err = parent.communicate(timeout=TIMEOUT)
        assert parent.returncode != 0
        assert "KeyboardInterrupt" in err
        assert err.count("via signal SIGKILL") == 2, err
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no orphans, even on failure
            except ProcessLookupError:
                pass
            os.close(fd)


_EXIT_WITH_CHILDREN = textwrap.dedent("""
    import signal
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as run from a terminal

    async def main():
        address = "\\0" + sys.argv[1]
        await aiomp.spawn(_funcs.ignore_sigterm_then_block, 1, args=(address,),
                          daemon=sys.argv[2] == "daemon")
        await anyio.sleep_forever()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("daemon", ["daemon", "non-daemon"])
def test_interpreter_exit_never_waits_on_children(daemon: str, gate: Gate) -> None:
    """Issue 18.1: multiprocessing's exit hook joins non-daemon children (and SIGTERMs,
    then joins, daemon ones) without a timeout, so a child left running (here: one that
    ignores SIGTERM, never joined) hung interpreter exit forever. aiomp's own hook, which
    runs first, SIGKILLs and reaps it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _EXIT_WITH_CHILDREN, gate.address[1:], daemon],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    pidfd = -1
    try:
        pid = gate.ready_sync(1, timeout=TIMEOUT)[0]
        pidfd = os.pidfd_open(pid)
        os.kill(parent.pid, signal.SIGINT)  # anyio.run: KeyboardInterrupt, then exit
        _, err = parent.communicate(timeout=TIMEOUT)
        assert select.select([pidfd], [], [], 0)[0], "the child outlived its parent"
        assert "still running at interpreter exit" in err
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        if pidfd >= 0:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(pidfd)


@pytest.mark.anyio
async def test_terminate_grace_period_argument(gate: Gate) -> None:
    """``terminate(grace_period=...)`` overrides the context's own (30 s here)."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.ignore_sigterm_then_block, 1, args=(gate.address,), grace_period=30
        )
        try:
            await gate.ready(1)
        finally:
            start = time.monotonic()
            await ctx.terminate(grace_period=0.2)
        elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 5
    assert exitcodes(ctx) == [-signal.SIGKILL]


# -- parent death (R8) ---------------------------------------------------------------------

_PARENT = textwrap.dedent("""
    import sys

    import anyio

    import aiomp
    from tests.children import common as _funcs

    async def main():
        address = "\\0" + sys.argv[1]  # abstract socket: argv cannot hold the NUL
        ctx = await aiomp.spawn(_funcs.ready_then_block, 2, args=(address,),
                                start_method=sys.argv[2])
        await ctx.join()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize("start_method", METHODS)
def test_children_die_with_a_sigkilled_parent(start_method: str, gate: Gate) -> None:
    """R8. Regression (forkserver): each child held the fork server's "alive" pipe, so the
    server, the child's real parent, outlived ours and no death signal came."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, gate.address[1:], start_method], cwd=REPO
    )
    pidfds: list[int] = []
    try:
        pids = gate.ready_sync(2, timeout=TIMEOUT)
        # pidfds work for processes that are not our children, and their readiness is the
        # exit: no /proc polling. Opened while the parent lives, so the pids are not reused.
        pidfds = [os.pidfd_open(pid) for pid in pids.values()]
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=TIMEOUT) == -signal.SIGKILL
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + 5
        exited: set[int] = set()
        while len(exited) < len(pidfds) and time.monotonic() < deadline:
            exited.update(fd for fd, _ in poller.poll(100))
        assert len(exited) == 2, "children outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # no orphans, even on failure
            except ProcessLookupError:
                pass
            os.close(fd)


# -- bad input, refused before any process starts (R13) ------------------------------------


def _no_process_started() -> None:
    assert multiprocessing.active_children() == []


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["threads", "Spawn", ""])
async def test_unknown_start_method(start_method: str) -> None:
    with pytest.raises(ValueError, match="start_method"):
        await aiomp.spawn(funcs.echo, 1, start_method=start_method)
    with pytest.raises(ValueError, match="start_method"):
        async with aiomp.spawn(funcs.echo, 1, start_method=start_method):
            pytest.fail("the body must not run")
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("nprocs", [0, -1])
async def test_nprocs_below_one(nprocs: int) -> None:
    with pytest.raises(ValueError, match="nprocs"):
        await aiomp.spawn(funcs.echo, nprocs)
    with pytest.raises(ValueError, match="nprocs"):
        async with aiomp.start_processes(funcs.echo, nprocs):
            pytest.fail("the body must not run")
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("nprocs", [2.0, "2", None, True])
async def test_nprocs_of_the_wrong_type_is_a_type_error(nprocs: object) -> None:
    # Issue 25 item 13: as Python's pools (and aiomp.Pool's counts), a TypeError.
    with pytest.raises(TypeError, match="nprocs"):
        await aiomp.spawn(funcs.echo, nprocs)
    _no_process_started()


def _local_function(rank: int) -> int:
    return rank


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_unpicklable_function(start_method: str) -> None:
    """Issue 29: a lambda or a local function travels by value (tests/first); one that
    cannot be pickled even so (it holds a lock) is refused before any process starts."""
    lock = threading.Lock()

    def local(rank: int) -> int:
        with lock:
            return rank

    for fn in (lambda rank: lock, local):
        with pytest.raises(pickle.PicklingError, match="cannot be pickled") as info:
            await aiomp.spawn(fn, 1, start_method=start_method)
        assert "even by value" in str(info.value) and "lock" in str(info.value)
    _no_process_started()


@pytest.mark.anyio
async def test_function_from_interactive_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's or REPL's ``__main__`` has no file for children to import: its
    functions travel by value (issue 29; they were refused before)."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    fn = types.FunctionType(_local_function.__code__, {}, "notebook_fn")
    fn.__module__ = "__main__"
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(fn, 1)
        await ctx.join()


_STDIN_SCRIPT = textwrap.dedent("""
    import pickle

    import anyio

    import aiomp

    def work(rank):
        return rank

    async def main():
        ctx = await aiomp.spawn(work, 1)
        await ctx.join()
        print("joined")

    anyio.run(main)
""")


def test_function_from_a_script_read_from_stdin() -> None:
    """Regression (issue 11): a function defined in ``python -`` was not detected; the
    child died with ``FileNotFoundError: '<stdin>'`` and the parent saw "exit code 1".
    Issue 29: such a function travels by value (it was refused)."""
    out = run_python("-", input=_STDIN_SCRIPT, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["joined"]


_UNGUARDED = textwrap.dedent("""
    import anyio

    import aiomp

    def work(rank):
        return rank

    async def main():
        async with aiomp.spawn(work, 4, grace_period=1):
            pass

    anyio.run(main)  # no `if __name__ == "__main__":` guard
""")


def test_unguarded_main_module_gets_a_one_line_hint(tmp_path: Path) -> None:
    """Regression (issue 11): a script without the ``__main__`` guard made every spawned
    child re-run it; multiprocessing's "bootstrapping phase" error came out of each child
    in 115 to 346 lines, and the parent said only "exit code 1". Now each child reports
    one line and the parent's exception carries it."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, text=True, capture_output=True, timeout=TIMEOUT
    )
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert len(lines) < 60, out.stderr
    assert "bootstrapping phase" not in out.stderr
    assert lines[-1].startswith("RuntimeError: this child re-ran the parent's main module")
    assert 'protect the entry point with `if __name__ == "__main__":`' in lines[-1]
    assert any(line.startswith("aiomp.ProcessRaisedException: process ") for line in lines)


@pytest.mark.anyio
async def test_coroutine_object_instead_of_function() -> None:
    coro = funcs.async_echo(0)
    with pytest.raises(TypeError, match="coroutine"):
        await aiomp.spawn(coro, 1)  # type: ignore[arg-type]
    assert coro.cr_frame is None  # closed by aiomp: no "never awaited" warning later
    _no_process_started()


@pytest.mark.anyio
async def test_not_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        await aiomp.spawn(42, 1)  # type: ignore[arg-type]
    _no_process_started()


@pytest.mark.anyio
@pytest.mark.parametrize("args", [[1, 2], 1, "ab", None])
async def test_args_must_be_a_tuple(args: object) -> None:
    with pytest.raises(TypeError, match="tuple"):
        await aiomp.spawn(funcs.echo, 1, args=args)  # type: ignore[arg-type]
    _no_process_started()


@pytest.mark.anyio
async def test_unpicklable_args() -> None:
    with pytest.raises((TypeError, pickle.PicklingError)):
        await aiomp.spawn(funcs.echo, 2, args=(threading.Lock(),))
    _no_process_started()


# -- fork safety (R14) ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["async with", "await"])
# Python 3.12+ adds its own warning to os.fork in a process with threads; aiomp's, the one
# checked here, says what to do instead.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_fork_with_threads_running_warns(how: str) -> None:
    async def fork() -> aiomp.ProcessContext:
        if how == "await":
            ctx = await aiomp.spawn(funcs.echo, 1, start_method="fork", grace_period=GRACE)
            await ctx.join()
        else:
            async with aiomp.spawn(funcs.echo, 1, start_method="fork", grace_period=GRACE) as ctx:
                pass
        return ctx

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="aiomp-test-waiter")
    thread.start()
    try:
        with anyio.fail_after(TIMEOUT):
            with pytest.warns(RuntimeWarning, match="thread") as record:
                ctx = await fork()
    finally:
        stop.set()
        thread.join()
    assert ctx.results == [(0, ())]
    mine = [w for w in record if "aiomp-test-waiter" in str(w.message)]
    assert mine
    # Regression: for `await spawn(...)` the warning pointed into anyio's runner.
    assert all(w.filename == __file__ for w in mine), [w.filename for w in mine]


# -- regressions from review ---------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_while_leaving_the_block_terminates_children(gate: Gate) -> None:
    """Regression: a cancellation that arrived while `async with` waited for its children
    (the body had finished) left them running. Also: no fd is left watched on the loop."""
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)

                async def cancel_soon() -> None:
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()

                async with anyio.create_task_group() as tg:  # the body ends; the exit waits
                    tg.start_soon(cancel_soon)
    assert scope.cancelled_caught
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]
    assert all(gone(pid) for pid in ctx.pids())
    assert not ctx._exits.watching  # the fd set dropped its watch on the loop


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_fork_child_does_not_inherit_the_loops_sigterm_handler(gate: Gate) -> None:
    """Regression: under fork a child kept the parent loop's SIGTERM handler and wakeup
    fd, so it ignored SIGTERM (every terminate waited out the grace period) and woke the
    parent's handler instead."""
    import asyncio

    calls: list[int] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, calls.append, 1)
    try:
        with anyio.fail_after(TIMEOUT):
            ctx = await aiomp.spawn(
                funcs.ready_then_block,
                1,
                args=(gate.address,),
                start_method="fork",
                grace_period=10,
            )
            await gate.ready(1)
            await ctx.terminate()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    assert exitcodes(ctx) == [-signal.SIGTERM]  # died of SIGTERM, not SIGKILL after 10 s
    assert calls == []


# -- start-up cost (issue 17): what a spawn child's exit still does ----------------------


@pytest.mark.anyio
async def test_a_spawn_child_exits_without_teardown_but_runs_its_exit_functions(
    tmp_path: Path,
) -> None:
    """Pins the start-up fix for ``spawn(f, 4)`` taking 1.14-1.20x four multiprocessing
    processes: a spawn child no longer tears its interpreter down after its report (a
    global's finaliser does not run, as in a fork child), yet its ``atexit`` functions
    run and what it wrote last reaches the parent."""
    lines: list[tuple[int, str, str]] = []
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.exit_traces,
            2,
            args=(str(tmp_path),),
            output=lambda rank, stream, line: lines.append((rank, stream, line)),
        ) as ctx:
            pass
    assert ctx.results == ["done", "done"]
    assert exitcodes(ctx) == [0, 0]
    made = sorted(os.listdir(tmp_path))
    assert made == ["atexit-0", "atexit-1"]  # no "teardown-N": no interpreter teardown
    assert sorted(line for _, _, line in lines) == ["last words of 0", "last words of 1"]


@pytest.mark.anyio
@pytest.mark.parametrize("method", METHODS)
async def test_a_childs_exit_waits_for_its_non_daemon_threads(tmp_path: Path, method: str) -> None:
    """A child whose function returns while a non-daemon thread works exits once the
    thread is done, as a normal exit does (the fast exit steps aside)."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.thread_outlives_fn, 1, args=(str(tmp_path),), start_method=method
        ) as ctx:
            pass
    assert exitcodes(ctx) == [0]
    assert os.listdir(tmp_path) == ["thread-0"]


@pytest.mark.anyio
async def test_failed_exit_hooks_run_once_per_abnormal_exit() -> None:
    """``_shm`` sweeps a failed child's names through this hook; the process layer runs
    it without knowing ``_shm`` (see docs/decisions/0016-process-hooks.md)."""
    from aiomp import _lifecycle

    calls: list[None] = []

    def hook() -> None:
        calls.append(None)

    _lifecycle.on_failed_exit(hook)
    try:
        with anyio.fail_after(TIMEOUT):
            ctx = await aiomp.spawn(funcs.sys_exit, 1, args=(3,))
            with pytest.raises(aiomp.ProcessExitedException):
                await ctx.join()
            with pytest.raises(aiomp.ProcessExitedException):
                await ctx.join()  # the same failure again; the hook does not run again
    finally:
        _lifecycle._failed_exits.remove(hook)
    assert exitcodes(ctx) == [3]
    assert len(calls) == 1


def test_pid_alive_counts_a_zombie_and_a_reaped_pid_as_dead() -> None:
    """The one "is this pid alive" of children (their parent check) and of ``_shm``'s
    janitor (a segment's creator)."""
    from aiomp._lifecycle import pid_alive, start_time

    me = os.getpid()
    assert pid_alive(me) and pid_alive(me, start_time(me) or 0)
    assert not pid_alive(me, (start_time(me) or 0) + 1)  # a reused pid is another process
    assert not pid_alive(0)
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {})], ids=["trio"])
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_a_child_forked_from_trio_runs_asyncio_as_asyncio() -> None:
    # Found while fixing issue 25 item 6: the fork kept sniffio's mark that trio runs the
    # thread, so anyio in the child's own asyncio loop took it for trio and failed.
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.async_library, 1, start_method="fork", grace_period=GRACE
        ) as ctx:
            pass
    assert ctx.results == ["asyncio"]


def test_start_processes_in_torchs_positional_order_is_refused_clearly() -> None:
    """issue 42: aiomp.start_processes has spawn's signature, not torch's positional
    ``(fn, args, nprocs, ...)``: a tuple where nprocs goes says so."""

    async def start() -> None:
        await aiomp.start_processes(funcs.echo, ("x",))  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="args= as a keyword"):
        anyio.run(start)
