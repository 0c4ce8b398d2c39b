"""The reader kept on an asyncio loop (``aiomp._loop.readers``; see
docs/decisions/0005-kept-readers.md), watched on a datagram socket pair in this process."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from aiomp._loop import readers as rd
from aiomp._wire import datagram as t
from tests._fds import is_open, same_file


async def loop_turns(n: int) -> None:
    """Let the event loop run ``n`` iterations: a waiter registers, a level-triggered
    report repeats. Handshake-free: the loop itself is what is tested, no child."""
    import asyncio

    for _ in range(n):
        await asyncio.sleep(0)  # handshake-free: one loop iteration is what is waited for


@pytest.fixture
def watched_pair() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """A datagram pair ``(a, b, b's fd)``; the fd is forgotten and both closed after."""
    a, b = t.socketpair()
    try:
        yield a, b, b.fileno()
    finally:
        rd.forget(b.fileno())
        a.close()
        b.close()


asyncio_loops = pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


@pytest.mark.anyio
@asyncio_loops
async def test_a_report_after_the_wake_neither_wakes_nor_drops_the_reader(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    """asyncio's own loop looks at its fds again after a waiter woke and before that
    waiter's step reads (the reader's callback is queued after the task's): the reader
    takes that one report for what it is and keeps watching; the old reader woke nobody
    only after a ``poll`` of its own per report."""
    import asyncio

    a, b, fd = watched_pair
    reports = 0

    async def get() -> tuple[bytes, list[int]] | None:
        nonlocal reports
        await rd.wait_readable(fd)
        reports = rd._readers[fd].idle
        return t.try_recv(b)  # as a queue's get does: read in the step that woke

    readers = []
    for i in range(3):
        waiter = asyncio.ensure_future(get())
        await loop_turns(3)  # the waiter registers and sleeps
        assert not waiter.done()
        assert t.try_send(a, bytes([0, i]), [])
        got = await asyncio.wait_for(waiter, 30)
        assert got == (bytes([0, i]), [])
        assert reports <= 1
        readers.append(rd._readers[fd])
    assert readers[0] is readers[1] is readers[2], "one reader for every wait"


@pytest.mark.anyio
@asyncio_loops
async def test_many_tasks_wait_on_one_kept_reader_and_a_cancelled_one_leaves(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    a, b, fd = watched_pair
    waiters = [asyncio.ensure_future(rd.wait_readable(fd)) for _ in range(3)]
    await loop_turns(3)
    reader = rd._readers[fd]
    assert len(reader.waiters) == 3
    waiters[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert len(reader.waiters) == 2, "the cancelled wait is gone from the reader"
    assert t.try_send(a, b"\x00x", [])
    await asyncio.wait_for(asyncio.gather(*waiters[1:]), 30)
    assert t.try_recv(b) is not None


@pytest.mark.anyio
@asyncio_loops
async def test_kept_reader_wakes_each_wait_and_stops_when_nobody_waits(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    a, b, fd = watched_pair

    async def get() -> tuple[bytes, list[int]] | None:
        await rd.wait_readable(fd)
        return t.try_recv(b)  # as a queue's get does: read in the step that woke

    readers = []
    for i in range(3):
        waiter = asyncio.ensure_future(get())
        await loop_turns(3)
        assert not waiter.done(), "nothing to read yet"
        assert t.try_send(a, bytes([0, i]), [])
        got = await asyncio.wait_for(waiter, 30)
        assert got is not None and got[0] == bytes([0, i])
        await loop_turns(3)  # a stale report of the datagram just read wakes nobody
        readers.append(rd._readers[fd])
    assert readers[0] is readers[1] is readers[2], "one reader for every wait"
    assert t.try_send(a, b"\x00x", [])
    await loop_turns(5)  # readable, and nobody waits: it stops watching
    assert fd not in rd._readers
    assert t.try_recv(b) is not None


@pytest.mark.anyio
@asyncio_loops
async def test_forget_stops_watching_and_closes_the_duplicate(
    watched_pair: tuple[socket.socket, socket.socket, int],
) -> None:
    import asyncio

    _, _, fd = watched_pair
    waiter = asyncio.ensure_future(rd.wait_readable(fd))
    await loop_turns(1)
    waiter.cancel()  # a cancelled wait leaves only the idle watch
    with pytest.raises(asyncio.CancelledError):
        await waiter
    watched = rd._readers[fd].watched
    assert is_open(watched) and same_file(watched, fd)
    rd.forget(fd)
    assert fd not in rd._readers and not is_open(watched)
    rd.forget(fd)  # idempotent
