"""One task per process waits on an fd; the others wait for it to wake them.

Two tasks must never wait on one fd at once (trio refuses it; asyncio's selector keeps
only the last reader), so the first waiter waits on the fd and any other waits on an
event the first sets when it wakes, or when it is cancelled (then one of the others takes
over). Per thread: two threads' event loops waiting on one fd each have their own first
waiter, and an event is only ever set by its own loop's thread (issue 25 item 8). anyio is
imported on first use: children import this module without it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from threading import get_ident
from typing import Any


class FdWaiters:
    """The waits on fds of one owner (a queue, a child): see the module docstring.

    ``readable`` is how the waiting task waits for a readable fd: anyio's by default; a
    queue passes ``_transport.wait_readable``, which keeps its reader registered between
    waits and so needs ``_transport.forget`` before the fd is closed.
    """

    __slots__ = ("_events", "_readable")

    def __init__(self, readable: Callable[[int], Awaitable[None]] | None = None) -> None:
        # (fd, write, thread) -> None while one task waits alone, an anyio.Event once
        # others join
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
