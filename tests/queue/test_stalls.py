"""``aiomp.Queue`` with a process stopped holding the overflow lock: no loop stalls,
waiters survive its kill, blocking calls stay interruptible; two threads' loops on one queue.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._wire import datagram as _transport
from tests._sinks import Stalls
from tests.children import queue as qfuncs
from tests.conftest import run_plain
from tests.queue._queues import GRACE, TIMEOUT, drain, fill_until_overflow

# -- the overflow's lock never blocks a loop; one queue, many loops (issue 25) --------------

#: Before the fix a test resumes the stopped child after this long, to fail, not hang.
WATCHDOG = 5.0
#: The longest loop stall allowed meanwhile: some 10 ms when the machine is idle; before
#: the fix, the whole stop (WATCHDOG). Generous for a loaded machine.
STALL = 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("maxsize", [0, 10], ids=["unbounded", "bounded"])
async def test_a_process_stopped_holding_the_overflow_lock_stalls_no_loop(maxsize: int) -> None:
    """Issue 25 item 2: a process stopped (SIGSTOP, a debugger) while it held the queue's
    overflow mutex froze the whole loop of every process that touched the queue
    (``pthread_mutex_lock`` on the loop's thread): no other task, no timeout ran. Now only
    the queue call waits, on the loop, and is cancellable: nothing taken, nothing put;
    once the holder resumes, every item is there."""
    q = aiomp.Queue(maxsize)
    n = 0 if maxsize else fill_until_overflow(q)
    q.put_nowait("before")
    held = aiomp.Event()
    step = "producer: record written"
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.stop_at, 1, args=(q, step, "carried", held), grace_period=GRACE
        )
    pid = ctx.pids()[0]
    # Before the fix this loop froze until the child resumed: the watchdog resumes it, so
    # that the test fails on its stalls instead of hanging.
    watchdog = threading.Timer(WATCHDOG, os.kill, (pid, signal.SIGCONT))
    stalls = Stalls()

    try:
        with anyio.fail_after(TIMEOUT):
            await held.wait()
        watchdog.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(stalls.watch)
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.3):
                    await q.get()
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.3):
                    await q.put("a cancelled put")
            tg.cancel_scope.cancel()
        longest = stalls.worst + Stalls.TICK  # the longest time between two ticks
        assert stalls.ticks and longest < STALL, f"the loop stalled for {longest:.2f} s"
        assert stalls.ticks > 20, "the ticker ran while the queue calls waited"
        started = time.monotonic()
        with pytest.raises(aiomp.Empty):
            q.get_nowait()  # bounded: it waits no longer than a nowait call may
        with pytest.raises(aiomp.Full):
            q.put_nowait("a refused put")
        with pytest.raises(aiomp.Empty):
            await anyio.to_thread.run_sync(functools.partial(q.sync.get, timeout=0.1))
        assert time.monotonic() - started < 2.0
    finally:
        watchdog.cancel()
        os.kill(pid, signal.SIGCONT)
    with anyio.fail_after(TIMEOUT):
        await ctx.join()
        assert await q.get() == ("before" if maxsize else bytes(_transport.MAX_INLINE - 100))
    got = drain(q)[max(n - 1, 0) :]
    assert got == (["carried"] if maxsize else ["before", "carried"]), "nothing lost or added"
    assert q.empty()


def _two_loops_consumer(q: aiomp.Queue, out: list[Any], idle: threading.Event) -> Any:
    async def consume() -> None:
        # Gets that find the queue empty and are cancelled: each looks at the socket
        # (poll) first, the other thread's loop doing the same at once.
        for _ in range(3_000):
            with anyio.move_on_after(0):
                await q.get()
        idle.set()
        while (item := await q.get()) is not None:
            out.append(item)

    return consume


@pytest.mark.parametrize(
    "backends",
    [("asyncio", "asyncio"), ("trio", "trio"), ("asyncio", "trio"), ("uvloop", "uvloop")],
    ids=lambda b: "+".join(b),
)
def test_two_threads_loops_get_from_one_queue(backends: tuple[str, str]) -> None:
    """Issue 25 item 8: two threads, each running its own loop, calling ``q.get()`` on one
    queue raised ``RuntimeError: concurrent poll() invocation`` (the overflow's poll
    object was shared), and lost wake-ups (their waits shared one fan-out: one loop's
    event set from the other's thread). Every item reaches exactly one of them, none
    raises, neither hangs."""

    options = {"asyncio": "asyncio", "trio": "trio", "uvloop": ("asyncio", {"use_uvloop": True})}
    q = aiomp.Queue()
    n = 20_000
    got: list[list[Any]] = [[], []]
    idle = [threading.Event(), threading.Event()]
    errors: list[BaseException] = []

    def consumer(k: int) -> None:
        try:
            run_plain(options[backends[k]], _two_loops_consumer(q, got[k], idle[k]))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            idle[k].set()

    # daemons: a consumer that missed its wake-up must not keep the test run alive
    threads = [threading.Thread(target=consumer, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for e in idle:
        assert e.wait(TIMEOUT)
    for i in range(n):
        q.sync.put(i)
        if i % 1000 == 999:
            time.sleep(0.001)  # handshake-free: pacing, so that the consumers wait again
    q.sync.put(None)
    q.sync.put(None)
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a consumer missed its wake-up"
    assert not errors, errors
    assert sorted(got[0] + got[1]) == list(range(n))
    with pytest.raises(aiomp.Empty):  # not q.empty(): two threads' counts may race (qsize)
        q.get_nowait()


@pytest.mark.anyio
async def test_a_stopped_holder_killed_while_others_wait_for_the_overflow_lock() -> None:
    """Issue 25 item 2, recovery: while a stopped process holds the overflow's lock, a
    blocking get (a thread, in timed waits) and an async get (pausing on the loop) wait;
    SIGKILLed, its lock is recovered (EOWNERDEAD) by whichever comes first, its half-put
    item is not in the queue, and both gets return."""
    q = aiomp.Queue(10)
    q.put_nowait("first")
    q.put_nowait("second")
    held = aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.stop_at,
            1,
            args=(q, "producer: record written", "never committed", held),
            grace_period=GRACE,
        )
        await held.wait()
    got: list[Any] = []

    async def async_get() -> None:
        got.append(await q.get())

    async def sync_get() -> None:
        got.append(await anyio.to_thread.run_sync(functools.partial(q.sync.get, timeout=TIMEOUT)))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(async_get)
            tg.start_soon(sync_get)
            await anyio.sleep(0.2)  # handshake-free: a thread blocked in a lock says nothing
            assert got == []
            os.kill(ctx.pids()[0], signal.SIGKILL)
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    assert sorted(got) == ["first", "second"]
    assert q.qsize() == 0
    q.put_nowait("the queue works on")
    assert q.get_nowait() == "the queue works on"


class _Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def test_a_blocking_call_waiting_for_a_stopped_holder_can_be_interrupted() -> None:
    """Issue 25 item 2, the blocking side: ``q.sync.get`` waited in ``pthread_mutex_lock``,
    where no signal handler runs (Ctrl-C did nothing) and its timeout did not hold, for as
    long as the holder stayed stopped. Now it waits in timed slices: a signal handler's
    exception interrupts it, leaving the lock unheld, and a timeout raises Empty/Full."""
    import multiprocessing

    q = aiomp.Queue(10)
    q.put_nowait("before")
    held = aiomp.Event()
    child = multiprocessing.get_context("fork").Process(
        target=qfuncs.stop_at, args=(0, q, "producer: record written", "carried", held)
    )
    child.start()
    watchdog = threading.Timer(WATCHDOG, os.kill, (child.pid, signal.SIGCONT))
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        assert held.sync.wait(TIMEOUT)
        watchdog.start()
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # as Ctrl-C would, in the main thread
        with pytest.raises(_Interrupted):
            q.sync.get()
        assert time.monotonic() - started < WATCHDOG / 2, "interrupted only once resumed"
        with pytest.raises(aiomp.Empty):
            q.sync.get(timeout=0.1)
        with pytest.raises(aiomp.Full):
            q.sync.put("refused", timeout=0.1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()
        os.kill(child.pid, signal.SIGCONT)
    child.join(TIMEOUT)
    assert child.exitcode == 0
    child.close()
    assert drain(q) == ["before", "carried"], "nothing lost, the interrupted get took nothing"
