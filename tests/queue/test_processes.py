"""``aiomp.Queue`` and ``aiomp.Event`` across processes: producers and consumers in
children, queues passed to children, close and events seen in other processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiomp
from tests.children import queue as qfuncs
from tests.queue._queues import GRACE, QUICK, SHORT, TIMEOUT, drain, fill_vault

# -- across processes ----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("child", [qfuncs.q_mpmc, qfuncs.q_mpmc_async], ids=["sync", "async"])
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
@pytest.mark.parametrize("child", [qfuncs.q_forward, qfuncs.q_forward_async], ids=["sync", "async"])
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
        async with aiomp.spawn(qfuncs.q_identities, 1, args=(q, reply), grace_period=GRACE):
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
            qfuncs.q_close_from_child, 1, args=(q, list(range(50))), grace_period=GRACE
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
            qfuncs.q_close_waiters_async, 2, args=(full, empty, ready), grace_period=GRACE
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
            qfuncs.q_sync_timeouts, 1, args=(q, SHORT), grace_period=GRACE
        ) as ctx:
            pass
    assert ctx.results == [("Full", "Empty")]


@pytest.mark.anyio
async def test_event_across_processes() -> None:
    go, ready, done = aiomp.Event(), aiomp.Event(), aiomp.Event()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            qfuncs.ev_ping, 1, args=(go, ready, done, SHORT), grace_period=GRACE
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
        async with aiomp.spawn(qfuncs.ev_ping_async, 2, args=(go, done), grace_period=GRACE) as ctx:
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
