"""CUDA IPC for CuPy arrays: the reducer, the pool of IPC-safe blocks, the lease slots.

What travels (:class:`IpcArrayMeta`, one small tuple per array): the ``cudaIpcMemHandle``
of the block holding the array, the byte offset of element 0 in it, shape, strides,
dtype, the device (index and PCI bus id), a ``cudaIpcEventHandle`` recorded on the
sender's current stream, and the lease slot that keeps the block alive.

Which block an array travels in (an IPC-safe block of :class:`_BlockPool`, its base
allocation, or a staging copy made by :func:`_stage`): see
docs/decisions/0030-cuda-ipc.md. Who keeps it alive (R6: a :class:`SlotTable` slot per sent block,
leased by each message in flight and each consumer holding a view, freed by
:meth:`SlotTable.collect`): see
docs/decisions/0030-cuda-ipc.md and *Kernel leases* in docs/architecture.md.

The CUDA calls sit behind a small backend (:class:`_CupyBackend`); the bookkeeping
around it is plain Python that the tests drive with a fake backend (a model of CuPy's
pool and the driver's allocator) on machines without a GPU. Importing this module
imports neither cupy nor ctypes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

from .. import _lifecycle
from .._errors import CudaIpcError
from .._memory import lease as _lease
from .._wire import pickling as _reduction
from . import driver as _driver
from .driver import (
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED,
    Backend,
    Described,
    get_backend,
    libcuda,
)
from .meta import IpcArrayMeta, check_extent, extent, locate
from .slots import DEFAULT_IPC_LIMIT, SlotTable

T = TypeVar("T")

#: Live interprocess events per process (torch's CUDA_IPC_MAXIMUM_EVENTS_TO_USE). Past
#: it, a send synchronises the producer's stream and carries no event.
MAX_IPC_EVENTS = 1000

#: The CUDA programming guide: IPC shares the whole underlying memory block, and the
#: driver sub-allocates smaller cudaMallocs from shared blocks, so only allocations of
#: whole multiples of 2 MiB are safe to share. Smaller arrays travel as copies in blocks
#: of this size.
IPC_BLOCK = 2 << 20
_STAGE_ALIGN = 512  # cudaMalloc's alignment, for arrays packed into one staging block


# -- IPC-safe blocks ------------------------------------------------------------------------


class _Alloc:
    """One whole cudaMalloc of a multiple of :data:`IPC_BLOCK` bytes, owned by the pool."""

    __slots__ = ("device", "handle", "mem", "ptr", "size")

    def __init__(self, device: int, size: int, ptr: int, mem: object) -> None:
        self.device = device
        self.size = size
        self.ptr = ptr
        self.mem = mem  # the backend's allocation: dropping it frees the memory
        self.handle: bytes | None = None  # its IPC handle, asked for once


class IpcBlock:
    """The owner of an IPC-safe block while it is in use (by arrays, or by sent records).

    Arrays from :func:`aiomp.cuda.empty` hold it through their memory's owner; when the
    last reference goes, the allocation goes back to the pool's idle list.
    """

    __slots__ = ("__weakref__", "alloc")

    def __init__(self, alloc: _Alloc) -> None:
        self.alloc = alloc

    @property
    def ptr(self) -> int:
        return self.alloc.ptr

    @property
    def size(self) -> int:
        return self.alloc.size


class _BlockPool:
    """Idle IPC-safe allocations per (device, size), like the host-side segment pool.

    A block is idle once nothing references its :class:`IpcBlock`: no array of the
    producer's and no sent record, which the producer frees once every consumer's lease
    is gone. So reuse follows the same leases as the rest of this module.
    """

    def __init__(self) -> None:
        self.idle: dict[tuple[int, int], list[_Alloc]] = {}
        self.pid = os.getpid()

    def take(self, backend: Backend, dev: int, nbytes: int) -> IpcBlock:
        size = max(1, -(-nbytes // IPC_BLOCK)) * IPC_BLOCK
        idle = self.idle.get((dev, size))
        if idle:
            alloc = idle.pop()
        else:
            ptr, mem = _retry_oom(backend, dev, backend.malloc, dev, size)
            alloc = _Alloc(dev, size, ptr, mem)
        block = IpcBlock(alloc)
        weakref.finalize(block, self._give_back, alloc).atexit = False
        return block

    @_lifecycle.finalizer
    def _give_back(self, alloc: _Alloc) -> None:
        with _lock:
            if self is _block_pool and self.pid == os.getpid():
                self.idle.setdefault((alloc.device, alloc.size), []).append(alloc)

    def free_idle(self, dev: int) -> None:
        for key in [k for k in self.idle if k[0] == dev]:
            del self.idle[key]  # the last references: the backend frees them

    def idle_count(self) -> int:
        return sum(len(v) for v in self.idle.values())


_block_pool = _BlockPool()


def _retry_oom(backend: Backend, dev: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``; on out-of-memory, reclaim what aiomp holds and retry once.

    torch frees released IPC blocks from its allocator's out-of-memory callback; CuPy has
    none, so aiomp does it where it allocates: collect the sent blocks every consumer has
    released, free the idle IPC-safe blocks and CuPy's cached ones, and try again. A
    second out-of-memory error propagates.
    """
    try:
        return fn(*args)
    except BaseException as exc:
        if not backend.is_oom(exc):
            raise
    with _lock:
        prod = _producer_state
        if prod is not None and prod.pid == os.getpid():
            prod.collect()
        _block_pool.free_idle(dev)
    backend.free_cached(dev)
    return fn(*args)


