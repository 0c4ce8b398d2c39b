"""This process's shared memory: its segments, its blocks' exporters, the pool; one object.

:data:`REGISTRY` owns the registry lock, the map of segments mapped here (by their
``(device, inode)`` key, received ones included), the *exporter* of each block in use
here, the segments received lately (kept mapped for reuse) and the pool of segments this
process created (:class:`~.allocator.SegmentPool`). A forked child resets it in place
(:meth:`Registry.after_fork_in_child`); at exit it lets go of the names it created.

A block's presence in this process is its exporter: a ctypes array over the block that
numpy keeps as the ``base`` of every view. The block is used here exactly as long as the
exporter lives; when it dies the block's lease is dropped (a received block) or the
block is retired into the pool (a block of ours).

A *child* module.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref
from collections import deque
from functools import partial

from .._loop.finalizers import finalizer
from . import fdlimit as _fdlimit
from . import lease as _lease
from .allocator import SegmentPool
from .janitor import janitor, remove_if_orphan, tree_ending
from .segment import Segment

Exporter = ctypes.Array[ctypes.c_char]

#: Received segments stay mapped after their last block here is dropped, least recently
#: dropped first out, while they total at most RECENT_BYTES and RECENT_SEGMENTS (an fd
#: each), and the last 4 whatever their size: a segment that comes back (a producer's
#: pool cycles a few) is then not mapped and faulted in again. A bound of 4 alone
#: thrashes once producers cycle more than 4 segments (a data loader's batches).
RECENT_BYTES = 256 << 20
RECENT_SEGMENTS = 32  # as IDLE_SEGMENTS: the fd bound holds on the receiving side too


class Registry:
    """The segments and blocks of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.segments: weakref.WeakValueDictionary[tuple[int, int], Segment] = (
            weakref.WeakValueDictionary()
        )
        # (segment key, block index) -> a weak reference to its exporter (see export)
        self.blocks: dict[tuple[tuple[int, int], int], weakref.ref[Exporter]] = {}
        self.info: dict[int, tuple[Segment, int]] = {}  # id(exporter) -> (segment, index)
        self.recent: deque[Segment] = deque()
        self.pool = SegmentPool(self.lock, self.segments)
        # a forked child's own descriptions of the blocks it inherited (held till exit)
        self.inherited_holds: list[int] = []

    def exported(self, key: tuple[tuple[int, int], int]) -> Exporter | None:
        """The live exporter of block ``key`` (segment key, index) here, or None."""
        ref = self.blocks.get(key)
        return None if ref is None else ref()

    def export(self, segment: Segment, index: int) -> Exporter:
        exporter = (ctypes.c_char * segment.block_size).from_address(
            segment.address + segment.offset(index)
        )
        # A ctypes array takes attributes its type does not declare: the mapping outlives views.
        exporter._aiomp_mapping = segment.mapping  # type: ignore[attr-defined]
        exporter_id = id(exporter)
        self.info[exporter_id] = (segment, index)
        key = (segment.key, index)
        if segment.name is None:
            # The weak reference's own callback drops the block: a fifth of what
            # weakref.finalize costs, per array sent or received. Nothing is left to do at
            # exit for a memfd's block (the kernel drops a dead process's leases).
            self.blocks[key] = weakref.ref(
                exporter, partial(self.drop_block, segment, index, exporter_id)
            )
        else:  # a name's last holder removes it, at exit too: finalize runs then
            ref = self.blocks[key] = weakref.ref(exporter)
            weakref.finalize(exporter, self.drop_block, segment, index, exporter_id, ref)
        return exporter

    @finalizer
    def drop_block(
        self, segment: Segment, index: int, exporter_id: int, ref: weakref.ref[Exporter]
    ) -> None:
        """The exporter of a block died: retire the block, or release its lease."""
        if segment.inherited:
            return  # its leases and pool are the parent's (we share its descriptions)
        if _lease is None:  # a block held by a module global, dropped as the interpreter
            return  # clears the modules: the kernel drops an exiting process's leases
        with self.lock:
            self.info.pop(exporter_id, None)
            key = (segment.key, index)
            if self.blocks.get(key) is not ref:
                return  # rebuilt (by another thread) since this exporter died: still in use
            del self.blocks[key]
            if segment.owned:
                self.pool.retire(segment, index)
            else:
                try:
                    _lease.release(segment.fd, segment.offset(index), segment.block_size)
                except OSError:
                    pass
                if segment.name is not None and not any(
                    (segment.key, i) in self.blocks for i in range(segment.nblocks)
                ):  # our description now holds no lease: it can test for everyone else's
                    remove_if_orphan(segment.name, fd=segment.fd)
                self.keep_recent(segment)

    def keep_recent(self, segment: Segment) -> None:
        recent = self.recent
        if recent and recent[-1] is segment:
            return  # the common case: blocks of one segment dropped in a row
        if segment in recent:
            recent.remove(segment)
        recent.append(segment)
        total = sum(s.size for s in recent)
        while len(recent) > 4 and (total > RECENT_BYTES or len(recent) > RECENT_SEGMENTS):
            total -= recent.popleft().size

    def allocate(self, nbytes: int, *, zero: bool = False) -> Exporter:
        """A block of at least ``nbytes`` bytes, held here; returns its exporter."""
        pool = self.pool
        with self.lock:
            pool.busy += 1
            try:
                segment, index = pool.take(nbytes)
                exporter = self.export(segment, index)
                if zero and segment.dirty[index]:
                    ctypes.memset(exporter, 0, segment.block_size)
                segment.dirty[index] = 1
                return exporter
            finally:
                pool.busy -= 1
                pool.bound()

    def shed(self) -> int:
        """At the fd limit: give away idle segments and the recent ones; how many went."""
        with self.lock:
            shed = self.pool.shed()
            self.recent.clear()
        return shed

    def segments_held(self) -> int:
        return len(self.segments)

    def purge(self) -> None:
        """Release every idle pooled segment and every recent one."""
        self.pool.trim(0)
        self.recent.clear()

    def at_exit(self) -> None:
        """Let go of the names this process created; in the root of a tree with no child
        left, also sweep what the tree leaves (its messages can no longer be read).

        A name still held, or named by a message that can still be read, stays: whoever
        drops it last (a receiver, or the janitor) removes it. Runs at interpreter exit
        and, because fork and forkserver children leave by ``os._exit``, from
        multiprocessing's own exit hook too (once before it joins children, once after).
        """
        ending = tree_ending()
        if ending is not None:
            # our own leases do not count any more: we are the last process of the tree
            for seg in list(self.segments.values()):
                if not seg.owned and not seg.inherited:
                    try:
                        _lease.release(seg.fd, 0, 0)
                    except OSError:
                        pass
        pool = self.pool
        for segs in list(pool.segments.values()):
            for seg in segs:
                if seg.name in pool.named:
                    remove_if_orphan(seg.name, abandon=True, ending=ending, fd=seg.fd)
        for name in list(pool.named):
            remove_if_orphan(name, abandon=True, ending=ending)
            pool.named.discard(name)
        if ending is not None:
            janitor(_ending=ending)

    def register_exit_hooks(self, _: object = None) -> None:
        from multiprocessing import util

        util.Finalize(None, self.at_exit, exitpriority=0)
        util.Finalize(None, self.at_exit, exitpriority=-100)  # after it joins children
        # multiprocessing clears its finalizers in a forked child: register again there
        util.register_after_fork(self.pool, self.register_exit_hooks)

    def after_fork_in_child(self) -> None:
        """A forked child shares its parent's descriptions and mappings: it must not hand
        out, retire or unlink the parent's blocks. It starts with an empty pool.

        Arrays it inherited stay valid for its whole life: it takes a lease of its own on
        every block it inherited a view of (through descriptions of its own, kept until
        it exits). They travel as copies (pass arrays in ``args`` to send them as shared).
        """
        self.lock = threading.RLock()  # another thread may have held it at the fork
        own: dict[tuple[int, int], int] = {}
        for segment, index in list(self.info.values()):
            try:
                fd = own.get(segment.key)
                if fd is None:
                    fd = own[segment.key] = _lease.reopen(segment.fd)
                    self.inherited_holds.append(fd)
                _lease.hold(fd, segment.offset(index), segment.block_size)
            except OSError:
                pass  # the parent's segment is gone from under us: nothing to protect
        for seg in list(self.segments.values()):
            seg.inherited = True
        for segs in self.pool.segments.values():
            for seg in segs:
                seg.inherited = True
        self.segments.clear()
        self.blocks.clear()
        self.info.clear()
        self.recent.clear()
        self.pool = SegmentPool(self.lock, self.segments)
        self.register_exit_hooks()


REGISTRY = Registry()
_fdlimit.relieve_with(REGISTRY.shed, REGISTRY.segments_held)
atexit.register(REGISTRY.at_exit)
REGISTRY.register_exit_hooks()
os.register_at_fork(after_in_child=REGISTRY.after_fork_in_child)
