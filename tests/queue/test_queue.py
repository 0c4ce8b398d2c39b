"""Contract tests for ``aiomp.Queue`` and ``aiomp.Event`` (README "Queues, events and
shared memory", R11), through the public API, on asyncio, uvloop and trio.

Most behaviour is visible in one process (a queue put to and read from by tasks and
threads of this process); a few tests start children to show that the same holds across
processes: many producers and consumers, queues travelling in args and messages, close()
reaching waiters elsewhere. Children are never slept on: they report through queues and
events, and every await on them is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import resource
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue
from aiomp._wire import datagram as _transport
from tests._sinks import Stalls
from tests.children import common as funcs
from tests.children import queue as qfuncs
from tests.conftest import run_plain

#: Bound on every await that depends on a child. Generous: two shared cores, cold starts.
TIMEOUT = 20
#: Bound on awaits that depend on this process only.
QUICK = 5
GRACE = 0.5
#: A timeout the test waits out on purpose (sync twins).
SHORT = 0.05


class Unpicklable:
    def __reduce__(self) -> object:
        raise TypeError("Unpicklable refuses to be pickled")


def drain(q: aiomp.Queue) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except (aiomp.Empty, aiomp.QueueClosedError):
            return items


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


# -- one process: put / get ----------------------------------------------------------------


def test_public_names() -> None:
    import queue

    assert aiomp.Full is queue.Full and aiomp.Empty is queue.Empty
    assert issubclass(aiomp.QueueClosedError, Exception)
    for name in ("Queue", "Event", "QueueClosedError"):
        assert getattr(aiomp, name).__module__ == "aiomp"


@pytest.mark.anyio
async def test_put_get_fifo() -> None:
    q = aiomp.Queue()
    items: list[object] = [1, "two", b"three", None, {"four": [4.0]}, (5,), bytes(200_000)]
    with anyio.fail_after(QUICK):
        for item in items:
            await q.put(item)
        assert q.qsize() == len(items)
        assert [await q.get() for _ in items] == items
    assert q.empty()


@pytest.mark.anyio
async def test_nowait_full_and_empty() -> None:
    q = aiomp.Queue(maxsize=2)
    assert q.maxsize == 2
    with pytest.raises(aiomp.Empty):
        q.get_nowait()
    q.put_nowait("a")
    await q.put("b")
    assert q.full() and q.qsize() == 2 and not q.empty()
    with pytest.raises(aiomp.Full):
        q.put_nowait("c")
    assert q.qsize() == 2, "a refused put changes nothing"
    assert q.get_nowait() == "a"
    assert not q.full()
    q.put_nowait("c")
    assert drain(q) == ["b", "c"]
    with pytest.raises(aiomp.Empty):
        q.get_nowait()
    assert q.qsize() == 0 and q.empty() and not q.full()


@pytest.mark.parametrize("maxsize", [0, -1])
def test_maxsize_zero_or_less_is_unbounded(maxsize: int) -> None:
    q = aiomp.Queue(maxsize)
    assert q.maxsize == 0
    for i in range(1000):
        q.put_nowait(i)
    assert not q.full() and q.qsize() == 1000
    assert drain(q) == list(range(1000))


@pytest.mark.anyio
async def test_maxsize_back_pressure() -> None:
    q = aiomp.Queue(maxsize=1)
    send, progress = anyio.create_memory_object_stream[int](10)

    async def producer() -> None:
        async with send:
            for i in range(3):
                await q.put(i)
                await send.send(i)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg, progress:
            tg.start_soon(producer)
            assert await progress.receive() == 0
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.WouldBlock):
                progress.receive_nowait()  # the second put waits for room
            assert q.full()
            assert await q.get() == 0
            assert await progress.receive() == 1
            assert await q.get() == 1
            assert await progress.receive() == 2
            assert await q.get() == 2


def fill_until_overflow(q: aiomp.Queue) -> int:
    """Put large-ish items until the socket buffer is full and the overflow is in use."""
    item = bytes(_transport.MAX_INLINE - 100)
    n = 0
    while _queue.overflow_of(q).count() == 0:
        q.put_nowait(item)
        n += 1
        assert n < 10_000, "the socket never filled"
    assert q.qsize() == n
    return n


def shrink_vault(q: aiomp.Queue) -> None:
    """Make the overflow's fd vault hold only a few items (its buffer at the minimum)."""
    import socket

    q._recv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)


def fill_vault(q: aiomp.Queue) -> list[aiomp.Event]:
    """Fill the socket, then the (shrunk) vault with items carrying an fd, until Full."""
    shrink_vault(q)
    fill_until_overflow(q)
    events = []
    with pytest.raises(aiomp.Full):
        while True:
            events.append(aiomp.Event())
            q.put_nowait(events[-1])
            assert len(events) < 1000, "the vault never filled"
    return events


async def _put_wakes_after_one_get() -> bool:
    q = aiomp.Queue()
    fill_vault(q)
    put_done = anyio.Event()

    async def put() -> None:
        await q.put(aiomp.Event())  # fits once an item with fds is taken
        put_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(put)
        await anyio.wait_all_tasks_blocked()  # the put waits for room in the vault
        while not isinstance(q.get_nowait(), aiomp.Event):
            pass
        with anyio.move_on_after(1):  # handshake-free: a bounded wait for the bug
            await put_done.wait()
        tg.cancel_scope.cancel()
    drain(q)
    return put_done.is_set()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_waiting_put_wakes_once_an_item_is_taken() -> None:
    assert await _put_wakes_after_one_get()


@pytest.mark.anyio
async def test_many_getters_in_one_process_each_get_one_item() -> None:
    # One task per process waits on the socket; the others fan out from it.
    q = aiomp.Queue()
    got: list[int] = []

    async def getter() -> None:
        got.append(await q.get())

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(getter)
            await anyio.wait_all_tasks_blocked()
            for i in range(5):
                await q.put(i)
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert q.empty()