def empty(shape: Any, dtype: Any = float, *, zero: bool = False) -> Any:
    """See :func:`aiomp.cuda.empty` (``zero``: :func:`aiomp.cuda.zeros`)."""
    import numpy

    dt = numpy.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"a CUDA array cannot hold Python objects (dtype {dt})")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(n, int | numpy.integer) for n in dims):
        raise TypeError(f"shape must be an int or a tuple of ints, not {shape!r}")
    dims = tuple(int(n) for n in dims)
    if any(n < 0 for n in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    nbytes = dt.itemsize
    for n in dims:
        nbytes *= n
    backend = get_backend()
    dev = backend.current_device()
    if nbytes == 0:
        return backend.empty(dims, dt.str, dev)
    with _lock:
        block = _block_pool.take(backend, dev, nbytes)
    if zero:
        backend.memset(dev, block.ptr, nbytes)  # on the current stream, like cupy.zeros
    strides, acc = [], dt.itemsize
    for n in reversed(dims):
        strides.append(acc)
        acc *= n
    return backend.wrap(
        block.ptr, block.size, block, dev, 0, dims, tuple(reversed(strides)), dt.str
    )


# -- producer -------------------------------------------------------------------------------


class _Sent:
    """A sent block, kept alive until every consumer has released it.

    ``keep`` holds the memory of *every* array sent in it (a pool allocation is split
    into chunks that CuPy frees one by one), not only the first one's.
    """

    __slots__ = ("base", "device", "event", "event_handle", "keep", "size")

    def __init__(
        self, event: object, event_handle: bytes | None, device: int, base: int, size: int
    ) -> None:
        self.keep: list[object] = []
        self.event = event
        self.event_handle = event_handle
        self.device = device
        self.base = base
        self.size = size

    def hold(self, memory: object) -> None:
        if not any(m is memory for m in self.keep):
            self.keep.append(memory)


class _Producer:
    def __init__(self, backend: Backend, limit: int) -> None:
        self.backend = backend
        self.table: SlotTable[_Sent] = SlotTable(limit)
        self.events_live = 0
        self.handoffs: set[int] = set()  # open handoff fds: closed in a forked child
        self.pid = os.getpid()

    def collect(self) -> int:
        for record in self.table.collect():
            self._free(record)
        return len(self.table)

    def _free(self, record: _Sent) -> None:
        if record.event is not None:
            assert record.event_handle is not None  # recorded together (_send_block)
            self.events_live -= 1
            self.backend.recycle_event(record.device, record.event, record.event_handle)
        record.keep = []
        record.event = None

    def close_handoff(self, fd: int) -> None:
        with _lock:
            if fd in self.handoffs:
                self.handoffs.discard(fd)
                os.close(fd)

    def held_bytes(self) -> int:
        return sum(r.size for r in self.table.records.values())


_lock = threading.RLock()
_producer_state: _Producer | None = None
_limit = DEFAULT_IPC_LIMIT
_atexit_registered = False


def _get_producer(backend: Backend) -> _Producer:
    global _producer_state, _atexit_registered
    if _producer_state is None:
        _producer_state = _Producer(backend, _limit)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_at_exit)
    return _producer_state


