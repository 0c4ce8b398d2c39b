"""The queue's overflow beyond the socket buffer: unbounded queues never wait, the
bound kept, the vault, producers and consumers killed at each step of an overflow put or get.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue
from tests.children import queue as qfuncs
from tests.queue._queues import (
    GRACE,
    PRODUCER_STEPS,
    QUICK,
    TIMEOUT,
    drain,
    fill_until_overflow,
    fill_vault,
)

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
