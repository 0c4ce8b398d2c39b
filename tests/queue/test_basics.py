"""Contract tests for ``aiomp.Queue`` in one process: put and get, maxsize and
back-pressure, the sync twin, iteration and draining after close.
"""

from __future__ import annotations

import threading
import time

import anyio
import anyio.lowlevel
import pytest

import aiomp
from tests.queue._queues import QUICK, SHORT, drain, fill_vault

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