@pytest.mark.anyio
async def test_many_putters_wait_for_room() -> None:
    q = aiomp.Queue(maxsize=1)
    await q.put(-1)
    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(q.put, i)
            await anyio.wait_all_tasks_blocked()
            got = [await q.get() for _ in range(5)]
    assert got[0] == -1 and sorted(got[1:]) == [0, 1, 2, 3]


def test_sync_twin_with_timeouts() -> None:
    q = aiomp.Queue(maxsize=1)
    start = time.monotonic()
    with pytest.raises(aiomp.Empty):
        q.sync.get(timeout=SHORT)
    assert time.monotonic() - start >= SHORT
    with pytest.raises(aiomp.Empty):
        q.sync.get(timeout=0)
    q.sync.put("a", timeout=0)
    start = time.monotonic()
    with pytest.raises(aiomp.Full):
        q.sync.put("b", timeout=SHORT)
    assert time.monotonic() - start >= SHORT
    assert q.qsize() == 1
    assert q.sync.get(timeout=0) == "a"
    q.sync.put("c")
    assert q.sync.get() == "c"


def test_sync_twin_from_threads() -> None:
    q = aiomp.Queue(maxsize=2)
    got: list[int] = []

    def consume() -> None:
        for _ in range(100):
            got.append(q.sync.get(timeout=QUICK))

    thread = threading.Thread(target=consume)
    thread.start()
    for i in range(100):
        q.sync.put(i, timeout=QUICK)
    thread.join(QUICK)
    assert not thread.is_alive()
    assert got == list(range(100))


@pytest.mark.anyio
async def test_async_and_sync_sides_together() -> None:
    q = aiomp.Queue(maxsize=1)

    def produce() -> None:
        for i in range(20):
            q.sync.put(i, timeout=QUICK)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, produce)
            got = [await q.get() for _ in range(20)]
    assert got == list(range(20))


def test_repr_and_qsize_after_gets() -> None:
    q = aiomp.Queue(maxsize=3)
    q.put_nowait(1)
    assert repr(q) == "<aiomp.Queue maxsize=3 qsize=1>"
    q.get_nowait()
    assert repr(q) == "<aiomp.Queue maxsize=3 qsize=0>"


# -- one process: close --------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("maxsize", [0, 3])
async def test_close_then_drain(maxsize: int) -> None:
    q = aiomp.Queue(maxsize)
    for i in range(3):
        await q.put(i)
    q.close()
    q.close()  # idempotent
    with pytest.raises(aiomp.QueueClosedError):
        await q.put(3)
    with pytest.raises(aiomp.QueueClosedError):
        q.put_nowait(3)
    with pytest.raises(aiomp.QueueClosedError):
        q.sync.put(3, timeout=0)
    assert q.qsize() == 3, "refused puts changed nothing"
    with anyio.fail_after(QUICK):
        assert await q.get() == 0
        assert q.get_nowait() == 1
        assert q.sync.get(timeout=0) == 2
        with pytest.raises(aiomp.QueueClosedError):
            await q.get()
    with pytest.raises(aiomp.QueueClosedError):
        q.get_nowait()
    with pytest.raises(aiomp.QueueClosedError):
        q.sync.get(timeout=QUICK)
    assert q.qsize() == 0 and q.empty()


@pytest.mark.anyio
async def test_async_for_ends_when_closed() -> None:
    q = aiomp.Queue()
    got: list[int] = []

    async def consume() -> None:
        async for item in q:
            got.append(item)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(5):
                await q.put(i)
            await anyio.wait_all_tasks_blocked()
            q.close()
    assert got == [0, 1, 2, 3, 4]


def test_sync_iteration_ends_when_closed() -> None:
    q = aiomp.Queue()
    for i in range(3):
        q.sync.put(i)
    q.close()
    assert list(q.sync) == [0, 1, 2]


async def _outcomes_of_waiters_at_close(
    q: aiomp.Queue, wait: Any, wait_sync: Any, n_async: int
) -> list[str]:
    """Start ``n_async`` tasks and one thread that wait on ``q``, close it, and return how
    each ended: ``"done"`` or ``"closed"``."""
    outcomes: list[str] = []

    async def waiter() -> None:
        try:
            await wait()
            outcomes.append("done")
        except aiomp.QueueClosedError:
            outcomes.append("closed")

    def sync_waiter() -> None:
        try:
            wait_sync()
            outcomes.append("done")
        except aiomp.QueueClosedError:
            outcomes.append("closed")

    thread = threading.Thread(target=sync_waiter)
    thread.start()
    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for _ in range(n_async):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            q.close()
    thread.join(QUICK)
    return outcomes


@pytest.mark.anyio
async def test_close_wakes_waiting_consumers() -> None:
    q = aiomp.Queue()
    outcomes = await _outcomes_of_waiters_at_close(q, q.get, lambda: q.sync.get(timeout=QUICK), 3)
    assert outcomes == ["closed"] * 4


@pytest.mark.anyio
async def test_close_wakes_producers_blocked_on_a_full_queue() -> None:
    q = aiomp.Queue(maxsize=1)
    await q.put("kept")
    outcomes = await _outcomes_of_waiters_at_close(
        q, lambda: q.put("refused"), lambda: q.sync.put("refused", timeout=QUICK), 2
    )
    assert outcomes == ["closed"] * 3
    assert drain(q) == ["kept"]


# -- one process: errors and cancellation leave the queue intact --------------------------


