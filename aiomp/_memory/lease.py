"""Cross-process reference counts that the kernel keeps: open-file-description byte locks.

A *lease* on a byte range of a file is an OFD read lock (``F_OFD_SETLK``) on that range,
held through an open file description of the holder's own. The owner of the file asks
"does anyone else hold this range?" with ``F_OFD_GETLK`` for a write lock: the kernel
answers from every description in the system. A process that dies, SIGKILL included,
loses its locks when its descriptions close, so the count can never leak, and no shared
counter needs atomic operations.

Two descriptions are needed because locks of one description never conflict with each
other, and an fd passed with ``SCM_RIGHTS`` shares its sender's description. So:

- the owner keeps its own description (``fd``) and only ever *tests* ranges with it;
- a message that hands a range on carries a fresh description (:func:`handoff_fd`) that
  already holds the lease, so the range stays held while the message is in flight, even
  if the sender exits before anyone receives it;
- a receiver takes its own lease with its own per-file description (:class:`Holder`),
  then closes the message's description.

Used for shared-memory blocks (the segment itself is the file) and for CUDA IPC blocks
(a small lease file per producer): the owner reuses a block only when no lease is found
(docs/decisions/0010-kernel-leases.md). A *child* module: the standard library only.
"""

from __future__ import annotations

import fcntl
import os
import struct

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86_64/aarch64
_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)


def _lock(fd: int, cmd: int, kind: int, start: int, length: int) -> bytes:
    return fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))


def hold(fd: int, start: int, length: int) -> None:
    """Take a lease on ``[start, start+length)`` through description ``fd``."""
    _lock(fd, _SETLK, fcntl.F_RDLCK, start, length)


def release(fd: int, start: int, length: int) -> None:
    """Drop this description's lease on the range."""
    _lock(fd, _SETLK, fcntl.F_UNLCK, start, length)


def is_held(fd: int, start: int, length: int) -> bool:
    """True if any *other* description holds a lease overlapping the range."""
    return a_holder(fd, start, length) is not None


def a_holder(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """``(start, length)`` of one lease that another description holds in the range, or None.

    ``F_OFD_GETLK`` names one conflicting lock, not necessarily the lowest; a length of 0
    means "to the end of the file".
    """
    kind, _whence, lstart, llength, _pid = _FLOCK.unpack(
        _lock(fd, _GETLK, fcntl.F_WRLCK, start, length)
    )
    return None if kind == fcntl.F_UNLCK else (lstart, llength)


class exclusive:
    """``with exclusive(fd, start, length):`` a blocking OFD write lock on the range.

    A cross-process mutex the kernel releases if its holder dies. Threads that share a
    description share the lock: guard against them separately. With ``wait=False``,
    entering raises :class:`BlockingIOError` at once if another description holds it.
    """

    __slots__ = ("fd", "length", "start", "wait")

    def __init__(self, fd: int, start: int, length: int, wait: bool = True) -> None:
        self.fd, self.start, self.length, self.wait = fd, start, length, wait

    def __enter__(self) -> None:
        _lock(self.fd, _SETLKW if self.wait else _SETLK, fcntl.F_WRLCK, self.start, self.length)

    def __exit__(self, *exc: object) -> None:
        _lock(self.fd, _SETLK, fcntl.F_UNLCK, self.start, self.length)


def reopen(fd: int) -> int:
    """A new open file description of the same file (close-on-exec)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def handoff_fd(fd: int, ranges: list[tuple[int, int]]) -> int:
    """A fresh description holding leases on ``ranges``, to send in a message.

    The caller sends it and then closes its copy; the leases live as long as any process
    (or an in-flight message) holds that description.
    """
    new = reopen(fd)
    try:
        for start, length in ranges:
            hold(new, start, length)
    except BaseException:
        os.close(new)
        raise
    return new


def identity(fd: int) -> tuple[int, int]:
    """(device, inode): the same file however many fds point at it."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
