"""Shared-memory segments, the per-process pool that recycles them, and the janitor.

A *segment* is a shared file mapped once per process: an anonymous memfd (strategy
``"file_descriptor"``, the default: its fd travels inside the message with SCM_RIGHTS) or
a named file ``/dev/shm/aiomp-<pid>-<random>`` (strategy ``"file_system"``: its name
travels). A segment is cut into equal *blocks*; one array lives in one block. Small blocks
share 8 MiB slabs, so thousands of arrays need a handful of fds; a large array has a
segment of its own.

Who may reuse a block is decided by leases (:mod:`aiomp._lease`): every process that holds
a view of a block holds a read lock on the block's byte range, and so does every message in
flight that names it. The process that created the segment reuses a block once its own
views are gone and the kernel reports no lease on it. A SIGKILLed holder loses its leases
with its fds. Nothing is counted by hand.

Fresh segments cost page faults (about 0.7 s/GiB here, against 13 GiB/s for memcpy into
mapped memory), so blocks are recycled instead of freed, and a new segment is allocated
in full up front (``posix_fallocate``: an exhausted ``/dev/shm`` or memory is a
:class:`~aiomp.SharedMemoryError` at the call, never a SIGBUS later) and mapped with
``MAP_POPULATE``. Idle segments beyond :data:`POOL_LIMIT` bytes are released.

Under ``"file_system"`` a message carries no fd, so nothing can hold a block while the
message is in flight: a block that was sent is not reused until a receiver has opened it
(a counter in the segment's header page) and released it. A name lives while its creator
lives or any process holds a lease in it; :func:`janitor` removes the names whose creator
died (SIGKILL included) and that nobody holds. A message whose sender died can be read
only until then: use ``"file_descriptor"`` when senders may exit first.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import mmap
import os
import threading
import time
import weakref
from collections import deque
from typing import cast

from . import _lease, _reduction
from ._errors import SharedMemoryError

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
SHM_DIR = "/dev/shm"
PREFIX = "aiomp-"
_MAX_RETIRED_CHECKS = 64

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


class Segment:
    """One shared file mapped in this process, with this process's own description.

    ``owned``: this process created it and its pool hands out its blocks.
    """

    def __init__(self, fd: int, size: int, block_size: int, name: str | None, owned: bool,
                 populate: bool) -> None:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self.mm = mmap.mmap(fd, size, flags)
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
        self.inherited = False  # set in a forked child: the parent's, not ours to touch
        self._finalizer = weakref.finalize(self, _close_segment, self.mm, fd)

    def offset(self, index: int) -> int:
        return HEADER + index * self.block_size

    # file_system: a message names a block without holding it, so the header counts, for
    # each block, the references sent and the references rebuilt ("opens"). A block whose
    # opens have caught up with its sends, and that nobody holds, has nothing in flight.
    # Read-modify-write happens under an OFD write lock on byte 0 (robust: a holder that
    # dies releases it), plus the module lock for threads sharing our description.
    def counters(self, index: int) -> tuple[int, int]:
        at = _COUNTERS + index * 8
        with _lock, _lease.exclusive(self.fd, 0, 1):
            return (int.from_bytes(self.mm[at : at + 4], "little"),
                    int.from_bytes(self.mm[at + 4 : at + 8], "little"))

    def count(self, index: int, sends: int = 0, opens: int = 0, reset: bool = False) -> None:
        at = _COUNTERS + index * 8
        with _lock, _lease.exclusive(self.fd, 0, 1):
            if reset:
                self.mm[at : at + 8] = bytes(8)
                return
            s = int.from_bytes(self.mm[at : at + 4], "little") + sends
            o = int.from_bytes(self.mm[at + 4 : at + 8], "little") + opens
            self.mm[at : at + 8] = max(s, 0).to_bytes(4, "little") + max(o, 0).to_bytes(4, "little")
        if sends > 0:
            os.utime(self.fd)  # the janitor's clock for messages that are never read

    def in_flight(self, index: int) -> bool:
        sends, opens = self.counters(index)
        return opens < sends

    def close(self) -> None:
        self._finalizer()


def _close_segment(mm: mmap.mmap, fd: int) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # views remain; the mapping goes when they do
    os.close(fd)


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
        state = _reduction.current()
        memo_key = ("aiomp-seg", seg.key)
        handoff = cast("tuple[int, int] | None", state.memo.get(memo_key))
        if handoff is None:
            fd = _lease.reopen(seg.fd)
            _reduction.on_sent(lambda: os.close(fd))
            handoff = (fd, _reduction.add_fd(fd))
            state.memo[memo_key] = handoff
        _lease.hold(handoff[0], seg.offset(index), seg.block_size)  # held while in flight
        return _rebuild_block, (None, handoff[1], seg.size, seg.block_size, index, seg.key)


# -- registries (per process) ------------------------------------------------------
#
# A block's presence in this process is its *exporter*: a ctypes array over the block that
# numpy keeps as the ``base`` of every view. The block is used here exactly as long as the
# exporter lives; when it dies the lease is dropped (or, in the owner, the block retired).
_segments: weakref.WeakValueDictionary[tuple[int, int], Segment] = weakref.WeakValueDictionary()
_blocks: weakref.WeakValueDictionary[tuple[tuple[int, int], int], ctypes.Array[ctypes.c_char]] = (
    weakref.WeakValueDictionary()
)
_info: dict[int, tuple[Segment, int]] = {}  # id(exporter) -> (segment, block index)
# Received segments stay mapped after their last block here is dropped, least recently
# dropped first out, while they total at most RECENT_BYTES and RECENT_SEGMENTS (an fd
# each), and the last 4 whatever their size: a segment that comes back (a producer's pool
# cycles a few) is then not mapped and faulted in again. A count of 4 alone thrashed as
# soon as the producers cycled more than 4 (issue 17: a data loader's batches).
RECENT_BYTES = 256 << 20
RECENT_SEGMENTS = 64
_recent: deque[Segment] = deque()


def _keep_recent(segment: Segment) -> None:
    if segment in _recent:
        _recent.remove(segment)
    _recent.append(segment)
    total = sum(s.size for s in _recent)
    while len(_recent) > 4 and (total > RECENT_BYTES or len(_recent) > RECENT_SEGMENTS):
        total -= _recent.popleft().size


def _export(segment: Segment, index: int) -> ctypes.Array[ctypes.c_char]:
    exporter = (ctypes.c_char * segment.block_size).from_buffer(segment.mm, segment.offset(index))
    _info[id(exporter)] = (segment, index)
    _blocks[(segment.key, index)] = exporter
    weakref.finalize(exporter, _drop_block, segment, index, id(exporter))
    return exporter


def _drop_block(segment: Segment, index: int, exporter_id: int) -> None:
    if segment.inherited:
        return  # its leases and pool are the parent's (we share its descriptions)
    with _lock:
        _info.pop(exporter_id, None)
        if (segment.key, index) in _blocks:
            return  # rebuilt (by another thread) since this exporter died: still in use
        if segment.owned:
            segment.state[index] = 2
            _pool.retire(segment, index)
        else:
            try:
                _lease.release(segment.fd, segment.offset(index), segment.block_size)
            except OSError:
                pass
            if segment.name is not None:
                _remove_if_orphan(segment.name)
            _keep_recent(segment)


def block_of(exporter: object) -> BlockRef | None:
    """The block ``exporter`` stands for, if it is one of ours."""
    info = _info.get(id(exporter))
    if info is None or _blocks.get((info[0].key, info[1])) is not exporter:
        return None
    return BlockRef(*info)


def _rebuild_block(name: str | None, fd_index: int, size: int, block_size: int,
                   index: int, key: tuple[int, int] | None) -> ctypes.Array[ctypes.c_char]:
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
        exporter = _blocks.get((key, index))
        if exporter is not None:
            if name is not None:
                _segments[key].count(index, opens=1)
            return exporter
        segment = _segments.get(key)
        if segment is None:
            if name is None:
                own = _lease.reopen(fd)
            else:
                try:
                    own = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
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


# -- the pool (segments this process created) --------------------------------------


class _Pool:
    def __init__(self) -> None:
        # keyed by (named, block size): a strategy switch applies to new arrays at once
        self.segments: dict[tuple[bool, int], list[Segment]] = {}
        self.free: dict[tuple[bool, int], list[tuple[Segment, int]]] = {}
        self.retired: dict[tuple[bool, int], deque[tuple[Segment, int]]] = {}

    def allocate(self, nbytes: int, *, zero: bool) -> ctypes.Array[ctypes.c_char]:
        bs = (_strategy == "file_system", block_size_for(max(nbytes, 1)))
        with _lock:
            found = self._take_free(bs) or self._take_retired(bs)
            if found is None:
                segment = self._new_segment(bs)
                for i in range(segment.nblocks - 1, 0, -1):
                    self.free.setdefault(bs, []).append((segment, i))
                found = (segment, 0)
            segment, index = found
            segment.state[index] = 1
            segment.live += 1
            if segment.name is not None:
                segment.count(index, reset=True)
            exporter = _export(segment, index)
            if zero and segment.dirty[index]:
                ctypes.memset(exporter, 0, segment.block_size)
            segment.dirty[index] = 1
            return exporter

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
        key = (segment.name is not None, segment.block_size)
        self.retired.setdefault(key, deque()).append((segment, index))

    def reclaim(self, segment: Segment, index: int) -> None:
        """A block of ours came back in a message: it is held here again."""
        if segment.state[index] == 2:
            segment.state[index] = 1

    def _new_segment(self, key: tuple[bool, int]) -> Segment:
        self.trim(POOL_LIMIT)
        named, bs = key
        size = HEADER + (SLAB if bs <= LARGEST_SMALL else bs)
        name = None
        if named:
            name = f"{PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
            fd = os.open(os.path.join(SHM_DIR, name),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        else:
            _check_memory(size)
            fd = os.memfd_create("aiomp-shm", os.MFD_CLOEXEC)
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
            idle: list[Segment] = []
            for segs in self.segments.values():
                for seg in segs:
                    if seg.live == 0 or all(
                        seg.state[i] == 0 or self._reusable(seg, i) for i in range(seg.nblocks)
                    ):
                        idle.append(seg)
            total = sum(s.size for s in idle)
            for seg in idle:
                if total <= limit:
                    break
                total -= seg.size
                self._forget(seg)

    def _forget(self, seg: Segment) -> None:
        bs = (seg.name is not None, seg.block_size)
        self.segments[bs].remove(seg)
        self.free[bs] = [(s, i) for s, i in self.free.get(bs, []) if s is not seg]
        self.retired[bs] = deque((s, i) for s, i in self.retired.get(bs, ()) if s is not seg)
        if seg.name:
            _named.discard(seg.name)
            _unlink(seg.name)
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
        return int(name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return -1


def _remove_if_orphan(name: str, creator_must_be_dead: bool = True) -> bool:
    """Unlink ``name`` if nothing can need it any more; True if it was removed.

    Nothing needs it when its creator is dead (or is us, exiting), no process holds a
    lease in it, and every reference ever sent has been opened (nothing in flight) or,
    for a dead creator's name, the last send is :data:`STALE_IN_FLIGHT` seconds old (a
    message that was dropped unread, with its queue, would otherwise pin it forever).
    """
    pid = _creator(name)
    if pid < 0 or (creator_must_be_dead and (pid == os.getpid() or _alive(pid))):
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if _lease.is_held(fd, 0, 0):
            return False
        header = os.pread(fd, HEADER, 0)
        stale = creator_must_be_dead and time.time() - os.fstat(fd).st_mtime > STALE_IN_FLIGHT
        for at in range(_COUNTERS, len(header) - 7, 8):
            sends = int.from_bytes(header[at : at + 4], "little")
            if int.from_bytes(header[at + 4 : at + 8], "little") < sends and not stale:
                return False
        _unlink(name)
        return True
    finally:
        os.close(fd)


def janitor() -> list[str]:
    """Remove ``/dev/shm/aiomp-*`` names that nothing can need any more.

    A name goes once its creator has died (SIGKILL included), no process holds it, and no
    message naming it is still unread. Returns the names removed. Safe to call at any
    time from any process; aiomp calls it when a child exits abnormally.
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return []
    return [name for name in names if _remove_if_orphan(name)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def at_exit() -> None:
    """Remove the names this process created that nothing needs any more.

    Names still held, or named by a message not yet read, stay: whoever drops them last
    (a receiver, or the janitor) removes them. Runs at interpreter exit and, because
    fork and forkserver children leave by ``os._exit``, from multiprocessing's own exit
    hook too.
    """
    for name in list(_named):
        if _remove_if_orphan(name, creator_must_be_dead=False):
            _named.discard(name)


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
    global _pool, _lock
    _lock = threading.RLock()  # another thread may have held it at the fork
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


atexit.register(at_exit)
_register_exit_hooks()
os.register_at_fork(after_in_child=_after_fork_in_child)
_raise_fd_limit()