def _at_exit() -> None:
    prod = _producer_state
    if prod is None or prod.pid != os.getpid():
        return
    with _lock:
        try:
            held = prod.collect()
        except OSError:
            return
        if held:
            warnings.warn(
                f"aiomp.cuda: process {os.getpid()} is exiting while consumers still hold "
                f"{held} CUDA block(s) it sent ({prod.held_bytes()} bytes): their arrays "
                "become invalid. Keep a producer alive until its consumers drop what they "
                "received (wait for their reply), or have consumers copy what they keep",
                RuntimeWarning,
                stacklevel=1,
            )


class _Sending:
    """What one message's CuPy arrays share (its scratchpad entry): the handoff
    description holding the leases of all its blocks, the blocks sent in it, and the
    staging block per device its small arrays are copied into."""

    __slots__ = ("blocks", "handoff", "stages")

    def __init__(self) -> None:
        self.handoff: tuple[int, int] | None = None  # (fd, index in the message)
        self.blocks: dict[tuple[int, int], tuple[int, bytes | None]] = {}  # (dev, base) -> slot
        self.stages: dict[int, list[Any]] = {}  # device -> [staging block, bytes used]


def reduce_array(arr: Any) -> tuple[Any, tuple[IpcArrayMeta]]:
    """Reducer for ``cupy.ndarray`` in aiomp messages (see the module docstring)."""
    pad = _reduction.current()
    backend = get_backend()
    desc = backend.describe(arr)
    # Before any CUDA call: the driver may refuse to export imported memory, and that
    # error would hide the real one (torch checks first too).
    if isinstance(desc.owner, _SlotRef) or _consumer_maps(desc.device, desc.ptr):
        raise CudaIpcError(
            "cannot send a CuPy array that this process received from another process "
            "(its memory belongs to the sender, which tracks only the consumers it sent "
            "to): send a copy (arr.copy()), or have the original sender send it"
        )
    dev = desc.device
    lo, hi = extent(desc.shape, desc.strides, desc.itemsize)
    if hi == lo:
        meta = IpcArrayMeta(
            None,
            0,
            0,
            desc.shape,
            desc.strides,
            desc.dtype,
            dev,
            backend.bus_id(dev),
            None,
            os.getpid(),
            -1,
            -1,
        )
        return _rebuild, (meta,)
    with _lock:
        prod = _get_producer(backend)
        sending = pad.once(_Sending, _Sending)
        handoff = _handoff(prod, sending)
        staged = False
        if isinstance(desc.owner, IpcBlock):
            block: IpcBlock | None = desc.owner
        elif hi - lo < IPC_BLOCK:
            # The driver sub-allocates small cudaMallocs from shared blocks and a handle
            # shares the whole block: send a copy in an IPC-safe block of this message.
            block, offset = _stage(backend, sending, desc, lo, hi)
            staged = True
        else:
            block = None
        if block is not None:
            alloc = block.alloc
            base, size, keep = alloc.ptr, alloc.size, cast("object", block)
            if alloc.handle is None:
                alloc.handle = backend.ipc_handle(dev, base)
            handle = alloc.handle
        else:
            base, size = backend.address_range(dev, desc.ptr)
            handle = backend.ipc_handle(dev, base)
            keep = desc.keep
        if not staged:
            offset = locate(desc.ptr, base, size, desc.shape, desc.strides, desc.itemsize)
        entry = sending.blocks.get((dev, base))
        if entry is None:
            entry = sending.blocks[dev, base] = _send_block(prod, dev, base, size, handoff[0])
        elif staged:
            # The copy was queued after the slot's event was recorded: record it again,
            # so that the consumer's wait (made once the message has arrived) covers it.
            record = prod.table.records[entry[0]]
            if record.event is not None:
                backend.record(record.event, dev)
            else:
                backend.sync(dev)
        slot, event_handle = entry
        prod.table.records[slot].hold(keep)
    meta = IpcArrayMeta(
        handle,
        size,
        offset,
        desc.shape,
        desc.strides,
        desc.dtype,
        dev,
        backend.bus_id(dev),
        event_handle,
        os.getpid(),
        slot,
        handoff[1],
    )
    return _rebuild, (meta,)


