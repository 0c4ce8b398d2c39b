"""Functions that queue-test children run (the overflow, faults, calls without a loop).

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
