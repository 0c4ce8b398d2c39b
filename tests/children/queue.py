"""Functions that queue-test children run: queues and events across processes, the
overflow, faults, calls without a loop.

Module level so that spawn children import them by name.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def _strategy(name: str) -> None:
    import aiomp

    aiomp.set_sharing_strategy(name)  # children choose their own, as in torch


def put_range(rank: int, q: Any, n: int, strategy: str = "file_descriptor") -> int:
    """Put ``(rank, i)`` for i < n with ``q.sync.put`` and return: never waits on an
    unbounded queue, so the process exits with its items still queued."""
    _strategy(strategy)
    for i in range(n):
        q.sync.put((rank, i))
    return n


def drain_in_order(rank: int, q: Any, n: int) -> bool:
    """Get n items; True if they are 0..n-1 in order."""
    return [q.sync.get() for _ in range(n)] == list(range(n))


def put_then_die(rank: int, q: Any, n: int, array_every: int, ready: Any) -> None:
    """Put n items (an array every ``array_every``), then SIGKILL itself the instant the
    last put has returned: everything put must still be delivered."""
    import numpy as np

    for i in range(n):
        if array_every and i % array_every == 0:
            q.sync.put(("array", i, np.full(16_384, i, dtype=np.int32)))
        else:
            q.sync.put(("int", i))
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def die_at(rank: int, q: Any, step: str, role: str, item: object, gets: int = 1) -> object:
    """Kill this process at ``step`` of an overflow operation (``aiomp._queue.overflow.fault``):
    a producer putting ``item``, or a consumer doing ``gets`` gets. Returns what it got
    if the step never came."""
    from aiomp._queue import overflow as _overflow

    def fault(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    _overflow.fault = fault
    if role == "producer":
        q.sync.put(item)
        return None
    return [q.sync.get(timeout=10) for _ in range(gets)]


def async_calls_without_a_loop(rank: int, q: Any, e: Any) -> list[str]:
    """torch-style ``q.put(x)`` in a sync child: each must raise at once, naming the
    ``.sync`` call, and leave no coroutine behind."""
    import warnings

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would raise
        for call in (lambda: q.put(1), q.get, e.wait):
            try:
                call()
            except RuntimeError as exc:
                out.append(str(exc))
    q.sync.put("still usable")
    return out


async def event_wait_reported(rank: int, go: Any, ready: Any, timeout: float) -> str:
    """Wait for ``go`` in a task; once that task is blocked in ``go.wait()``, set
    ``ready`` (the parent then sets and clears ``go``). "woken", or TimeoutError."""
    import anyio

    woken = anyio.Event()

    async def waiter() -> None:
        await go.wait()
        woken.set()

    with anyio.fail_after(timeout):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()  # the waiter is inside go.wait()
            ready.set()
            await woken.wait()
    return "woken"


def event_sync_wait(rank: int, go: Any, timeout: float) -> bool:
    """``go.sync.wait(timeout)``: True once a set() reached it."""
    return bool(go.sync.wait(timeout=timeout))


def stop_at(rank: int, q: Any, step: str, item: object, held: Any) -> None:
    """Put ``item`` and stop this process (SIGSTOP) at ``step`` of the overflow put, while
    it holds the overflow's lock, once ``held`` is set: the test resumes it (SIGCONT)."""
    from aiomp._queue import overflow as _overflow

    def fault(name: str) -> None:
        if name == step:
            held.set()
            os.kill(os.getpid(), signal.SIGSTOP)

    _overflow.fault = fault
    q.sync.put(item)


def take_and_put(rank: int, q: Any, take: int, put: int) -> int:
    """Take ``take`` items, put ``put`` more; returns what qsize() said here after."""
    for _ in range(take):
        q.sync.get(timeout=30)
    for i in range(put):
        q.sync.put(i)
    return int(q.qsize())


def q_forward(rank: int, qin: object, qout: object) -> int:
    """Move every item from ``qin`` to ``qout`` until ``qin`` is closed; return the count."""
    n = 0
    for item in qin.sync:  # type: ignore[attr-defined]
        qout.sync.put(item)  # type: ignore[attr-defined]
        del item  # hold no view of a shared block between items
        n += 1
    return n


