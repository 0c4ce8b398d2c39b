"""Kept readers: an asyncio loop keeps watching an fd between waits.

A waiting task adds a future to the reader kept for its fd (made on first use) instead of
adding and removing a reader per wait (two ``epoll_ctl`` per wait): any number of tasks
wait on one fd, and the reader's report resolves them all. On trio, :func:`wait_readable`
is trio's own wait. Owns the duplicate fd each reader watches (closed once its loop no
longer watches it) and the registry of readers by fd, in this process: the owner of a
waited fd calls :func:`forget` before closing it. A forked child drops the parent's
readers. Stdlib-only at module level (children import it).
"""

from __future__ import annotations

import os
import select
import threading

from . import running_asyncio_loop

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    import asyncio
    from typing import Any


async def wait_readable(fd: int) -> None:
    """Wait until ``fd`` is readable, on the running loop (asyncio, uvloop or trio).

    On asyncio and uvloop the loop keeps watching ``fd`` between waits (a :class:`KeptReader`,
    see :func:`kept_readable`: any number of tasks may wait) instead of adding and
    removing a reader per wait; on trio this is trio's own ``wait_readable`` (one task per
    process and fd at a time: the queue's waiters fan out). The fd's owner calls
    :func:`forget` before closing it. Cancellation leaves nothing behind but the idle
    watch.
    """
    loop = running_asyncio_loop()
    if loop is None:
        import trio

        await trio.lowlevel.wait_readable(fd)
        return
    fut = kept_readable(loop, fd)
    if fut is None:
        import anyio

        await anyio.wait_readable(fd)
        return
    await wait_kept(fd, fut)


def kept_readable(loop: Any, fd: int) -> asyncio.Future[None] | None:
    """A future of ``loop`` resolved once ``fd`` is readable, through the reader kept for
    ``fd`` (made on first use), or None where no reader can be kept (another loop's
    task waits on ``fd``, another thread's running loop keeps it, or the loop has no
    ``add_reader``): then wait another way. Any number of tasks may wait on one fd this
    way: the reader resolves every future it holds. The caller awaits it with
    :func:`wait_kept`."""
    reader = _readers.get(fd)
    if reader is None or reader.loop is not loop:
        if reader is not None:
            if reader.waiters or (
                reader.thread != threading.get_ident() and reader.loop.is_running()
            ):
                # A task of another loop waits, or another thread's loop runs (it may be
                # adding a waiter right now: only its thread changes its reader; issue 25
                # item 8): leave its reader be.
                return None
            reader.remove()
        if type(loop) in _readerless:
            return None
        try:
            reader = KeptReader(loop, fd)
        except NotImplementedError:
            _readerless.add(type(loop))
            return None
        _readers[fd] = reader
    fut: asyncio.Future[None] = loop.create_future()
    reader.waiters.append(fut)
    reader.idle = 0
    return fut


async def wait_kept(fd: int, fut: asyncio.Future[None]) -> None:
    """Await a future from :func:`kept_readable`. On cancellation the future is cancelled
    and dropped from the reader; nothing else changes."""
    try:
        await fut
    finally:
        if fut.cancelled():
            drop_waiter(fd, fut)


def drop_waiter(fd: int, fut: asyncio.Future[None]) -> None:
    """A future from :func:`kept_readable` was cancelled: the reader forgets it."""
    reader = _readers.get(fd)
    if reader is not None:
        try:
            reader.waiters.remove(fut)
        except ValueError:
            pass


def forget(fd: int) -> None:
    """``fd`` is about to be closed: stop watching it (see :func:`wait_readable`)."""
    reader = _readers.pop(fd, None)
    if reader is not None:
        reader.remove()


class KeptReader:
    """A reader callback that stays registered on an asyncio loop for one fd.

    It watches its own duplicate of the fd, closed only once the loop no longer watches
    it: so a registration never outlives the fd it names, whoever closes the original.
    A report with waiters wakes them all. A loop may report the fd once more after a
    waiter woke and before it read; so a report with nobody waiting is ignored once, and
    the second in a row since the last wait stops the watch (the fd is readable and nobody
    here waits: it would fire at every turn of the loop). On asyncio's own loop that
    second report can also reach a waiter registered after the read (the loop queued it
    before the woken task ran): there the reader looks with ``poll`` before waking anyone.
    uvloop runs woken tasks before it looks at fds again: there it wakes without a look
    (a waiter that finds nothing, another process having read first, waits again).
    """

    __slots__ = ("fd", "idle", "loop", "poll", "thread", "waiters", "watched")

    def __init__(self, loop: Any, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.thread = threading.get_ident()
        self.waiters: list[Any] = []
        self.idle = 0  # reports with nobody waiting, since the last wait began
        self.poll: select.poll | None = None
        self.watched = os.dup(fd)
        try:
            if not type(loop).__module__.startswith("uvloop"):
                self.poll = select.poll()
                self.poll.register(self.watched, select.POLLIN)
            loop.add_reader(self.watched, self.fire)
        except BaseException:
            os.close(self.watched)
            raise

    def fire(self) -> None:
        waiters = self.waiters
        if not waiters:
            self.idle += 1
            if self.idle > 1:
                if _readers.get(self.fd) is self:
                    del _readers[self.fd]
                self.remove()
            return
        if self.poll is not None and not self.poll.poll(0):
            return  # a stale report: what made the fd readable was read since
        self.waiters = []
        for fut in waiters:
            if not fut.done():  # a cancelled waiter's future is done
                fut.set_result(None)

    def remove(self) -> None:
        """Stop watching and close the duplicate (from the loop's thread, or through it)."""
        watched, self.watched = self.watched, -1
        if watched < 0:
            return
        loop = self.loop
        if threading.get_ident() != self.thread and loop.is_running():
            loop.call_soon_threadsafe(_unwatch, loop, watched)
        else:
            _unwatch(loop, watched)


def _unwatch(loop: Any, fd: int) -> None:
    try:
        loop.remove_reader(fd)
    except (RuntimeError, ValueError, OSError):
        pass  # the loop is closed: it watches nothing any more
    os.close(fd)


#: Loop types without ``add_reader`` (an asyncio loop may lack it): waits go through anyio.
_readerless: set[type] = set()
#: fd -> the reader watching it, in this process (a forked child inherits none).
_readers: dict[int, KeptReader] = {}


def _after_fork_in_child() -> None:
    # The parent's loops are not ours: close the duplicates, touch no loop (an epoll
    # instance is shared with the parent).
    readers = list(_readers.values())
    _readers.clear()
    for reader in readers:
        if reader.watched >= 0:
            os.close(reader.watched)


os.register_at_fork(after_in_child=_after_fork_in_child)
