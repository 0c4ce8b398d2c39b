"""Queue: between any processes of one tree, async and blocking.

A :class:`Queue` is one ``SOCK_SEQPACKET`` socket pair shared by every process holding it
(see docs/decisions/0001-datagram-queue.md), an overflow log in shared memory
(:mod:`aiomp._queue.overflow`, see docs/decisions/0006-queue-overflow-log.md) and eventfds: wake-up
tokens for the
consumers of a bounded queue, and a wake-up for producers that wait (see
docs/decisions/0005-kept-readers.md; an unbounded queue counts its items as in
docs/decisions/0007-queue-counts.md). An item is in the
kernel when ``put`` returns, and an unpicklable item fails in ``put``, in the caller.

Unbounded (``maxsize <= 0``): the socket while it has room, then the log; only items
carrying fds are bounded there (about 10,900 parked datagrams: beyond that ``put`` waits
and ``put_nowait`` raises Full). Bounded: every item goes through the log, whose
committed count is the bound, so no process death changes the capacity.

:meth:`Queue.close` shuts the socket down for writing in every process at once: later
puts raise :class:`~aiomp.QueueClosedError`; consumers get what is queued, then QueueClosedError
(``async for`` ends). An item that cannot be rebuilt raises :class:`~aiomp.QueueItemError`
at ``get`` (that item is lost; the queue goes on); exceptions that could not be rebuilt
are refused at ``put``.

Within one process one task waits on an fd (:class:`~aiomp._loop.waiters.FdWaiters`).
No call blocks an event loop on the overflow's lock: found held (a process stopped while
holding it), an async call waits on its loop, cancellably, and a ``*_nowait`` call waits
at most ``NOWAIT_LOCK`` seconds, then raises Empty or Full. Called where no event loop
runs, ``put`` and ``get`` raise RuntimeError naming the ``.sync`` call. A queue rebuilt in a
process that already holds it is that same object. Owns the queue's socket pair, its two
eventfds and (through :class:`~aiomp._queue.overflow.Overflow`) the overflow's memfd,
released when the object is garbage-collected. A *child* module.
"""

from __future__ import annotations

import os
import queue as _stdqueue
import socket
import time
import weakref
from collections.abc import Sequence

from .. import _loop
from .._errors import QueueClosedError
from .._loop import readers as _readers
from .._loop.finalizers import finalizer
from .._loop.waiters import FdWaiters
from .._memory import janitor as _janitor
from .._wire import datagram as _datagram
from .._wire import pickling as _pickling
from . import overflow as _overflow
from .core import BUSY, PUT, QueueCore
from .items import MISSING, message
from .mutex import Busy
from .sync import SyncQueue, no_loop

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving a queue skip typing
if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Coroutine
    from typing import Any

Full = _stdqueue.Full
Empty = _stdqueue.Empty

__all__ = ("Empty", "Full", "Queue", "overflow_of")

_EFD = os.EFD_NONBLOCK | os.EFD_CLOEXEC
HINT = _overflow.HINT
_live: weakref.WeakValueDictionary[bytes, Queue] = weakref.WeakValueDictionary()
#: The longest a ``*_nowait`` call waits for the overflow's lock, held by another thread or
#: process (held for longer, that holder is stopped: the call raises Empty or Full).
NOWAIT_LOCK = 0.2
#: An async call's pauses on its loop between tries of a held overflow lock (seconds): a
#: yield first (the holder, running, is done within microseconds), then growing ones.
_PAUSES = (0.0, 0.0001, 0.0003, 0.001, 0.003, 0.01)


async def _pause(turn: int) -> None:
    """Wait on the running loop before trying the overflow's lock again: the ``turn``-th
    pause since it was found held. Cancellation leaves nothing."""
    await _loop.sleep(_PAUSES[min(turn, len(_PAUSES) - 1)])


