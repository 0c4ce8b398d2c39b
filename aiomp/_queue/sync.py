"""The blocking side of a queue (``q.sync``), for sync workers and threads.

Owns no OS resource: it blocks in the kernel on the queue's socket and eventfds (a
blocking ``recvmsg`` where it can: waking a process blocked there costs far less than
waking one blocked in ``poll``). A *child* module.
"""

from __future__ import annotations

import queue as _stdqueue
import time

from .._errors import QueueClosedError
from .._wire.datagram import wait_fd_sync
from .core import BUSY, PUT
from .items import MISSING, message
from .mutex import Busy

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving a queue skip typing
if TYPE_CHECKING:
    from typing import Any

    from .queue import Queue


def no_loop(call: str, sync_call: str) -> RuntimeError:
    """The error of an async call made where no event loop runs: it names the sync one."""
    return RuntimeError(
        f"{call} is a coroutine and no event loop runs in this thread; in sync code (a "
        f"sync worker, a thread) call {sync_call} instead"
    )


class SyncQueue:
    """The blocking side of a :class:`Queue`, for sync workers and threads (``q.sync``)."""

    __slots__ = ("_q",)

    def __init__(self, q: Queue) -> None:
        self._q = q

    def put(self, obj: object, timeout: float | None = None) -> None:
        """Put ``obj``, blocking only while a bounded queue is full (or the queue's
        overflow lock is held elsewhere); :class:`aiomp.Full` after ``timeout`` s."""
        q = self._q
        if q._put_plain(obj):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with message(obj) as msg:
            while (fd := q._put_step(msg)) != PUT:
                if fd == BUSY:
                    if not q._ovf.wait_unlocked(deadline):
                        raise _stdqueue.Full from None
                elif not wait_fd_sync(fd, deadline=deadline):
                    raise _stdqueue.Full

    def get(self, timeout: float | None = None) -> Any:
        """Remove and return an item, blocking while empty (or while the queue's overflow
        lock is held elsewhere); :class:`aiomp.Empty` after ``timeout`` s;
        :class:`aiomp.QueueClosedError` once closed and drained."""
        q = self._q
        if timeout is None and not q._maxsize:
            # One blocking recvmsg: waking a process blocked in recvmsg costs far less
            # than waking one blocked in poll. (If an event loop somewhere made the
            # socket non-blocking, this returns at once and we poll below.)
            try:
                item = q._try_get(blocking=True)
            except Busy:
                item = MISSING
            if item is not MISSING:
                return item
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = q._try_get()
            except Busy:
                if not q._ovf.wait_unlocked(deadline):
                    raise _stdqueue.Empty from None
                continue
            if item is not MISSING:
                return item
            if not wait_fd_sync(q._wait_fd, deadline=deadline):
                raise _stdqueue.Empty

    def __iter__(self) -> Any:
        while True:
            try:
                yield self.get()
            except QueueClosedError:
                return
