"""Spawning: a child's failure seen by the parent: exits noticed quickly, raised errors
and their text, exit codes, signals, errors that pickle.

How children are met and bounded: see ``tests/spawn/test_results.py``.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import threading
import time

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common as funcs
from tests.children import spawn as funcs_context
from tests.spawn._spawns import FAILED, GRACE, METHODS, TIMEOUT, exitcodes

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


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
        aiomp.BrokenPoolError("the pool is broken", not_run=3),
        aiomp.PoolOverloadedError("2 tasks wait", max_pending=2),
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
    broken, overloaded = (pickle.loads(pickle.dumps(exc)) for exc in errors[4:])
    assert isinstance(broken, RuntimeError) and (broken.msg, broken.not_run) == (
        "the pool is broken",
        3,
    )
    assert isinstance(overloaded, RuntimeError) and overloaded.max_pending == 2


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
