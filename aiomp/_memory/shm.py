"""Shared-memory segments, the per-process pool that recycles them, and the janitor.

A *segment* is a shared file mapped once per process: an anonymous memfd (strategy
``"file_descriptor"``, the default: its fd travels inside the message) or a named file
``/dev/shm/aiomp-<pid>-<random>`` (``"file_system"``: its name travels). A segment is cut
into equal *blocks*, one array per block; small blocks share 8 MiB slabs, a large array
has a segment of its own.

A block is reused once its creator's own views are gone and the kernel reports no lease
on it (see *Kernel leases* in docs/architecture.md). Segments are recycled, allocated in
full up front and pre-faulted, and a segment holds one fd however many arrays were sent
(docs/decisions/0012-shared-memory-segments.md). Under ``"file_system"`` a message holds no
lease while in flight, so the segment's header page counts the references sent and opened
per block, and names the creator and its *process tree*; who removes a name, and when, is
"``file_system`` names do not outlive their users" in docs/reliability.md.

A *child* module (see *Light children*).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import resource  # imported up front: the fd-limit error path must not need an fd
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import TYPE_CHECKING

from .. import _lifecycle
from .._errors import SharedMemoryError, TransportError
from .._lifecycle import pid_alive, start_time
from .._loop.finalizers import finalizer
from .._wire import pickling as _reduction
from . import lease as _lease

if TYPE_CHECKING:
    from collections.abc import Callable

STRATEGIES = frozenset({"file_descriptor", "file_system"})
_strategy = "file_descriptor"

PAGE = mmap.PAGESIZE
HEADER = PAGE  # header page: per-block counters of sends and opens (file_system)
_COUNTERS = 64  # counters start here; byte 0 is the lock that guards them
SLAB = 8 << 20
SMALLEST = 64 << 10
LARGEST_SMALL = 1 << 20
LARGE_ROUND = 2 << 20
#: A name whose creator has died and that nobody holds is removed even though a message
#: naming it was never read, once nothing has been sent naming it for this many seconds.
STALE_IN_FLIGHT = 60.0
#: Bytes of idle pooled segments a process keeps for reuse.
POOL_LIMIT = 1 << 30
#: Segments with no array of this process in them that a process keeps (one fd each);
#: past that the oldest is given away (see docs/decisions/0012-shared-memory-segments.md).
IDLE_SEGMENTS = 32
SHM_DIR = "/dev/shm"
PREFIX = "aiomp-"
_MAX_RETIRED_CHECKS = 64
# file_system header page: byte 0 is the lock; then who made the name, and its tree
_H_CREATOR = 8  # pid (4 bytes), then at 16 its start time (8 bytes)
_H_TREE = 24  # the tree's root: pid (4 bytes), then at 32 its start time (8 bytes)
_H_FLAGS = 40
_ABANDONED = 1  # the creator has let go of the name (exited, or gave the segment away)
_EMFILE = (errno.EMFILE, errno.ENFILE)

_lock = threading.RLock()


def get_all_sharing_strategies() -> set[str]:
    """The strategies this platform supports: ``{"file_descriptor", "file_system"}``."""
    return set(STRATEGIES)


def get_sharing_strategy() -> str:
    """The strategy used for arrays put into shared memory from now on in this process."""
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose how new shared segments are named: ``"file_descriptor"`` or ``"file_system"``.

    Affects segments this process creates from now on; arrays already shared keep theirs.
    Children inherit the parent's choice only if they call this too (as in torch).
    """
    global _strategy
    if new_strategy not in STRATEGIES:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}; choose from {sorted(STRATEGIES)}"
        )
    _strategy = new_strategy


