"""Queue and Event: between any processes of one tree, async and blocking.

A :class:`Queue` is one ``SOCK_SEQPACKET`` socket pair that every process holding the
queue shares (producers send on one end, consumers receive on the other), plus two
eventfds: a count of items (for ``qsize``) and, for a bounded queue, a count of free
slots. A datagram is delivered whole to exactly one receiver with its fds, so any number
of producers and consumers need no lock and no feeder thread: an item is in the kernel
when ``put`` returns, and an unpicklable item fails in ``put``, in the caller.

Closing (:meth:`Queue.close`) shuts the socket down for writing, in the kernel, for every
process at once: later puts raise :class:`~aiomp.QueueClosed`; consumers receive the items
already queued and then :class:`~aiomp.QueueClosed` (``async for`` simply ends).

An :class:`Event` is an eventfd: set writes to it, clear drains it, and it is readable
while set, so waiting is readiness on the event loop, or ``poll`` in blocking code.

Async calls wait through anyio (asyncio, uvloop, trio); within one process one task waits
on an fd and wakes the others (one waiter, fanning out). Objects rebuilt from a message
in a process that already holds the same queue or event are that same object.

fds are released when the object is garbage-collected in each process.
"""

from __future__ import annotations

import os
import queue as _stdqueue
import select
import socket
import time
import weakref

from . import _reduction, _transport
from ._errors import QueueClosed

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving a queue skip typing
if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from typing import Any

Full = _stdqueue.Full
Empty = _stdqueue.Empty

__all__ = ("Empty", "Event", "Full", "Queue")

_EFD = os.EFD_NONBLOCK | os.EFD_CLOEXEC
_ONE = (1).to_bytes(8, "little")
# Written to the slots eventfd by close(), to wake every waiting producer.
_FLOOD = 1 << 60
_MISSING = object()

_live: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()


def _eventfd_take(fd: int) -> bool:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        return False
    return True


