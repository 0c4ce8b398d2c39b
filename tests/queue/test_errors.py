"""``aiomp.Queue`` when things go wrong: close waking waiters, items that cannot be
pickled or unpickled, cancelled gets and puts, transport errors.
"""

from __future__ import annotations

import os
import pickle
import resource
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._wire import datagram as _transport
from tests.queue._queues import QUICK, SHORT, drain


class Unpicklable:
    def __reduce__(self) -> object:
        raise TypeError("Unpicklable refuses to be pickled")


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


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
