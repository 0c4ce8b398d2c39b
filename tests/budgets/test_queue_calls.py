"""How much work one small item costs a queue, counted, not timed (issue 17 targets 2, 3).

Python calls (``sys.setprofile``) made on a queue's hot paths, in one process: a ``get``
woken by a ``put`` on each loop, and a plain item put to and taken from the overflow log
(the many-to-many steady state: the socket full). Counts are the same on a busy machine,
so these pin what ``benchmarks/diagnostics/profile_queue.py`` measured without a timed assert.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._queue import queue as _queue

PAYLOAD = b"x" * 64
#: Bound on awaits that depend on this process only.
QUICK = 5


@contextmanager
def calls() -> Iterator[list[str]]:
    """Record the Python functions (``folder/name``) and C functions (``C:qualname``)
    called in this thread meanwhile."""
    seen: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            folder = os.path.basename(os.path.dirname(code.co_filename))
            seen.append(f"{folder}/{code.co_name}")
        elif event == "c_call":
            seen.append(f"C:{getattr(arg, '__qualname__', arg)}")

    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(None)


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
    seen: list[str] = []
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
    churn = ("C:Loop.add_reader", "C:Loop.remove_reader")
    assert not [c for c in seen if c in churn or c.endswith(("/add_reader", "/remove_reader"))]
    # uvloop runs a woken task before it looks at fds again: the reader wakes without a
    # look; asyncio's own loop may queue a stale report behind it: one poll there.
    uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    assert seen.count("C:poll.poll") == (0 if uvloop else 1), seen
    own = [c for c in seen if c.startswith("aiomp/")]
    assert "aiomp/wait" not in own, "FdWaiters.wait: the kept reader fans out itself"
    assert len(own) <= 20, own


def test_a_plain_item_through_the_overflow_log_costs_few_calls() -> None:
    """Issue 17 target 3: once the socket is full every put goes to the overflow log and
    every get takes from it. A plain item's put made a Message, went through the general
    path and took and released the mutex through three method layers (11 Python calls);
    its get committed, unlocked and counted through helpers (10). Now: 3 and 4."""
    q = aiomp.Queue()
    try:
        while not q._hint[_queue.HINT]:  # fill the socket: the next put is the log's
            q.put_nowait(PAYLOAD)
        q.put_nowait(PAYLOAD)
        with calls() as seen:
            q.put_nowait(PAYLOAD)
        own = [c for c in seen if c.startswith("aiomp/")]
        assert own == ["aiomp/put_nowait", "aiomp/_put_plain", "aiomp/append"], own
        while not q._ovf._header[10]:  # take the socket's items: then gets read the log
            assert q.get_nowait() == PAYLOAD
        assert q._ovf.count() == 2
        with calls() as seen:
            assert q.get_nowait() == PAYLOAD
        own = [c for c in seen if c.startswith("aiomp/")]
        assert own == ["aiomp/get_nowait", "aiomp/_try_get", "aiomp/pop", "aiomp/_load"], own
        assert q._ovf.count() == 1
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
    own = [c for c in seen if c.startswith("aiomp/")]
    assert "aiomp/wait" not in own and "aiomp/wait_readable" not in own, own
    assert "aiomp/_send_now" not in own and "aiomp/try_send" not in own, own
    assert len(own) <= 16, own
    assert seen.count("C:poll.poll") == 1, seen  # the look before the wait
    # Per round: the consumer's step that reads the item, and this task's after done.wait.
    assert steps.consumer_steps == 3, steps.consumer_steps


class Steps:
    """A trio instrument: steps of tasks named ``consumer``."""

    def __init__(self) -> None:
        self.consumer_steps = 0

    def before_task_step(self, task: Any) -> None:
        if task.name.endswith("consumer"):
            self.consumer_steps += 1