def _eventfd_count(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("eventfd-count:"):
                return int(line.split()[1], 16)
    return 0  # pragma: no cover


class _Waiters:
    """One task per process waits on an fd; the others wait for it to wake them."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        # (fd, write) -> None while one task waits alone, an anyio.Event once others join
        self._events: dict[tuple[int, bool], Any] = {}

    async def wait(self, fd: int, write: bool = False) -> None:
        import anyio

        key = (fd, write)
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
            else:
                await anyio.wait_readable(fd)
        finally:
            event = self._events.pop(key)
            if event is not None:
                event.set()


class Queue:
    """A multi-producer, multi-consumer FIFO queue shared between processes.

    Create it in the parent and pass it to children in ``spawn(args=...)``, a Pool task,
    or inside another queue's message. ``maxsize <= 0`` means unbounded (in practice
    bounded by the kernel socket buffer of about 4 MiB of queued datagrams: ``put`` then
    waits, and ``put_nowait`` raises Full). Numpy arrays in items travel through shared
    memory (see :func:`aiomp.share_memory`). ``q.sync`` has the blocking calls.
    """

    def __init__(self, maxsize: int = 0) -> None:
        maxsize = max(0, int(maxsize))
        send, recv = _transport.socketpair()
        items = os.eventfd(0, _EFD | os.EFD_SEMAPHORE)
        room = os.eventfd(0, _EFD)
        slots = os.eventfd(maxsize, _EFD | os.EFD_SEMAPHORE) if maxsize else -1
        self._setup(os.urandom(16), maxsize, send, recv, items, room, slots)

    def _setup(self, token: bytes, maxsize: int, send: socket.socket, recv: socket.socket,
               items: int, room: int, slots: int) -> None:
        self._token = token
        self._maxsize = maxsize
        self._send = send
        self._recv = recv
        self._items = items
        # Every get writes ``room``: a put that found the socket buffer full waits on it.
        # (The socket itself reports writable only once 3/4 of its buffer has drained.)
        self._room = room
        self._slots = slots
        self._waiters = _Waiters()
        self.sync = SyncQueue(self)
        self._finalizer = weakref.finalize(self, _close_all, send, recv, items, room, slots)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        add = _reduction.add_fd
        fds = (add(self._send.fileno()), add(self._recv.fileno()), add(self._items),
               add(self._room), add(self._slots) if self._slots >= 0 else -1)
        return _rebuild_queue, (self._token, self._maxsize, *fds)

    def __repr__(self) -> str:
        return f"<aiomp.Queue maxsize={self._maxsize} qsize={self.qsize()}>"

    @property
    def maxsize(self) -> int:
        return self._maxsize

    # -- state --------------------------------------------------------------------
    def qsize(self) -> int:
        """Items put and not yet taken, across all processes (approximate while busy)."""
        return min(_eventfd_count(self._items), _FLOOD - 1)

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._maxsize > 0 and self.qsize() >= self._maxsize

    def close(self) -> None:
        """Close the queue for every process: no more puts; consumers drain, then end.

        After ``close()``, ``put`` raises :class:`~aiomp.QueueClosed` anywhere, and ``get``
        returns the items already queued and then raises QueueClosed; ``async for``
        over the queue ends. Idempotent.
        """
        try:
            self._send.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        os.eventfd_write(self._room, 1)  # wake producers waiting for buffer room
        if self._slots >= 0:
            try:
                os.eventfd_write(self._slots, _FLOOD)  # wake producers waiting for a slot
            except BlockingIOError:
                pass  # closed before

    # -- the non-waiting core -------------------------------------------------------
    def _try_put(self, datagram: bytes, fds: list[int]) -> bool:
        """Send if there is room: True if sent. Raises QueueClosed (or TransportError)."""
        if self._slots >= 0 and not _eventfd_take(self._slots):
            return False
        os.eventfd_write(self._items, 1)
        sent = False
        try:
            sent = _transport.try_send(self._send, datagram, fds)
        except _transport.Closed:
            raise QueueClosed("put on a closed aiomp.Queue") from None
        finally:
            if not sent:  # not sent, for whatever reason: give the counts back
                _eventfd_take(self._items)
                if self._slots >= 0:
                    os.eventfd_write(self._slots, 1)
        return sent

    def _put_wait_fd(self, datagram: bytes, fds: list[int]) -> int:
        """After a failed put: the fd to wait on, or -1 if a retry just succeeded."""
        if self._slots >= 0 and not _readable(self._slots):
            return self._slots  # no free slot
        # The socket buffer is full: wait for a get. Reset ``room`` first and try once
        # more, so that a get between the failed put and the wait is not missed.
        _eventfd_take(self._room)
        if self._try_put(datagram, fds):
            return -1
        return self._room

    def _try_get(self, blocking: bool = False) -> object:
        try:
            got = _transport.try_recv(self._recv, blocking)
        except _transport.Closed:
            raise QueueClosed("the aiomp.Queue is closed and drained") from None
        except OSError:
            self._took()  # the message was consumed (and is lost): keep the counts true
            raise
        if got is None:
            return _MISSING
        self._took()
        _, body, fds = _transport.decode(*got)
        return _reduction.loads(body, fds)

    def _took(self) -> None:
        _eventfd_take(self._items)
        if self._slots >= 0:
            os.eventfd_write(self._slots, 1)
        os.eventfd_write(self._room, 1)

    # -- async ----------------------------------------------------------------------
    async def put(self, obj: object) -> None:
        """Put ``obj``, waiting while the queue is full.

        Pickling errors raise here. On cancellation nothing has been put.
        Raises :class:`~aiomp.QueueClosed` once the queue is closed.
        """
        with _Item(obj) as item:
            while not self._try_put(item.datagram, item.fds):
                fd = self._put_wait_fd(item.datagram, item.fds)
                if fd < 0:
                    break
                await self._waiters.wait(fd)

    async def get(self) -> Any:
        """Remove and return an item, waiting while the queue is empty.

        On cancellation nothing is taken. Raises :class:`~aiomp.QueueClosed` once the
        queue is closed and drained.
        """
        while (item := self._try_get()) is _MISSING:
            await self._waiters.wait(self._recv.fileno())
        return item

    def put_nowait(self, obj: object) -> None:
        """Put ``obj`` if there is room at once, else raise :class:`aiomp.Full`."""
        with _Item(obj) as item:
            if not self._try_put(item.datagram, item.fds):
                raise Full

    def get_nowait(self) -> Any:
        """Remove and return an item if one is there, else raise :class:`aiomp.Empty`."""
        item = self._try_get()
        if item is _MISSING:
            raise Empty
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            try:
                item = await self.get()
            except QueueClosed:
                return
            yield item


class SyncQueue:
    """The blocking side of a :class:`Queue`, for sync workers and threads (``q.sync``)."""

    __slots__ = ("_q",)

    def __init__(self, q: Queue) -> None:
        self._q = q

    def put(self, obj: object, timeout: float | None = None) -> None:
        """Put ``obj``, blocking while full; :class:`aiomp.Full` after ``timeout`` s."""
        q = self._q
        deadline = None if timeout is None else time.monotonic() + timeout
        with _Item(obj) as item:
            while not q._try_put(item.datagram, item.fds):
                fd = q._put_wait_fd(item.datagram, item.fds)
                if fd < 0:
                    break
                if not _transport.wait_fd_sync(fd, deadline=deadline):
                    raise Full

    def get(self, timeout: float | None = None) -> Any:
        """Remove and return an item, blocking while empty; :class:`aiomp.Empty` after
        ``timeout`` s; :class:`aiomp.QueueClosed` once closed and drained."""
        q = self._q
        if timeout is None:
            # One blocking recvmsg: waking a process blocked in recvmsg costs far less
            # than waking one blocked in poll. (If an event loop somewhere made the
            # socket non-blocking, this returns at once and we poll below.)
            item = q._try_get(blocking=True)
            if item is not _MISSING:
                return item
        deadline = None if timeout is None else time.monotonic() + timeout
        while (item := q._try_get()) is _MISSING:
            if not _transport.wait_fd_sync(q._recv.fileno(), deadline=deadline):
                raise Empty
        return item

    def __iter__(self) -> Any:
        while True:
            try:
                yield self.get()
            except QueueClosed:
                return


def _readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class _Item:
    """An item being put: pickled (errors raise in the caller) and framed.

    ``with _Item(obj) as item:`` sends it, or else, leaving by an exception (Full, a
    timeout, cancellation), discards it: what pickling promised is undone.
    """

    __slots__ = ("_extra", "_out", "datagram", "fds")

    def __init__(self, obj: object) -> None:
        self._out = _reduction.dumps(obj)
        try:
            self.datagram, self.fds, self._extra = _transport.encode(
                self._out.body, self._out.fds
            )
        except BaseException:
            self._out.discard()
            raise

    def __enter__(self) -> _Item:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._extra >= 0:
            os.close(self._extra)
        if exc_type is None:
            self._out.close()
        else:
            self._out.discard()


def _close_all(send: socket.socket, recv: socket.socket, *fds: int) -> None:
    send.close()
    recv.close()
    _transport.close_fds([fd for fd in fds if fd >= 0])


def _rebuild_queue(token: bytes, maxsize: int, send: int, recv: int, items: int, room: int,
                   slots: int) -> Queue:
    existing = _live.get(token)
    if isinstance(existing, Queue):
        return existing  # the message's fds are closed by loads
    take = _reduction.take_fd
    q = Queue.__new__(Queue)
    q._setup(token, maxsize, socket.socket(fileno=take(send)), socket.socket(fileno=take(recv)),
             take(items), take(room), take(slots) if slots >= 0 else -1)
    return q


class Event:
    """A cross-process event (``threading.Event`` semantics).

    ``await e.wait()`` waits on the event loop; ``e.sync.wait(timeout)`` blocks.
    """

    def __init__(self) -> None:
        self._setup(os.urandom(16), os.eventfd(0, _EFD))

    def _setup(self, token: bytes, fd: int) -> None:
        self._token = token
        self._fd = fd
        self._waiters = _Waiters()
        self.sync = SyncEvent(self)
        self._finalizer = weakref.finalize(self, os.close, fd)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_event, (self._token, _reduction.add_fd(self._fd))

    def __repr__(self) -> str:
        return f"<aiomp.Event {'set' if self.is_set() else 'unset'}>"

    def is_set(self) -> bool:
        return _readable(self._fd)

    def set(self) -> None:
        """Set the event; every waiter in every process wakes."""
        os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        _eventfd_take(self._fd)

    async def wait(self) -> None:
        """Wait until the event is set. Cancellation leaves the event as it was."""
        while not self.is_set():
            await self._waiters.wait(self._fd)


class SyncEvent:
    """The blocking side of an :class:`Event` (``e.sync``)."""

    __slots__ = ("_e",)

    def __init__(self, e: Event) -> None:
        self._e = e

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set; returns False if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return _transport.wait_fd_sync(self._e._fd, deadline=deadline)


def _rebuild_event(token: bytes, fd: int) -> Event:
    existing = _live.get(token)
    if isinstance(existing, Event):
        return existing
    e = Event.__new__(Event)
    e._setup(token, _reduction.take_fd(fd))
    return e


for _cls in (Queue, Event, SyncQueue, SyncEvent):
    _cls.__module__ = "aiomp"