@pytest.mark.anyio
async def test_pickling_error_raises_at_put_and_sends_nothing() -> None:
    q = aiomp.Queue(maxsize=1)
    with pytest.raises(TypeError, match="refuses"):
        await q.put([1, Unpicklable()])
    with pytest.raises(TypeError, match="refuses"):
        q.put_nowait(Unpicklable())
    with pytest.raises(TypeError, match="refuses"):
        q.sync.put(Unpicklable(), timeout=0)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        await q.put(lambda: None)
    assert q.qsize() == 0
    with pytest.raises(aiomp.Empty):
        q.get_nowait()
    q.put_nowait("the slot is still free")
    assert q.get_nowait() == "the slot is still free"


class FailsOnLoad:
    def __reduce__(self) -> tuple[object, ...]:
        return _fail_on_load, ()


def _fail_on_load() -> None:
    raise ValueError("cannot rebuild this here")


@pytest.mark.anyio
async def test_unpickling_error_raises_at_get_and_loses_only_that_item() -> None:
    q = aiomp.Queue(maxsize=2)
    await q.put([aiomp.Event(), FailsOnLoad()])
    await q.put("next")
    with pytest.raises(aiomp.QueueItemError, match="_fail_on_load") as info:
        await q.get()
    assert isinstance(info.value.__cause__, ValueError)
    assert "cannot rebuild" in str(info.value.__cause__)
    assert q.qsize() == 1
    q.put_nowait("fits: the lost item's slot was given back")
    assert drain(q) == ["next", "fits: the lost item's slot was given back"]


@pytest.mark.anyio
async def test_cancelled_get_leaves_the_queue_intact() -> None:
    q = aiomp.Queue()
    with anyio.fail_after(QUICK):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(q.get)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        await q.put("x")
        assert q.qsize() == 1
        assert await q.get() == "x"
        assert q.empty()


@pytest.mark.anyio
async def test_cancelled_waiter_hands_over_to_the_others() -> None:
    # The task that waits on the fd for the whole process is cancelled: the others must
    # still be woken when an item comes.
    q = aiomp.Queue()
    got: list[object] = []

    async def getter() -> None:
        got.append(await q.get())

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as first:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(getter)
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(getter)
                    tg.start_soon(getter)
                    await anyio.wait_all_tasks_blocked()
                    first.cancel()
            await anyio.wait_all_tasks_blocked()
            await q.put(1)
            await q.put(2)
    assert sorted(got) == [1, 2]
    assert q.empty()


@pytest.mark.anyio
async def test_cancelled_put_leaves_the_queue_intact() -> None:
    q = aiomp.Queue(maxsize=1)
    await q.put("first")
    with anyio.fail_after(QUICK):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(q.put, "cancelled")
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        assert q.qsize() == 1
        assert await q.get() == "first"
        with pytest.raises(aiomp.Empty):
            q.get_nowait()
        await q.put("second")  # the slot was given back
        assert q.full()
        assert await q.get() == "second"


@pytest.mark.anyio
async def test_get_timeout_by_fail_after_takes_nothing() -> None:
    q = aiomp.Queue()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(SHORT):  # handshake-free: nothing is meant to arrive
            await q.get()
    q.put_nowait(1)
    assert q.get_nowait() == 1


def _counts_after_failed_puts(maxsize: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    q = aiomp.Queue(maxsize)
    q.put_nowait("kept")

    def refuse(*args: object) -> bool:
        raise aiomp.TransportError(109, "too many fds in flight (simulated)")

    monkeypatch.setattr(_transport, "try_send", refuse)
    errors = []
    for put in (q.put_nowait, lambda item: q.sync.put(item, timeout=0)):
        try:
            put(("refused", aiomp.Event()))  # its fd must travel (socket, or fd vault)
        except Exception as exc:  # noqa: BLE001 - compared below
            errors.append(type(exc).__name__)
    monkeypatch.undo()
    observed: dict[str, object] = {"errors": errors, "qsize": q.qsize()}
    if maxsize:
        try:
            q.put_nowait("takes the last free slot")
        except aiomp.Full:
            pass
        observed["full"] = q.full()
    observed["items"] = drain(q)
    return observed


@pytest.mark.parametrize("maxsize", [0, 2])
def test_transport_error_at_put_leaves_counts_intact(
    monkeypatch: pytest.MonkeyPatch, maxsize: int
) -> None:
    # e.g. ETOOMANYREFS: an unprivileged sender with too many fds in flight. (The queue
    # lives in a helper so that a failure here leaks nothing through the traceback.)
    observed = _counts_after_failed_puts(maxsize, monkeypatch)
    assert observed["errors"] == ["TransportError", "TransportError"]
    assert observed["qsize"] == 1, "a failed put must not count as an item"
    if maxsize:
        assert observed["full"], "the slots of failed puts were given back"
    assert observed["items"][0] == "kept"  # type: ignore[index]


def _counts_after_a_lost_message(maxsize: int) -> dict[str, object]:
    q = aiomp.Queue(maxsize)
    carried = [aiomp.Event() for _ in range(10)]
    q.put_nowait(carried)
    q.put_nowait("next")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd() + 3, hard))
    try:
        with pytest.raises(aiomp.TransportError, match="fd limit"):
            q.get_nowait()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    observed: dict[str, object] = {"qsize": q.qsize()}
    if maxsize:
        try:
            q.put_nowait("takes the last free slot")
        except aiomp.Full:
            pass
        observed["full"] = q.full()
    observed["items"] = drain(q)
    return observed