class Queue(QueueCore):
    """A multi-producer, multi-consumer FIFO queue shared between processes.

    Create it in the parent and pass it to children in ``spawn(args=...)``, a Pool task,
    or inside another queue's message. ``maxsize <= 0`` means unbounded: items beyond the
    socket buffer go to the queue's overflow in shared memory (see the module docstring),
    and ``put`` never waits for a consumer. Numpy arrays in items travel through shared
    memory (see :func:`aiomp.share_memory`). ``q.sync`` has the blocking calls.
    """

    def __init__(self, maxsize: int = 0) -> None:
        maxsize = max(0, int(maxsize))
        _janitor.sweep_once()  # (a tree's first queue: what dead trees left goes)
        send, recv = _datagram.socketpair()
        fds: list[int] = []
        try:
            # Consumers' tokens: a bounded queue's only (an unbounded one's consumers wait
            # for the socket; see docs/decisions/0007-queue-counts.md), so an unbounded queue has
            # one fd fewer.
            fds.append(os.eventfd(0, _EFD | os.EFD_SEMAPHORE) if maxsize else -1)
            fds.append(os.eventfd(0, _EFD))
            fds.append(_overflow.create())
        except BaseException:  # EMFILE, ENOMEM: nothing half-made is left open
            send.close()
            recv.close()
            _datagram.close_fds([fd for fd in fds if fd >= 0])
            raise
        self._setup(os.urandom(16), maxsize, (send, recv), fds)

    def _setup(
        self,
        token: bytes,
        maxsize: int,
        pair: tuple[socket.socket, socket.socket],
        fds: Sequence[int],
    ) -> None:
        """``pair``: the sending and receiving sockets; ``fds``: the items and room
        eventfds and the overflow log's memfd (items -1 for an unbounded queue)."""
        self._token = token
        self._maxsize = maxsize
        send, recv = self._send, self._recv = pair
        # The items eventfd of a bounded queue: wake-up tokens for consumers, never fewer
        # than the items (see _overflow, "Bounded"); -1 when unbounded (qsize counts in
        # the log's header). The room eventfd: written when an item that frees room is
        # taken; a put waiting for a slot (bounded), or for the overflow's fd vault, waits
        # on it. close() writes it too.
        items, room, log = fds
        self._items, self._room = items, room
        # Consumers wait for the socket, or for the tokens of a bounded queue.
        self._wait_fd = items if maxsize else recv.fileno()
        # The fds parked with overflowed items travel the socket pair backwards.
        self._ovf = _overflow.Overflow(log, vault_in=recv, vault_out=send)
        self._hint = self._ovf.header  # byte HINT: 0 only while the overflow is empty
        self._look = self._ovf.look  # poll(0) on the socket: falsy while it is empty
        self._used_socket = True  # sent on the socket since this process last overflowed
        self._waited = True  # the last async get found the queue empty (see _get)
        # This process's slot of socket counts (claimed on first use) and its counts.
        self._slot = -1
        self._sent = self._received = 0
        # Waits for room (every loop), and for items on a loop without a kept reader.
        self._waiters = FdWaiters(_readers.wait_readable)
        self.sync = SyncQueue(self)
        self._finalizer = weakref.finalize(self, _close_all, send, recv, self._ovf, items, room)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        add = _pickling.add_fd
        fds = (
            add(self._send.fileno()),
            add(self._recv.fileno()),
            add(self._items) if self._maxsize else -1,
            add(self._room),
            add(self._ovf.fd),
        )
        return _rebuild_queue, (self._token, self._maxsize, *fds)

    def __repr__(self) -> str:
        return f"<aiomp.Queue maxsize={self._maxsize} qsize={self.qsize()}>"

    @property
    def maxsize(self) -> int:
        return self._maxsize

    # -- state --------------------------------------------------------------------
    def qsize(self) -> int:
        """Items put and not yet taken, across all processes: exact for a bounded queue;
        for an unbounded one, approximate like ``multiprocessing.Queue.qsize``: those in
        the socket, by counts each process keeps (exact once puts and gets have returned,
        unless a process was killed between sending or receiving an item and counting it,
        or two threads of one process raced on one count) and those in the overflow
        (exact)."""
        if self._maxsize:
            return self._ovf.count()
        return self._ovf.socket_count() + self._ovf.count()

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._maxsize > 0 and self.qsize() >= self._maxsize

    def close(self) -> None:
        """Close the queue for every process: no more puts; consumers drain, then end.

        After ``close()``, ``put`` raises :class:`~aiomp.QueueClosedError` anywhere, and ``get``
        returns the items already queued (overflow included) and then raises
        QueueClosedError; ``async for`` over the queue ends. Idempotent. Takes the overflow's
        lock: while a stopped process holds it, this blocks (Ctrl-C interrupts it).
        """
        self._ovf.close_log()
        try:
            self._send.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        os.eventfd_write(self._room, 1)  # wake producers waiting for room
        if self._maxsize:
            os.eventfd_write(self._items, 1)  # wake consumers: a token no one takes

    # -- async ----------------------------------------------------------------------
    def put(self, obj: object) -> Coroutine[Any, Any, None]:
        """Put ``obj`` (``await q.put(obj)``), waiting only while a bounded queue is full.

        Pickling errors raise here. On cancellation nothing has been put (while the
        queue's overflow lock is held elsewhere, the put waits for it on the loop).
        Raises :class:`~aiomp.QueueClosedError` once the queue is closed, and RuntimeError at
        once (before any coroutine exists) where no event loop runs: use ``q.sync.put``.
        """
        if _loop.running_loop() is None:
            raise no_loop("Queue.put", "q.sync.put(obj)")
        return self._put(obj)

    async def _put(self, obj: object) -> None:
        if self._put_plain(obj):
            return
        with message(obj) as msg:
            turn = 0
            while (fd := self._put_step(msg)) != PUT:
                if fd == BUSY:
                    await _pause(turn)
                    turn += 1
                else:
                    await self._waiters.wait(fd)

    def get(self) -> Coroutine[Any, Any, Any]:
        """Remove and return an item (``await q.get()``), waiting while the queue is empty.

        On cancellation nothing is taken (while the queue's overflow lock is held
        elsewhere, the get waits for it on the loop). Raises
        :class:`~aiomp.QueueClosedError` once the queue is closed and drained,
        :class:`~aiomp.QueueItemError` for an item that cannot be rebuilt here, and
        RuntimeError at once where no event loop runs: use ``q.sync.get``.
        """
        loop = _loop.running_loop()
        if loop is None:
            raise no_loop("Queue.get", "q.sync.get()")
        return self._get(loop)

    async def _get(self, loop: _loop.RunningLoop) -> Any:
        """``loop``: the running loop, as :func:`aiomp._loop.running_loop` found it."""
        # Look before reading only if the last get had to wait: a poll costs less than an
        # empty read's exception, but is wasted where items are waiting (a busy consumer).
        busy = False
        try:
            item = self._try_get(peek=self._waited)
        except Busy:
            item, busy = MISSING, True
        if item is not MISSING:
            self._waited = False
            return item
        self._waited = True
        turn = 0
        while item is MISSING:
            if busy:  # the overflow's lock is held elsewhere: pause on the loop, try again
                await _pause(turn)
                turn += 1
            else:
                await self._waiters.readable(self._wait_fd, loop)
            try:
                item = self._try_get()
                busy = False
            except Busy:
                busy = True
        return item

    def put_nowait(self, obj: object) -> None:
        """Put ``obj`` at once. Raises :class:`aiomp.Full` if a bounded queue is full (or,
        unbounded, if the overflow cannot park any more fds: see the module docstring, or
        if its lock stays held elsewhere for NOWAIT_LOCK seconds)."""
        if self._put_plain(obj):
            return
        msg = message(obj)
        try:  # not `with`: this is the hot path of a producer that never waits
            try:
                put = self._try_put(msg)
            except Busy:
                deadline = time.monotonic() + NOWAIT_LOCK
                put = self._when_unlocked(lambda: self._try_put(msg), deadline) is True
            if put:
                msg.close()
                return
        except BaseException:
            msg.discard()
            raise
        msg.discard()
        raise Full

    def get_nowait(self) -> Any:
        """Remove and return an item if one is there, else raise :class:`aiomp.Empty` (also
        if the queue's overflow lock stays held elsewhere for NOWAIT_LOCK seconds)."""
        try:
            item = self._try_get()
        except Busy:
            item = self._when_unlocked(self._try_get, time.monotonic() + NOWAIT_LOCK)
        if item is MISSING:
            raise Empty
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        loop = _loop.running_loop()
        assert loop is not None  # an async for runs on a loop
        while True:
            try:
                item = await self._get(loop)
            except QueueClosedError:
                return
            yield item


