"""FdSet: many fds behind one epoll fd on the event loop, a callback each.

Owns the epoll fd, made while a task waits and closed when the last waiter leaves. Its
owner adds fds (:meth:`FdSet.add`) with the events to wait for and a callback; tasks
wait (:meth:`FdSet.wait`) for a condition of their own. While a task waits, every added
fd is armed in the epoll set, one-shot, and that one fd is what the loop watches (an
:mod:`aiomp._loop.watch`: a reader callback on asyncio and uvloop, one system task on
trio). When it is readable the
set takes every ready fd at once, runs its callback (which says whether the fd is still
to watch: it is re-armed then), and wakes each waiting task whose condition now holds,
and only those. Nothing reached from a callback may touch anyio: it runs in a loop
callback on asyncio.

Cancellation of a waiting task leaves the fds and their owner as they were; the last
waiter to leave closes the epoll set. An owner forgets an fd (:meth:`FdSet.forget`)
before it closes it. Used for every wait on a child's exit (``aiomp._process.child``):
one set per spawn, watching all its children's exit fds and report sockets.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import running_asyncio_loop
from .wakeup import Signal
from .watch import FdWatch, fd_watch

if TYPE_CHECKING:
    import asyncio

#: A callback for a ready fd: True while the fd is still to watch (it is re-armed).
OnReady = Callable[[], bool]


class FdSet:
    """Fds watched through one epoll fd while a task waits (see the module docstring)."""

    __slots__ = (
        "_armed",
        "_epoll",
        "_error",
        "_loop",
        "_on_loop",
        "_sources",
        "_waits",
        "wakeups",
    )

    def __init__(self) -> None:
        #: fd -> (events, callback): what is to watch whenever a task waits
        self._sources: dict[int, tuple[int, OnReady]] = {}
        #: the fds armed in the epoll set now; one that fired leaves it (one-shot: it is
        #: disarmed, so forgetting it then costs no epoll_ctl)
        self._armed: dict[int, tuple[int, OnReady]] = {}
        self._waits: list[tuple[Callable[[], bool], Signal]] = []
        self._epoll: select.epoll | None = None  # while a task waits
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiters' loop; None: trio
        self._on_loop: FdWatch | None = None  # the loop's watch on the epoll fd
        self._error: Exception | None = None  # a callback's unexpected error, for the waiters
        self.wakeups = 0  # waiting tasks woken by the watches (tests count them)

    @property
    def watching(self) -> bool:
        """Whether the epoll set is on the loop now (a task waits)."""
        return self._epoll is not None

    def add(self, fd: int, events: int, on_ready: OnReady) -> None:
        """Watch ``fd`` for ``events`` (``select.EPOLL*``; one-shot is added) whenever a
        task waits; ``on_ready()`` runs once it has fired. Armed at once if one waits."""
        self._sources[fd] = (events | select.EPOLLONESHOT, on_ready)
        if self._epoll is not None:
            self._arm(fd)

    def forget(self, fd: int) -> None:
        """Stop watching ``fd`` (its owner calls this before closing it)."""
        self._sources.pop(fd, None)
        if self._armed.pop(fd, None) is not None and self._epoll is not None:
            self._epoll.unregister(fd)

    async def wait(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds; it is checked after each event on the fds.

        Cancellation leaves the fds as they were; the last waiter to leave closes the
        epoll set.
        """
        if self._error is None and done():
            return
        loop = running_asyncio_loop()
        entry = (done, Signal(loop))
        self._waits.append(entry)
        try:
            self._watch(loop)
            self.check()  # the condition may hold already (reaped by another path)
            await entry[1].wait()
        finally:
            if entry in self._waits:
                self._waits.remove(entry)
            if not self._waits:
                self._unwatch()
        if self._error is not None:
            raise RuntimeError("aiomp: watching the fds failed") from self._error

    def check(self) -> None:
        """Wake each waiter whose condition holds now."""
        for entry in list(self._waits):
            done, woken = entry
            if self._error is not None or done():
                self._waits.remove(entry)
                self.wakeups += 1
                woken.set()

    def _watch(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if self._epoll is not None and loop is not self._loop:
            self._unwatch()  # left from a wait on another loop
        if self._epoll is None:
            self._epoll = select.epoll()
            self._loop = loop
            try:
                # Shielded: at trio.run's end, trio cancels the system tasks while
                # shielded shutdowns (a pool terminating its workers) still wait here;
                # the last waiter to leave stops it.
                watch = fd_watch(
                    loop, self._epoll.fileno(), self._poll, "aiomp fd set", self._failed, True
                )
                watch.start()
            except BaseException:
                self._epoll.close()
                self._epoll = None
                raise
            self._on_loop = watch
        for fd in list(self._sources):
            self._arm(fd)

    def _arm(self, fd: int) -> None:
        if fd not in self._armed:
            assert self._epoll is not None
            source = self._sources[fd]
            self._epoll.register(fd, source[0])
            self._armed[fd] = source

    def _unwatch(self) -> None:
        ep, self._epoll = self._epoll, None
        self._armed.clear()
        watch, self._on_loop = self._on_loop, None
        if watch is not None:
            watch.stop()  # before the close: the loop no longer watches the fd then
        if ep is not None:
            ep.close()

    def _failed(self, exc: Exception) -> None:
        """trio's wait on the epoll fd failed: the waiters get the error."""
        self._error = exc
        self.check()

    def _poll(self) -> None:
        """The epoll set is readable: handle every ready fd (a loop callback on asyncio)."""
        ep = self._epoll
        if ep is None:
            return
        try:
            ready = ep.poll(0)
        except OSError as exc:
            self._error = exc
            ready = []
        for fd, _ in ready:
            # One-shot: the fd is disarmed now. None: forgotten while handling an
            # earlier one.
            source = self._armed.pop(fd, None)
            if source is None:
                continue
            if not self._ready(source[1]):
                self._sources.pop(fd, None)
            elif self._sources.get(fd) is source:
                try:  # still to watch (another path handled it, a spurious wake-up)
                    ep.modify(fd, source[0])
                    self._armed[fd] = source
                except OSError as exc:
                    self._error = exc
        self.check()

    def _ready(self, on_ready: OnReady) -> bool:
        try:
            return on_ready()
        except Exception as exc:  # noqa: BLE001 - handed to the waiters, never lost
            self._error = exc
            return False
