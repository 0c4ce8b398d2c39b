"""FdWatch: a callback run each time one fd is readable, until the watch stops.

The one way aiomp watches an fd on the event loop. On asyncio and uvloop the callback is
the loop's reader callback itself (``loop.add_reader``), left registered between reports
(adding and removing it per report costs two ``epoll_ctl``), so what it resolves wakes its
waiter with no task in between; on trio a task waits on the fd (``wait_readable``) and
calls it after each wait. :func:`fd_watch` picks the kind for the running loop once, when
the watch's owner is made: the callback is bound then, and nothing dispatches per report.

A watch runs in a task of its owner (:meth:`FdWatch.serve`) or on its own
(:meth:`FdWatch.start`: the reader callback alone, or a trio system task) until
:meth:`FdWatch.stop`, which the callback itself may call. Cancelling the task that serves
it leaves nothing registered. Owns the registration of the fd on the loop, never the fd:
its owner stops the watch before closing it. Nothing reached from the callback may touch
anyio: on asyncio it runs in a loop callback.

Users: the pool's results channel (``aiomp._pool.process_handle``), the epoll set of
:mod:`aiomp._loop.fdset`, and the coalesced reads of :mod:`aiomp._loop.turns`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

#: What a trio watch calls with an unexpected error of its wait (it then ends); without
#: one, the error propagates from the task that serves the watch.
OnError = Callable[[Exception], None]


class FdWatch(Protocol):
    """What every watch offers (see the module docstring)."""

    def start(self) -> None: ...

    async def serve(self) -> None: ...

    def stop(self) -> None: ...


def fd_watch(
    loop: asyncio.AbstractEventLoop | None,
    fd: int | socket.socket,
    on_readable: Callable[[], None],
    name: str = "aiomp fd watch",
    on_error: OnError | None = None,
    shield: bool = False,
) -> FdWatch:
    """A watch calling ``on_readable()`` each time ``fd`` is readable, not yet started.

    ``loop``: the running asyncio loop (:func:`aiomp._loop.running_asyncio_loop`), None
    under trio. ``name``, ``on_error`` and ``shield`` matter only to trio's watch: with
    ``shield``, a watch started on its own (:meth:`~FdWatch.start`) goes on when
    ``trio.run``'s end cancels the system tasks, until its owner stops it.
    """
    if loop is not None:
        return ReaderWatch(loop, fd, on_readable)
    return TaskWatch(fd, on_readable, name, on_error, shield)


class ReaderWatch:
    """asyncio and uvloop: the loop's reader callback, registered from :meth:`start` (or
    :meth:`serve`) until :meth:`stop`; :meth:`pause` removes it until the next
    :meth:`start`. On the loop's thread."""

    __slots__ = ("_done", "_fd", "_on_readable", "loop", "stopped")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int | socket.socket,
        on_readable: Callable[[], None],
    ) -> None:
        self.loop = loop
        self._fd = fd
        self._on_readable = on_readable
        self.stopped = False
        self._done: asyncio.Future[None] | None = None  # what serve() waits on

    def start(self) -> None:
        self.loop.add_reader(self._fd, self._on_readable)

    def pause(self) -> None:
        self.loop.remove_reader(self._fd)

    async def serve(self) -> None:
        """Call the callback until :meth:`stop` (or cancellation, which leaves nothing
        registered)."""
        self._done = done = self.loop.create_future()
        if self.stopped:
            return
        self.start()
        try:
            await done
        finally:
            self._remove()

    def stop(self) -> None:
        """No more calls (from the callback itself, or anywhere on the loop's thread)."""
        if self.stopped:
            return
        self.stopped = True
        self._remove()
        done = self._done
        if done is not None and not done.done():
            done.set_result(None)

    def _remove(self) -> None:
        try:
            self.loop.remove_reader(self._fd)
        except Exception:  # noqa: BLE001 - the loop is closed: nothing to remove
            pass


class TaskWatch:
    """trio: a task that waits on the fd and calls the callback, in a cancel scope that
    :meth:`stop` cancels (trio delivers it at once: the fd leaves trio's epoll then)."""

    __slots__ = ("_fd", "_name", "_on_error", "_on_readable", "_scope", "_shield", "stopped")

    def __init__(
        self,
        fd: int | socket.socket,
        on_readable: Callable[[], None],
        name: str,
        on_error: OnError | None,
        shield: bool = False,
    ) -> None:
        self._fd = fd
        self._shield = shield
        self._on_readable = on_readable
        self._name = name
        self._on_error = on_error
        self._scope: Any = None  # trio.CancelScope, once the task runs
        self.stopped = False

    def start(self) -> None:
        """Serve the watch in a trio system task (in ``trio.run``, on its thread)."""
        import trio

        trio.lowlevel.spawn_system_task(self.serve, name=self._name)

    async def serve(self) -> None:
        """Watch until :meth:`stop`; on cancellation nothing is left waiting."""
        import trio

        with trio.CancelScope(shield=self._shield) as scope:
            self._scope = scope
            await self.run()

    async def run(self) -> None:
        """The task's loop: wait, call, until stopped (a subclass may read differently)."""
        import trio

        wait_readable = trio.lowlevel.wait_readable
        fd, on_readable = self._fd, self._on_readable
        while not self.stopped:
            try:
                await wait_readable(fd)
            except Exception as exc:
                if self.stopped:
                    return
                if self._on_error is None:
                    raise
                self._on_error(exc)
                return
            on_readable()

    def stop(self) -> None:
        """No more calls (from the callback, or anywhere in ``trio.run``'s thread)."""
        if self.stopped:
            return
        self.stopped = True
        if self._scope is not None:
            try:
                self._scope.cancel()
            except RuntimeError:  # trio.run has ended
                pass
