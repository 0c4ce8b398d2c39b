"""CUDA IPC for CuPy arrays: handles, offsets, events, kernel-kept reference counts.

What travels (:class:`IpcArrayMeta`, one small tuple per array): the ``cudaIpcMemHandle``
of the array's *base allocation* (pooled allocators place arrays inside larger blocks;
the driver's address-range query finds the block), the byte offset of element 0 in it,
shape, strides, dtype, the device (index and PCI bus id), a ``cudaIpcEventHandle``
recorded on the sender's current stream, and the lease slot that keeps the block alive.

Lifetime (DESIGN R6), with the leases of :mod:`aiomp._lease`:

- The producer owns one lease memfd. Every sent block gets a slot (one byte of that
  file) and a record holding a reference to the array's memory, so CuPy cannot free or
  reuse the block. The message carries a handoff description that holds the slot's
  lease while it is in flight (one description per message, whatever its array count).
- The consumer takes its own lease on the slot through one description per producer
  lease file, opens the IPC handle (once per process: opened handles are cached and
  shared by every slot that names them), makes its current stream wait on the event and
  returns a ``cupy.ndarray`` view. When the last view of the slot dies, a finalizer
  synchronises the consumer's current stream (as torch does: its kernels may still be
  reading), releases the lease and closes the handle if no other slot uses it.
  A consumer that dies, by SIGKILL too, loses its leases with its descriptions.
- The producer frees records whose slot nobody holds any more (:meth:`SlotTable.collect`,
  one ``F_OFD_GETLK`` per held range), at every message sent and in
  :func:`aiomp.cuda.ipc_collect`. At most :data:`DEFAULT_IPC_LIMIT`
  blocks (settable) may be outstanding: past it, sending raises :class:`IpcLimitError`.
  At most :data:`MAX_IPC_EVENTS` interprocess events are live (torch's cap); past it the
  producer synchronises its stream instead and sends no event.

The CUDA calls sit behind a small backend (:class:`_CupyBackend`); the bookkeeping
around it is plain Python that the tests drive with a fake backend on machines without
a GPU. Importing this module imports neither cupy nor ctypes.
"""

from __future__ import annotations

import atexit
import fcntl
import heapq
import os
import sys
import threading
import warnings
import weakref
from typing import Any, NamedTuple, cast

from . import _lease, _reduction

#: Blocks a process may have sent and not yet seen released, unless changed with
#: :func:`aiomp.cuda.set_ipc_limit`.
DEFAULT_IPC_LIMIT = 1000
#: Live interprocess events per process (torch's CUDA_IPC_MAXIMUM_EVENTS_TO_USE). Past
#: it, a send synchronises the producer's stream and carries no event.
MAX_IPC_EVENTS = 1000
#: Idle interprocess events kept per device for reuse.
EVENT_POOL_SIZE = 64

_CUDA_ERROR_NOT_INITIALIZED = 3
_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_INVALID_CONTEXT = 201


class CudaIpcError(RuntimeError):
    """A CuPy array could not be sent or received as a CUDA IPC handle.

    Raised by ``put`` (and anything else that pickles an aiomp message) in the sender,
    or by ``get`` in the receiver. The message says why and what to do.
    """


class IpcLimitError(CudaIpcError):
    """Too many sent CUDA blocks are still held by consumers (raised at ``put``)."""


CudaIpcError.__module__ = "aiomp.cuda"
IpcLimitError.__module__ = "aiomp.cuda"


# -- pure parts: what is pickled, where an array sits in its allocation ---------------------


class IpcArrayMeta(NamedTuple):
    """What a CuPy array becomes in an aiomp message."""

    handle: bytes | None  #: cudaIpcMemHandle of the base allocation; None: empty array
    alloc_size: int  #: bytes in the base allocation
    offset: int  #: byte offset of element 0 from the base
    shape: tuple[int, ...]
    strides: tuple[int, ...]  #: in bytes, as cupy reports them
    dtype: str  #: numpy dtype string, e.g. ``"<f4"``
    device: int  #: device index in the sender
    bus_id: str  #: PCI bus id of the device ("" if unknown): indices differ between processes
    event: bytes | None  #: cudaIpcEventHandle to wait on; None: the sender synchronised
    pid: int  #: the sender's pid
    slot: int  #: lease slot in the sender's lease file; -1 for empty arrays
    fd_index: int  #: index of the lease handoff fd among the message's fds; -1 if none


def extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` an array touches, relative to its element 0.

    ``lo`` is negative when some stride is; ``(0, 0)`` for an empty array.
    """
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    if any(n == 0 for n in shape):
        return 0, 0
    lo = hi = 0
    for n, s in zip(shape, strides, strict=True):
        if n < 0:
            raise ValueError(f"negative dimension in shape {shape}")
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def locate(
    ptr: int,
    base: int,
    size: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
) -> int:
    """The offset of an array's element 0 (at ``ptr``) in the allocation ``[base, base+size)``.

    Raises ValueError if any byte the array touches falls outside the allocation.
    """
    offset = ptr - base
    check_extent(offset, size, shape, strides, itemsize)
    return offset


def check_extent(
    offset: int, size: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> None:
    """Raise ValueError unless the array at ``offset`` lies inside ``size`` bytes."""
    lo, hi = extent(shape, strides, itemsize)
    if hi == lo:
        return
    if offset + lo < 0 or offset + hi > size:
        raise ValueError(
            f"array bytes [{offset + lo}, {offset + hi}) fall outside its allocation "
            f"of {size} bytes (shape {shape}, strides {strides}, itemsize {itemsize})"
        )


# -- lease bookkeeping (producer side) ------------------------------------------------------


def held_ranges(fd: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The parts of ``[start, stop)`` that some other description holds a lease on.

    ``F_OFD_GETLK`` names one conflicting lock per call, not necessarily the lowest, so
    this splits around each answer: about two calls per held range, one if none is held.
    Returns sorted, possibly adjacent, ``(start, stop)`` pairs.
    """
    out: list[tuple[int, int]] = []
    todo = [(start, stop)]
    while todo:
        a, b = todo.pop()
        if a >= b:
            continue
        raw = _lease._lock(fd, _lease._GETLK, fcntl.F_WRLCK, a, b - a)
        kind, _whence, lstart, length, _pid = _lease._FLOCK.unpack(raw)
        if kind == fcntl.F_UNLCK:
            continue
        lstop = b if length == 0 else lstart + length
        lo, hi = max(a, lstart), min(b, lstop)
        if lo >= hi:  # defensive: the kernel only reports overlapping locks
            continue
        out.append((lo, hi))
        todo.append((a, lo))
        todo.append((hi, b))
    out.sort()
    return out


class SlotTable:
    """Slots of one producer lease file and the record kept alive for each sent slot.

    No CUDA here: a record is whatever the caller keeps alive. Not thread-safe (the
    producer serialises calls).
    """

    def __init__(self, limit: int = DEFAULT_IPC_LIMIT) -> None:
        self.fd = os.memfd_create("aiomp-cuda-lease", os.MFD_CLOEXEC)
        self.ident = _lease.identity(self.fd)
        self.limit = limit
        self.records: dict[int, object] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first keeps ranges short
        self._next = 0

    def __len__(self) -> int:
        return len(self.records)

    def allocate(self, record: object) -> int:
        """A free slot for ``record``; IpcLimitError when ``limit`` slots are outstanding.

        The caller must hold the slot's lease (through a handoff description) before
        the next :meth:`collect`, which otherwise frees it at once.
        """
        self.check_room()
        slot = heapq.heappop(self._free) if self._free else self._next
        if slot == self._next:
            self._next += 1
        self.records[slot] = record
        return slot

    def check_room(self) -> None:
        """Raise IpcLimitError if no slot may be allocated."""
        if len(self.records) >= self.limit:
            raise IpcLimitError(
                f"{len(self.records)} CUDA blocks sent by this process are still held by "
                f"their consumers (the limit is {self.limit}): consumers must drop the "
                "arrays they received (or copy them) before more can be sent. Wait for "
                "them (for example for a reply), then retry; or raise the limit with "
                "aiomp.cuda.set_ipc_limit()"
            )

    def discard(self, slot: int) -> object:
        """Forget ``slot`` now (a send that failed before its lease was taken)."""
        record = self.records.pop(slot)
        heapq.heappush(self._free, slot)
        return record

    def collect(self) -> list[object]:
        """Free every slot that no description holds; returns their records."""
        if not self.records:
            return []
        held = held_ranges(self.fd, 0, self._next)
        released: list[object] = []
        i = 0
        for slot in sorted(self.records):
            while i < len(held) and held[i][1] <= slot:
                i += 1
            if i < len(held) and held[i][0] <= slot:
                continue
            released.append(self.records.pop(slot))
            heapq.heappush(self._free, slot)
        if not self.records:  # all free: start again from slot 0
            self._free.clear()
            self._next = 0
        return released

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# -- the CUDA backend -----------------------------------------------------------------------


class Export(NamedTuple):
    """What the backend reports about an array being sent."""

    device: int
    bus_id: str
    ptr: int  #: address of element 0
    base: int  #: base of the allocation holding it
    size: int  #: size of that allocation
    handle: bytes | None  #: its IPC handle (None for an empty array)
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    keep: object  #: keeps the memory alive while the block is sent
    owner: object  #: the owner of the array's memory, if the backend can tell


_libcuda_lib: Any = None


def _libcuda(noload: bool = False) -> Any:
    """``libcuda.so.1`` through ctypes, or None. ``noload``: only if already loaded."""
    global _libcuda_lib
    if _libcuda_lib is not None:
        return _libcuda_lib
    import ctypes

    mode = os.RTLD_LAZY | os.RTLD_LOCAL | (os.RTLD_NOLOAD if noload else 0)
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=mode)
    except OSError:
        return None
    lib.cuDeviceGetCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuDeviceGetCount.restype = ctypes.c_int
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    _libcuda_lib = lib
    return lib


def _driver_error_name(lib: Any, rc: int) -> str:
    import ctypes

    name = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
        return str(name.value.decode())
    return f"CUresult {rc}"


def address_range(ptr: int, establish_context: Any = None) -> tuple[int, int]:
    """``cuMemGetAddressRange``: the base and size of the allocation holding ``ptr``.

    CuPy does not expose it, so this calls the driver through ctypes. The calling thread
    needs a current context; on CUDA_ERROR_INVALID_CONTEXT ``establish_context()`` is
    called once and the query retried.
    """
    import ctypes

    lib = _libcuda()
    if lib is None:
        raise CudaIpcError("cannot load libcuda.so.1 to find the allocation of a CuPy array")
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc == _CUDA_ERROR_INVALID_CONTEXT and establish_context is not None:
        establish_context()
        rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc != 0:
        raise CudaIpcError(
            f"cuMemGetAddressRange failed for device pointer {ptr:#x}: "
            f"{_driver_error_name(lib, rc)}"
        )
    return int(base.value), int(size.value)


class _CupyBackend:
    """The CUDA calls, through CuPy's documented API (and the driver for the base address)."""

    def __init__(self) -> None:
        import importlib

        cupy = importlib.import_module("cupy")  # untyped: Any
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self._bus: dict[int, str] = {}
        self._local: dict[str, int] = {}
        self._events: dict[int, list[tuple[Any, bytes]]] = {}

    # producer side

    def export(self, arr: Any) -> Export:
        cp, rt = self.cp, self.rt
        memptr = arr.data
        dev = int(arr.device.id)
        ptr = int(memptr.ptr)
        shape = tuple(int(n) for n in arr.shape)
        strides = tuple(int(s) for s in arr.strides)
        dtype = arr.dtype
        owner = getattr(memptr.mem, "_owner", None)
        if arr.size == 0:
            return Export(dev, self.bus_id(dev), ptr, ptr, 0, None, shape, strides,
                          dtype.str, dtype.itemsize, None, owner)
        with cp.cuda.Device(dev):
            base, size = address_range(ptr, rt.memGetInfo)
            try:
                handle = bytes(rt.ipcGetMemHandle(base))
            except rt.CUDARuntimeError as exc:
                raise CudaIpcError(
                    f"cannot export this CuPy array's memory (device {dev}, pointer "
                    f"{ptr:#x}) as a CUDA IPC handle: {exc}. Only memory from cudaMalloc "
                    "(CuPy's default MemoryPool) can be shared; memory from "
                    "cudaMallocAsync pools (MemoryAsyncPool), managed memory and "
                    "virtual-memory allocators cannot: copy the array into a default-pool "
                    "array first"
                ) from exc
        return Export(dev, self.bus_id(dev), ptr, base, size, handle, shape, strides,
                      dtype.str, dtype.itemsize, memptr, owner)

    def bus_id(self, dev: int) -> str:
        bus = self._bus.get(dev)
        if bus is None:
            try:
                bus = str(self.rt.deviceGetPCIBusId(dev))
            except (AttributeError, self.rt.CUDARuntimeError):
                bus = ""
            self._bus[dev] = bus
        return bus

    def record_event(self, dev: int) -> tuple[Any, bytes]:
        cp = self.cp
        with cp.cuda.Device(dev):
            idle = self._events.get(dev)
            if idle:
                event, handle = idle.pop()
            else:
                event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                handle = bytes(self.rt.ipcGetEventHandle(event.ptr))
            event.record(cp.cuda.get_current_stream())
        return event, handle

    def recycle_event(self, dev: int, event: Any, handle: bytes) -> None:
        idle = self._events.setdefault(dev, [])
        if len(idle) < EVENT_POOL_SIZE:
            idle.append((event, handle))

    def sync(self, dev: int) -> None:
        with self.cp.cuda.Device(dev):
            self.cp.cuda.get_current_stream().synchronize()

    # consumer side

    def local_device(self, bus_id: str, device: int) -> int:
        rt = self.rt
        if not bus_id:
            count = rt.getDeviceCount()
            if not 0 <= device < count:
                raise CudaIpcError(self._invisible(f"device {device}", count))
            return device
        dev = self._local.get(bus_id)
        if dev is None:
            try:
                dev = int(rt.deviceGetByPCIBusId(bus_id))
            except rt.CUDARuntimeError as exc:
                raise CudaIpcError(
                    self._invisible(f"the GPU at PCI bus id {bus_id} (device {device} in "
                                    "the sending process)", None)
                ) from exc
            self._local[bus_id] = dev
        return dev

    @staticmethod
    def _invisible(what: str, count: int | None) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = "" if count is None else f" ({count} device(s) visible)"
        return (
            f"a CuPy array on {what} arrived, but this process cannot access that "
            f"device{seen}; CUDA_VISIBLE_DEVICES={visible!r}. Make the device visible to "
            "every process that receives arrays on it"
        )

    def wait(self, event_handle: bytes, dev: int) -> None:
        cp, rt = self.cp, self.rt
        with cp.cuda.Device(dev):
            event = rt.ipcOpenEventHandle(event_handle)
            try:
                rt.streamWaitEvent(cp.cuda.get_current_stream().ptr, event)
            finally:
                # The wait is enqueued already; destroying our handle does not undo it.
                rt.eventDestroy(event)

    def wait_local(self, event: Any, dev: int) -> None:
        with self.cp.cuda.Device(dev):
            self.cp.cuda.get_current_stream().wait_event(event)

    def open(self, handle: bytes, dev: int) -> int:
        with self.cp.cuda.Device(dev):
            return int(self.rt.ipcOpenMemHandle(handle))

    def close(self, ptr: int, dev: int) -> None:
        with self.cp.cuda.Device(dev):
            self.rt.ipcCloseMemHandle(ptr)

    def wrap(self, ptr: int, size: int, owner: object, dev: int, offset: int,
             shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, size, owner, dev)
        with cp.cuda.Device(dev):
            return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, offset),
                              strides=strides)

    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> Any:
        with self.cp.cuda.Device(dev):
            return self.cp.empty(shape, dtype=dtype)

    def error_type(self) -> type[BaseException]:
        return self.rt.CUDARuntimeError  # type: ignore[no-any-return]


_backend: Any = None


def get_backend() -> Any:
    global _backend
    if _backend is None:
        try:
            _backend = _CupyBackend()
        except ImportError as exc:
            raise CudaIpcError(
                f"a CuPy array arrived but cupy cannot be imported here: {exc}"
            ) from exc
    return _backend


# -- producer -------------------------------------------------------------------------------


class _Sent:
    """A sent block, kept alive until every consumer has released it."""

    __slots__ = ("base", "device", "event", "event_handle", "keep", "size")

    def __init__(self, keep: object, event: object, event_handle: bytes | None, device: int,
                 base: int, size: int) -> None:
        self.keep = keep
        self.event = event
        self.event_handle = event_handle
        self.device = device
        self.base = base
        self.size = size


class _Producer:
    def __init__(self, backend: Any, limit: int) -> None:
        self.backend = backend
        self.table = SlotTable(limit)
        self.events_live = 0
        self.handoffs: set[int] = set()  # open handoff fds: closed in a forked child
        self.pid = os.getpid()

    def collect(self) -> int:
        for record in self.table.collect():
            self._free(record)  # type: ignore[arg-type]
        return len(self.table)

    def _free(self, record: _Sent) -> None:
        if record.event is not None:
            self.events_live -= 1
            self.backend.recycle_event(record.device, record.event, record.event_handle)
        record.keep = record.event = None

    def close_handoff(self, fd: int) -> None:
        with _lock:
            if fd in self.handoffs:
                self.handoffs.discard(fd)
                os.close(fd)

    def held_bytes(self) -> int:
        return sum(r.size for r in self.table.records.values())  # type: ignore[attr-defined]


_lock = threading.RLock()
_producer_state: _Producer | None = None
_limit = DEFAULT_IPC_LIMIT
_atexit_registered = False


def _get_producer(backend: Any) -> _Producer:
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


_MEMO = "aiomp._cuda"


def reduce_array(arr: Any) -> tuple[Any, tuple[IpcArrayMeta]]:
    """Reducer for ``cupy.ndarray`` in aiomp messages (see the module docstring)."""
    state = _reduction.current()
    backend = get_backend()
    exp = backend.export(arr)
    if isinstance(exp.owner, _SlotRef) or _consumer_maps(exp.device, exp.ptr):
        raise CudaIpcError(
            "cannot send a CuPy array that this process received from another process "
            "(its memory belongs to the sender, which tracks only the consumers it sent "
            "to): send a copy (arr.copy()), or have the original sender send it"
        )
    if exp.handle is None:
        meta = IpcArrayMeta(None, 0, 0, exp.shape, exp.strides, exp.dtype, exp.device,
                            exp.bus_id, None, os.getpid(), -1, -1)
        return _rebuild, (meta,)
    offset = locate(exp.ptr, exp.base, exp.size, exp.shape, exp.strides, exp.itemsize)
    with _lock:
        prod = _get_producer(backend)
        memo = state.memo
        # One handoff description per message holds the leases of all its blocks.
        handoff = cast("tuple[int, int] | None", memo.get((_MEMO, "handoff")))
        if handoff is None:
            prod.collect()  # the cadence: once per message
        key = (_MEMO, exp.device, exp.base)
        entry = cast("tuple[int, bytes | None] | None", memo.get(key))
        if entry is None:
            if handoff is None:
                fd = _lease.reopen(prod.table.fd)
                prod.handoffs.add(fd)
                try:
                    index = _reduction.add_fd(fd)
                except BaseException:
                    prod.close_handoff(fd)
                    raise
                _reduction.on_sent(lambda fd=fd: prod.close_handoff(fd))
                handoff = memo[(_MEMO, "handoff")] = (fd, index)
            entry = memo[key] = _send_block(prod, exp, handoff[0])
        slot, event_handle = entry
    assert handoff is not None
    meta = IpcArrayMeta(exp.handle, exp.size, offset, exp.shape, exp.strides, exp.dtype,
                        exp.device, exp.bus_id, event_handle, os.getpid(), slot, handoff[1])
    return _rebuild, (meta,)


def _send_block(prod: _Producer, exp: Export, handoff_fd: int) -> tuple[int, bytes | None]:
    backend = prod.backend
    prod.table.check_room()
    if prod.events_live < MAX_IPC_EVENTS:
        event, event_handle = backend.record_event(exp.device)
        prod.events_live += 1
    else:
        backend.sync(exp.device)
        event, event_handle = None, None
    record = _Sent(exp.keep, event, event_handle, exp.device, exp.base, exp.size)
    try:
        slot = prod.table.allocate(record)
    except BaseException:
        prod._free(record)
        raise
    try:
        _lease.hold(handoff_fd, slot, 1)
    except BaseException:
        prod._free(prod.table.discard(slot))  # type: ignore[arg-type]
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
            m.device == device and m.ptr <= ptr < m.ptr + m.size
            for m in cons.mappings.values()
        )


def _rebuild(meta: IpcArrayMeta) -> Any:
    backend = get_backend()
    if meta.handle is None:
        return backend.empty(meta.shape, meta.dtype,
                             backend.local_device(meta.bus_id, meta.device))
    fd = _reduction.peek_fd(meta.fd_index)
    ident = _lease.identity(fd)
    key = (ident, meta.slot)
    with _lock:
        cons = _get_consumer()
        wr = cons.slots.get(key)
        ref = wr() if wr is not None else None
        if ref is None:
            ref = _import(cons, backend, meta, fd, ident, key)
    check_extent(meta.offset, ref.size, meta.shape, meta.strides,
                 _itemsize(meta.dtype))
    return backend.wrap(ref.ptr, ref.size, ref, ref.device, meta.offset, meta.shape,
                        meta.strides, meta.dtype)


def _itemsize(dtype: str) -> int:
    import numpy

    return int(numpy.dtype(dtype).itemsize)


def _import(cons: _Consumer, backend: Any, meta: IpcArrayMeta, fd: int,
            ident: tuple[int, int], key: tuple[tuple[int, int], int]) -> _SlotRef:
    holder = cons.holders.get(ident)
    if holder is None:
        holder = cons.holders[ident] = _Holder(_lease.reopen(fd))
    holder.count += 1
    mapping_key: tuple[bytes, int] | None = None
    try:
        _lease.hold(holder.fd, meta.slot, 1)
        prod = _producer_state
        if (meta.pid == os.getpid() and prod is not None and prod.table.ident == ident
                and meta.slot in prod.table.records):
            # Sent to ourselves: the memory is ours already (a handle cannot be opened in
            # the process that exported it).
            rec: _Sent = prod.table.records[meta.slot]  # type: ignore[assignment]
            if rec.event is not None:
                backend.wait_local(rec.event, rec.device)
            ref = _SlotRef(rec.base, rec.size, rec.device, rec.keep)
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
    return (
        f"could not open a CUDA array sent by process {meta.pid}, which {alive}: "
        f"{exc}; {hint}"
    )


def _release(cons: _Consumer, key: tuple[tuple[int, int], int],
             mapping_key: tuple[bytes, int] | None, device: int,
             wr: weakref.ref[_SlotRef]) -> None:
    """Finalizer of a received slot: its last view died."""
    if cons is not _consumer_state or sys.is_finalizing():
        return  # a forked copy, state reset, or shutdown: leases die with the process
    backend = _backend
    if backend is None:
        return
    try:
        # Kernels the consumer queued on the memory may still run; the producer may
        # reuse it as soon as the lease goes (torch synchronises here too).
        backend.sync(device)
    finally:
        with _lock:
            if cons.slots.get(key) is wr:
                del cons.slots[key]
            _drop(cons, backend, key[0], key[1], mapping_key)


def _drop(cons: _Consumer, backend: Any, ident: tuple[int, int], slot: int,
          mapping_key: tuple[bytes, int] | None) -> None:
    holder = cons.holders.get(ident)
    if holder is not None:
        try:
            _lease.release(holder.fd, slot, 1)
        finally:
            holder.count -= 1
            if holder.count <= 0:
                del cons.holders[ident]
                os.close(holder.fd)
    if mapping_key is not None:
        mapping = cons.mappings.get(mapping_key)
        if mapping is not None:
            mapping.count -= 1
            if mapping.count <= 0:
                del cons.mappings[mapping_key]
                backend.close(mapping.ptr, mapping_key[1])


# -- fork, public helpers ------------------------------------------------------------------


_fork_orphans: list[object] = []


def _after_fork_in_child() -> None:
    """A forked child owns none of its parent's leases: drop the copies, release nothing."""
    global _producer_state, _consumer_state, _lock
    _lock = threading.RLock()
    prod, _producer_state = _producer_state, None
    cons, _consumer_state = _consumer_state, None
    fds: list[int] = []
    if prod is not None:
        # Cleared, so that a stale Outgoing collected in this child closes nothing.
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


def reducers() -> dict[type, object]:
    """Called by :mod:`aiomp._reduction` once cupy has been imported."""
    cupy: Any = sys.modules["cupy"]
    return {cupy.ndarray: reduce_array}


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
    lib = _libcuda(noload=True)
    if lib is None:
        return False
    import ctypes

    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return rc not in (_CUDA_ERROR_NOT_INITIALIZED, _CUDA_ERROR_NO_DEVICE)


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


IpcStatistics.__module__ = "aiomp.cuda"


def statistics() -> IpcStatistics:
    with _lock:
        prod = _producer_state if (_producer_state and
                                   _producer_state.pid == os.getpid()) else None
        cons = _consumer_state
        held = sum(1 for r in cons.slots.values() if r() is not None) if cons else 0
        return IpcStatistics(
            len(prod.table) if prod else 0,
            prod.held_bytes() if prod else 0,
            prod.events_live if prod else 0,
            held,
            len(cons.mappings) if cons else 0,
            _limit,
        )


def _reset() -> None:
    """Forget all state, closing this process's lease fds (tests only)."""
    global _producer_state, _consumer_state
    with _lock:
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