@pytest.mark.parametrize("maxsize", [0, 2])
def test_transport_error_at_get_leaves_counts_intact(maxsize: int) -> None:
    # A message whose fds cannot be received (this process is at its fd limit) raises
    # TransportError. From the socket (unbounded) it is lost, and the counts follow; from
    # the log (every item of a bounded queue) it is only peeked at, so it stays queued.
    observed = _counts_after_a_lost_message(maxsize)
    items: list[Any] = observed["items"]  # type: ignore[assignment]
    if maxsize:
        assert observed["qsize"] == 2, "the item stayed in the queue"
        assert observed["full"]
        assert len(items[0]) == 10 and items[1] == "next"
    else:
        assert observed["qsize"] == 1, "the lost message no longer counts"
        assert items[0] == "next"


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


# -- across processes ----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("child", [funcs.q_mpmc, funcs.q_mpmc_async], ids=["sync", "async"])
async def test_many_producers_and_consumers_across_processes(child: Callable[..., Any]) -> None:
    count = 300
    q, done = aiomp.Queue(maxsize=16), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(child, 4, args=(q, done, 2, count), grace_period=GRACE) as ctx:
            for i in range(count):  # this process produces too
                await q.put(("parent", i))
            assert sorted([await done.get(), await done.get()]) == [0, 1]
            q.close()
    taken = [tuple(item) for rank in (2, 3) for item in ctx.results[rank]]  # type: ignore[attr-defined]
    expected = [(p, i) for p in (0, 1, "parent") for i in range(count)]
    assert len(taken) == len(expected), "no item lost, none duplicated"
    assert sorted(taken, key=repr) == sorted(expected, key=repr)
    for rank in (2, 3):  # each producer's items arrive in order at each consumer
        mine = [item for item in ctx.results[rank]]  # type: ignore[attr-defined]
        for producer in (0, 1, "parent"):
            seq = [i for p, i in mine if p == producer]
            assert seq == sorted(seq)
    assert q.qsize() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("child", [funcs.q_forward, funcs.q_forward_async], ids=["sync", "async"])
async def test_items_through_a_child_and_back(child: Callable[..., Any]) -> None:
    qin, qout = aiomp.Queue(maxsize=4), aiomp.Queue(maxsize=4)
    items: list[object] = [0, "s", b"b" * 200_000, {"k": [1, 2]}, None, 3.5]

    async def produce() -> None:
        for item in items * 10:
            await qin.put(item)
        qin.close()

    with anyio.fail_after(TIMEOUT):
        async with (
            aiomp.spawn(child, 1, args=(qin, qout), grace_period=GRACE) as ctx,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(produce)
            got = [await qout.get() for _ in range(len(items) * 10)]
    assert got == items * 10
    assert ctx.results == [len(items) * 10]


@pytest.mark.anyio
async def test_queues_and_events_in_args_and_messages() -> None:
    q, reply, inner, event = aiomp.Queue(), aiomp.Queue(), aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.q_identities, 1, args=(q, reply), grace_period=GRACE):
            await q.put((q, inner, inner))
            await q.put(inner)
            await q.put(event)
            info = await inner.get()  # the child answers on the queue it received
            await event.wait()
            assert await reply.get() == "done"
    assert info == {
        "args_and_message_same": True,
        "twice_in_one_message_same": True,
        "twice_in_two_messages_same": True,
        "event_type": "Event",
    }


@pytest.mark.anyio
async def test_close_from_a_child_ends_the_parents_iteration() -> None:
    q = aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.q_close_from_child, 1, args=(q, list(range(50))), grace_period=GRACE
        ):
            got = [item async for item in q]
    assert got == list(range(50))
    with pytest.raises(aiomp.QueueClosedError):
        await q.put(1)


@pytest.mark.anyio
async def test_close_wakes_waiters_in_other_processes() -> None:
    full, empty, ready = aiomp.Queue(maxsize=1), aiomp.Queue(), aiomp.Queue()
    await full.put("kept")
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.q_close_waiters_async, 2, args=(full, empty, ready), grace_period=GRACE
        ) as ctx:
            assert sorted([await ready.get(), await ready.get()]) == [0, 1]
            # Both children are about to wait (or already are): either way close() must
            # end their wait, not leave them blocked.
            full.close()
            empty.close()
    assert ctx.results == ["QueueClosedError", "QueueClosedError"]
    assert drain(full) == ["kept"]


@pytest.mark.anyio
async def test_sync_timeouts_in_a_child() -> None:
    q = aiomp.Queue(maxsize=1)
    await q.put("first")
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.q_sync_timeouts, 1, args=(q, SHORT), grace_period=GRACE
        ) as ctx:
            pass
    assert ctx.results == [("Full", "Empty")]


@pytest.mark.anyio
async def test_event_across_processes() -> None:
    go, ready, done = aiomp.Event(), aiomp.Event(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.ev_ping, 1, args=(go, ready, done, SHORT), grace_period=GRACE
        ) as ctx:
            await ready.wait()  # the child's first wait has timed out
            assert not go.is_set()
            go.set()
            await done.wait()
            assert not go.is_set(), "the child's clear() is seen here"
            assert done.is_set()
    assert ctx.results == [(False, True)]


@pytest.mark.anyio
async def test_event_async_wait_in_a_child() -> None:
    go, done = aiomp.Event(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.ev_ping_async, 2, args=(go, done), grace_period=GRACE) as ctx:
            go.set()
            await done.wait()
    assert ctx.results == [True, True]


