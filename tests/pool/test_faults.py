"""Regression tests for the Pool's faults that must end in an error in one caller (issue 25,
items 9, 10, 12 and 13), through the public API.

conftest runs every async test here on a plain ``asyncio.run`` loop, uvloop and
``trio.run``. Workers are never slept on, and every await is bounded. The one seam the
tests reach past the public API is where the pool starts a worker process
(``aiomp._process.launch.launch``), to inject a failed fork without a real pids limit.
"""

from __future__ import annotations

import errno
import functools
import pickle
from typing import Any

import anyio
import pytest

import aiomp
from aiomp._pool import scheduler as _scheduler
from aiomp._process import launch as _process
from aiomp._wire import datagram as _transport
from tests.children import pool as funcs
from tests.pool._pools import pool

pytestmark = pytest.mark.anyio

TIMEOUT = 30


# -- item 9: SystemExit and other BaseExceptions reach their caller alone -----------------


async def test_a_tasks_system_exit_is_raised_in_its_caller_and_the_worker_serves_on() -> None:
    """Issue 25 item 9: ``sys.exit`` in a task killed its worker (BrokenWorkerError)."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pid)
            with pytest.raises(SystemExit) as info:
                await p.apply(funcs.exit_task, (3,))
            assert info.value.code == 3
            assert "exit_task" in str(info.value.__cause__)  # the worker's traceback
            with pytest.raises(SystemExit) as info:
                await p.apply(funcs.exit_task_async, (5,))
            assert info.value.code == 5
            # A sync task on the worker's loop now (it went async above).
            with pytest.raises(SystemExit):
                await p.apply(funcs.exit_task, (6,))
            with pytest.raises(SystemExit) as info:
                await p.map(funcs.exit_at, range(6), chunksize=2)
            assert info.value.code == 3
            assert await p.apply(funcs.pid) == pid
            assert p.statistics().replaced == 0


async def test_a_tasks_keyboard_interrupt_is_raised_in_its_caller() -> None:
    """Issue 25 item 9: as ``concurrent.futures`` does, a KeyboardInterrupt that a task
    raises is that task's outcome; the worker (which ignores SIGINT) serves on."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pid)
            with pytest.raises(KeyboardInterrupt, match="from the task"):
                await p.apply(funcs.interrupt_task)
            assert await p.apply(funcs.pid) == pid


async def test_system_exit_while_unpickling_a_result_is_raised_in_its_caller() -> None:
    """Issue 25 item 9: a SystemExit raised while the parent unpickled a result escaped
    the reader callback: the caller got a CancelledError, the pool broke and the loop
    exited."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            await p.apply(funcs.pid)
            pids = p.pids()
            with pytest.raises(SystemExit) as info:
                await p.apply(funcs.result_that_exits_when_unpickled)
            assert info.value.code == 4
            assert "unpickling the result" in " ".join(getattr(info.value, "__notes__", ()))
            assert await p.map(funcs.square, range(4)) == [0, 1, 4, 9]
            assert p.pids() == pids and p.statistics().replaced == 0


# -- item 10: a failed fork is retried --------------------------------------------------


def failing_launch(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
    """Make the next ``failures`` worker starts fail as fork does under a pids limit
    (EAGAIN), keeping ``launch``'s promise to close the ends it was given. Returns a list
    that grows by one slot number per start tried."""
    real = _process.launch
    tried: list[int] = []

    def launch(*args: Any, output: Any = None, **kwargs: Any) -> Any:
        tried.append(args[2])
        if len(tried) <= failures:
            args[5].close()  # the child's end of its channel
            if output is not None:
                output.close()
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable (injected)")
        return real(*args, output=output, **kwargs)

    monkeypatch.setattr(_process, "launch", launch)
    return tried


async def test_a_failed_fork_is_retried_and_the_pool_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25 item 10: one fork that failed with EAGAIN while a worker was replaced
    broke the pool for good; every later call raised BrokenPoolError."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pid)
            tried = failing_launch(monkeypatch, 3)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.kill_self_at, (0, 0))
            new = await p.apply(funcs.pid)  # waits while the start is retried
            assert new != pid and p.pids() == [new]
            assert tried == [0, 0, 0, 0]  # three failures, then the start that worked
            assert await p.map(funcs.square, range(4)) == [0, 1, 4, 9]


async def test_a_fork_that_keeps_failing_breaks_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25 item 10: only a persistent start failure breaks the pool, with the
    OSError as its cause, once the retries are spent."""
    monkeypatch.setattr(_scheduler, "START_RETRY_DELAYS", (0.01, 0.02))
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            await p.apply(funcs.pid)
            tried = failing_launch(monkeypatch, 1000)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.kill_self_at, (0, 0))
            with pytest.raises(aiomp.BrokenPoolError, match="could not start") as info:
                await p.apply(funcs.pid)
            assert isinstance(info.value.__cause__, OSError)
            assert info.value.__cause__.errno == errno.EAGAIN
            assert len(tried) == 3  # the first try and two retries


