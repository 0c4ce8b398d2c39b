"""IPC-safe device blocks: the pool of whole cudaMallocs that travel in place, and the
staging copies that carry small arrays in them.

The CUDA programming guide: IPC shares the whole underlying memory block, and the driver
sub-allocates smaller cudaMallocs from shared blocks, so only allocations of whole
multiples of :data:`IPC_BLOCK` (2 MiB) are safe to share. :class:`BlockPool` owns such
allocations while idle; :class:`IpcBlock` owns one while arrays or sent records use it.
An array smaller than a block, from CuPy's pool, travels as a copy (:func:`stage`) in a
block of the message it is sent in.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .._loop.finalizers import finalizer
from .driver import Backend, Described, DeviceRange

T = TypeVar("T")

#: The size unit of IPC-safe blocks: smaller arrays travel as copies in blocks of it.
IPC_BLOCK = 2 << 20
_STAGE_ALIGN = 512  # cudaMalloc's alignment, for arrays packed into one staging block


class Alloc(DeviceRange):
    """One whole cudaMalloc of a multiple of :data:`IPC_BLOCK` bytes, owned by the pool."""

    __slots__ = ("handle", "mem")

    def __init__(self, device: int, size: int, ptr: int, mem: object) -> None:
        super().__init__(ptr, size, device)
        self.mem = mem  # the backend's allocation: dropping it frees the memory
        self.handle: bytes | None = None  # its IPC handle, asked for once


class IpcBlock:
    """The owner of an IPC-safe block while it is in use (by arrays, or by sent records).

    Arrays from :func:`aiomp.cuda.empty` hold it through their memory's owner; when the
    last reference goes, the allocation goes back to the pool's idle list.
    """

    __slots__ = ("__weakref__", "alloc")

    def __init__(self, alloc: Alloc) -> None:
        self.alloc = alloc

    @property
    def ptr(self) -> int:
        return self.alloc.ptr

    @property
    def size(self) -> int:
        return self.alloc.size

    @property
    def device(self) -> int:
        return self.alloc.device


def retry_oom(
    backend: Backend, dev: int, reclaim: Callable[[int], None], fn: Callable[..., T], *args: object
) -> T:
    """``fn(*args)``; on out-of-memory, ``reclaim(dev)`` what aiomp holds and retry once.

    torch frees released IPC blocks from its allocator's out-of-memory callback; CuPy has
    none, so aiomp does it where it allocates: ``reclaim`` collects the sent blocks every
    consumer has released and frees the idle IPC-safe blocks; CuPy's cached ones are freed
    here. A second out-of-memory error propagates.
    """
    try:
        return fn(*args)
    except BaseException as exc:
        if not backend.is_oom(exc):
            raise
    reclaim(dev)
    backend.free_cached(dev)
    return fn(*args)


class BlockPool:
    """Idle IPC-safe allocations per (device, size), like the host-side segment pool.

    A block is idle once nothing references its :class:`IpcBlock`: no array of the
    producer's and no sent record, which the producer frees once every consumer's lease
    is gone. So reuse follows the same leases as the rest of this package. ``lock`` is
    the CUDA IPC state's lock: callers of :meth:`take` hold it; a block's finalizer takes
    it to give the block back. A pool replaced by another (:meth:`retire`) or inherited
    by a forked child takes nothing back: dropped allocations are freed, or kept as the
    parent's.
    """

    def __init__(self, lock: threading.RLock, reclaim: Callable[[int], None]) -> None:
        self.idle: dict[tuple[int, int], list[Alloc]] = {}
        self.pid = os.getpid()
        self.lock = lock
        self.reclaim = reclaim
        self.retired = False

    def take(self, backend: Backend, dev: int, nbytes: int) -> IpcBlock:
        size = max(1, -(-nbytes // IPC_BLOCK)) * IPC_BLOCK
        idle = self.idle.get((dev, size))
        if idle:
            alloc = idle.pop()
        else:
            ptr, mem = retry_oom(backend, dev, self.reclaim, backend.malloc, dev, size)
            alloc = Alloc(dev, size, ptr, mem)
        block = IpcBlock(alloc)
        weakref.finalize(block, self._give_back, alloc).atexit = False
        return block

    @finalizer
    def _give_back(self, alloc: Alloc) -> None:
        if self.retired or self.pid != os.getpid():
            return  # never the lock of a retired or inherited pool: it may be a stale copy
        with self.lock:
            if not self.retired:
                self.idle.setdefault((alloc.device, alloc.size), []).append(alloc)

    def retire(self) -> None:
        self.retired = True

    def free_idle(self, dev: int) -> None:
        for key in [k for k in self.idle if k[0] == dev]:
            del self.idle[key]  # the last references: the backend frees them

    def idle_count(self) -> int:
        return sum(len(v) for v in self.idle.values())


def stage(
    pool: BlockPool,
    backend: Backend,
    stages: dict[int, list[Any]],
    desc: Described,
    lo: int,
    hi: int,
) -> tuple[IpcBlock, int]:
    """Copy the bytes ``[lo, hi)`` of a small array into its message's IPC-safe staging
    block, on the producer's current stream; returns the block and element 0's offset.

    ``stages`` is the message's ``device -> [staging block, bytes used]``: small arrays of
    one message share staging blocks (512-byte aligned, as cudaMalloc). Under the lock.
    """
    stage = stages.get(desc.device)
    n = hi - lo
    if stage is None or stage[1] + n > stage[0].size:
        stage = stages[desc.device] = [pool.take(backend, desc.device, IPC_BLOCK), 0]
    block, pos = stage
    backend.copy(desc.device, block.ptr + pos, desc.ptr + lo, n)
    stage[1] = pos + -(-n // _STAGE_ALIGN) * _STAGE_ALIGN
    return block, pos - lo