@finalizer
def _close_all(
    send: socket.socket, recv: socket.socket, ovf: _overflow.Overflow, *fds: int
) -> None:
    for fd in (recv.fileno(), *fds):
        _readers.forget(fd)
    send.close()
    recv.close()
    ovf.close()
    _datagram.close_fds([fd for fd in fds if fd >= 0])


def _rebuild_queue(
    token: bytes, maxsize: int, send: int, recv: int, items: int, room: int, log: int
) -> Queue:
    existing = _live.get(token)
    if isinstance(existing, Queue):
        return existing  # the message's fds are closed by loads
    take = _pickling.take_fd
    q = Queue.__new__(Queue)
    pair = socket.socket(fileno=take(send)), socket.socket(fileno=take(recv))
    q._setup(token, maxsize, pair, (take(items) if maxsize else -1, take(room), take(log)))
    return q


def overflow_of(q: Queue) -> _overflow.Overflow:
    """The overflow log behind ``q``: the test seam for what the log holds (its
    ``count()``, ``fd``, ``header`` and ``socket_empty()``), not for use by aiomp."""
    return q._ovf


def _after_fork_in_child() -> None:
    # A forked child counts in a slot of its own (claimed with its pid on first use).
    for q in list(_live.values()):
        q._slot = -1


os.register_at_fork(after_in_child=_after_fork_in_child)

Queue.__module__ = "aiomp"
