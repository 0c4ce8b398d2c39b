"""Contract tests for ``aiomp.Event``: set, clear and wait, async and sync, timeouts,
cancellation, a full registry, loops in several threads.
"""

from __future__ import annotations

import os
import threading
import time

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._wire import datagram as _transport
from tests.conftest import run_plain
from tests.queue._queues import QUICK, SHORT

# -- one process: Event --------------------------------------------------------------------


@pytest.mark.anyio
async def test_event_set_clear_wait() -> None:
    e = aiomp.Event()
    assert not e.is_set() and repr(e) == "<aiomp.Event unset>"
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await e.wait()
        woken.append(i)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            e.set()
        assert sorted(woken) == [0, 1, 2]
        assert e.is_set() and repr(e) == "<aiomp.Event set>"
        e.set()  # setting twice is fine; one clear undoes it
        await e.wait()  # returns at once while set
        e.clear()
        assert not e.is_set()
        e.clear()  # clearing twice is fine
        assert not e.is_set()


def test_event_sync_wait() -> None:
    e = aiomp.Event()
    start = time.monotonic()
    assert e.sync.wait(timeout=SHORT) is False
    assert time.monotonic() - start >= SHORT
    assert e.sync.wait(timeout=0) is False
    timer = threading.Timer(SHORT, e.set)  # handshake-free: a thread sets it later
    timer.start()
    assert e.sync.wait(timeout=QUICK) is True
    timer.join()
    assert e.sync.wait() is True


@pytest.mark.anyio
async def test_cancelled_event_wait_leaves_it_as_it_was() -> None:
    e = aiomp.Event()
    with anyio.move_on_after(SHORT):  # handshake-free: nothing sets it
        await e.wait()
    assert not e.is_set()
    e.set()
    with anyio.fail_after(QUICK):
        await e.wait()
    assert e.is_set()


def wait_registered(e: aiomp.Event, timeout: float) -> bool:
    """Block until a waiter of ``e`` has registered: a test's window into the wait (see
    docs/decisions/0032-event-wake-ups.md). A waiter reads the event's generation
    before it registers, so from then on any ``set()`` wakes it."""
    import select

    poll = select.poll()
    poll.register(e._registry.fileno(), select.POLLIN)
    return bool(poll.poll(timeout * 1000))


@pytest.mark.anyio
async def test_event_set_then_clear_wakes_every_waiter() -> None:
    """Regression, issue 25 item 6: ``e.set(); e.clear()`` woke nobody (the waiters
    watched the flag's eventfd, unreadable again by the time they looked);
    ``threading.Event`` wakes everyone waiting at the set."""
    e = aiomp.Event()
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await e.wait()
        woken.append(i)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()  # each is inside e.wait()
            e.set()
            e.clear()
    assert sorted(woken) == [0, 1, 2]
    assert not e.is_set()
    with anyio.move_on_after(SHORT):  # handshake-free: a new wait sees the clear
        await e.wait()
        pytest.fail("a wait begun after set(); clear() returned")


def test_event_set_then_clear_wakes_a_sync_waiter() -> None:
    """Regression, issue 25 item 6, through ``e.sync.wait`` in a thread."""
    e = aiomp.Event()
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(e.sync.wait(timeout=QUICK)))
    t.start()
    assert wait_registered(e, QUICK)
    e.set()
    e.clear()
    t.join(QUICK + 1)
    assert result == [True], "woken by the set, not by the timeout"
    assert e.sync.wait(timeout=0) is False


def registrations(e: aiomp.Event) -> int:
    """Take every registration out of ``e``'s registry (a test's look; closes their fds)."""
    import socket

    count = 0
    while True:
        try:
            _, anc, _, _ = e._registry.recvmsg(16, socket.CMSG_SPACE(4), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return count
        _transport.close_fds(_transport.fds_in(anc))
        count += 1


def test_event_waits_that_time_out_register_once() -> None:
    """A thread's waits park one registration until a set() takes it: waits that time
    out again and again (a polling loop) add no fds to the registry."""
    e = aiomp.Event()
    for _ in range(50):
        assert e.sync.wait(timeout=0) is False
    assert registrations(e) == 1


@pytest.mark.anyio
async def test_event_wait_with_a_full_registry_wakes_at_set() -> None:
    """A waiter that cannot register (the registry is full) waits for room, which a set()
    makes: it wakes even if clear() follows at once."""
    import socket

    e = aiomp.Event()
    e._registry.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the kernel's least
    waker = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        with pytest.raises(BlockingIOError):
            for _ in range(10_000):  # registrations of a thread that stopped waiting
                e._registry.sendmsg(
                    [bytes(16)],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, waker.to_bytes(4, "little"))],
                    socket.MSG_DONTWAIT,
                )
        woken = False

        async def waiter() -> None:
            nonlocal woken
            await e.wait()
            woken = True

        with anyio.fail_after(QUICK):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()  # waiting for room
                e.set()
                e.clear()
        assert woken
        assert os.eventfd_read(waker) >= 1, "the parked registrations were woken"
    finally:
        os.close(waker)


def _wait_in_a_thread(
    backend: object, e: aiomp.Event, ready: threading.Event, woken: list[str], name: str
) -> None:
    """Run a loop of ``backend`` in this thread; two tasks wait for ``e``; ``ready`` is set
    once both are inside ``e.wait()``."""

    async def main() -> None:
        async def waiter() -> None:
            await e.wait()
            woken.append(name)

        with anyio.fail_after(QUICK):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                ready.set()

    try:
        run_plain(backend, main)
    except BaseException as exc:  # noqa: BLE001 - reported to the test's thread
        woken.append(f"{name}: {exc!r}")
    finally:
        ready.set()


@pytest.mark.parametrize("clear", [False, True], ids=["set", "set-clear"])
def test_event_awaited_from_loops_in_several_threads(clear: bool) -> None:
    """Regression, issue 25 item 7: tasks of two threads' loops waiting for one Event
    shared one anyio.Event across loops, set from the wrong thread: "bound to a different
    event loop", or some waiters never woke. Each thread's loop is woken by its own
    poller now. The threads start one after the other, each waiting before the next
    begins (how the bug reproduced at every run)."""
    e = aiomp.Event()
    woken: list[str] = []
    loops = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {}), ("trio", {})]
    threads = []
    for i, backend in enumerate(loops):
        ready = threading.Event()
        name = f"{backend[0]}{'-uvloop' if backend[1] else ''}-{i}"
        t = threading.Thread(target=_wait_in_a_thread, args=(backend, e, ready, woken, name))
        t.start()
        threads.append(t)
        assert ready.wait(QUICK)
    sync_result: list[bool] = []
    sync = threading.Thread(target=lambda: sync_result.append(e.sync.wait(timeout=QUICK)))
    sync.start()  # and a sync waiter in a thread of its own
    assert wait_registered(e, QUICK)
    e.set()
    if clear:
        e.clear()
    for t in (*threads, sync):
        t.join(QUICK + 1)
    assert sorted(woken) == sorted(n for n in woken if ":" not in n), woken
    assert len(woken) == 2 * len(loops)
    assert sync_result == [True]
