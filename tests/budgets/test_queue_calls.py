"""How much work one small item costs a queue, counted, not timed (issue 17 targets 2, 3).

Python calls (``sys.setprofile``) made on a queue's hot paths, in one process: a ``get``
woken by a ``put`` on each loop, and a plain item put to and taken from the overflow log
(the many-to-many steady state: the socket full). Counts are the same on a busy machine,
so they are pinned here without a timed assert (a diagnostic that printed them was retired:
these tests, and bench_queue's CPU per round trip, measure what it did).
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue
from tests.budgets import budgets as B
from tests.budgets.budgets import calls

PAYLOAD = b"x" * 64
#: Bound on awaits that depend on this process only.
QUICK = 5


def drain(q: aiomp.Queue) -> list[Any]:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except aiomp.Empty:
            return items


@pytest.mark.anyio
@pytest.mark.parametrize(
    "anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
async def test_a_woken_get_costs_no_poll_and_no_reader_churn() -> None:
    """Issue 17 target 2: a ``get`` that waited and was woken by a ``put`` went, on
    asyncio, through anyio's ``wait_readable`` (``add_reader`` and ``remove_reader``, two
    ``epoll_ctl``, per get) and, on uvloop, through the queue's FdWaiters and a ``poll``
    in the kept reader before every wake-up. Now both loops keep one reader, whose report
    wakes the get directly: no reader added or removed, no FdWaiters, no ``poll`` on
    uvloop, and about 20 calls of aiomp's own for the whole put-to-get hand-over."""
    import asyncio

    q = aiomp.Queue()
    got: list[object] = []
    seen = B.Calls()
    for _ in range(3):  # the reader is made by the first wait; count later ones
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def consumer(done: anyio.Event) -> None:
                got.append(await q.get())
                done.set()

            tg.start_soon(consumer, done)
            for _ in range(3):  # the consumer finds the queue empty and waits
                await anyio.lowlevel.checkpoint()
            with anyio.fail_after(QUICK):
                with calls() as seen:
                    await q.put(PAYLOAD)
                    await done.wait()
    assert got == [PAYLOAD] * 3
    churn = [c for c in seen.outside if c.endswith(("add_reader", "remove_reader"))]
    churn += [r for r in seen.roles() if r.endswith(("/add_reader", "/remove_reader"))]
    assert len(churn) == B.SYSCALLS["queue: reader changes per woken get"], churn
    # uvloop runs a woken task before it looks at fds again: the reader wakes without a
    # look; asyncio's own loop may queue a stale report behind it: one poll there.
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    polls = B.SYSCALLS[f"queue: poll per woken get ({'uvloop' if uvloop else 'asyncio'})"]
    assert seen.outside.count("poll.poll") == polls, seen.outside
    assert not seen.count("loop: wait on an fd through FdWaiters"), "the kept reader fans out"
    assert len(seen.own) <= B.CALLS["queue: woken get (asyncio, uvloop)"], seen.roles()


def test_a_plain_item_through_the_overflow_log_costs_few_calls() -> None:
    """Issue 17 target 3: once the socket is full every put goes to the overflow log and
    every get takes from it. A plain item's put made a Message, went through the general
    path and took and released the mutex through three method layers (11 Python calls);
    its get committed, unlocked and counted through helpers (10). Now: 3 and 4."""
    q = aiomp.Queue()
    try:
        while not _queue.overflow_of(q).header[
            _queue.HINT
        ]:  # fill the socket: the next put is the log's
            q.put_nowait(PAYLOAD)
        q.put_nowait(PAYLOAD)
        with calls() as seen:
            q.put_nowait(PAYLOAD)
        assert seen.roles() == B.SEQUENCES["overflow log: put"]
        while not _queue.overflow_of(
            q
        ).drained():  # take the socket's items: then gets read the log
            assert q.get_nowait() == PAYLOAD
        assert _queue.overflow_of(q).count() == 2
        with calls() as seen:
            assert q.get_nowait() == PAYLOAD
        assert seen.roles() == B.SEQUENCES["overflow log: get"]
        assert _queue.overflow_of(q).count() == 1
    finally:
        assert drain(q) == [PAYLOAD]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_woken_get_on_trio_waits_on_the_fd_without_layers() -> None:
    """Issue 17 target 2, trio: a ``get`` that found the queue empty, waited and was woken
    by a ``put`` went through FdWaiters' ``wait`` and ``_transport.wait_readable`` (which
    looked up the running loop once more) on every wait, and the put through
    ``_send_now`` and ``try_send``: 26 calls of aiomp's own for the whole hand-over. Now
    the queue fans its trio waits out itself and the plain put sends inline: 16, and one
    scheduler step for the woken consumer (no extra checkpoint)."""
    import trio

    q = aiomp.Queue()
    steps = Steps()
    for _ in range(3):
        got: list[object] = []
        done = trio.Event()

        async def consumer(got: list[object], done: trio.Event) -> None:
            got.append(await q.get())
            done.set()

        async with trio.open_nursery() as nursery:
            with anyio.fail_after(QUICK), calls() as seen:
                nursery.start_soon(consumer, got, done)
                for _ in range(3):  # the consumer finds the queue empty and waits
                    await trio.lowlevel.checkpoint()
                trio.lowlevel.add_instrument(steps)
                try:
                    await q.put(PAYLOAD)
                    await done.wait()
                finally:
                    trio.lowlevel.remove_instrument(steps)
        assert got == [PAYLOAD]
    bypassed = (
        "loop: wait on an fd through FdWaiters",
        "loop: wait until an fd is readable",
        "queue: send a datagram now",
        "wire: send a datagram with fds",
    )
    assert not [r for r in seen.roles() if r in bypassed], seen.roles()
    assert len(seen.own) <= B.CALLS["queue: woken get (trio)"], seen.roles()
    assert seen.outside.count("poll.poll") == B.SYSCALLS["queue: poll per woken get (trio)"], (
        seen.outside
    )
    # Per round: the consumer's step that reads the item, and this task's after done.wait.
    assert steps.consumer_steps == 3 * B.SYSCALLS["queue: consumer steps per woken get (trio)"]


class Steps:
    """A trio instrument: steps of tasks named ``consumer``."""

    def __init__(self) -> None:
        self.consumer_steps = 0

    def before_task_step(self, task: Any) -> None:
        if task.name.endswith("consumer"):
            self.consumer_steps += 1
