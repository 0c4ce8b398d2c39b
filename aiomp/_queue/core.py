"""The non-waiting core of a :class:`~aiomp.Queue`: put and get now, on the socket or
through the overflow log, and this process's counts of the socket's items.

The queue's sockets, eventfds and overflow are owned by the :class:`~aiomp.Queue` that
holds this core (:mod:`aiomp._queue.queue`); this module owns no OS resource. Every call
here returns at once or raises :class:`~aiomp._queue.overflow.Busy` (the overflow's lock
is held elsewhere) having done nothing: waiting is the async side's, or ``q.sync``'s. A
*child* module.
"""

from __future__ import annotations

import os
import pickle

from .._errors import QueueClosedError
from .._wire import datagram as _datagram
from .._wire.pickling import PLAIN as _PLAIN
from .items import MISSING, load
from .mutex import Busy
from .overflow import HINT, RECEIVED, SENT, U64, take_token

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving a queue skip typing
if TYPE_CHECKING:
    import mmap
    import socket
    from collections.abc import Callable
    from typing import Any

    from .._wire.pickling import Message
    from .overflow import Overflow, Popped

_KIND_DATA = _datagram.KIND_DATA
_DATA = bytes((_KIND_DATA,))
_NO_FDS: list[int] = []  # never mutated
_SEND_FLAGS = _datagram.SEND_FLAGS
_SENT = SENT
_RECEIVED = RECEIVED


#: What :meth:`QueueCore._put_step` returns once the item is in, and while the overflow's
#: lock is held elsewhere (an fd is never negative).
PUT, BUSY = -1, -2