@pytest.mark.anyio
async def test_event_set_then_clear_wakes_an_async_waiter_in_a_child() -> None:
    """Regression, issue 25 item 6, across processes: the child says ``ready`` once its
    waiting task is blocked inside ``go.wait()``; one ``set(); clear()`` must wake it."""
    go, ready = aiomp.Event(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            qfuncs.event_wait_reported, 1, args=(go, ready, QUICK), grace_period=GRACE
        ) as ctx:
            await ready.wait()
            go.set()
            go.clear()
    assert ctx.results == ["woken"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],  # a child forked from trio.run sees sniffio say "trio"
)
# It forks on purpose; an earlier trio test's idle worker thread (trio keeps one a while
# after a forkserver start) makes aiomp warn, rightly, and harmlessly here.
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_event_waits_in_a_forked_child_after_the_parent_waited() -> None:
    """A forked child inherits the parent's registration and its eventfd: it must wait on
    a wake-up of its own. Shared, the one write of a set() woke whichever process read it
    first (here the parent, whose task waits too), and the other could miss it."""
    go, ready = aiomp.Event(), aiomp.Event()
    parent_woken = False

    async def parent_waiter() -> None:
        nonlocal parent_woken
        await go.wait()
        parent_woken = True

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(parent_waiter)
            await anyio.wait_all_tasks_blocked()  # registered before the fork
            async with aiomp.spawn(
                qfuncs.event_wait_reported,
                1,
                args=(go, ready, QUICK),
                start_method="fork",
                grace_period=GRACE,
            ) as ctx:
                await ready.wait()
                go.set()
                go.clear()
    assert ctx.results == ["woken"]
    assert parent_woken


@pytest.mark.anyio
async def test_event_set_then_clear_wakes_a_sync_waiter_in_a_child() -> None:
    """Regression, issue 25 item 6: a child blocked in ``go.sync.wait()``. The parent sees
    the child's wait registered (see ``wait_registered``) before it sets and clears."""
    go = aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            qfuncs.event_sync_wait, 1, args=(go, QUICK), grace_period=GRACE
        ) as ctx:
            await anyio.wait_readable(go._registry.fileno())
            go.set()
            go.clear()
    assert ctx.results == [True]


@pytest.mark.anyio
async def test_close_wakes_a_put_waiting_for_the_vault() -> None:
    """Regression: close() woke producers waiting for a slot, not those waiting for room
    (then in the socket buffer, now in the overflow's fd vault); they stayed blocked."""
    q = aiomp.Queue()
    fill_vault(q)
    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:

            async def put() -> None:
                with pytest.raises(aiomp.QueueClosedError):
                    await q.put(aiomp.Event())

            tg.start_soon(put)
            await anyio.wait_all_tasks_blocked()
            q.close()
    drain(q)


# -- unbounded: the overflow (issue 10) ----------------------------------------------------

STRATEGIES = pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])


@pytest.fixture
def strategy(request: pytest.FixtureRequest) -> Any:
    before = aiomp.get_sharing_strategy()
    aiomp.set_sharing_strategy(request.param)
    yield request.param
    aiomp.set_sharing_strategy(before)


def _log_bytes(q: aiomp.Queue) -> int:
    return os.fstat(_queue.overflow_of(q).fd).st_size


def _put_and_drain_200k(strategy: str) -> dict[str, object]:
    import numpy as np

    q = aiomp.Queue()
    fresh_log = _log_bytes(q)
    expected: list[object] = []
    for i in range(200_000):
        q.put_nowait(i)  # never Full: no consumer at all
        expected.append(i)
        if i % 100 == 0:
            q.put_nowait(np.full(16_384, i, dtype=np.int32))  # 64 KiB: a shared array
            expected.append(("array", i))
    observed: dict[str, object] = {"qsize": q.qsize(), "in_overflow": _queue.overflow_of(q).count()}
    got: list[object] = []
    while True:
        try:
            item = q.get_nowait()
        except aiomp.Empty:
            break
        if isinstance(item, np.ndarray):
            assert aiomp.is_shared(item), "arrays travel as shared-memory handles"
            assert (item == item[0]).all()
            got.append(("array", int(item[0])))
        else:
            got.append(item)
    observed["in_order"] = got == expected
    observed["empty"] = q.empty() and q.qsize() == 0
    observed["log_after_drain"] = _log_bytes(q) == fresh_log
    observed["vault_empty"] = _queue.overflow_of(q).socket_empty()
    return observed


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"], indirect=True)
def test_unbounded_queue_takes_200k_items_and_2k_arrays_with_no_consumer(strategy: str) -> None:
    """Issue 10: put_nowait raised Full after about 10,900 small items (505 arrays)."""
    observed = _put_and_drain_200k(strategy)
    assert observed["qsize"] == 202_000
    assert observed["in_overflow"] > 150_000, "the overflow was in use"
    assert observed["in_order"], "every item, in the order put"
    assert observed["empty"]
    assert observed["log_after_drain"], "the overflow's memory is given back once drained"
    assert observed["vault_empty"]


@pytest.mark.anyio
async def test_put_and_get_never_wait_on_an_unbounded_queue() -> None:
    q = aiomp.Queue()
    n = fill_until_overflow(q) + 5_000
    with anyio.fail_after(QUICK):
        for i in range(5_000):
            await q.put(i)  # the socket is full: these go to the overflow, no waiting
        assert q.qsize() == n
        got = [await q.get() for _ in range(n)]
    assert got[-5_000:] == list(range(5_000))
    assert q.empty()


@pytest.mark.anyio
async def test_close_with_items_in_the_overflow() -> None:
    q = aiomp.Queue()
    n = fill_until_overflow(q)
    for i in range(100):
        q.put_nowait(i)
    q.close()
    with pytest.raises(aiomp.QueueClosedError):
        q.put_nowait("refused: the overflow is closed too")
    with anyio.fail_after(QUICK):
        got = [item async for item in q]
    assert len(got) == n + 100 and got[-100:] == list(range(100))
    with pytest.raises(aiomp.QueueClosedError):
        q.get_nowait()


def test_bounded_queue_keeps_its_bound_beyond_the_socket_buffer() -> None:
    q = aiomp.Queue(maxsize=20_000)
    for i in range(20_000):
        q.put_nowait(i)
    assert _queue.overflow_of(q).count() > 0 and q.full()
    with pytest.raises(aiomp.Full):
        q.put_nowait("one too many")
    assert q.get_nowait() == 0
    q.put_nowait(20_000)
    assert drain(q) == list(range(1, 20_001))


