"""The receiving side of CUDA IPC: rebuilding ``cupy.ndarray`` views on opened IPC memory
handles, and releasing each received slot's lease when its last view dies.

A consumer opens each IPC memory handle once (:class:`OpenedHandle`, shared by every
received slot naming it), takes a lease of its own on each received slot (through a
:class:`LeaseHolder`, one reopened slot file per producer), and owns every view rebuilt
from one slot through a :class:`SlotRef`. When the last view of a slot dies, the
consumer synchronises the device (its kernels may still use the memory), closes the
handle if no other slot maps it, then releases the lease: in that order, since the
producer may free the memory as soon as the lease goes. A received array cannot be sent
onward (:func:`consumer_maps` tells the producer).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

from .._errors import CudaIpcError
from .._loop.finalizers import finalizer
from .._memory import lease as _lease
from .._wire import pickling as _reduction
from . import driver as _driver
from .driver import Backend, DeviceRange, get_backend
from .meta import IpcArrayMeta, check_extent
from .state import state


class SlotRef(DeviceRange):
    """Owner of every view rebuilt from one received slot; its death releases the slot."""

    __slots__ = ("__weakref__", "keep")

    def __init__(self, ptr: int, size: int, device: int, keep: object) -> None:
        super().__init__(ptr, size, device)
        self.keep = keep  # same-process receipt: the producer's memory


class LeaseHolder:
    """This consumer's own description of one producer's slot file, and its users."""

    __slots__ = ("count", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0


class OpenedHandle(DeviceRange):
    """One opened IPC memory handle, shared by every received slot that names it."""

    __slots__ = ("count",)

    def __init__(self, ptr: int, size: int, device: int) -> None:
        super().__init__(ptr, size, device)
        self.count = 0


class Consumer:
    """This process's leases on received slots, its open handles and its live slots."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.holders: dict[tuple[int, int], LeaseHolder] = {}
        self.mappings: dict[tuple[bytes, int], OpenedHandle] = {}
        self.slots: dict[tuple[tuple[int, int], int], weakref.ref[SlotRef]] = {}

    def drop_fds(self) -> list[int]:
        """Forget the lease holders and open handles; the caller closes the fds returned."""
        fds = [h.fd for h in self.holders.values()]
        self.holders.clear()
        self.mappings.clear()
        return fds


def _get_consumer() -> Consumer:
    cons = state.consumer
    if cons is None:
        cons = state.consumer = Consumer()
    return cons


def consumer_maps(device: int, ptr: int) -> bool:
    """Does ``ptr`` lie inside memory this process opened through IPC?"""
    cons = state.consumer
    if cons is None or not cons.mappings:
        return False
    with state.lock:
        return any(
            m.device == device and m.ptr <= ptr < m.ptr + m.size for m in cons.mappings.values()
        )


def rebuild(meta: IpcArrayMeta) -> Any:
    """Rebuild a sent array as a view of its slot (opened once per slot)."""
    backend = get_backend()
    if meta.handle is None:
        return backend.empty(meta.shape, meta.dtype, backend.local_device(meta.bus_id, meta.device))
    fd = _reduction.peek_fd(meta.fd_index)
    ident = _lease.identity(fd)
    key = (ident, meta.slot)
    with state.lock:
        cons = _get_consumer()
        wr = cons.slots.get(key)
        ref = wr() if wr is not None else None
        if ref is None:
            ref = _import(cons, backend, meta, fd, ident, key)
    check_extent(meta.offset, ref.size, meta.shape, meta.strides, _itemsize(meta.dtype))
    return backend.wrap(ref, meta)


def _itemsize(dtype: str) -> int:
    import numpy

    return int(numpy.dtype(dtype).itemsize)


def _import(
    cons: Consumer,
    backend: Backend,
    meta: IpcArrayMeta,
    fd: int,
    ident: tuple[int, int],
    key: tuple[tuple[int, int], int],
) -> SlotRef:
    holder = cons.holders.get(ident)
    if holder is None:
        holder = cons.holders[ident] = LeaseHolder(_lease.reopen(fd))
    holder.count += 1
    mapping_key: tuple[bytes, int] | None = None
    try:
        _lease.hold(holder.fd, meta.slot, 1)
        prod = state.producer
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
            ref = SlotRef(rec.base, rec.size, rec.device, list(rec.keep))
        else:
            dev = backend.local_device(meta.bus_id, meta.device)
            assert meta.handle is not None
            try:
                if meta.event is not None:
                    backend.wait(meta.event, dev)
                mapping = cons.mappings.get((meta.handle, dev))
                if mapping is None:
                    ptr = backend.open(meta.handle, dev)
                    mapping = OpenedHandle(ptr, meta.alloc_size, dev)
                    cons.mappings[(meta.handle, dev)] = mapping
            except backend.error_type() as exc:
                raise CudaIpcError(_open_failed(meta, exc)) from exc
            mapping.count += 1
            mapping_key = (meta.handle, dev)
            ref = SlotRef(mapping.ptr, meta.alloc_size, dev, None)
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


@finalizer
def _release(
    cons: Consumer,
    key: tuple[tuple[int, int], int],
    mapping_key: tuple[bytes, int] | None,
    device: int,
    wr: weakref.ref[SlotRef],
) -> None:
    """Finalizer of a received slot: its last view died."""
    if cons is not state.consumer or sys.is_finalizing():
        return  # a forked copy, state reset, or shutdown: leases die with the process
    backend = _driver.backend
    if backend is None:
        return
    with state.lock:
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
        with state.lock:
            _forget(cons, backend, key, mapping_key, wr)


def _forget(
    cons: Consumer,
    backend: Backend,
    key: tuple[tuple[int, int], int],
    mapping_key: tuple[bytes, int] | None,
    wr: weakref.ref[SlotRef],
) -> None:
    """Under the lock: remove a dead slot and release its lease (and its mapping's)."""
    if cons.slots.get(key) is wr:
        del cons.slots[key]
    _drop(cons, backend, key[0], key[1], mapping_key)


def _drop(
    cons: Consumer,
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