class QueueCore:
    """A queue's state in this process, and the calls that never wait (see the module
    docstring). :class:`~aiomp.Queue` sets every attribute in its ``_setup``."""

    _maxsize: int
    _send: socket.socket
    _recv: socket.socket
    _items: int  # bounded: consumers' tokens (an eventfd); unbounded: -1
    _room: int  # an eventfd written when an item that frees room is taken
    _ovf: Overflow
    _hint: mmap.mmap  # the overflow's header: byte HINT is 0 only while it is empty
    _look: Callable[[int], list[tuple[int, int]]]  # the overflow's look at the socket
    _used_socket: bool  # sent on the socket since this process last overflowed
    _slot: int  # this process's slot of socket counts (-1 until claimed)
    _sent: int
    _received: int

    def _send_now(self, datagram: bytes, fds: list[int]) -> bool:
        """Send on the socket if its buffer has room: True if sent."""
        try:
            sent = _datagram.try_send(self._send, datagram, fds)
        except _datagram.Closed:
            raise QueueClosedError("put on a closed aiomp.Queue") from None
        if sent:
            self._count_sent()
        self._used_socket = True  # the overflow's order needs to know (see _overflow)
        return sent

    def _put_plain(self, obj: object) -> bool:
        """Put a plain item (bytes, str, a number: no reducer, no fd, no exception) of an
        unbounded queue: on the socket, or behind the overflow's items, without a Message.
        True if put. False: not plain, a bounded queue, too large for a datagram, or the
        overflow's lock held elsewhere; nothing is put then, and the caller takes the
        general path (which waits for the lock). The general path's
        work, without its objects (see docs/decisions/0008-queue-fast-path.md)."""
        if type(obj) not in _PLAIN or self._maxsize:
            return False
        body = pickle.dumps(obj, 5)
        if len(body) >= _datagram.MAX_INLINE:
            return False
        if not self._hint[HINT]:
            # hot path: tests/budgets
            self._used_socket = True
            try:
                self._send.send(_DATA + body, _SEND_FLAGS)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise QueueClosedError("put on a closed aiomp.Queue") from None
            else:
                self._count_sent()
                return True
        used, self._used_socket = self._used_socket, False
        try:
            return self._ovf.append(
                body, _NO_FDS, lambda: self._send_now(_DATA + body, _NO_FDS), used
            )
        except Busy:  # the overflow's lock is held: the general path waits for it
            self._restore_used(used)
            return False

    def _try_put(self, msg: Message) -> bool:
        """Put if there is room: True if put (socket or overflow).

        False: a bounded queue is full, or the overflow cannot park the item's fds now;
        wait on ``_room``. Raises QueueClosedError (or TransportError), or Busy (the
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
        except Busy:
            self._restore_used(used)
            raise

    def _restore_used(self, used: bool) -> None:
        """An append found the overflow's lock held: the flag it was to pass on stays
        with this process. Only ever set again (another thread may have set it since)."""
        if used:
            self._used_socket = True

    def _put_step(self, msg: Message) -> int:
        """One try of a put that may wait: :data:`PUT` once ``msg`` is in, :data:`BUSY`
        while the overflow's lock is held elsewhere (wait for it), else the fd to wait on
        before the next try. The async and the sync put differ only in how they wait."""
        try:
            if self._try_put(msg):
                return PUT
            return self._put_wait_fd(msg)
        except Busy:
            return BUSY

    def _put_wait_fd(self, msg: Message) -> int:
        """After a failed put: the fd to wait on, or :data:`PUT` if a retry just succeeded."""
        # Reset ``room`` first and try once more, so that a get between the failed put
        # and the wait is not missed.
        take_token(self._room)
        if self._try_put(msg):
            return PUT
        return self._room

    def _try_get(self, blocking: bool = False, peek: bool = False) -> object:
        """An item, or MISSING. ``peek``: look with ``poll`` before reading, so that an
        empty socket costs no exception (a get about to wait usually finds it empty).
        Raises Busy (nothing taken) while the overflow's lock is held elsewhere."""
        if self._maxsize:
            popped = self._ovf.pop(None, self._items, self._room)
            if popped is None:
                if self._ovf.closed():
                    raise QueueClosedError("the aiomp.Queue is closed and drained")
                return MISSING
            return load(popped[0], popped[1])
        hint = self._hint
        while True:
            if hint[HINT]:
                popped = self._ovf.pop(self._recv_locked)
                if popped is not None:
                    body, fds, from_socket = popped
                    if fds and not from_socket:
                        os.eventfd_write(self._room, 1)  # the vault has room again
                    return load(body, fds)
            if peek and not hint[HINT]:
                try:
                    if not self._look(0):  # hot path: tests/budgets
                        return MISSING
                except RuntimeError:  # another thread polls it now (issue 25 item 8)
                    if self._ovf.socket_empty():
                        return MISSING
            # Blocking in recvmsg is safe only while the overflow is empty: it becomes
            # non-empty only when the socket is full, which wakes this recvmsg.
            try:
                got = _datagram.try_recv(self._recv, blocking and not hint[HINT])
            except _datagram.Closed:
                if hint[HINT]:  # the overflow still holds items (appended before close)
                    continue
                raise QueueClosedError("the aiomp.Queue is closed and drained") from None
            except OSError:
                self._took()  # the message was consumed (and is lost): keep the counts true
                raise
            if got is None:
                if hint[HINT]:  # a producer overflowed meanwhile
                    continue
                return MISSING
            self._took()
            data, fds = got
            if data[0] == _KIND_DATA:  # hot path: tests/budgets
                return load(memoryview(data)[1:], fds)
            _, body, fds = _datagram.decode(data, fds)
            return load(body, fds)

    def _when_unlocked(self, call: Callable[[], Any], deadline: float | None) -> Any:
        """``call()`` again each time the overflow's lock, found held, is free: its
        result, or MISSING once ``deadline`` passes first. Blocks this thread: a blocking
        call's, or a ``*_nowait`` call's bounded wait."""
        while self._ovf.wait_unlocked(deadline):
            try:
                return call()
            except Busy:
                pass
        return MISSING

    def _recv_locked(self) -> Popped | None:
        """The overflow's look at the socket, under its mutex: ``(body, fds, True)`` or
        None. The socket's items come first: they were put before the overflow's."""
        if self._ovf.socket_empty():
            return None
        try:
            got = _datagram.try_recv(self._recv)
        except _datagram.Closed:
            return None
        except OSError:
            self._took()
            raise
        if got is None:
            return None
        self._took()
        _, body, fds = _datagram.decode(*got)
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
