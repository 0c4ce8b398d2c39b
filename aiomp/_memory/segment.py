"""A shared segment as this process sees it: its fd, its one mapping, its header page.

A *segment* is a shared file (a memfd, or a name under ``/dev/shm``) cut into equal
*blocks* after a header page, one array per block. :class:`Segment` owns the segment's fd
in this process (closed by :meth:`Segment.close` or when it is collected) and
:class:`SharedMapping` owns the mapping (unmapped once the segment and every view of its
memory are gone). Under ``file_system`` the header page counts, per block, the references
sent and opened, and names the creator and its process tree (see :mod:`.janitor`).

A *child* module.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

from .._loop.finalizers import finalizer
from . import lease as _lease

PAGE = mmap.PAGESIZE
#: The header page: byte 0 is the lock that guards it; then who made the name and its
#: tree (file_system); from COUNTERS on, per block, the references sent and opened.
HEADER = PAGE
H_CREATOR = 8  # pid (4 bytes), then at 16 its start time (8 bytes)
H_TREE = 24  # the tree's root: pid (4 bytes), then at 32 its start time (8 bytes)
H_FLAGS = 40
ABANDONED = 1  # in H_FLAGS: the creator has let go of the name (exited, or gave it away)
COUNTERS = 64

# Threads of this process share one description of a segment, and OFD locks of one
# description never conflict: the counters' read-modify-write also takes this lock.
_counter_lock = threading.RLock()

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class SharedMapping:
    """A shared mapping that holds no fd (Python's ``mmap`` would keep a dup of it).

    Unmapped when the last reference goes: its segment's, and each exporter's (a view
    of the memory must never outlive it).
    """

    __slots__ = ("__weakref__", "address", "size")

    def __init__(self, fd: int, size: int, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map a shared segment: {os.strerror(err)}")
        self.address: int = address
        self.size = size
        weakref.finalize(self, _libc.munmap, address, size)


class Segment:
    """One shared file mapped in this process, with this process's own description.

    ``owned``: this process created it and its pool hands out its blocks.
    """

    def __init__(
        self, fd: int, size: int, block_size: int, name: str | None, owned: bool, populate: bool
    ) -> None:
        self.mapping: SharedMapping | None = SharedMapping(fd, size, populate)
        self.address = self.mapping.address
        self.fd = fd
        self.size = size
        self.block_size = block_size
        self.nblocks = (size - HEADER) // block_size
        self.name = name
        self.owned = owned
        self.key = _lease.identity(fd)
        # owner bookkeeping: per block 0 free, 1 held here, 2 retired (maybe held elsewhere)
        self.state = bytearray(self.nblocks)
        self.dirty = bytearray(self.nblocks)
        self.live = 0  # blocks not free
        self.held = 0  # blocks in state 1: this process has arrays in them
        self.inherited = False  # set in a forked child: the parent's, not ours to touch
        self._bytes: memoryview | None = None
        self._finalizer = weakref.finalize(self, _close_fd, fd)

    def bytes(self) -> memoryview:
        """The whole mapping as bytes, made once per segment (copies into its blocks).

        Only while the segment is open: :meth:`close` drops it with the mapping."""
        view = self._bytes
        if view is None:
            whole = (ctypes.c_char * self.size).from_address(self.address)
            view = self._bytes = memoryview(whole).cast("B")
        return view

    def offset(self, index: int) -> int:
        return HEADER + index * self.block_size

    # file_system: a message names a block without holding it, so the header counts, for
    # each block, the references sent and the references rebuilt ("opens"). A block whose
    # opens have caught up with its sends, and that nobody holds, has nothing in flight.
    # Read-modify-write happens under an OFD write lock on byte 0 (robust: a holder that
    # dies releases it), plus the counter lock for threads sharing our description.
    def counters(self, index: int) -> tuple[int, int]:
        at = self.address + COUNTERS + index * 8
        with _counter_lock, _lease.exclusive(self.fd, 0, 1):
            raw = ctypes.string_at(at, 8)
        return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:], "little")

    def count(self, index: int, sends: int = 0, opens: int = 0, reset: bool = False) -> None:
        at = self.address + COUNTERS + index * 8
        with _counter_lock, _lease.exclusive(self.fd, 0, 1):
            if reset:
                ctypes.memset(at, 0, 8)
                return
            raw = ctypes.string_at(at, 8)
            s = int.from_bytes(raw[:4], "little") + sends
            o = int.from_bytes(raw[4:], "little") + opens
            ctypes.memmove(at, max(s, 0).to_bytes(4, "little") + max(o, 0).to_bytes(4, "little"), 8)
        if sends > 0:
            os.utime(self.fd)  # the janitor's clock for messages that are never read

    def in_flight(self, index: int) -> bool:
        sends, opens = self.counters(index)
        return opens < sends

    def close(self) -> None:
        """Close the fd now; the memory is unmapped once no array of it is left."""
        self._bytes = None
        self.mapping = None
        self._finalizer()


@finalizer
def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _after_fork_in_child() -> None:
    global _counter_lock
    _counter_lock = threading.RLock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)