def test_the_vault_full_makes_put_nowait_full_and_nothing_is_lost() -> None:
    q = aiomp.Queue()
    events = fill_vault(q)
    n = q.qsize() - (len(events) - 1)
    q.put_nowait("an item without fds still fits")
    got = drain(q)
    assert len(got) == n + len(events) - 1 + 1
    assert got[n:-1] == events[:-1]  # the same objects: their fds came back


@pytest.mark.anyio
async def test_put_everything_then_start_the_consumer() -> None:
    """Issue 10: "put every job on the queue, then start the workers" deadlocked."""
    q = aiomp.Queue()
    n = 50_000
    for i in range(n):
        q.put_nowait(i)
    with anyio.fail_after(TIMEOUT * 3):
        async with aiomp.spawn(qfuncs.drain_in_order, 1, args=(q, n), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [True]
    assert q.empty()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
async def test_producers_exit_then_the_parent_drains(strategy: str) -> None:
    """Issue 10: "join the producers, then drain the results": a child that put 50,000
    results never exited, and `async with aiomp.spawn(...)` never left."""
    q = aiomp.Queue()
    n = 50_000
    with anyio.fail_after(TIMEOUT * 3):
        async with aiomp.spawn(
            qfuncs.put_range, 2, args=(q, n, strategy), grace_period=GRACE
        ) as ctx:
            pass  # leaving joins both: they exit with their items still queued
    assert ctx.results == [n, n]
    assert q.qsize() == 2 * n
    got = drain(q)
    assert len(got) == 2 * n
    for rank in (0, 1):
        assert [i for r, i in got if r == rank] == list(range(n)), "per-producer order"


@pytest.mark.anyio
async def test_items_survive_a_producer_sigkilled_right_after_put() -> None:
    """Issue 10: items in the overflow belong to the queue, not to the producer: a
    producer SIGKILLed the instant its last put returned loses nothing (arrays' fds
    included)."""
    import numpy as np

    q, ready = aiomp.Queue(), aiomp.Event()
    n = fill_until_overflow(q)
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.put_then_die, 1, args=(q, 3_000, 10, ready), grace_period=GRACE
        )
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    assert ready.is_set()
    got = drain(q)[n:]
    assert [item[1] for item in got] == list(range(3_000)), "none lost, none duplicated"
    arrays = [item[2] for item in got if item[0] == "array"]
    assert len(arrays) == 300
    assert all(isinstance(a, np.ndarray) and (a == i * 10).all() for i, a in enumerate(arrays))


# Each step of an overflow operation, and whether the item is in the queue when the
# process doing it dies there.
PRODUCER_STEPS = [
    ("producer: fds parked", False),
    ("producer: record written", False),
    ("producer: committed", True),
]
CONSUMER_STEPS = [("consumer: record read", True), ("consumer: committed", False)]


@pytest.mark.anyio
@pytest.mark.parametrize(("step", "kept"), PRODUCER_STEPS)
async def test_a_producer_killed_at_any_step_of_an_overflow_put(step: str, kept: bool) -> None:
    """The argument in aiomp/_queue/overflow.py, step by step: a producer SIGKILLed inside an
    overflow put (with an fd to park) leaves the item either wholly in the queue or not
    at all, and the queue works on (its robust mutex recovered)."""
    q = aiomp.Queue()
    n = fill_until_overflow(q)
    q.put_nowait("before")
    item = ("carried", aiomp.Event())
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.die_at, 1, args=(q, step, "producer", item), grace_period=GRACE
        )
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    q.put_nowait(("after", aiomp.Event()))
    got = drain(q)[n:]
    assert got[0] == "before" and got[-1][0] == "after"
    middle = got[1:-1]
    assert middle == ([item] if kept else [])
    if kept:
        assert middle[0][1] is item[1], "the Event's fd came through the vault"
    assert q.empty() and _queue.overflow_of(q).socket_empty()


@pytest.mark.anyio
@pytest.mark.parametrize(("step", "kept"), CONSUMER_STEPS)
async def test_a_consumer_killed_at_any_step_of_an_overflow_get(step: str, kept: bool) -> None:
    """Issue 10: a consumer SIGKILLed while reading from the overflow: the items it had
    not received are still there for the others, and none is delivered twice."""
    q = aiomp.Queue()
    events = [aiomp.Event() for _ in range(3)]
    for i, e in enumerate(events):  # straight into the overflow, as if the socket were full
        assert _queue.overflow_of(q).append(*_item_parts((i, e)), lambda: False)
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.die_at, 1, args=(q, step, "consumer", None), grace_period=GRACE
        )
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    got = drain(q)
    expected = [(i, e) for i, e in enumerate(events)]
    assert got == (expected if kept else expected[1:])
    assert all(a[1] is b[1] for a, b in zip(got, expected[-len(got) :], strict=True))
    assert q.empty() and _queue.overflow_of(q).socket_empty(), (
        "the stale vault datagram was dropped"
    )


def _item_parts(obj: object) -> tuple[bytes, list[int]]:
    from aiomp._wire import pickling as _reduction

    out = _reduction.dumps(obj)
    _PARTS.append(out)  # closed by the test's end: the fds must live until appended
    return bytes(out.body), out.fds


_PARTS: list[Any] = []


# -- async calls where no loop runs ----------------------------------------------------------


