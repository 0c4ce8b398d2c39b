"""One task per process waits on an fd; the others wait for it to wake them.

Two tasks must never wait on one fd at once (trio refuses it; asyncio's selector keeps
only the last reader), so the first waiter waits on the fd and any other waits on an
event the first sets when it wakes, or when it is cancelled (then one of the others takes
over). Per thread: two threads' event loops waiting on one fd each have their own first
waiter, and an event is only ever set by its own loop's thread. Owns no fd: the events of
the waits in progress. anyio and trio are imported on first use: children import this
module without them.
"""

from __future__ import annotations

import sys
from threading import get_ident

from . import TRIO, readers

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import Any

    from . import RunningLoop


class FdWaiters:
    """The waits on fds of one owner (a queue, an event's waker, a child).

    ``readable`` is how the waiting task of :meth:`wait` waits for a readable fd: anyio's
    by default; :func:`aiomp._loop.readers.wait_readable` keeps its reader registered
    between waits (the fd's owner then calls :func:`~aiomp._loop.readers.forget` before
    closing it). :meth:`readable` is the queue's wait for items, on the loop it found.
    """

    __slots__ = ("_events", "_readable")

    def __init__(self, readable: Callable[[int], Awaitable[None]] | None = None) -> None:
        # (fd, write, thread) -> None while one task waits alone, an event once others
        # join (anyio's, or trio's own in readable(): both wait() and set())
        self._events: dict[tuple[int, bool, int], Any] = {}
        self._readable = readable

    def waiting(self, fd: int) -> bool:
        """Whether a task waits on ``fd`` now (it must not be closed under it)."""
        return any(key[0] == fd for key in list(self._events))  # a copy: other threads

    async def wait(self, fd: int, write: bool = False) -> None:
        """Return once ``fd`` is readable (writable with ``write``), or once the task that
        waits on it has woken: the caller checks again what it waits for.

        On cancellation nothing changes but that the task waiting on the fd hands the wait
        to the others.
        """
        import anyio

        key = (fd, write, get_ident())
        if key in self._events:
            event = self._events[key]
            if event is None:
                event = self._events[key] = anyio.Event()
            await event.wait()
            return
        self._events[key] = None
        try:
            if write:
                await anyio.wait_writable(fd)
            elif self._readable is not None:
                await self._readable(fd)
            else:
                await anyio.wait_readable(fd)
        finally:
            event = self._events.pop(key)
            if event is not None:
                event.set()

    async def readable(self, fd: int, loop: RunningLoop) -> None:
        """As ``wait(fd)``, on ``loop`` (from :func:`aiomp._loop.running_loop`): on
        asyncio and uvloop straight on the reader kept for ``fd``, which wakes every task
        that waits; on trio one task waits on the fd and the others behind it. On
        cancellation nothing changes but that a task waiting on the fd on trio hands the
        wait to the others."""
        if loop is TRIO:
            # hot path: tests/budgets
            events = self._events
            key = (fd, False, get_ident())
            if key in events:
                event = events[key]
                if event is None:
                    event = events[key] = sys.modules["trio"].Event()
                await event.wait()
                return
            events[key] = None
            try:
                await sys.modules["trio"].lowlevel.wait_readable(fd)
            finally:
                event = events.pop(key)
                if event is not None:
                    event.set()
            return
        fut = readers.kept_readable(loop, fd)
        if fut is None:
            await self.wait(fd)
            return
        await readers.wait_kept(fd, fut)
