"""The overflow log's process-shared robust mutex (in the log's header page), through
ctypes, loaded on first use: a child that never overflows a queue never imports ctypes.

Owns no OS resource (the header's mapping is the log's); a :class:`Mutex` pins the
mapping while it lives. Only ever *tried* by an operation: found held, the operation
raises :class:`Busy` having done nothing, and its caller waits its own way. A *child*
module.
"""

from __future__ import annotations

import errno
import mmap
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PAGE = mmap.PAGESIZE
_MUTEX = 128  # its offset in the header page: a pthread_mutex_t (40 bytes on x86_64)
#: How long one timed wait for the mutex lasts: a blocking wait is a series of these, so
#: that this thread's signal handlers (Ctrl-C) run between them.
_WAIT_SLICE = 0.05


class Busy(Exception):
    """The overflow's mutex is held by another thread or process: nothing was done. The
    caller waits for it (:meth:`Mutex.wait`, or on its loop) and tries again."""


class Mutex:
    """The header's process-shared robust mutex, called through ctypes (loaded on first
    use: a child that never overflows a queue never imports ctypes)."""

    __slots__ = ("_anchor", "addr", "trylock", "unlock")

    _libc: Any = None
    _timespec: Any = None  # a struct timespec type, for pthread_mutex_clocklock

    def __init__(self, header: mmap.mmap) -> None:
        import ctypes

        if Mutex._libc is None:
            Mutex._libc = ctypes.CDLL(None, use_errno=True)
            fields = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
            Mutex._timespec = type("timespec", (ctypes.Structure,), {"_fields_": fields})
        libc: Any = Mutex._libc
        self._anchor = (ctypes.c_char * PAGE).from_buffer(header)  # pins the mapping
        # A ready-made argument: ctypes converts nothing per call.
        self.addr = ctypes.c_void_p(ctypes.addressof(self._anchor) + _MUTEX)
        self.trylock = libc.pthread_mutex_trylock
        self.unlock = libc.pthread_mutex_unlock

    def init(self) -> None:
        import ctypes

        libc: Any = Mutex._libc
        attr = ctypes.create_string_buffer(64)  # a pthread_mutexattr_t is 4 bytes
        check(libc.pthread_mutexattr_init(attr))
        check(libc.pthread_mutexattr_setpshared(attr, 1))  # PTHREAD_PROCESS_SHARED
        check(libc.pthread_mutexattr_setrobust(attr, 1))  # PTHREAD_MUTEX_ROBUST
        check(libc.pthread_mutex_init(self.addr, attr))

    def acquire(self) -> None:
        """Take the mutex, blocking this thread while another holds it (in short waits:
        signal handlers run in between, so Ctrl-C interrupts it)."""
        while True:
            try:
                if rc := self.trylock(self.addr):
                    self.recover(rc)
                return
            except Busy:
                self.wait(None)

    def wait(self, deadline: float | None) -> bool:
        """Block this thread until the mutex is free (taken and given back at once), or
        until ``deadline`` (a ``time.monotonic()``) passes: False then. Waits in slices of
        _WAIT_SLICE, so that signal handlers run in between."""
        import ctypes
        import time

        clocklock: Any = Mutex._libc.pthread_mutex_clocklock
        when: Any = Mutex._timespec()
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            end = now + _WAIT_SLICE if deadline is None else min(deadline, now + _WAIT_SLICE)
            when.tv_sec, when.tv_nsec = int(end), int(end % 1 * 1e9)
            rc = clocklock(self.addr, time.CLOCK_MONOTONIC, ctypes.byref(when))
            if rc == errno.ETIMEDOUT:
                continue
            if rc not in (0, errno.EOWNERDEAD):
                check(rc)
            try:  # held now: give it straight back, marked consistent if its holder died
                if rc:
                    self.recover(rc)
            finally:
                self.release()
            return True

    def recover(self, rc: int) -> None:
        """After a lock call returned ``rc`` (not 0): raise :class:`Busy` if the mutex is
        held, take over the mutex of a holder that died, or raise OSError."""
        if rc == errno.EBUSY:
            raise Busy
        if rc == errno.EOWNERDEAD:
            # Its holder died. The log is consistent at every instruction (see *Queue
            # overflow* in docs/reliability.md): only the mutex needs marking so.
            libc: Any = Mutex._libc
            rc = libc.pthread_mutex_consistent(self.addr)
        check(rc)

    def release(self) -> None:
        if rc := self.unlock(self.addr):
            check(rc)

    def detach(self) -> None:
        # Typed for the live object; None only after detach, when nothing reads it again.
        self._anchor = None  # type: ignore[assignment]


def check(rc: int) -> None:
    """Raise OSError for a pthread call's nonzero return."""
    if rc:
        raise OSError(rc, f"the queue overflow's mutex: {os.strerror(rc)}")