def test_async_calls_without_a_loop_raise_at_once_in_a_thread() -> None:
    q, e = aiomp.Queue(), aiomp.Event()
    errors: list[str] = []

    def worker() -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "coroutine ... was never awaited" would raise
            for call in (lambda: q.put(1), q.get, e.wait):
                try:
                    call()
                except RuntimeError as exc:
                    errors.append(str(exc))

    t = threading.Thread(target=worker)
    t.start()
    t.join(QUICK)
    assert len(errors) == 3
    assert "q.sync.put" in errors[0] and "q.sync.get" in errors[1] and "e.sync.wait" in errors[2]
    assert q.empty(), "nothing was put"


@pytest.mark.anyio
async def test_async_calls_without_a_loop_raise_at_once_in_a_sync_child() -> None:
    """Regression: torch-style ``q.put(x)`` in a sync child returned a coroutine that was
    never awaited: the item silently never arrived."""
    q, e = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            qfuncs.async_calls_without_a_loop, 1, args=(q, e), grace_period=GRACE
        ) as ctx:
            assert await q.get() == "still usable"
    errors = ctx.results[0]
    assert len(errors) == 3  # type: ignore[arg-type]
    for error, call in zip(
        errors,
        ("q.sync.put", "q.sync.get", "e.sync.wait"),  # type: ignore[call-overload]
        strict=True,
    ):
        assert call in error


@pytest.mark.anyio
async def test_async_calls_still_work_under_every_loop() -> None:
    q, e = aiomp.Queue(), aiomp.Event()
    with anyio.fail_after(QUICK):
        await q.put(1)
        assert await q.get() == 1
        e.set()
        await e.wait()


# -- items that cannot be rebuilt (issue 18 item 3) ----------------------------------------


