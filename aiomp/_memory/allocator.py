"""The segments this process creates, and the pool that lends their blocks out again.

Owns the idle segments of this process: a segment with no array of this process in it
stays open (one fd) for reuse, at most :data:`IDLE_SEGMENTS` of them and
:data:`POOL_LIMIT` bytes; past that the oldest is given away (closed here; blocks still
held elsewhere stay valid, since the kernel frees a memfd with its last holder and the
last user of an abandoned name removes it). Segments are allocated in full up front and
pre-faulted, so a block costs no page fault when it is filled.

Small blocks (up to :data:`LARGEST_SMALL`, powers of two from :data:`SMALLEST`) share
:data:`SLAB`-byte segments; a larger array has a segment of its own, rounded up to
:data:`LARGE_ROUND`. A block is reused once its creator's own views are gone (it is
*retired*) and the kernel reports no lease on it, nor, under ``file_system``, a reference
in flight.

A *child* module.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from typing import TYPE_CHECKING

from .._errors import SharedMemoryError
from . import lease as _lease
from . import strategy as _strategy
from .fdlimit import open_fd
from .janitor import PREFIX, SHM_DIR, first_segment, header_identity, remove_if_orphan, unlink
from .segment import H_CREATOR, HEADER, Segment

if TYPE_CHECKING:
    import threading
    import weakref

SLAB = 8 << 20
SMALLEST = 64 << 10
LARGEST_SMALL = 1 << 20
LARGE_ROUND = 2 << 20
#: Bytes of idle pooled segments a process keeps for reuse.
POOL_LIMIT = 1 << 30
#: Segments with no array of this process in them that a process keeps (one fd each);
#: past that the oldest is given away.
IDLE_SEGMENTS = 32
_MAX_RETIRED_CHECKS = 64


def block_size_for(nbytes: int) -> int:
    if nbytes <= LARGEST_SMALL:
        size = SMALLEST
        while size < nbytes:
            size <<= 1
        return size
    return -(-nbytes // LARGE_ROUND) * LARGE_ROUND


class SegmentPool:
    """The segments this process created, their free and retired blocks, and the idle ones.

    Every method runs under ``lock`` (the registry's); ``index`` is the registry's map of
    segments by key, where the pool enters the segments it makes and removes those it
    gives away.
    """

    def __init__(
        self, lock: threading.RLock, index: weakref.WeakValueDictionary[tuple[int, int], Segment]
    ) -> None:
        self.lock = lock
        self.index = index
        # keyed by (named, block size): a strategy switch applies to new arrays at once
        self.segments: dict[tuple[bool, int], list[Segment]] = {}
        self.free: dict[tuple[bool, int], list[tuple[Segment, int]]] = {}
        self.retired: dict[tuple[bool, int], deque[tuple[Segment, int]]] = {}
        # segments with no array of this process in them, oldest first (bounded)
        self.idle: dict[Segment, None] = {}
        #: The names this process created and has not let go of (file_system).
        self.named: set[str] = set()
        # >0 while the lists above are being walked: an array dying meanwhile (its
        # finalizer runs retire, in this thread) must not give segments away then
        self.busy = 0

    def lend(self, nbytes: int) -> tuple[Segment, int]:
        """A block held here with no exporter: the caller fills it and then calls
        :meth:`retire` on it (the one way out, errors included)."""
        with self.lock:
            self.busy += 1
            try:
                segment, index = self.take(nbytes)
                segment.dirty[index] = 1
                return segment, index
            finally:
                self.busy -= 1
                self.bound()

    def take(self, nbytes: int) -> tuple[Segment, int]:
        """A block of at least ``nbytes`` bytes, held here (with ``busy`` raised)."""
        bs = (_strategy.current == "file_system", block_size_for(max(nbytes, 1)))
        found = self._take_free(bs) or self._take_retired(bs)
        if found is None:
            segment = self._new_segment(bs)
            for i in range(segment.nblocks - 1, 0, -1):
                self.free.setdefault(bs, []).append((segment, i))
            found = (segment, 0)
        segment, index = found
        segment.state[index] = 1
        segment.live += 1
        self._hold(segment)
        if segment.name is not None:
            segment.count(index, reset=True)
        return segment, index

    def _hold(self, segment: Segment) -> None:
        segment.held += 1
        self.idle.pop(segment, None)

    def _take_free(self, bs: tuple[bool, int]) -> tuple[Segment, int] | None:
        free = self.free.get(bs)
        return free.pop() if free else None

    def _reusable(self, segment: Segment, index: int) -> bool:
        if segment.state[index] != 2:
            return False
        if segment.name is not None and segment.in_flight(index):
            return False
        return not _lease.is_held(segment.fd, segment.offset(index), segment.block_size)

    def _take_retired(self, bs: tuple[bool, int]) -> tuple[Segment, int] | None:
        retired = self.retired.get(bs)
        if not retired:
            return None
        for _ in range(min(len(retired), _MAX_RETIRED_CHECKS)):
            segment, index = retired.popleft()
            if segment.state[index] != 2:
                continue  # reclaimed meanwhile
            if self._reusable(segment, index):
                segment.live -= 1
                return segment, index
            retired.append((segment, index))
        return None

    def retire(self, segment: Segment, index: int) -> None:
        """The last array of this process in a block of ours has gone."""
        segment.state[index] = 2
        key = (segment.name is not None, segment.block_size)
        self.retired.setdefault(key, deque()).append((segment, index))
        segment.held -= 1
        if segment.held == 0:
            self.idle[segment] = None
            if not self.busy:
                self.bound()

    def bound(self) -> None:
        """Give away the oldest idle segments past :data:`IDLE_SEGMENTS`."""
        while len(self.idle) > IDLE_SEGMENTS:
            self.forget(next(iter(self.idle)))

    def reclaim(self, segment: Segment, index: int) -> None:
        """A block of ours came back in a message: it is held here again."""
        if segment.state[index] == 2:
            segment.state[index] = 1
            self._hold(segment)

    def _new_segment(self, key: tuple[bool, int]) -> Segment:
        first_segment()
        self.trim(POOL_LIMIT)
        named, bs = key
        size = HEADER + (SLAB if bs <= LARGEST_SMALL else bs)
        name = None
        if named:
            name = f"{PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
            path = os.path.join(SHM_DIR, name)
            fd = open_fd(
                lambda: os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600),
                "a new shared segment",
            )
        else:
            _check_memory(size)
            fd = open_fd(
                lambda: os.memfd_create("aiomp-shm", os.MFD_CLOEXEC), "a new shared segment"
            )
        try:
            self._fallocate(fd, size, name)
            if name:
                os.pwrite(fd, header_identity(), H_CREATOR)
            segment = Segment(fd, size, bs, name, owned=True, populate=True)
        except BaseException:
            os.close(fd)
            if name:
                unlink(name)
            raise
        self.index[segment.key] = segment
        self.segments.setdefault(key, []).append(segment)
        if name:
            self.named.add(name)
        return segment

    def _fallocate(self, fd: int, size: int, name: str | None) -> None:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            # give back what we hold idle and try once more
            self.trim(0)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                where = SHM_DIR if name else "memory"
                raise SharedMemoryError(
                    exc.errno,
                    f"cannot allocate {size} bytes of shared memory: {where} is full "
                    f"({exc.strerror}); free shared arrays, or enlarge {where}",
                ) from None

    def trim(self, limit: int) -> None:
        """Release idle segments (no block used anywhere) while idle bytes exceed ``limit``."""
        with self.lock:
            self.busy += 1
            try:
                idle = [
                    seg
                    for seg in self.idle
                    if all(seg.state[i] == 0 or self._reusable(seg, i) for i in range(seg.nblocks))
                ]
                total = sum(s.size for s in idle)
                for seg in idle:
                    if total <= limit:
                        break
                    total -= seg.size
                    self.forget(seg)
            finally:
                self.busy -= 1

    def shed(self) -> int:
        """Give away every segment with no array of this process in it (to free fds)."""
        with self.lock:
            self.busy += 1
            try:
                idle = list(self.idle)
                for seg in idle:
                    self.forget(seg)
                return len(idle)
            finally:
                self.busy -= 1

    def forget(self, seg: Segment) -> None:
        """Drop ``seg`` from the pool and close it here. Blocks still held elsewhere (by a
        message in flight or a receiver) stay valid: the kernel frees a memfd with its last
        holder, and the last user of an abandoned name removes it."""
        if not seg.owned:
            return  # forgotten already
        bs = (seg.name is not None, seg.block_size)
        self.segments[bs].remove(seg)
        self.idle.pop(seg, None)
        self.free[bs] = [(s, i) for s, i in self.free.get(bs, []) if s is not seg]
        self.retired[bs] = deque((s, i) for s, i in self.retired.get(bs, ()) if s is not seg)
        if self.index.get(seg.key) is seg:
            del self.index[seg.key]
        seg.owned = False
        if seg.name:
            self.named.discard(seg.name)
            remove_if_orphan(seg.name, abandon=True, fd=seg.fd)
        seg.close()


def _check_memory(size: int) -> None:
    # A memfd is bounded by memory, not by /dev/shm: asking the kernel for more than it
    # has would wake the OOM killer rather than fail.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
            else:
                return
    except OSError:
        return
    if size > avail:
        raise SharedMemoryError(
            errno.ENOMEM,
            f"cannot allocate {size} bytes of shared memory: only {avail} bytes are available",
        )