def _handoff(prod: _Producer, sending: _Sending) -> tuple[int, int]:
    """The message's handoff description (fd, index), made on its first block.

    One description per message holds the leases of all its blocks; making it is also
    the collection cadence (once per message).
    """
    handoff = sending.handoff
    if handoff is None:
        prod.collect()
        fd = _lease.reopen(prod.table.fd)
        prod.handoffs.add(fd)
        try:
            index = _reduction.add_fd(fd)
        except BaseException:
            prod.close_handoff(fd)
            raise
        _reduction.on_sent(lambda: prod.close_handoff(fd))
        handoff = sending.handoff = (fd, index)
    return handoff


def _stage(
    backend: Backend, sending: _Sending, desc: Described, lo: int, hi: int
) -> tuple[IpcBlock, int]:
    """Copy the bytes ``[lo, hi)`` of a small array into this message's IPC-safe staging
    block, on the producer's current stream; returns the block and element 0's offset.

    Small arrays of one message share staging blocks (512-byte aligned, as cudaMalloc).
    """
    stage = sending.stages.get(desc.device)
    n = hi - lo
    if stage is None or stage[1] + n > stage[0].size:
        stage = sending.stages[desc.device] = [_block_pool.take(backend, desc.device, IPC_BLOCK), 0]
    block, pos = stage
    backend.copy(desc.device, block.ptr + pos, desc.ptr + lo, n)
    stage[1] = pos + -(-n // _STAGE_ALIGN) * _STAGE_ALIGN
    return block, pos - lo


def _send_block(
    prod: _Producer, dev: int, base: int, size: int, handoff_fd: int
) -> tuple[int, bytes | None]:
    backend = prod.backend
    prod.table.check_room()
    if prod.events_live < MAX_IPC_EVENTS:
        event, event_handle = _retry_oom(backend, dev, backend.record_event, dev)
        prod.events_live += 1
    else:
        backend.sync(dev)
        event, event_handle = None, None
    record = _Sent(event, event_handle, dev, base, size)
    try:
        slot = prod.table.allocate(record)
    except BaseException:
        prod._free(record)
        raise
    try:
        _lease.hold(handoff_fd, slot, 1)
    except BaseException:
        prod._free(prod.table.discard(slot))
        raise
    return slot, event_handle


# -- consumer -------------------------------------------------------------------------------


class _SlotRef:
    """Owner of every view rebuilt from one received slot; its death releases the slot."""

    __slots__ = ("__weakref__", "device", "keep", "ptr", "size")

    def __init__(self, ptr: int, size: int, device: int, keep: object) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self.keep = keep  # same-process receipt: the producer's memory


class _Holder:
    __slots__ = ("count", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0


class _Mapping:
    """One opened IPC memory handle, shared by every received slot that names it."""

    __slots__ = ("count", "device", "ptr", "size")

    def __init__(self, ptr: int, size: int, device: int) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self.count = 0


class _Consumer:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.holders: dict[tuple[int, int], _Holder] = {}
        self.mappings: dict[tuple[bytes, int], _Mapping] = {}
        self.slots: dict[tuple[tuple[int, int], int], weakref.ref[_SlotRef]] = {}


_consumer_state: _Consumer | None = None


def _get_consumer() -> _Consumer:
    global _consumer_state
    if _consumer_state is None:
        _consumer_state = _Consumer()
    return _consumer_state


def _consumer_maps(device: int, ptr: int) -> bool:
    """Does ``ptr`` lie inside memory this process opened through IPC?"""
    cons = _consumer_state
    if cons is None or not cons.mappings:
        return False
    with _lock:
        return any(
            m.device == device and m.ptr <= ptr < m.ptr + m.size for m in cons.mappings.values()
        )


def _rebuild(meta: IpcArrayMeta) -> Any:
    backend = get_backend()
    if meta.handle is None:
        return backend.empty(meta.shape, meta.dtype, backend.local_device(meta.bus_id, meta.device))
    fd = _reduction.peek_fd(meta.fd_index)
    ident = _lease.identity(fd)
    key = (ident, meta.slot)
    with _lock:
        cons = _get_consumer()
        wr = cons.slots.get(key)
        ref = wr() if wr is not None else None
        if ref is None:
            ref = _import(cons, backend, meta, fd, ident, key)
    check_extent(meta.offset, ref.size, meta.shape, meta.strides, _itemsize(meta.dtype))
    return backend.wrap(
        ref.ptr, ref.size, ref, ref.device, meta.offset, meta.shape, meta.strides, meta.dtype
    )


def _itemsize(dtype: str) -> int:
    import numpy

    return int(numpy.dtype(dtype).itemsize)


def _import(
    cons: _Consumer,
    backend: Backend,
    meta: IpcArrayMeta,
    fd: int,
    ident: tuple[int, int],
    key: tuple[tuple[int, int], int],
) -> _SlotRef:
    holder = cons.holders.get(ident)
    if holder is None:
        holder = cons.holders[ident] = _Holder(_lease.reopen(fd))
    holder.count += 1
    mapping_key: tuple[bytes, int] | None = None
    try:
        _lease.hold(holder.fd, meta.slot, 1)
        prod = _producer_state
        if (
            meta.pid == os.getpid()
            and prod is not None
            and prod.table.ident == ident
            and meta.slot in prod.table.records
        ):
            # Sent to ourselves: the memory is ours already (a handle cannot be opened in
            # the process that exported it).
            rec = prod.table.records[meta.slot]
            if rec.event is not None:
                backend.wait_local(rec.event, rec.device)
            ref = _SlotRef(rec.base, rec.size, rec.device, list(rec.keep))
        else:
            dev = backend.local_device(meta.bus_id, meta.device)
            assert meta.handle is not None
            try:
                if meta.event is not None:
                    backend.wait(meta.event, dev)
                mapping = cons.mappings.get((meta.handle, dev))
                if mapping is None:
                    ptr = backend.open(meta.handle, dev)
                    mapping = _Mapping(ptr, meta.alloc_size, dev)
                    cons.mappings[(meta.handle, dev)] = mapping
            except backend.error_type() as exc:
                raise CudaIpcError(_open_failed(meta, exc)) from exc
            mapping.count += 1
            mapping_key = (meta.handle, dev)
            ref = _SlotRef(mapping.ptr, meta.alloc_size, dev, None)
    except BaseException:
        _drop(cons, backend, ident, meta.slot, mapping_key)
        raise
    cons.slots[key] = wr = weakref.ref(ref)
    # Not at exit: the kernel drops the leases with the process, and CUDA may be half
    # torn down by then.
    weakref.finalize(ref, _release, cons, key, mapping_key, ref.device, wr).atexit = False
    return ref


def _open_failed(meta: IpcArrayMeta, exc: BaseException) -> str:
    try:
        os.kill(meta.pid, 0)
        alive = "is still running"
    except ProcessLookupError:
        alive = "has exited"
    except PermissionError:
        alive = "is still running"
    hint = (
        "a process must stay alive while others use the CUDA arrays it sent "
        "(return host copies, cupy.asnumpy(x), from spawned functions)"
        if alive == "has exited"
        else "the sender and receiver must share the GPU and IPC namespace"
    )
    return f"could not open a CUDA array sent by process {meta.pid}, which {alive}: {exc}; {hint}"


@_lifecycle.finalizer
def _release(
    cons: _Consumer,
    key: tuple[tuple[int, int], int],
    mapping_key: tuple[bytes, int] | None,
    device: int,
    wr: weakref.ref[_SlotRef],
) -> None:
    """Finalizer of a received slot: its last view died."""
    if cons is not _consumer_state or sys.is_finalizing():
        return  # a forked copy, state reset, or shutdown: leases die with the process
    backend = _driver.backend
    if backend is None:
        return
    with _lock:
        mapping = cons.mappings.get(mapping_key) if mapping_key is not None else None
        if mapping is not None and mapping.count > 1:
            # Another received slot still maps the allocation, so the producer can neither
            # free nor reuse it; the last slot's release syncs for the kernels of both.
            _forget(cons, backend, key, mapping_key, wr)
            return
    try:
        # Kernels the consumer queued on the memory may still run; the producer may
        # reuse it as soon as the lease goes (torch synchronises here too).
        backend.sync(device)
    finally:
        with _lock:
            _forget(cons, backend, key, mapping_key, wr)


def _forget(
    cons: _Consumer,
    backend: Backend,
    key: tuple[tuple[int, int], int],
    mapping_key: tuple[bytes, int] | None,
    wr: weakref.ref[_SlotRef],
) -> None:
    """Under ``_lock``: remove a dead slot and release its lease (and its mapping's)."""
    if cons.slots.get(key) is wr:
        del cons.slots[key]
    _drop(cons, backend, key[0], key[1], mapping_key)


def _drop(
    cons: _Consumer,
    backend: Backend,
    ident: tuple[int, int],
    slot: int,
    mapping_key: tuple[bytes, int] | None,
) -> None:
    """Close the slot's mapping if no other slot uses it, then release its lease.

    In that order: the producer may free the memory as soon as the lease goes, and
    freeing an exported region before the importer has closed its mapping is undefined
    behaviour (CUDA driver API, cuIpcCloseMemHandle). The release (and the close of the
    lease description) happens whatever the close does.
    """
    try:
        if mapping_key is not None:
            mapping = cons.mappings.get(mapping_key)
            if mapping is not None:
                mapping.count -= 1
                if mapping.count <= 0:
                    del cons.mappings[mapping_key]
                    backend.close(mapping.ptr, mapping_key[1])
    finally:
        holder = cons.holders.get(ident)
        if holder is not None:
            try:
                _lease.release(holder.fd, slot, 1)
            finally:
                holder.count -= 1
                if holder.count <= 0:
                    del cons.holders[ident]
                    os.close(holder.fd)


# -- fork, public helpers ------------------------------------------------------------------


_fork_orphans: list[object] = []


def _after_fork_in_child() -> None:
    """A forked child owns none of its parent's leases: drop the copies, release nothing."""
    global _producer_state, _consumer_state, _lock, _block_pool
    _lock = threading.RLock()
    # The parent's idle IPC-safe blocks: kept, never freed or reused here.
    _fork_orphans.append(_block_pool)
    _block_pool = _BlockPool()
    prod, _producer_state = _producer_state, None
    cons, _consumer_state = _consumer_state, None
    fds: list[int] = []
    if prod is not None:
        # Cleared, so that a stale Message collected in this child closes nothing.
        fds.extend(prod.handoffs)
        prod.handoffs.clear()
        fds.append(prod.table.fd)
        prod.table.fd = -1
        # The records' arrays are the parent's: kept, so that freeing them here never
        # reaches CUDA in a forked child.
        _fork_orphans.append(prod)
    if cons is not None:
        fds.extend(h.fd for h in cons.holders.values())
        cons.holders.clear()
        cons.mappings.clear()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def init_reductions() -> None:
    """Register aiomp's reducer for ``cupy.ndarray`` (called by
    :func:`aiomp._wire.pickling.init_reductions` once cupy has been imported)."""
    cupy: Any = sys.modules["cupy"]
    _reduction.register(cupy.ndarray, reduce_array)


def cuda_initialized() -> bool:
    """True if CUDA has been initialised in this process (R14: fork would be unsafe).

    Cheap and side-effect free: False when cupy is not imported; otherwise asks an
    *already loaded* libcuda whether ``cuInit`` has run (``cuDeviceGetCount`` answers
    CUDA_ERROR_NOT_INITIALIZED before it), loading nothing and initialising nothing.
    """
    if "cupy" not in sys.modules:
        return False
    if _producer_state is not None or _consumer_state is not None:
        return True
    lib = libcuda(noload=True)
    if lib is None:
        return False
    import ctypes

    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return rc not in (CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NO_DEVICE)


@_lifecycle.on_fork_check
def _refuse_fork() -> None:
    """A forked child cannot use the CUDA its parent initialised: refuse the fork."""
    if cuda_initialized():
        raise RuntimeError(
            "cannot fork: CUDA is initialised in this process and a forked child "
            "cannot use it; use start_method='spawn' or 'forkserver'"
        )


def ipc_collect() -> int:
    """Free sent blocks that every consumer has released; returns how many are still held."""
    prod = _producer_state
    if prod is None or prod.pid != os.getpid():
        return 0
    with _lock:
        return prod.collect()


def get_ipc_limit() -> int:
    return _limit


def set_ipc_limit(limit: int) -> None:
    global _limit
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"the limit must be an int >= 1, not {limit!r}")
    with _lock:
        _limit = limit
        if _producer_state is not None:
            _producer_state.table.limit = limit


class IpcStatistics(NamedTuple):
    """A snapshot of this process's CUDA IPC state (see :func:`aiomp.cuda.statistics`)."""

    sent_held: int  #: blocks sent and not yet seen released (as of the last collect)
    sent_bytes: int  #: bytes in those blocks' allocations
    events: int  #: interprocess events held for them
    received_held: int  #: received blocks this process still has views of
    received_open: int  #: IPC memory handles this process has open
    limit: int  #: the outstanding-block limit
    idle_blocks: int  #: IPC-safe blocks (aiomp.cuda.empty, staging) cached for reuse


IpcStatistics.__module__ = "aiomp.cuda"


def statistics() -> IpcStatistics:
    with _lock:
        prod = _producer_state if (_producer_state and _producer_state.pid == os.getpid()) else None
        cons = _consumer_state
        held = sum(1 for r in cons.slots.values() if r() is not None) if cons else 0
        return IpcStatistics(
            len(prod.table) if prod else 0,
            prod.held_bytes() if prod else 0,
            prod.events_live if prod else 0,
            held,
            len(cons.mappings) if cons else 0,
            _limit,
            _block_pool.idle_count(),
        )


def _reset() -> None:
    """Forget all state, closing this process's lease fds (tests only)."""
    global _producer_state, _consumer_state, _block_pool
    with _lock:
        _block_pool = _BlockPool()
        prod, _producer_state = _producer_state, None
        cons, _consumer_state = _consumer_state, None
        if prod is not None:
            for fd in list(prod.handoffs):
                prod.close_handoff(fd)
            prod.table.records.clear()
            prod.table.close()
        if cons is not None:  # live views' finalizers see a new state and do nothing
            for holder in cons.holders.values():
                os.close(holder.fd)
            cons.holders.clear()
            cons.mappings.clear()
            cons.slots.clear()
