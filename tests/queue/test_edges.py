"""``aiomp.Queue`` at its edges: async calls without a loop, items that cannot be
rebuilt, processes killed inside get or put, tokens, threads at the overflow boundary,
qsize across processes, one reader on the loop, order, no tokens eventfd when unbounded.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue
from aiomp._wire import datagram as _transport
from tests.children import queue as qfuncs
from tests.queue._queues import GRACE, PRODUCER_STEPS, QUICK, TIMEOUT, drain, fill_until_overflow

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
# trio keeps an idle worker thread for a while after a test on trio, so the fork may see it
# and warn (R14), as test_event_waits_in_a_forked_child_after_the_parent_waited allows too.
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
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