def block_size_for(nbytes: int) -> int:
    if nbytes <= LARGEST_SMALL:
        size = SMALLEST
        while size < nbytes:
            size <<= 1
        return size
    return -(-nbytes // LARGE_ROUND) * LARGE_ROUND


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


class _Mapping:
    """A shared mapping that holds no fd (Python's ``mmap`` keeps a dup of it).

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
        self.mapping: _Mapping | None = _Mapping(fd, size, populate)
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
    # dies releases it), plus the module lock for threads sharing our description.
    def counters(self, index: int) -> tuple[int, int]:
        at = self.address + _COUNTERS + index * 8
        with _lock, _lease.exclusive(self.fd, 0, 1):
            raw = ctypes.string_at(at, 8)
        return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:], "little")

    def count(self, index: int, sends: int = 0, opens: int = 0, reset: bool = False) -> None:
        at = self.address + _COUNTERS + index * 8
        with _lock, _lease.exclusive(self.fd, 0, 1):
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


class BlockRef:
    """A block named inside a message; unpickles to the receiver's exporter of it."""

    __slots__ = ("index", "segment")

    def __init__(self, segment: Segment, index: int) -> None:
        self.segment = segment
        self.index = index

    def __reduce__(self) -> tuple[object, ...]:
        seg, index = self.segment, self.index
        if seg.name is not None:
            seg.count(index, sends=1)
            _reduction.on_unsent(lambda: seg.count(index, sends=-1))
            _reduction.on_copy(lambda: seg.count(index, sends=1))
            return _rebuild_block, (seg.name, -1, seg.size, seg.block_size, index, None)
        handoffs: dict[object, tuple[int, int]] = _reduction.current().once(BlockRef, dict)
        handoff = handoffs.get(seg.key)  # one description per segment and message
        if handoff is None:
            fd = _open_fd(lambda: _lease.reopen(seg.fd), "a shared segment to send")
            _reduction.on_sent(lambda: os.close(fd))
            handoff = handoffs[seg.key] = (fd, _reduction.add_fd(fd))
        _lease.hold(handoff[0], seg.offset(index), seg.block_size)  # held while in flight
        return _rebuild_block, (None, handoff[1], seg.size, seg.block_size, index, seg.key)


# -- registries (per process) ------------------------------------------------------
#
# A block's presence in this process is its *exporter*: a ctypes array over the block that
# numpy keeps as the ``base`` of every view. The block is used here exactly as long as the
# exporter lives; when it dies the lease is dropped (or, in the owner, the block retired).
_segments: weakref.WeakValueDictionary[tuple[int, int], Segment] = weakref.WeakValueDictionary()
# (segment key, block index) -> a weak reference to its exporter (see _export)
_blocks: dict[tuple[tuple[int, int], int], weakref.ref[ctypes.Array[ctypes.c_char]]] = {}
_info: dict[int, tuple[Segment, int]] = {}  # id(exporter) -> (segment, block index)
# Received segments stay mapped after their last block here is dropped, least recently
# dropped first out, while they total at most RECENT_BYTES and RECENT_SEGMENTS (an fd
# each), and the last 4 whatever their size: a segment that comes back (a producer's pool
# cycles a few) is then not mapped and faulted in again. A count of 4 alone thrashed as
# soon as the producers cycled more than 4 (issue 17: a data loader's batches).
RECENT_BYTES = 256 << 20
RECENT_SEGMENTS = 32  # as IDLE_SEGMENTS: the fd bound holds on the receiving side too
_recent: deque[Segment] = deque()


def _keep_recent(segment: Segment) -> None:
    if _recent and _recent[-1] is segment:
        return  # the common case: blocks of one segment dropped in a row
    if segment in _recent:
        _recent.remove(segment)
    _recent.append(segment)
    total = sum(s.size for s in _recent)
    while len(_recent) > 4 and (total > RECENT_BYTES or len(_recent) > RECENT_SEGMENTS):
        total -= _recent.popleft().size


def _exported(key: tuple[tuple[int, int], int]) -> ctypes.Array[ctypes.c_char] | None:
    """The live exporter of block ``key`` (segment key, index) in this process, or None."""
    ref = _blocks.get(key)
    return None if ref is None else ref()


def _export(segment: Segment, index: int) -> ctypes.Array[ctypes.c_char]:
    exporter = (ctypes.c_char * segment.block_size).from_address(
        segment.address + segment.offset(index)
    )
    # A ctypes array takes attributes its type does not declare: the mapping outlives views.
    exporter._aiomp_mapping = segment.mapping  # type: ignore[attr-defined]
    exporter_id = id(exporter)
    _info[exporter_id] = (segment, index)
    key = (segment.key, index)
    if segment.name is None:
        # The weak reference's own callback drops the block: a fifth of what
        # weakref.finalize costs, per array sent or received. Nothing is left to do at
        # exit for a memfd's block (the kernel drops a dead process's leases).
        _blocks[key] = weakref.ref(exporter, partial(_drop_block, segment, index, exporter_id))
    else:  # a name's last holder removes it, at exit too: finalize runs then
        ref = _blocks[key] = weakref.ref(exporter)
        weakref.finalize(exporter, _drop_block, segment, index, exporter_id, ref)
    return exporter


@finalizer
def _drop_block(
    segment: Segment,
    index: int,
    exporter_id: int,
    ref: weakref.ref[ctypes.Array[ctypes.c_char]],
) -> None:
    if segment.inherited:
        return  # its leases and pool are the parent's (we share its descriptions)
    with _lock:
        _info.pop(exporter_id, None)
        key = (segment.key, index)
        if _blocks.get(key) is not ref:
            return  # rebuilt (by another thread) since this exporter died: still in use
        del _blocks[key]
        if segment.owned:
            _pool.retire(segment, index)
        else:
            try:
                _lease.release(segment.fd, segment.offset(index), segment.block_size)
            except OSError:
                pass
            if segment.name is not None and not any(
                (segment.key, i) in _blocks for i in range(segment.nblocks)
            ):  # our description now holds no lease: it can test for everyone else's
                _remove_if_orphan(segment.name, fd=segment.fd)
            _keep_recent(segment)


def block_of(exporter: object) -> BlockRef | None:
    """The block ``exporter`` stands for, if it is one of ours."""
    info = _info.get(id(exporter))
    if info is None or _exported((info[0].key, info[1])) is not exporter:
        return None
    return BlockRef(*info)


def _rebuild_block(
    name: str | None,
    fd_index: int,
    size: int,
    block_size: int,
    index: int,
    key: tuple[int, int] | None,
) -> ctypes.Array[ctypes.c_char]:
    with _lock:
        if name is None:
            # The key (device, inode) names the segment; the fd travelled with it in the
            # same datagram, so it cannot be another segment's.
            fd = _reduction.peek_fd(fd_index)
            key = _lease.identity(fd) if key is None else (key[0], key[1])
        else:
            fd = -1
            try:
                st = os.stat(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                raise SharedMemoryError(
                    errno.ENOENT,
                    f"shared segment {name!r} is gone: its creator exited before this message "
                    "was read (use the 'file_descriptor' strategy when senders may exit first)",
                ) from None
            key = (st.st_dev, st.st_ino)
        exporter = _exported((key, index))
        if exporter is not None:
            if name is not None:
                _segments[key].count(index, opens=1)
            return exporter
        segment = _segments.get(key)
        if segment is None:
            if name is None:
                own = _open_fd(lambda: _lease.reopen(fd), "a shared segment received")
            else:
                path = os.path.join(SHM_DIR, name)
                try:
                    own = _open_fd(
                        lambda: os.open(path, os.O_RDWR | os.O_CLOEXEC), "a shared segment received"
                    )
                except FileNotFoundError:
                    raise SharedMemoryError(
                        errno.ENOENT, f"shared segment {name!r} vanished before it was opened"
                    ) from None
            try:
                segment = Segment(own, size, block_size, name, owned=False, populate=False)
            except BaseException:
                os.close(own)
                raise
            _segments[key] = segment
        if segment.owned:
            _pool.reclaim(segment, index)
        else:
            _lease.hold(segment.fd, segment.offset(index), block_size)
        if name is not None:
            segment.count(index, opens=1)
        return _export(segment, index)


# -- one array alone in a message, without the pickler --------------------------------
# See docs/decisions/0013-one-array-messages.md. The same leases as BlockRef's: a
# fresh description per message holds the block while the message is in flight.


def _handoff(segment: Segment, index: int) -> int:
    ranges = [(segment.offset(index), segment.block_size)]
    return _open_fd(lambda: _lease.handoff_fd(segment.fd, ranges), "a shared segment to send")


def send_copy(data: memoryview) -> tuple[int, Segment, int] | None:
    """Copy ``data`` (bytes) into a fresh pooled block of a memfd segment, and hand it on.

    Returns ``(fd, segment, index)``: ``fd`` is a fresh description that holds the
    block's lease, for the message to carry and to close once sent; no view of the block
    is left here, so the block is reused once every receiver has let go. None under the
    ``file_system`` strategy (its names need the pickled path's counters).
    """
    if _strategy != "file_descriptor":
        return None
    segment, index = _pool.lend(len(data))
    try:
        if segment.name is not None:  # another thread switched the strategy meanwhile
            return None
        at = segment.offset(index)
        segment.bytes()[at : at + len(data)] = data
        return _handoff(segment, index), segment, index
    finally:  # held by the description now (or by nobody, after an error)
        with _lock:
            _pool.retire(segment, index)


def send_block(exporter: object) -> tuple[int, Segment, int] | None:
    """``(fd, segment, index)`` for the block ``exporter`` stands for: ``fd`` a fresh
    description holding its lease, as :func:`send_copy`. None if ``exporter`` is not a
    block of ours, or is one of a named segment."""
    info = _info.get(id(exporter))
    if info is None:
        return None
    segment, index = info
    if segment.name is not None or _exported((segment.key, index)) is not exporter:
        return None
    return _handoff(segment, index), segment, index


def receive_block(
    size: int, block_size: int, index: int, key: tuple[int, int]
) -> ctypes.Array[ctypes.c_char]:
    """The exporter of a block sent by :func:`send_copy` or :func:`send_block`, its
    description the message's only fd (left for :func:`aiomp._wire.pickling.loads` to close)."""
    return _rebuild_block(None, 0, size, block_size, index, key)


# -- the pool (segments this process created) --------------------------------------


class _Pool:
    def __init__(self) -> None:
        # keyed by (named, block size): a strategy switch applies to new arrays at once
        self.segments: dict[tuple[bool, int], list[Segment]] = {}
        self.free: dict[tuple[bool, int], list[tuple[Segment, int]]] = {}
        self.retired: dict[tuple[bool, int], deque[tuple[Segment, int]]] = {}
        # segments with no array of this process in them, oldest first (bounded)
        self.idle: dict[Segment, None] = {}
        # >0 while the lists above are being walked: an array dying meanwhile (its
        # finalizer runs retire, in this thread) must not give segments away then
        self.busy = 0

    def allocate(self, nbytes: int, *, zero: bool) -> ctypes.Array[ctypes.c_char]:
        with _lock:
            self.busy += 1
            try:
                return self._allocate(nbytes, zero)
            finally:
                self.busy -= 1
                self._bound()

    def _allocate(self, nbytes: int, zero: bool) -> ctypes.Array[ctypes.c_char]:
        segment, index = self._take(nbytes)
        exporter = _export(segment, index)
        if zero and segment.dirty[index]:
            ctypes.memset(exporter, 0, segment.block_size)
        segment.dirty[index] = 1
        return exporter

    def lend(self, nbytes: int) -> tuple[Segment, int]:
        """A block held here with no exporter: the caller fills it and then calls
        :meth:`retire` on it (the one way out, errors included)."""
        with _lock:
            self.busy += 1
            try:
                segment, index = self._take(nbytes)
                segment.dirty[index] = 1
                return segment, index
            finally:
                self.busy -= 1
                self._bound()

    def _take(self, nbytes: int) -> tuple[Segment, int]:
        bs = (_strategy == "file_system", block_size_for(max(nbytes, 1)))
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
                self._bound()

    def _bound(self) -> None:
        while len(self.idle) > IDLE_SEGMENTS:
            self._forget(next(iter(self.idle)))

    def reclaim(self, segment: Segment, index: int) -> None:
        """A block of ours came back in a message: it is held here again."""
        if segment.state[index] == 2:
            segment.state[index] = 1
            self._hold(segment)

    def _new_segment(self, key: tuple[bool, int]) -> Segment:
        if not _started:
            _start()
        self.trim(POOL_LIMIT)
        named, bs = key
        size = HEADER + (SLAB if bs <= LARGEST_SMALL else bs)
        name = None
        if named:
            name = f"{PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
            path = os.path.join(SHM_DIR, name)
            fd = _open_fd(
                lambda: os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600),
                "a new shared segment",
            )
        else:
            _check_memory(size)
            fd = _open_fd(
                lambda: os.memfd_create("aiomp-shm", os.MFD_CLOEXEC), "a new shared segment"
            )
        try:
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
            if name:
                os.pwrite(fd, _header_identity(), _H_CREATOR)
            segment = Segment(fd, size, bs, name, owned=True, populate=True)
        except BaseException:
            os.close(fd)
            if name:
                _unlink(name)
            raise
        _segments[segment.key] = segment
        self.segments.setdefault(key, []).append(segment)
        if name:
            _named.add(name)
        return segment

    def trim(self, limit: int) -> None:
        """Release idle segments (no block used anywhere) while idle bytes exceed ``limit``."""
        with _lock:
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
                    self._forget(seg)
            finally:
                self.busy -= 1

    def shed(self) -> int:
        """Give away every segment with no array of this process in it (to free fds)."""
        with _lock:
            self.busy += 1
            try:
                idle = list(self.idle)
                for seg in idle:
                    self._forget(seg)
                return len(idle)
            finally:
                self.busy -= 1

    def _forget(self, seg: Segment) -> None:
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
        if _segments.get(seg.key) is seg:
            del _segments[seg.key]
        seg.owned = False
        if seg.name:
            _named.discard(seg.name)
            _remove_if_orphan(seg.name, abandon=True, fd=seg.fd)
        seg.close()


_pool = _Pool()
_named: set[str] = set()


def allocate(nbytes: int, *, zero: bool = False) -> ctypes.Array[ctypes.c_char]:
    """A block of at least ``nbytes`` bytes in shared memory, held by this process.

    Returns its exporter: build arrays on it with ``numpy.ndarray(buffer=exporter)``.
    """
    return _pool.allocate(nbytes, zero=zero)


def purge_pool() -> None:
    """Release every idle pooled segment (tests use it to check for leaks)."""
    _pool.trim(0)
    _recent.clear()


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


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _creator(name: str) -> int:
    try:
        return int(name[len(PREFIX) :].split("-", 1)[0])
    except ValueError:
        return -1


# -- who may still need a name (file_system) ----------------------------------------


def _find_tree() -> tuple[int, int, bool]:
    """(root pid, root start time, whether this process is the root) of this process tree.

    The root is the process with no multiprocessing parent; its descendants learn it
    from ``AIOMP_TREE`` in their environment (or take their parent, if it was not set when
    they started). Only the tree's processes can hold its queues.
    """
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        pid, start, root = os.getpid(), start_time(os.getpid()) or 0, True
    else:
        try:
            pid, start = map(int, os.environ.get("AIOMP_TREE", "").split(":"))
        except ValueError:
            pid = parent.pid or 0
            start = start_time(pid) or 0
        root = False
    os.environ["AIOMP_TREE"] = f"{pid}:{start}"
    return pid, start, root


def _header_identity() -> bytes:
    """The creator and tree fields of a new name's header page (from ``_H_CREATOR``)."""
    me = os.getpid()
    if _me[0] != me:  # a forked child
        _me[:] = [me, start_time(me) or 0]
    return (
        me.to_bytes(4, "little")
        + bytes(4)
        + _me[1].to_bytes(8, "little")
        + _tree[0].to_bytes(4, "little")
        + bytes(4)
        + _tree[1].to_bytes(8, "little")
    )


def _field(header: bytes, at: int, size: int) -> int:
    return int.from_bytes(header[at : at + size], "little")


def _unread(header: bytes) -> bool:
    """True if a reference to some block was sent and not yet opened."""
    for at in range(_COUNTERS, HEADER - 7, 8):
        if _field(header, at + 4, 4) < _field(header, at, 4):
            return True
    return False


def _unreadable(header: bytes, fd: int, ending: tuple[int, int] | None) -> bool:
    """True if no message naming the segment can still be read: its tree is gone (or is
    ``ending``: its root is exiting with no child left), or it is stale."""
    tree = (_field(header, _H_TREE, 4), _field(header, _H_TREE + 8, 8))
    if tree[0] and (tree == ending or not pid_alive(*tree)):
        return True
    return time.time() - os.fstat(fd).st_mtime > STALE_IN_FLIGHT


def _remove_if_orphan(
    name: str,
    *,
    abandon: bool = False,
    ending: tuple[int, int] | None = None,
    wait: bool = True,
    fd: int = -1,
) -> bool:
    """Unlink ``name`` if nothing can need it any more; True if it was removed.

    With ``abandon``, the caller is its creator letting go of it first. The test and
    the unlink happen under the header's lock, so of a creator letting go and the last
    holder releasing, whichever comes second sees the other's step. Without ``wait``
    (the janitor), a name whose header is locked right now is left alone. ``fd``: a
    description of the name that holds no lease (one the caller has open already: at the
    fd limit, opening another would fail).
    """
    pid = _creator(name)
    if pid < 0:
        return False
    own = fd < 0
    try:
        if own:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with _lease.exclusive(fd, 0, 1, wait):
            header = os.pread(fd, HEADER, 0)
            complete = len(header) == HEADER
            if abandon:
                os.pwrite(fd, bytes((_ABANDONED,)), _H_FLAGS)
            elif not (complete and header[_H_FLAGS] & _ABANDONED):
                start = _field(header, _H_CREATOR + 8, 8) if complete else 0
                if pid_alive(pid, start):
                    return False
            if _lease.is_held(fd, 1, 0):  # any lease (all but the lock byte)
                return False
            if complete and _unread(header) and not _unreadable(header, fd, ending):
                return False
            _unlink(name)
            return True
    except OSError:
        return False
    finally:
        if own:
            os.close(fd)


def janitor(*, _ending: tuple[int, int] | None = None) -> list[str]:
    """Remove ``/dev/shm/aiomp-*`` names that nothing can need any more.

    A name goes once its creator has let go of it or died (SIGKILL included), no process
    holds it, and no message naming it can still be read (see docs/reliability.md).
    Returns the names removed. Safe to call at any time from any process; aiomp calls it
    when the first segment of a process tree is made, when a child exits abnormally, and
    when the root of a tree exits.
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return []
    return [name for name in names if _remove_if_orphan(name, ending=_ending, wait=False)]


@_lifecycle.on_failed_exit
def _sweep() -> None:
    """A child that died abnormally may have left named segments (``file_system``
    strategy): remove those whose creator is dead and that nobody holds."""
    try:
        janitor()
    except OSError:
        pass


def _children() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return pids


def _tree_is_ending() -> bool:
    """True in the root when no other process of the tree is left: none of its children
    lives but multiprocessing's helpers (their children, the fork server's, count)."""
    if not _tree[2]:
        return False
    from multiprocessing import forkserver, resource_tracker

    # The helpers' pids are private attributes of multiprocessing, absent from typeshed.
    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    helpers = {server, resource_tracker._resource_tracker._pid}  # type: ignore[attr-defined]
    others = set()
    try:
        others = _children() - helpers
        if server and pid_alive(server):
            with open(f"/proc/{server}/task/{server}/children") as f:
                others.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return not any(pid_alive(pid) for pid in others)


def at_exit() -> None:
    """Let go of the names this process created; in the root of a tree with no child
    left, also sweep what the tree leaves (its messages can no longer be read).

    A name still held, or named by a message that can still be read, stays: whoever
    drops it last (a receiver, or the janitor) removes it. Runs at interpreter exit and,
    because fork and forkserver children leave by ``os._exit``, from multiprocessing's
    own exit hook too (once before it joins children, once after).
    """
    try:
        ending = _tree[:2] if _tree_is_ending() else None
    except (OSError, ImportError):  # out of fds, say: let go of our names all the same
        ending = None
    if ending is not None:
        # our own leases do not count any more: we are the last process of the tree
        for seg in list(_segments.values()):
            if not seg.owned and not seg.inherited:
                try:
                    _lease.release(seg.fd, 0, 0)
                except OSError:
                    pass
    for segs in list(_pool.segments.values()):
        for seg in segs:
            if seg.name in _named:
                _remove_if_orphan(seg.name, abandon=True, ending=ending, fd=seg.fd)
    for name in list(_named):
        _remove_if_orphan(name, abandon=True, ending=ending)
        _named.discard(name)
    if ending is not None:
        janitor(_ending=ending)


# -- running out of file descriptors ---------------------------------------------------


def _open_reserve() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


_reserve = _open_reserve()  # an fd kept free for the error path (counting fds needs one)
_started = False


def _start() -> None:
    """The first segment of this process: the root of a new tree sweeps what dead trees
    left, and imports up front what recovering from an fd shortage needs (starting a
    consumer), since an import needs an fd."""
    global _started
    _started = True
    if _tree[2]:
        janitor()
        from .._spawn import api  # noqa: F401


def _open_fd(open_: Callable[[], int], what: str) -> int:
    """``open_()``, an fd; at the fd limit, give away idle segments and retry, then raise
    a :class:`~aiomp.TransportError` that says what to do."""
    try:
        return open_()
    except OSError as exc:
        if exc.errno not in _EMFILE:
            raise
        with _lock:
            shed = _pool.shed()
            _recent.clear()
        if shed:
            try:
                return open_()
            except OSError as again:
                if again.errno not in _EMFILE:
                    raise
        raise _fd_limit_error(exc, what) from None


def _fd_limit_error(exc: OSError, what: str) -> TransportError:
    global _reserve
    if _reserve >= 0:
        os.close(_reserve)  # the slot listdir needs
        _reserve = -1
    try:
        in_use = str(len(os.listdir("/proc/self/fd")) - 1)
    except OSError:
        in_use = "all its"
    finally:
        _reserve = _open_reserve()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ours = len(_segments)
    return TransportError(
        exc.errno,
        f"cannot open {what}: this process has {in_use} file descriptors open and its "
        f"limit (RLIMIT_NOFILE) is {soft}; about {ours} hold shared-memory segments that "
        "arrays of this process live in. Drop arrays (or other files) you no longer need, "
        "let consumers receive pending messages, or raise the limit (ulimit -n, "
        "resource.setrlimit)",
    )


def _raise_fd_limit() -> None:
    # Each message that carries shared arrays carries an fd while it is in flight, and
    # the kernel caps an unprivileged user's in-flight fds at RLIMIT_NOFILE: use all of
    # the hard limit we are allowed.
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


def _register_exit_hooks(_: object = None) -> None:
    from multiprocessing import util

    util.Finalize(None, at_exit, exitpriority=0)
    util.Finalize(None, at_exit, exitpriority=-100)  # after multiprocessing joins children
    # multiprocessing clears its finalizers in a forked child: register again there
    util.register_after_fork(_pool, _register_exit_hooks)


_inherited_holds: list[int] = []


def _after_fork_in_child() -> None:
    """A forked child shares its parent's descriptions and mappings: it must not hand out,
    retire or unlink the parent's blocks. It starts with an empty pool.

    Arrays it inherited stay valid for its whole life: it takes a lease of its own on
    every block it inherited a view of (through descriptions of its own, kept until it
    exits). They travel as copies (pass arrays in ``args`` to send them as shared).
    """
    global _pool, _lock, _tree, _started
    _lock = threading.RLock()  # another thread may have held it at the fork
    _tree = (_tree[0], _tree[1], False)
    _started = True  # the root has swept
    own: dict[tuple[int, int], int] = {}
    for segment, index in list(_info.values()):
        try:
            fd = own.get(segment.key)
            if fd is None:
                fd = own[segment.key] = _lease.reopen(segment.fd)
                _inherited_holds.append(fd)
            _lease.hold(fd, segment.offset(index), segment.block_size)
        except OSError:
            pass  # the parent's segment is gone from under us: nothing to protect
    for seg in list(_segments.values()):
        seg.inherited = True
    for segs in _pool.segments.values():
        for seg in segs:
            seg.inherited = True
    _segments.clear()
    _blocks.clear()
    _info.clear()
    _named.clear()
    _recent.clear()
    _pool = _Pool()
    _register_exit_hooks()


_tree = _find_tree()
_me = [os.getpid(), start_time(os.getpid()) or 0]  # read up front: no fd needed later
atexit.register(at_exit)
_register_exit_hooks()
os.register_at_fork(after_in_child=_after_fork_in_child)
_raise_fd_limit()