class TwoArgError(Exception):
    """Pickles (as ``TwoArgError(msg)``) but its __init__ wants two arguments."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


class HidesATwoArgError:
    """Carries a TwoArgError where the put-time check does not look."""

    def __init__(self) -> None:
        self.inner = {"deep": [TwoArgError("deep", 1)]}


@pytest.mark.anyio
async def test_an_exception_that_cannot_be_rebuilt_is_refused_at_put() -> None:
    """Issue 18 item 3: put succeeded and the consumer's get lost the item with a bare
    TypeError. Exceptions are checked at put: the producer gets the error."""
    q = aiomp.Queue()
    for bad in (TwoArgError("x", 1), ("result", TwoArgError("x", 1))):
        with pytest.raises(pickle.PicklingError, match="TwoArgError") as info:
            await q.put(bad)
        assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(pickle.PicklingError, match="TwoArgError"):
        q.sync.put(TwoArgError("x", 1))
    assert q.empty()
    await q.put(ValueError("a plain exception is fine"))
    assert str(await q.get()) == "a plain exception is fine"


@pytest.mark.anyio
async def test_an_item_that_cannot_be_rebuilt_then_a_good_one() -> None:
    """Issue 18 item 3: the consumer gets a QueueItemError naming the class, with the
    original cause; the queue goes on with the next item."""
    q = aiomp.Queue()
    with anyio.fail_after(QUICK):
        await q.put(HidesATwoArgError())
        await q.put("good")
        with pytest.raises(aiomp.QueueItemError, match="TwoArgError") as info:
            await q.get()
        assert isinstance(info.value.__cause__, TypeError)
        assert await q.get() == "good"
    assert q.empty()


@pytest.mark.anyio
async def test_an_item_that_cannot_be_rebuilt_in_the_overflow() -> None:
    q = aiomp.Queue()
    n = fill_until_overflow(q)
    q.put_nowait(HidesATwoArgError())
    q.put_nowait("good")
    for _ in range(n):
        q.get_nowait()
    with pytest.raises(aiomp.QueueItemError, match="HidesATwoArgError"):
        await q.get()
    assert await q.get() == "good"
    assert q.empty()


# -- bounded queues: capacity under faults (issue 9 item 2) ---------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("step", "taken"), [("consumer: record read", False), ("consumer: committed", True)]
)
async def test_a_consumer_killed_inside_get_does_not_change_capacity(
    step: str, taken: bool
) -> None:
    """Issue 9 item 2: a consumer SIGKILLed between taking an item and giving back its
    slot lost the slot for good (qsize() 1 with nothing queued, one put fewer fitting).
    Now the bound is the log's committed count: killed before its commit, the item stays;
    killed after, the item is gone and so is its slot's use. Either way the capacity is
    exactly maxsize."""
    q = aiomp.Queue(maxsize=3)
    for i in range(3):
        q.put_nowait(i)
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.die_at, 1, args=(q, step, "consumer", None), grace_period=GRACE
        )
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    assert q.qsize() == (2 if taken else 3)
    while not q.full():
        q.put_nowait("refill")
    with pytest.raises(aiomp.Full):
        q.put_nowait("one too many")
    got = drain(q)
    assert len(got) == 3 and got[0] == (1 if taken else 0)
    assert q.qsize() == 0 and q.empty()
    q.put_nowait("the tokens left by the death were spurious wake-ups only")
    with anyio.fail_after(QUICK):
        assert await q.get() == "the tokens left by the death were spurious wake-ups only"


@pytest.mark.anyio
@pytest.mark.parametrize(("step", "kept"), PRODUCER_STEPS)
async def test_a_producer_killed_inside_put_does_not_change_capacity(step: str, kept: bool) -> None:
    q = aiomp.Queue(maxsize=2)
    q.put_nowait("first")
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            qfuncs.die_at,
            1,
            args=(q, step, "producer", ("carried", aiomp.Event())),
            grace_period=GRACE,
        )
        with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
            await ctx.join()
    assert q.qsize() == (2 if kept else 1)
    if not kept:
        q.put_nowait("second")
    assert q.full()
    with pytest.raises(aiomp.Full):
        q.put_nowait("one too many")
    got = drain(q)
    assert got[0] == "first" and len(got) == 2


@pytest.mark.anyio
async def test_bounded_consumers_sleep_and_wake_on_tokens() -> None:
    q = aiomp.Queue(maxsize=2)
    got: list[int] = []

    async def getter() -> None:
        got.append(await q.get())

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(getter)
            await anyio.wait_all_tasks_blocked()
            for i in range(3):
                await q.put(i)
    assert sorted(got) == [0, 1, 2]
    assert q.empty()


def test_threads_put_and_get_across_the_socket_overflow_boundary() -> None:
    """Producers and consumers in threads of one process share the overflow's mutex
    (a pthread mutex: it excludes threads as well as processes) and its order."""
    q = aiomp.Queue()
    n, producers = 6_000, 3
    got: list[list[tuple[int, int]]] = [[], []]

    def produce(rank: int) -> None:
        for i in range(n):
            q.sync.put((rank, i))

    def consume(k: int) -> None:
        while True:
            item = q.sync.get(timeout=QUICK)
            if item is None:
                return
            got[k].append(item)

    while _queue.overflow_of(q).count() == 0:  # start with the socket full and the overflow in use
        q.put_nowait((-1, 0))
    threads = [threading.Thread(target=produce, args=(r,)) for r in range(producers)]
    threads += [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads[:producers]:
        t.join(TIMEOUT)
    q.sync.put(None)
    q.sync.put(None)
    for t in threads[producers:]:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)
    got = [[item for item in g if item[0] >= 0] for g in got]
    assert sorted(got[0] + got[1]) == sorted((r, i) for r in range(producers) for i in range(n))
    for k in range(2):  # each consumer sees each producer's items in order
        for r in range(producers):
            seq = [i for rr, i in got[k] if rr == r]
            assert seq == sorted(seq)
    assert q.empty()


# -- qsize's per-process counts and the kept reader (issue 17) -------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_qsize_counts_items_sent_and_taken_by_every_process(start_method: str) -> None:
    """The socket's items are counted per process in the log's header (no eventfd per
    item): a child's gets and puts, forked or spawned, count in the parent's qsize()."""
    from tests.children import queue as _funcs_counts

    q = aiomp.Queue()
    for i in range(5):
        q.put_nowait(i)
    assert q.qsize() == 5
    with anyio.fail_after(60):
        async with aiomp.spawn(
            _funcs_counts.take_and_put, 1, args=(q, 2, 3), start_method=start_method
        ) as ctx:
            pass
    assert ctx.results == [6], "the child sees its own counts and the parent's"
    assert q.qsize() == 6
    assert sorted(drain(q)) == [0, 1, 2, 2, 3, 4]
    assert q.qsize() == 0 and q.empty()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
async def test_waiting_gets_keep_one_reader_on_the_loop() -> None:
    """Issue 17: every get that waited added a reader to the loop and removed it (on
    uvloop: a new poll handle, five epoll_ctl and an ioctl setting O_NONBLOCK on the shared
    socket, per get; on asyncio's own loop two epoll_ctl and anyio's wait). Now the reader
    stays registered between waits on both (see docs/decisions/0005-kept-readers.md)."""
    import asyncio

    loop = asyncio.get_running_loop()
    added: list[int] = []
    add_reader = loop.add_reader

    def counting_add_reader(fd: Any, cb: Any, *args: Any) -> None:
        added.append(fd)
        add_reader(fd, cb, *args)

    loop.add_reader = counting_add_reader  # type: ignore[method-assign]
    try:
        q = aiomp.Queue()
        got = []

        async def consumer() -> None:
            for _ in range(20):
                got.append(await q.get())

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer)
                for i in range(20):
                    for _ in range(2):  # the consumer finds the queue empty and waits
                        await anyio.lowlevel.checkpoint()
                    await q.put(i)
        assert got == list(range(20))
        assert len(added) <= 2, f"a reader added per wait: {len(added)}"
    finally:
        del loop.add_reader


def test_plain_items_and_the_general_path_keep_one_order() -> None:
    """Plain items skip the Message (see docs/decisions/0008-queue-fast-path.md): at the
    inline limit they fall back to the general path (a memfd), behind a full socket they
    go to the overflow, and the queue's order and counts stay one."""
    q = aiomp.Queue()
    edge = _transport.MAX_INLINE - 64  # around the limit with pickle's few header bytes
    items: list[object] = [b"a", "b", 3, 4.5, None, True, bytes(edge), bytes(edge + 128)]
    items += [("a", 1), [1, 2]]  # not plain: the general path, between plain ones
    items += [b"z"]
    for x in items:
        q.put_nowait(x)
    assert q.qsize() == len(items)
    assert [q.get_nowait() for _ in items] == items
    n = fill_until_overflow(q)
    q.put_nowait(b"after the overflow")  # plain, but behind the overflow's items
    q.sync.put("and again")
    got = [q.get_nowait() for _ in range(n)]
    assert len(got) == n and q.get_nowait() == b"after the overflow"
    assert q.get_nowait() == "and again" and q.qsize() == 0
    q.close()
    with pytest.raises(aiomp.QueueClosedError):
        q.put_nowait(b"late")
    with pytest.raises(aiomp.QueueClosedError):
        q.sync.put(1)


def test_an_unbounded_queue_makes_no_tokens_eventfd() -> None:
    """An unbounded queue made (and its pickled form carried) the bounded queue's tokens
    eventfd it never used: an fd more in every process holding it."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    q = aiomp.Queue()
    # the socket pair, the room eventfd, the overflow log and its mapping's duplicate
    assert open_fds() - before == 5
    bounded = aiomp.Queue(3)
    assert open_fds() - before == 11  # and the consumers' tokens
    del q, bounded
    gc.collect()
    assert open_fds() == before


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
    from tests.conftest import run_plain

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
