"""The sending side of CUDA IPC: the reducer of ``cupy.ndarray``, and the records that
keep each sent block alive until every consumer has released it.

What travels (:class:`~aiomp._cuda.meta.IpcArrayMeta`, one small tuple per array): the
``cudaIpcMemHandle`` of the block holding the array, the byte offset of element 0 in it,
shape, strides, dtype, the device (index and PCI bus id), a ``cudaIpcEventHandle``
recorded on the sender's current stream, and the lease slot that keeps the block alive.

Which block an array travels in: an IPC-safe block of :mod:`aiomp._cuda.blocks` (from
:func:`aiomp.cuda.empty`) in place; another array of :data:`~aiomp._cuda.blocks.IPC_BLOCK`
bytes or more in place, in its base allocation (the driver's address range); a smaller one
as a staging copy in an IPC-safe block of its message. Who keeps it alive (R6): a
:class:`~aiomp._cuda.slots.SlotTable` slot per sent block, leased by each message in
flight (through its handoff description, one per message) and each consumer holding a
view; the producer frees a record once the kernel reports no lease on its slot.
"""

from __future__ import annotations

import atexit
import os
import warnings
from typing import Any, cast

from .._errors import CudaIpcError
from .._memory import lease as _lease
from .._wire import pickling as _reduction
from .blocks import IPC_BLOCK, IpcBlock, retry_oom, stage
from .consumer import SlotRef, consumer_maps, rebuild
from .driver import Backend, get_backend
from .meta import IpcArrayMeta, extent, locate
from .slots import SlotTable
from .state import state

#: Live interprocess events per process (torch's CUDA_IPC_MAXIMUM_EVENTS_TO_USE). Past
#: it, a send synchronises the producer's stream and carries no event.
MAX_IPC_EVENTS = 1000


class SentBlock:
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


class Producer:
    """This process's sent blocks (its slot table) and the handoff fds of messages in flight."""

    def __init__(self, backend: Backend, limit: int) -> None:
        self.backend = backend
        self.table: SlotTable[SentBlock] = SlotTable(limit)
        self.events_live = 0
        self.handoffs: set[int] = set()  # open handoff fds: closed in a forked child
        self.pid = os.getpid()

    def collect(self) -> int:
        for record in self.table.collect():
            self.free(record)
        return len(self.table)

    def free(self, record: SentBlock) -> None:
        if record.event is not None:
            assert record.event_handle is not None  # recorded together (_send_block)
            self.events_live -= 1
            self.backend.recycle_event(record.device, record.event, record.event_handle)
        record.keep = []
        record.event = None

    def close_handoff(self, fd: int) -> None:
        with state.lock:
            if fd in self.handoffs:
                self.handoffs.discard(fd)
                os.close(fd)

    def held_bytes(self) -> int:
        return sum(r.size for r in self.table.records.values())

    def drop_fds(self) -> list[int]:
        """In a forked child: forget the fds (the caller closes them) and keep the records.

        The handoffs are cleared, so that a stale Message collected in the child closes
        nothing; the records' arrays are the parent's, never freed here.
        """
        fds = [*self.handoffs, self.table.fd]
        self.handoffs.clear()
        self.table.fd = -1
        return fds

    def close(self) -> None:
        """Close the handoffs and the slot file, forgetting every record (tests only)."""
        for fd in list(self.handoffs):
            self.close_handoff(fd)
        self.table.records.clear()
        self.table.close()


_atexit_registered = False


def get_producer(backend: Backend) -> Producer:
    """This process's producer, made on its first send. Under the lock."""
    global _atexit_registered
    prod = state.producer
    if prod is None:
        prod = state.producer = Producer(backend, state.limit)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_at_exit)
    return prod


def _at_exit() -> None:
    prod = state.own_producer()
    if prod is None:
        return
    with state.lock:
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
    if isinstance(desc.owner, SlotRef) or consumer_maps(desc.device, desc.ptr):
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
        return rebuild, (meta,)
    with state.lock:
        prod = get_producer(backend)
        sending = pad.once(_Sending, _Sending)
        handoff = _handoff(prod, sending)
        staged = False
        if isinstance(desc.owner, IpcBlock):
            block: IpcBlock | None = desc.owner
        elif hi - lo < IPC_BLOCK:
            # The driver sub-allocates small cudaMallocs from shared blocks and a handle
            # shares the whole block: send a copy in an IPC-safe block of this message.
            block, offset = stage(state.pool, backend, sending.stages, desc, lo, hi)
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
            offset = locate(desc, base, size)
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
    return rebuild, (meta,)


def _handoff(prod: Producer, sending: _Sending) -> tuple[int, int]:
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


def _send_block(
    prod: Producer, dev: int, base: int, size: int, handoff_fd: int
) -> tuple[int, bytes | None]:
    backend = prod.backend
    prod.table.check_room()
    if prod.events_live < MAX_IPC_EVENTS:
        event, event_handle = retry_oom(backend, dev, state.reclaim, backend.record_event, dev)
        prod.events_live += 1
    else:
        backend.sync(dev)
        event, event_handle = None, None
    record = SentBlock(event, event_handle, dev, base, size)
    try:
        slot = prod.table.allocate(record)
    except BaseException:
        prod.free(record)
        raise
    try:
        _lease.hold(handoff_fd, slot, 1)
    except BaseException:
        prod.free(prod.table.discard(slot))
        raise
    return slot, event_handle