# -- item 12: a dead worker's unstarted tasks go to another worker ------------------------


async def test_chunks_waiting_in_a_dead_worker_go_to_another() -> None:
    """Issue 25 item 12: chunks of an imap that waited in a worker behind the chunk that
    killed it failed with it ("terminated ... while it ran"), though they never started.
    A worker runs its sync tasks one at a time in the order sent, so the parent knows
    exactly which had not started: they go to the replacement. Checked with the worker in
    its sync mode, then in its async mode (after an async task)."""
    victim = functools.partial(funcs.kill_self_at, victim=0)
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            for mode in ("sync", "async"):
                if mode == "async":
                    await p.apply(funcs.nothing_async)  # the worker now serves from a loop
                else:
                    await p.apply(funcs.pid)  # ready: the chunks go out in one dispatch
                results: list[object] = []
                # Chunks 0, 1 and 2 go to the one worker at once (1 and 2 wait behind 0).
                async with p.imap(victim, range(8), buffersize=8) as it:
                    while True:
                        try:
                            results.append(await it.__anext__())
                        except StopAsyncIteration:
                            break
                        except aiomp.BrokenWorkerError as exc:
                            results.append(type(exc))
                assert results == [aiomp.BrokenWorkerError, *(x * x for x in range(1, 8))], mode
            assert p.statistics().replaced == 2


# -- item 13: the error types Python's pools and R1 promise ------------------------------


async def test_a_wrong_type_of_chunksize_is_a_type_error() -> None:
    """Issue 25 item 13: a chunksize of the wrong type raised ValueError; Python's pools
    raise TypeError (ValueError stays for an int below 1)."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            for bad in ("2", 1.5, True):
                with pytest.raises(TypeError, match="chunksize"):
                    await p.map(funcs.square, [1], chunksize=bad)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match="chunksize"):
                    p.imap(funcs.square, [1], chunksize=bad)  # type: ignore[arg-type]
                with pytest.raises(TypeError, match="buffersize"):
                    p.imap(funcs.square, [1], buffersize=bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="chunksize"):
                await p.map(funcs.square, [1], chunksize=0)
            assert await p.map(funcs.square, [3], chunksize=1) == [9]
    with pytest.raises(TypeError, match="processes"):
        aiomp.Pool("2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="concurrency"):
        aiomp.Pool(1, concurrency=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="maxtasksperchild"):
        aiomp.Pool(1, maxtasksperchild="3")  # type: ignore[arg-type]


async def test_too_many_fds_in_one_message_is_a_transport_error() -> None:
    """Issue 25 item 13: over 252 fds in one message raised PicklingError; R1 promises
    TransportError, at the call, with nothing sent."""
    events = [aiomp.Event() for _ in range(_transport.MAX_FDS)]
    q = aiomp.Queue()
    try:
        with anyio.fail_after(TIMEOUT):
            async with pool(1) as p:
                with pytest.raises(aiomp.TransportError, match="at most 252") as info:
                    await p.apply(funcs.pid, (events,))
                assert not isinstance(info.value, pickle.PicklingError)
                assert p.statistics().completed == 0
                assert await p.apply(funcs.pid, (events[:3],)) > 0
            with pytest.raises(aiomp.TransportError, match="at most 252"):
                q.put_nowait(events)
            assert q.empty()
    finally:
        q.close()