async def q_forward_async(rank: int, qin: object, qout: object) -> int:
    """:func:`q_forward` on the child's event loop."""
    n = 0
    async for item in qin:  # type: ignore[attr-defined]
        await qout.put(item)  # type: ignore[attr-defined]
        del item
        n += 1
    return n


def q_mpmc(rank: int, q: object, done: object, nproducers: int, count: int) -> list[object]:
    """Ranks below ``nproducers`` put ``count`` items each, then report on ``done``;
    the others take items until ``q`` is closed and return what they took."""
    if rank < nproducers:
        for i in range(count):
            q.sync.put((rank, i))  # type: ignore[attr-defined]
        done.sync.put(rank)  # type: ignore[attr-defined]
        return []
    return list(q.sync)  # type: ignore[attr-defined]


async def q_mpmc_async(
    rank: int, q: object, done: object, nproducers: int, count: int
) -> list[object]:
    """:func:`q_mpmc` with the async calls."""
    if rank < nproducers:
        for i in range(count):
            await q.put((rank, i))  # type: ignore[attr-defined]
        await done.put(rank)  # type: ignore[attr-defined]
        return []
    return [item async for item in q]  # type: ignore[attr-defined]


def q_identities(rank: int, q: object, reply: object) -> None:
    """Receive queues and events in messages; answer on them how they resolved here.

    The first message is ``(q_again, inner, inner)``, the second ``inner`` once more,
    the third an Event: the answer goes on ``inner`` so that it is proven usable.
    """
    first = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    q_again, inner, inner_twice = first
    inner_later = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    event = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    inner.sync.put(
        {  # type: ignore[attr-defined]
            "args_and_message_same": q_again is q,
            "twice_in_one_message_same": inner is inner_twice,
            "twice_in_two_messages_same": inner_later is inner,
            "event_type": type(event).__name__,
        }
    )
    event.set()  # type: ignore[attr-defined]
    reply.sync.put("done")  # type: ignore[attr-defined]


def q_close_from_child(rank: int, q: object, items: list[object]) -> None:
    for item in items:
        q.sync.put(item)  # type: ignore[attr-defined]
    q.close()  # type: ignore[attr-defined]


async def q_close_waiters_async(rank: int, full: object, empty: object, ready: object) -> str:
    """Rank 0 waits to put on the full queue ``full``, rank 1 waits to get from ``empty``,
    until the test closes them; return what happened."""
    ready.sync.put(rank)  # type: ignore[attr-defined]
    try:
        if rank == 0:
            await full.put("one too many")  # type: ignore[attr-defined]
            return "put returned"
        await empty.get()  # type: ignore[attr-defined]
        return "get returned"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__


def q_sync_timeouts(rank: int, q: object, timeout: float) -> tuple[str, str]:
    """``q`` is full with maxsize 1: time out putting, take the item, time out getting."""
    import time

    results = []
    start = time.monotonic()
    try:
        q.sync.put("x", timeout=timeout)  # type: ignore[attr-defined]
        results.append("put")
    except Exception as exc:  # noqa: BLE001
        results.append(type(exc).__name__)
    item = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    assert item == "first"
    try:
        q.sync.get(timeout=timeout)  # type: ignore[attr-defined]
        results.append("get")
    except Exception as exc:  # noqa: BLE001
        results.append(type(exc).__name__)
    assert time.monotonic() - start >= 2 * timeout
    return results[0], results[1]


def ev_ping(
    rank: int, go: object, ready: object, done: object, timeout: float
) -> tuple[bool, bool]:
    """Time out waiting for ``go``, say ``ready``, wait for ``go``, clear it, set ``done``."""
    early = go.sync.wait(timeout=timeout)  # type: ignore[attr-defined]
    ready.set()  # type: ignore[attr-defined]
    later = go.sync.wait(timeout=20)  # type: ignore[attr-defined]
    go.clear()  # type: ignore[attr-defined]
    done.set()  # type: ignore[attr-defined]
    return early, later


async def ev_ping_async(rank: int, go: object, done: object) -> bool:
    await go.wait()  # type: ignore[attr-defined]
    was_set = go.is_set()  # type: ignore[attr-defined]
    done.set()  # type: ignore[attr-defined]
    return was_set
