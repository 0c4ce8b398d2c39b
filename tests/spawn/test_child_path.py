"""An async child's ``x = await q.get(); await q.put(x)``: a get that waits and is woken,
for every kind of datagram (plain, with fds, a large body, one that cannot be rebuilt),
with the overflow behind the socket, and at close; and a child echoing on every child
loop under every parent loop (issue 17 target 2's path, see docs/decisions/0008-queue-fast-path.md).
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue
from aiomp._wire import datagram as _transport
from tests.children import loops as cfuncs

PAYLOAD = b"x" * 64
#: Bound on awaits that depend on this process only.
QUICK = 5
#: Bound on awaits on a child (interpreter start under load included).
TIMEOUT = 60
GRACE = 0.5


class FailsOnLoad:
    def __reduce__(self) -> tuple[object, ...]:
        return _fail_on_load, ()


def _fail_on_load() -> None:
    raise ValueError("cannot rebuild this here")


async def _woken_get(q: aiomp.Queue, put: Any) -> Any:
    """``await q.get()`` that waits first, woken by ``put()`` from another task."""
    got: list[Any] = []

    async def consumer() -> None:
        try:
            got.append(await q.get())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    with anyio.fail_after(QUICK):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            put()
    return got[0]


@pytest.mark.anyio
async def test_a_woken_get_takes_every_kind_of_datagram() -> None:
    """The fast get leaves plain datagrams only: an item carrying fds, a body too large
    for a datagram (a memfd), and an item that cannot be rebuilt are taken as the general
    path takes them, and the counts stay true."""
    q = aiomp.Queue()
    event = aiomp.Event()
    got = await _woken_get(q, lambda: q.put_nowait(("with an fd", event)))
    assert got == ("with an fd", event)  # the same object: rebuilt from its fd
    large = b"L" * (_transport.MAX_INLINE + 1)
    assert await _woken_get(q, lambda: q.put_nowait(large)) == large
    error = await _woken_get(q, lambda: q.put_nowait([1, FailsOnLoad()]))
    assert isinstance(error, aiomp.QueueItemError), error
    assert "_fail_on_load" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert q.qsize() == 0
    q.put_nowait("after")  # the lost item was only that one
    assert await q.get() == "after"
    assert q.qsize() == 0


@pytest.mark.anyio
async def test_a_woken_get_reads_the_overflow_behind_the_socket() -> None:
    """Items put while a get waits go to the socket and then, once it is full, to the
    overflow: a woken get leaves the fast path for the overflow and takes every item in
    order; after ``close()`` the rest, then QueueClosedError."""
    q = aiomp.Queue()
    n = 0

    def fill() -> None:
        nonlocal n
        while not q._hint[_queue.HINT] or n < 20_000:
            q.put_nowait(n)
            n += 1
        q.close()

    assert await _woken_get(q, fill) == 0
    with anyio.fail_after(QUICK):
        rest = [item async for item in q]
    assert rest == list(range(1, n))
    with pytest.raises(aiomp.QueueClosedError):
        await q.get()


@pytest.mark.anyio
async def test_close_wakes_a_waiting_fast_get() -> None:
    q = aiomp.Queue()
    error = await _woken_get(q, q.close)
    assert isinstance(error, aiomp.QueueClosedError), error


@pytest.mark.anyio
@pytest.mark.parametrize("child_loop", ["default", "asyncio", "trio"])
async def test_an_async_child_echoes_on_every_loop(child_loop: str) -> None:
    """Parent on each loop, the echoing child on uvloop (aiomp's default for an async
    child), asyncio's own loop or trio: plain items, items with fds, large ones and
    exceptions come back equal and in order, and close ends the child's iteration."""
    qin, qout = aiomp.Queue(), aiomp.Queue()
    event = aiomp.Event()
    items: list[object] = [0, "s", PAYLOAD, None, 3.5, b"b" * 200_000, ("fd", event)]
    items += [KeyError("k"), {"k": [1, 2]}]
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            cfuncs.echo_on, 1, args=(qin, qout, child_loop), grace_period=GRACE
        ) as ctx:
            got = []
            for item in items * 3:  # one at a time: every child get waits
                await qin.put(item)
                got.append(await qout.get())
            qin.close()
    assert [repr(x) for x in got] == [repr(x) for x in items * 3]
    assert got[6] == ("fd", event)
    assert ctx.results == [len(items) * 3]
