"""Queue and Event: between any processes of one tree, async and blocking.

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
puts raise :class:`~aiomp.QueueClosed`; consumers get what is queued, then QueueClosed
(``async for`` ends). An item that cannot be rebuilt raises :class:`~aiomp.QueueItemError`
at ``get`` (that item is lost; the queue goes on); exceptions that could not be rebuilt
are refused at ``put``. An :class:`Event` is a flag and a generation in shared memory,
with a registry of waiting threads' eventfds (see docs/decisions/0032-event-wake-ups.md).

Within one process one task waits on an fd (see *One waiter per fd*). No call blocks an
event loop on the overflow's lock: found held (a process stopped while holding it), an
async call waits on its loop, cancellably, and a ``*_nowait`` call waits at most
``NOWAIT_LOCK`` seconds, then raises Empty or Full. Called where no
event loop runs, ``put``, ``get`` and ``Event.wait`` raise RuntimeError naming the
``.sync`` call. Objects rebuilt in a process that already holds the same queue or event
are that same object; fds are released when the object is garbage-collected. A *child*
module (see *Light children*).
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue as _stdqueue
import select
import socket
import sys
import threading
import time
import weakref
from threading import get_ident as _get_ident

from .. import _loop
from .._errors import CudaIpcError, QueueClosed, QueueItemError
from .._loop.fdwait import FdWaiters
from .._loop.finalizers import finalizer
from .._wire import pickling as _reduction
from .._wire import transport as _transport
from . import overflow as _overflow

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving a queue skip typing
if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Callable, Coroutine
    from typing import Any

Full = _stdqueue.Full
Empty = _stdqueue.Empty

__all__ = ("Empty", "Event", "Full", "Queue")

_EFD = os.EFD_NONBLOCK | os.EFD_CLOEXEC
_ONE = (1).to_bytes(8, "little")
_MISSING = object()
HINT = _overflow.HINT
U64 = _overflow.U64
_SENT = _overflow.SENT
_RECEIVED = _overflow.RECEIVED

_live: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()
_PLAIN = _reduction.PLAIN
_KIND_DATA = _transport.KIND_DATA
_DATA = bytes((_KIND_DATA,))
_NO_FDS: list[int] = []  # never mutated
_SEND_FLAGS = _transport.SEND_FLAGS
_Busy = _overflow.Busy
#: The longest a ``*_nowait`` call waits for the overflow's lock, held by another thread or
#: process (held for longer, that holder is stopped: the call raises Empty or Full).
NOWAIT_LOCK = 0.2
#: An async call's pauses on its loop between tries of a held overflow lock (seconds): a
#: yield first (the holder, running, is done within microseconds), then growing ones.
_PAUSES = (0.0, 0.0001, 0.0003, 0.001, 0.003, 0.01)


def _eventfd_take(fd: int) -> bool:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        return False
    return True


def _loop_running() -> bool:
    """Whether an event loop (asyncio, uvloop or trio) runs in this thread.

    Looks only at modules already imported: a sync child that never imported asyncio or
    trio cannot be running their loops, and pays two dict lookups.
    """
    return _loop.running_asyncio_loop() is not None or _loop.trio_running()


async def _pause(turn: int) -> None:
    """Wait on the running loop (asyncio, uvloop or trio) before trying the overflow's lock
    again: the ``turn``-th pause since it was found held. Cancellation leaves nothing."""
    delay = _PAUSES[min(turn, len(_PAUSES) - 1)]
    if _loop.running_asyncio_loop() is None:
        await sys.modules["trio"].sleep(delay)
    else:
        await sys.modules["asyncio"].sleep(delay)


def _no_loop(call: str, sync_call: str) -> RuntimeError:
    return RuntimeError(
        f"{call} is a coroutine and no event loop runs in this thread; in sync code (a "
        f"sync worker, a thread) call {sync_call} instead"
    )


class Queue:
    """A multi-producer, multi-consumer FIFO queue shared between processes.

    Create it in the parent and pass it to children in ``spawn(args=...)``, a Pool task,
    or inside another queue's message. ``maxsize <= 0`` means unbounded: items beyond the
    socket buffer go to the queue's overflow in shared memory (see the module docstring),
    and ``put`` never waits for a consumer. Numpy arrays in items travel through shared
    memory (see :func:`aiomp.share_memory`). ``q.sync`` has the blocking calls.
    """

    def __init__(self, maxsize: int = 0) -> None:
        maxsize = max(0, int(maxsize))
        send, recv = _transport.socketpair()
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
            _transport.close_fds([fd for fd in fds if fd >= 0])
            raise
        self._setup(os.urandom(16), maxsize, send, recv, *fds)

    def _setup(
        self,
        token: bytes,
        maxsize: int,
        send: socket.socket,
        recv: socket.socket,
        items: int,
        room: int,
        log: int,
    ) -> None:
        self._token = token
        self._maxsize = maxsize
        self._send = send
        self._recv = recv
        # Bounded: wake-up tokens for consumers, never fewer than the items (see
        # _overflow, "Bounded"). Unbounded: -1 (qsize counts in the log's header).
        self._items = items
        # Written when an item that frees room is taken: a put waiting for a slot
        # (bounded), or for the overflow's fd vault, waits on it. close() writes it too.
        self._room = room
        # Consumers wait for the socket, or for the tokens of a bounded queue.
        self._wait_fd = items if maxsize else recv.fileno()
        # The fds parked with overflowed items travel the socket pair backwards.
        self._ovf = _overflow.Overflow(log, vault_in=recv, vault_out=send)
        self._hint = self._ovf._header  # byte HINT: 0 only while the overflow is empty
        self._look = self._ovf.look  # poll(0) on the socket: falsy while it is empty
        self._used_socket = True  # sent on the socket since this process last overflowed
        self._waited = True  # the last async get found the queue empty (see _get)
        # This process's slot of socket counts (claimed on first use) and its counts.
        self._slot = -1
        self._sent = self._received = 0
        # Waits for room (every loop), and for items on a loop without a kept reader.
        self._waiters = FdWaiters(_transport.wait_readable)
        # trio: (fd, thread) -> None while one task waits for items, a trio.Event once
        # others join. Per thread: each thread's trio.run has its own tasks (issue 25 item 8).
        self._trio_waits: dict[tuple[int, int], Any] = {}
        self.sync = SyncQueue(self)
        self._finalizer = weakref.finalize(self, _close_all, send, recv, self._ovf, items, room)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        add = _reduction.add_fd
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

        After ``close()``, ``put`` raises :class:`~aiomp.QueueClosed` anywhere, and ``get``
        returns the items already queued (overflow included) and then raises
        QueueClosed; ``async for`` over the queue ends. Idempotent. Takes the overflow's
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

    # -- the non-waiting core -------------------------------------------------------
    def _send_now(self, datagram: bytes, fds: list[int]) -> bool:
        """Send on the socket if its buffer has room: True if sent."""
        try:
            sent = _transport.try_send(self._send, datagram, fds)
        except _transport.Closed:
            raise QueueClosed("put on a closed aiomp.Queue") from None
        if sent:
            self._count_sent()
        self._used_socket = True  # the overflow's order needs to know (see _overflow)
        return sent

    def _put_plain(self, obj: object) -> bool:
        """Put a plain item (bytes, str, a number: no reducer, no fd, no exception) of an
        unbounded queue: on the socket, or behind the overflow's items, without a Message.
        True if put. False: not plain, a bounded queue, or too large for a datagram;
        nothing is put then, and the caller takes the general path. The general path's
        work, without its objects (see docs/decisions/0008-queue-fast-path.md)."""
        if type(obj) not in _PLAIN or self._maxsize:
            return False
        body = pickle.dumps(obj, 5)
        if len(body) >= _transport.MAX_INLINE:
            return False
        if not self._hint[HINT]:
            # _send_now and _transport.try_send inlined for a datagram without fds: two
            # frames less on every round trip (see docs/decisions/0008-queue-fast-path.md).
            self._used_socket = True
            try:
                self._send.send(_DATA + body, _SEND_FLAGS)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise QueueClosed("put on a closed aiomp.Queue") from None
            else:
                self._count_sent()
                return True
        used, self._used_socket = self._used_socket, False
        try:
            return self._ovf.append(
                body, _NO_FDS, lambda: self._send_now(_DATA + body, _NO_FDS), used
            )
        except _Busy:
            self._restore_used(used)
            raise

    def _try_put(self, msg: _reduction.Message) -> bool:
        """Put if there is room: True if put (socket or overflow).

        False: a bounded queue is full, or the overflow cannot park the item's fds now;
        wait on ``_room``. Raises QueueClosed (or TransportError), or _Busy (the
        overflow's lock is held elsewhere: wait for it); nothing is put then.
        """
        if self._maxsize:  # every item through the log: the bound is its committed count
            return self._ovf.append(msg.body, msg.fds, None, False, self._maxsize, self._items)
        # The socket while the overflow is empty; else the overflow, behind the items
        # already there (it tries the socket again once it finds itself empty).
        if not self._hint[HINT] and self._send_now(*msg.datagram()):
            return True
        used, self._used_socket = self._used_socket, False
        try:
            return self._ovf.append(
                msg.body, msg.fds, lambda: self._send_now(*msg.datagram()), used
            )
        except _Busy:
            self._restore_used(used)
            raise

    def _restore_used(self, used: bool) -> None:
        """An append found the overflow's lock held: the flag it was to pass on stays
        with this process. Only ever set again (another thread may have set it since)."""
        if used:
            self._used_socket = True

    def _put_wait_fd(self, msg: _reduction.Message) -> int:
        """After a failed put: the fd to wait on, or -1 if a retry just succeeded."""
        # Reset ``room`` first and try once more, so that a get between the failed put
        # and the wait is not missed.
        _eventfd_take(self._room)
        if self._try_put(msg):
            return -1
        return self._room

    def _try_get(self, blocking: bool = False, peek: bool = False) -> object:
        """An item, or _MISSING. ``peek``: look with ``poll`` before reading, so that an
        empty socket costs no exception (a get about to wait usually finds it empty).
        Raises _Busy (nothing taken) while the overflow's lock is held elsewhere."""
        if self._maxsize:
            popped = self._ovf.pop(None, self._items, self._room)
            if popped is None:
                if self._ovf.closed():
                    raise QueueClosed("the aiomp.Queue is closed and drained")
                return _MISSING
            return _load(popped[0], popped[1])
        hint = self._hint
        while True:
            if hint[HINT]:
                popped = self._ovf.pop(self._recv_locked)
                if popped is not None:
                    body, fds, from_socket = popped
                    if fds and not from_socket:
                        os.eventfd_write(self._room, 1)  # the vault has room again
                    return _load(body, fds)
            if peek and not hint[HINT]:
                try:
                    if not self._look(0):  # _ovf.socket_empty, inlined
                        return _MISSING
                except RuntimeError:  # another thread polls it now (issue 25 item 8)
                    if self._ovf.socket_empty():
                        return _MISSING
            # Blocking in recvmsg is safe only while the overflow is empty: it becomes
            # non-empty only when the socket is full, which wakes this recvmsg.
            try:
                got = _transport.try_recv(self._recv, blocking and not hint[HINT])
            except _transport.Closed:
                if hint[HINT]:  # the overflow still holds items (appended before close)
                    continue
                raise QueueClosed("the aiomp.Queue is closed and drained") from None
            except OSError:
                self._took()  # the message was consumed (and is lost): keep the counts true
                raise
            if got is None:
                if hint[HINT]:  # a producer overflowed meanwhile
                    continue
                return _MISSING
            self._took()
            data, fds = got
            if data[0] == _KIND_DATA:  # _transport.decode's common case, inlined
                return _load(memoryview(data)[1:], fds)
            _, body, fds = _transport.decode(data, fds)
            return _load(body, fds)

    def _when_unlocked(self, call: Callable[[], Any], deadline: float | None) -> Any:
        """``call()`` again each time the overflow's lock, found held, is free: its
        result, or _MISSING once ``deadline`` passes first. Blocks this thread: a blocking
        call's, or a ``*_nowait`` call's bounded wait."""
        while self._ovf.wait_unlocked(deadline):
            try:
                return call()
            except _Busy:
                pass
        return _MISSING

    def _recv_locked(self) -> _overflow.Popped | None:
        """The overflow's look at the socket, under its mutex: ``(body, fds, True)`` or
        None. The socket's items come first: they were put before the overflow's."""
        if self._ovf.socket_empty():
            return None
        try:
            got = _transport.try_recv(self._recv)
        except _transport.Closed:
            return None
        except OSError:
            self._took()
            raise
        if got is None:
            return None
        self._took()
        _, body, fds = _transport.decode(*got)
        return body, fds, True

    # One more item sent or received on the socket by this process (for qsize: a store in
    # shared memory, no syscall; see docs/decisions/0007-queue-counts.md).
    def _count_sent(self) -> None:
        if self._slot < 0:
            self._claim_slot()
        self._sent += 1
        U64.pack_into(self._hint, self._slot + _SENT, self._sent)

    def _took(self) -> None:
        if self._slot < 0:
            self._claim_slot()
        self._received += 1
        U64.pack_into(self._hint, self._slot + _RECEIVED, self._received)

    def _claim_slot(self) -> None:
        self._slot, self._sent, self._received = self._ovf.claim_slot()

    # -- async ----------------------------------------------------------------------
    def put(self, obj: object) -> Coroutine[Any, Any, None]:
        """Put ``obj`` (``await q.put(obj)``), waiting only while a bounded queue is full.

        Pickling errors raise here. On cancellation nothing has been put (while the
        queue's overflow lock is held elsewhere, the put waits for it on the loop).
        Raises :class:`~aiomp.QueueClosed` once the queue is closed, and RuntimeError at
        once (before any coroutine exists) where no event loop runs: use ``q.sync.put``.
        """
        aio = sys.modules.get("asyncio")  # _transport.running_asyncio_loop, inlined
        if (aio is None or aio._get_running_loop() is None) and not _loop.trio_running():
            raise _no_loop("Queue.put", "q.sync.put(obj)")
        return self._put(obj)

    async def _put(self, obj: object) -> None:
        try:
            if self._put_plain(obj):
                return
        except _Busy:
            pass  # the overflow's lock is held: the general path waits for it
        with _message(obj) as msg:
            turn = 0
            while True:
                try:
                    if self._try_put(msg):
                        return
                    fd = self._put_wait_fd(msg)
                except _Busy:
                    await _pause(turn)
                    turn += 1
                    continue
                if fd < 0:
                    return
                await self._waiters.wait(fd)

    def get(self) -> Coroutine[Any, Any, Any]:
        """Remove and return an item (``await q.get()``), waiting while the queue is empty.

        On cancellation nothing is taken (while the queue's overflow lock is held
        elsewhere, the get waits for it on the loop). Raises
        :class:`~aiomp.QueueClosed` once the queue is closed and drained,
        :class:`~aiomp.QueueItemError` for an item that cannot be rebuilt here, and
        RuntimeError at once where no event loop runs: use ``q.sync.get``.
        """
        aio = sys.modules.get("asyncio")  # _transport.running_asyncio_loop, inlined
        loop = None if aio is None else aio._get_running_loop()
        if loop is None and not _loop.trio_running():
            raise _no_loop("Queue.get", "q.sync.get()")
        return self._get(loop)

    async def _get(self, loop: asyncio.AbstractEventLoop | None) -> Any:
        """``loop``: the running asyncio loop, None on trio."""
        # Look before reading only if the last get had to wait: a poll costs less than an
        # empty read's exception, but is wasted where items are waiting (a busy consumer).
        busy = False
        try:
            item = self._try_get(peek=self._waited)
        except _Busy:
            item, busy = _MISSING, True
        if item is not _MISSING:
            self._waited = False
            return item
        self._waited = True
        turn = 0
        while item is _MISSING:
            if busy:  # the overflow's lock is held elsewhere: pause on the loop, try again
                await _pause(turn)
                turn += 1
            else:
                await self._wait_readable(self._wait_fd, loop)
            try:
                item = self._try_get()
                busy = False
            except _Busy:
                busy = True
        return item

    async def _wait_readable(self, fd: int, loop: asyncio.AbstractEventLoop | None) -> None:
        """Wait for ``fd`` (one of this queue's) to be readable, or for the task that
        waits on it here to wake. On asyncio and uvloop, straight on the reader kept for
        ``fd``, which wakes every task that waits; on trio one task waits on the fd and the
        others on it (see *One waiter per fd*). On cancellation nothing is taken; a
        cancelled task that waited on the fd on trio wakes the others (one takes over)."""
        if loop is None:
            # trio: the fan-out of FdWaiters, inlined (two coroutine frames and a second
            # look for the running loop less per wait; see
            # docs/decisions/0009-trio-wait-path.md). The first
            # task waits on the fd; the others on an event it sets when it wakes or is
            # cancelled, so that one of them takes over.
            waits = self._trio_waits
            key = (fd, _get_ident())
            if key in waits:
                event = waits[key]
                if event is None:
                    event = waits[key] = sys.modules["trio"].Event()
                await event.wait()
                return
            waits[key] = None
            try:
                await sys.modules["trio"].lowlevel.wait_readable(fd)
            finally:
                event = waits.pop(key)
                if event is not None:
                    event.set()
            return
        fut = _transport.kept_readable(loop, fd)
        if fut is None:
            await self._waiters.wait(fd)
            return
        try:  # _transport.wait_kept, inlined: a coroutine frame less per wait
            await fut
        finally:
            if fut.cancelled():
                _transport.drop_waiter(fd, fut)

    def put_nowait(self, obj: object) -> None:
        """Put ``obj`` at once. Raises :class:`aiomp.Full` if a bounded queue is full (or,
        unbounded, if the overflow cannot park any more fds: see the module docstring, or
        if its lock stays held elsewhere for NOWAIT_LOCK seconds)."""
        try:
            if self._put_plain(obj):
                return
        except _Busy:
            pass  # the general path waits for the lock
        msg = _message(obj)
        try:  # not `with`: this is the hot path of a producer that never waits
            try:
                put = self._try_put(msg)
            except _Busy:
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
        except _Busy:
            item = self._when_unlocked(self._try_get, time.monotonic() + NOWAIT_LOCK)
        if item is _MISSING:
            raise Empty
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while True:
            try:
                item = await self._get(_loop.running_asyncio_loop())
            except QueueClosed:
                return
            yield item


class SyncQueue:
    """The blocking side of a :class:`Queue`, for sync workers and threads (``q.sync``)."""

    __slots__ = ("_q",)

    def __init__(self, q: Queue) -> None:
        self._q = q

    def put(self, obj: object, timeout: float | None = None) -> None:
        """Put ``obj``, blocking only while a bounded queue is full (or the queue's
        overflow lock is held elsewhere); :class:`aiomp.Full` after ``timeout`` s."""
        q = self._q
        try:
            if q._put_plain(obj):
                return
        except _Busy:
            pass  # the general path waits for the lock
        deadline = None if timeout is None else time.monotonic() + timeout
        with _message(obj) as msg:
            while True:
                try:
                    if q._try_put(msg):
                        return
                    fd = q._put_wait_fd(msg)
                except _Busy:
                    if not q._ovf.wait_unlocked(deadline):
                        raise Full from None
                    continue
                if fd < 0:
                    return
                if not _transport.wait_fd_sync(fd, deadline=deadline):
                    raise Full

    def get(self, timeout: float | None = None) -> Any:
        """Remove and return an item, blocking while empty (or while the queue's overflow
        lock is held elsewhere); :class:`aiomp.Empty` after ``timeout`` s;
        :class:`aiomp.QueueClosed` once closed and drained."""
        q = self._q
        if timeout is None and not q._maxsize:
            # One blocking recvmsg: waking a process blocked in recvmsg costs far less
            # than waking one blocked in poll. (If an event loop somewhere made the
            # socket non-blocking, this returns at once and we poll below.)
            try:
                item = q._try_get(blocking=True)
            except _Busy:
                item = _MISSING
            if item is not _MISSING:
                return item
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = q._try_get()
            except _Busy:
                if not q._ovf.wait_unlocked(deadline):
                    raise Empty from None
                continue
            if item is not _MISSING:
                return item
            if not _transport.wait_fd_sync(q._wait_fd, deadline=deadline):
                raise Empty

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


def _load(body: bytes | memoryview, fds: list[int]) -> object:
    """Rebuild an item; one that cannot be rebuilt here is a QueueItemError, except a CuPy
    array this process cannot open, which is the CudaIpcError that aiomp.cuda promises."""
    try:
        # Without fds there is nothing for _reduction.loads to track: one call less.
        return _reduction.loads(body, fds) if fds else pickle.loads(body)
    except (QueueClosed, QueueItemError, CudaIpcError):
        raise
    except Exception as exc:
        names = ", ".join(_classes_in(body)) or "no classes"
        raise QueueItemError(
            f"an item taken from the queue could not be rebuilt in this process "
            f"({type(exc).__name__}: {exc}); it refers to {names}. The item is lost; the "
            f"queue goes on."
        ) from exc


def _classes_in(body: bytes | memoryview) -> list[str]:
    """The non-builtin classes and functions a pickle names, in order (for errors)."""
    import pickletools

    names: list[str] = []
    strings: list[str] = []
    memo: dict[int, str | None] = {}
    last: str | None = None
    try:
        for op, arg, _ in pickletools.genops(bytes(body)):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                last = str(arg)
                strings.append(last)
                continue
            if op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                # pickletools types every op's argument as one union; these carry an int.
                value = memo.get(int(arg))  # type: ignore[arg-type]
                if value is not None:
                    strings.append(value)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            last = None
    except Exception:  # noqa: BLE001 - best effort, for an error message
        pass
    seen = [n for n in dict.fromkeys(names) if not n.startswith(("builtins.", "copyreg."))]
    return seen[-5:]


def _check_exceptions(obj: object) -> None:
    """Raise at ``put`` if an exception in ``obj`` (itself, or directly inside a small
    tuple, list or dict) cannot be rebuilt from what it pickles as: the consumer would
    lose it. Cheap: other objects cost one isinstance check."""
    if isinstance(obj, BaseException):
        found: list[BaseException] = [obj]
    elif isinstance(obj, (tuple, list)) and len(obj) <= 16:
        found = [x for x in obj if isinstance(x, BaseException)]
    elif isinstance(obj, dict) and len(obj) <= 16:
        found = [x for x in obj.values() if isinstance(x, BaseException)]
    else:
        return
    for exc in found:
        try:
            rv = exc.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            if isinstance(rv, tuple) and callable(rv[0]):
                rv[0](*rv[1])
        except Exception as error:
            raise pickle.PicklingError(
                f"{type(exc).__module__}.{type(exc).__qualname__} pickles but cannot be "
                f"rebuilt from its args {exc.args!r} ({type(error).__name__}: {error}): the "
                "consumer would lose it. Pass every __init__ argument to "
                "super().__init__, or define __reduce__."
            ) from error


def _message(obj: object) -> _reduction.Message:
    """``obj`` pickled for the queue: errors (an exception that could not be rebuilt
    included) raise here, in the caller."""
    if type(obj) not in _reduction.PLAIN:
        _check_exceptions(obj)
    return _reduction.dumps(obj)


@finalizer
def _close_all(
    send: socket.socket, recv: socket.socket, ovf: _overflow.Overflow, *fds: int
) -> None:
    for fd in (recv.fileno(), *fds):
        _transport.forget(fd)
    send.close()
    recv.close()
    ovf.close()
    _transport.close_fds([fd for fd in fds if fd >= 0])


def _rebuild_queue(
    token: bytes, maxsize: int, send: int, recv: int, items: int, room: int, log: int
) -> Queue:
    existing = _live.get(token)
    if isinstance(existing, Queue):
        return existing  # the message's fds are closed by loads
    take = _reduction.take_fd
    q = Queue.__new__(Queue)
    q._setup(
        token,
        maxsize,
        socket.socket(fileno=take(send)),
        socket.socket(fileno=take(recv)),
        take(items) if maxsize else -1,
        take(room),
        take(log),
    )
    return q


class Event:
    """A cross-process event with ``threading.Event`` semantics: a ``set()`` wakes every
    waiter waiting at that moment, in every process, thread and loop, even if ``clear()``
    follows at once.

    ``await e.wait()`` waits on the event loop; ``e.sync.wait(timeout)`` blocks. The flag
    and a generation (changed by every ``set()``) live in shared memory; a waiter returns
    once the flag is set or the generation has changed since it began. Each thread that
    waits registers an eventfd of its own in the event's registry, and ``set()`` writes
    to every one registered: see docs/decisions/0032-event-wake-ups.md.
    """

    def __init__(self) -> None:
        state = os.memfd_create("aiomp-event", os.MFD_CLOEXEC)
        try:
            os.ftruncate(state, _STATE_SIZE)
            registry = _new_registry()
        except BaseException:
            os.close(state)
            raise
        self._setup(os.urandom(16), state, registry)

    def _setup(self, token: bytes, state_fd: int, registry: socket.socket) -> None:
        self._token = token
        self._state_fd = state_fd
        self._state = mmap.mmap(state_fd, _STATE_SIZE)
        self._registry = registry
        self._units = threading.local()  # each thread's _Wakers: .aio (its loop), .sync
        self.sync = SyncEvent(self)
        self._finalizer = weakref.finalize(self, _close_event, state_fd, self._state, registry)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        add = _reduction.add_fd
        return _rebuild_event, (self._token, add(self._state_fd), add(self._registry.fileno()))

    def __repr__(self) -> str:
        return f"<aiomp.Event {'set' if self.is_set() else 'unset'}>"

    def is_set(self) -> bool:
        return self._state[_FLAG] == 1

    def set(self) -> None:
        """Set the event; every waiter in every process wakes, even if ``clear()``
        follows at once."""
        state = self._state
        state[_FLAG] = 1
        state[_GEN:_GEN_END] = os.urandom(8)  # fresh, whoever else sets at the same time
        _wake_registered(self._registry, state)

    def clear(self) -> None:
        self._state[_FLAG] = 0

    def wait(self) -> Coroutine[Any, Any, None]:
        """Wait until the event is set (``await e.wait()``): return once it is set, or
        once a ``set()`` happened since the wait began, even if cleared since.
        Cancellation leaves the event as it was (this thread's registration may stay, and
        then serves its next wait). Raises RuntimeError at once where no event loop runs:
        use ``e.sync.wait``."""
        if not _loop_running():
            raise _no_loop("Event.wait", "e.sync.wait()")
        return self._wait()

    async def _wait(self) -> None:
        state = self._state
        begun = state[_GEN:_GEN_END]
        if state[_FLAG]:
            return
        # This thread's waker: its tasks are the only ones that wait on it, so every
        # task it wakes runs on this thread's loop (never an event of another loop).
        waker = self._waker("aio")
        registry = self._registry
        while True:
            armed = waker.arm(registry, state)
            if _fired(state, begun):
                return
            if not armed:  # the registry is full: a set() makes room
                await waker.waits.wait(registry.fileno(), write=True)
                continue
            await waker.waits.wait(waker.fd)
            waker.take()
            if _fired(state, begun):
                return

    def _waker(self, kind: str) -> _Waker:
        waker: _Waker | None = getattr(self._units, kind, None)
        if waker is None:
            waker = _Waker()
            setattr(self._units, kind, waker)
        return waker


class SyncEvent:
    """The blocking side of an :class:`Event` (``e.sync``)."""

    __slots__ = ("_e",)

    def __init__(self, e: Event) -> None:
        self._e = e

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or until a ``set()`` happened since the call (even if cleared
        since): True. False if ``timeout`` seconds pass first."""
        e = self._e
        state = e._state
        begun = state[_GEN:_GEN_END]
        if state[_FLAG]:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        waker = e._waker("sync")
        registry = e._registry
        while True:
            armed = waker.arm(registry, state)
            if _fired(state, begun):
                return True
            if armed:
                if not _transport.wait_fd_sync(waker.fd, deadline=deadline):
                    return _fired(state, begun)
                waker.take()
            elif not _transport.wait_fd_sync(registry.fileno(), write=True, deadline=deadline):
                return _fired(state, begun)
            if _fired(state, begun):
                return True


# An Event's shared state: the flag (1 while set), then the generation, 8 random bytes
# that every set() replaces (random, not counted: two processes setting at once need no
# lock to each write a value no waiter has seen).
_FLAG = 0
_GEN = 8
_GEN_END = 16
_STATE_SIZE = 16
_REGISTRATION = 16  # a registration's body: the waker's id, then the generation it saw
_REGISTRATION_FDS = socket.CMSG_SPACE(4)
_RECV_FLAGS = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
_PEEK_FLAGS = _RECV_FLAGS | socket.MSG_PEEK


def _fired(state: mmap.mmap, begun: bytes) -> bool:
    """Whether a wait that began at generation ``begun`` is over."""
    return state[_FLAG] == 1 or state[_GEN:_GEN_END] != begun


def _new_registry() -> socket.socket:
    """A datagram socket connected to itself: what one holder sends, any holder receives,
    and no other socket may send to it (the kernel refuses a foreign sender of a socket
    that is connected, with EPERM). Its name is an abstract one the kernel picks."""
    registry = socket.socket(
        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
    )
    try:
        registry.bind("")
        registry.connect(registry.getsockname())
    except BaseException:
        registry.close()
        raise
    return registry


class _Waker:
    """One thread's wake-up for one Event (one for its loop's tasks, one for ``e.sync``).

    Registering sends the waker's eventfd, with the generation seen, into the event's
    registry; a ``set()`` takes each registration made before its own generation and
    writes to the eventfd. Tasks of one thread share the waker: one waits on the eventfd,
    the others for it (:class:`~aiomp._loop.fdwait.FdWaiters`), all on that thread's loop.
    """

    __slots__ = ("__weakref__", "fd", "id", "parked", "waits")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, _EFD)
        self.id = os.urandom(8)
        self.parked = b""  # the generation in this waker's registration, b"" if none
        self.waits = FdWaiters(_transport.wait_readable)
        weakref.finalize(self, _close_waker, self.fd)

    def arm(self, registry: socket.socket, state: mmap.mmap) -> bool:
        """Make sure that a registration of this waker, sent after the event's current
        generation was written, waits in ``registry``; False if the registry is full.
        The waiter reads the generation again after this: any ``set()`` then either
        writes a generation the waiter sees or finds the registration."""
        gen = state[_GEN:_GEN_END]
        if self.parked == gen:
            return True  # no set() since it was sent: it still waits there
        # A set() since: the registration was taken (and written to), or is about to be.
        _eventfd_take(self.fd)
        try:
            registry.sendmsg(
                [self.id + gen],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, self.fd.to_bytes(4, sys.byteorder))],
                socket.MSG_DONTWAIT,
            )
        except BlockingIOError:
            return False
        self.parked = gen
        return True

    def take(self) -> None:
        """After a wake-up: a write to the eventfd means the registration was taken."""
        if _eventfd_take(self.fd):
            self.parked = b""


def _wake_registered(registry: socket.socket, state: mmap.mmap) -> None:
    """Write to the waker of every registration made before the current generation.

    Registrations queue in the order sent, and one made after the current generation was
    written has its waiter see that generation (it reads it after registering): so the
    first such registration ends the walk, and everything behind it stays for the next
    ``set()``. The walk is bounded by the registrations already there. Each registration is
    written to before it is taken: a setter killed in between leaves it for the next
    ``set()`` (a spurious wake-up at worst). Another setter may take the head first: what
    this one then takes is written to as well.
    """
    while True:
        head = _registration(registry, _PEEK_FLAGS)
        if head is None:
            return
        body, fd = head
        if body[8:] == state[_GEN:_GEN_END]:
            _transport.close_fds([fd])
            return
        _write_and_close(fd)
        taken = _registration(registry, _RECV_FLAGS)
        if taken is None:
            return
        if taken[0][:8] != body[:8]:  # not the same waker's
            _write_and_close(taken[1])
        else:
            _transport.close_fds([taken[1]])


def _registration(registry: socket.socket, flags: int) -> tuple[bytes, int] | None:
    """The registry's first registration (its body and a new fd for its waker), taken or
    peeked at; None if there is none."""
    try:
        body, anc, _, _ = registry.recvmsg(_REGISTRATION, _REGISTRATION_FDS, flags)
    except BlockingIOError:
        return None
    fds = _transport.fds_in(anc)
    _transport.close_fds(fds[1:])
    return body, (fds[0] if fds else -1)


def _write_and_close(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.eventfd_write(fd, 1)
    except OSError:
        pass  # the counter is full: the waker is awake already
    finally:
        os.close(fd)


@finalizer
def _close_waker(fd: int) -> None:
    _transport.forget(fd)
    os.close(fd)


@finalizer
def _close_event(state_fd: int, state: mmap.mmap, registry: socket.socket) -> None:
    state.close()
    registry.close()
    os.close(state_fd)


def _rebuild_event(token: bytes, state_fd: int, registry: int) -> Event:
    existing = _live.get(token)
    if isinstance(existing, Event):
        return existing  # the message's fds are closed by loads
    take = _reduction.take_fd
    e = Event.__new__(Event)
    e._setup(token, take(state_fd), socket.socket(fileno=take(registry)))
    return e


def _after_fork_in_child() -> None:
    # A forked child counts in a slot of its own (claimed with its pid on first use).
    # An Event's wakers are the parent's: their eventfds are shared with it, and a set()
    # writing to one would wake whichever process read it first. Fresh ones on first use.
    for obj in list(_live.values()):
        if isinstance(obj, Queue):
            obj._slot = -1
        elif isinstance(obj, Event):
            obj._units = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)

for _cls in (Queue, Event, SyncQueue, SyncEvent):
    _cls.__module__ = "aiomp"
