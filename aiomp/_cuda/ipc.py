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
import contextlib
import heapq
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast

from .. import _lifecycle
from .._errors import CudaIpcError, IpcLimitError
from .._loop.finalizers import finalizer
from .._memory import lease as _lease
from .._wire import pickling as _reduction

#: Blocks a process may have sent and not yet seen released, unless changed with
#: :func:`aiomp.cuda.set_ipc_limit`.
DEFAULT_IPC_LIMIT = 1000
#: Live interprocess events per process (torch's CUDA_IPC_MAXIMUM_EVENTS_TO_USE). Past
#: it, a send synchronises the producer's stream and carries no event.
MAX_IPC_EVENTS = 1000
#: Idle interprocess events kept per device for reuse.
EVENT_POOL_SIZE = 64

#: The CUDA programming guide: IPC shares the whole underlying memory block, and the
#: driver sub-allocates smaller cudaMallocs from shared blocks, so only allocations of
#: whole multiples of 2 MiB are safe to share. Smaller arrays travel as copies in blocks
#: of this size.
IPC_BLOCK = 2 << 20
_STAGE_ALIGN = 512  # cudaMalloc's alignment, for arrays packed into one staging block

_CUDA_ERROR_MEMORY_ALLOCATION = 2
_CUDA_ERROR_NOT_INITIALIZED = 3
_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_INVALID_CONTEXT = 201


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
        holder = _lease.a_holder(fd, a, b - a)
        if holder is None:
            continue
        lstart, length = holder
        lstop = b if length == 0 else lstart + length
        lo, hi = max(a, lstart), min(b, lstop)
        if lo >= hi:  # defensive: the kernel only reports overlapping locks
            continue
        out.append((lo, hi))
        todo.append((a, lo))
        todo.append((hi, b))
    out.sort()
    return out


R = TypeVar("R")
T = TypeVar("T")


class SlotTable(Generic[R]):
    """Slots of one producer lease file and the record kept alive for each sent slot.

    No CUDA here: a record is whatever the caller keeps alive. Not thread-safe (the
    producer serialises calls).
    """

    def __init__(self, limit: int = DEFAULT_IPC_LIMIT) -> None:
        self.fd = os.memfd_create("aiomp-cuda-lease", os.MFD_CLOEXEC)
        self.ident = _lease.identity(self.fd)
        self.limit = limit
        self.records: dict[int, R] = {}
        self._free: list[int] = []  # a heap: the lowest free slot first keeps ranges short
        self._next = 0

    def __len__(self) -> int:
        return len(self.records)

    def allocate(self, record: R) -> int:
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

    def discard(self, slot: int) -> R:
        """Forget ``slot`` now (a send that failed before its lease was taken)."""
        record = self.records.pop(slot)
        heapq.heappush(self._free, slot)
        return record

    def collect(self) -> list[R]:
        """Free every slot that no description holds; returns their records."""
        if not self.records:
            return []
        held = held_ranges(self.fd, 0, self._next)
        released: list[R] = []
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


class Described(NamedTuple):
    """What the backend reads from an array being sent, without calling CUDA."""

    device: int
    ptr: int  #: address of element 0
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    keep: object  #: the array's own memory (CuPy: ``arr.data.mem``, a pool chunk)
    owner: object  #: the owner of unowned memory (``UnownedMemory._owner``), else None


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


def _no_gpu(exc: BaseException, doing: str) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"{doing}, but process {os.getpid()} has no usable CUDA device: {exc}. Check that "
        "the NVIDIA driver works here (nvidia-smi) and that CUDA_VISIBLE_DEVICES "
        f"(now {visible!r}) shows this process the GPUs it sends or receives arrays on"
    )


class Backend(Protocol):
    """The CUDA calls the bookkeeping makes: :class:`_CupyBackend`, or the tests' fake.

    ``dev`` is a device index; pointers are ints; events are the backend's own objects.
    Arrays are ``Any``: a ``cupy.ndarray`` (cupy ships no type information).
    """

    def describe(self, arr: Any) -> Described: ...
    def address_range(self, dev: int, ptr: int) -> tuple[int, int]: ...
    def ipc_handle(self, dev: int, base: int) -> bytes: ...
    def bus_id(self, dev: int) -> str: ...
    def current_device(self) -> int: ...
    def malloc(self, dev: int, size: int) -> tuple[int, object]: ...
    def is_oom(self, exc: BaseException) -> bool: ...
    def free_cached(self, dev: int) -> None: ...
    def copy(self, dev: int, dst: int, src: int, nbytes: int) -> None: ...
    def memset(self, dev: int, ptr: int, nbytes: int) -> None: ...
    def record_event(self, dev: int) -> tuple[object, bytes]: ...
    def record(self, event: Any, dev: int) -> None: ...
    def recycle_event(self, dev: int, event: Any, handle: bytes) -> None: ...
    def sync(self, dev: int) -> None: ...
    def local_device(self, bus_id: str, device: int) -> int: ...
    def wait(self, event_handle: bytes, dev: int) -> None: ...
    def wait_local(self, event: Any, dev: int) -> None: ...
    def open(self, handle: bytes, dev: int) -> int: ...
    def close(self, ptr: int, dev: int) -> None: ...
    def wrap(
        self,
        ptr: int,
        size: int,
        owner: object,
        dev: int,
        offset: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: str,
    ) -> Any: ...
    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> Any: ...
    def error_type(self) -> type[BaseException]: ...


class _CupyBackend:
    """The CUDA calls, through CuPy's documented API (and the driver for the base address).

    Every call that selects a device goes through :meth:`_on`, so that a process without
    a usable GPU gets a :class:`CudaIpcError` naming the cause, not a raw runtime error.
    """

    def __init__(self) -> None:
        import importlib

        cupy = importlib.import_module("cupy")  # untyped: Any
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self._bus: dict[int, str] = {}
        self._local: dict[str, int] = {}
        self._events: dict[int, list[tuple[Any, bytes]]] = {}

    @contextlib.contextmanager
    def _on(self, dev: int, doing: str = "CUDA is needed") -> Iterator[None]:
        device = self.cp.cuda.Device(dev)
        try:
            device.__enter__()
        except self.rt.CUDARuntimeError as exc:
            raise CudaIpcError(_no_gpu(exc, f"{doing} on device {dev}")) from exc
        try:
            yield
        finally:
            device.__exit__(None, None, None)

    # producer side

    def describe(self, arr: Any) -> Described:
        memptr = arr.data  # attributes only: no CUDA call
        dtype = arr.dtype
        mem = memptr.mem
        return Described(
            int(memptr.device_id),
            int(memptr.ptr),
            tuple(int(n) for n in arr.shape),
            tuple(int(s) for s in arr.strides),
            dtype.str,
            int(dtype.itemsize),
            mem,
            getattr(mem, "_owner", None),
        )

    def address_range(self, dev: int, ptr: int) -> tuple[int, int]:
        with self._on(dev, "a CuPy array is being sent"):
            return address_range(ptr, self.rt.memGetInfo)

    def ipc_handle(self, dev: int, base: int) -> bytes:
        rt = self.rt
        with self._on(dev, "a CuPy array is being sent"):
            try:
                return bytes(rt.ipcGetMemHandle(base))
            except rt.CUDARuntimeError as exc:
                raise CudaIpcError(
                    f"cannot export the CuPy allocation at {base:#x} (device {dev}) as a "
                    f"CUDA IPC handle: {exc}. Only memory from cudaMalloc (CuPy's default "
                    "MemoryPool, aiomp.cuda.empty) can be shared; memory from "
                    "cudaMallocAsync pools (MemoryAsyncPool), managed memory and "
                    "virtual-memory allocators cannot: copy the array into such memory first"
                ) from exc

    def bus_id(self, dev: int) -> str:
        bus = self._bus.get(dev)
        if bus is None:
            try:
                bus = str(self.rt.deviceGetPCIBusId(dev))
            except (AttributeError, self.rt.CUDARuntimeError):
                bus = ""
            self._bus[dev] = bus
        return bus

    def current_device(self) -> int:
        try:
            return int(self.rt.getDevice())
        except self.rt.CUDARuntimeError as exc:
            raise CudaIpcError(_no_gpu(exc, "an IPC-safe block was asked for")) from exc

    def malloc(self, dev: int, size: int) -> tuple[int, Any]:
        """A whole cudaMalloc of ``size`` bytes, outside CuPy's pool: freed when the
        returned ``cupy.cuda.Memory`` is collected."""
        rt = self.rt
        with self._on(dev, "an IPC-safe block was asked for"):
            try:
                mem = self.cp.cuda.Memory(size)
            except rt.CUDARuntimeError as exc:
                if getattr(exc, "status", None) != _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                # CuPy's own error for it, as its pool raises (a MemoryError)
                raise self.cp.cuda.memory.OutOfMemoryError(size, -1) from exc
        return int(mem.ptr), mem

    def is_oom(self, exc: BaseException) -> bool:
        if isinstance(exc, self.cp.cuda.memory.OutOfMemoryError):
            return True  # CuPy's pool, or malloc above
        return (
            isinstance(exc, self.rt.CUDARuntimeError)  # cudaEventCreate, ...
            and getattr(exc, "status", None) == _CUDA_ERROR_MEMORY_ALLOCATION
        )

    def free_cached(self, dev: int) -> None:
        with self._on(dev):
            self.cp.get_default_memory_pool().free_all_blocks()

    def copy(self, dev: int, dst: int, src: int, nbytes: int) -> None:
        cp = self.cp
        with self._on(dev, "a CuPy array is being sent"):
            self.rt.memcpyAsync(
                dst, src, nbytes, self.rt.memcpyDeviceToDevice, cp.cuda.get_current_stream().ptr
            )

    def memset(self, dev: int, ptr: int, nbytes: int) -> None:
        cp = self.cp
        with self._on(dev):
            self.rt.memsetAsync(ptr, 0, nbytes, cp.cuda.get_current_stream().ptr)

    def record_event(self, dev: int) -> tuple[Any, bytes]:
        cp = self.cp
        with self._on(dev, "a CuPy array is being sent"):
            idle = self._events.get(dev)
            if idle:
                event, handle = idle.pop()
            else:
                event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
                handle = bytes(self.rt.ipcGetEventHandle(event.ptr))
            event.record(cp.cuda.get_current_stream())
        return event, handle

    def record(self, event: Any, dev: int) -> None:
        with self._on(dev, "a CuPy array is being sent"):
            event.record(self.cp.cuda.get_current_stream())

    def recycle_event(self, dev: int, event: Any, handle: bytes) -> None:
        idle = self._events.setdefault(dev, [])
        if len(idle) < EVENT_POOL_SIZE:
            idle.append((event, handle))

    def sync(self, dev: int) -> None:
        with self._on(dev):
            self.cp.cuda.get_current_stream().synchronize()

    # consumer side

    def local_device(self, bus_id: str, device: int) -> int:
        rt = self.rt
        what = (
            f"the GPU at PCI bus id {bus_id} (device {device} in the sending process)"
            if bus_id
            else f"device {device}"
        )
        try:
            count = int(rt.getDeviceCount())
        except rt.CUDARuntimeError as exc:
            raise CudaIpcError(_no_gpu(exc, f"a CuPy array on {what} arrived")) from exc
        if not bus_id:
            if not 0 <= device < count:
                raise CudaIpcError(self._invisible(what, count))
            return device
        dev = self._local.get(bus_id)
        if dev is None:
            try:
                dev = int(rt.deviceGetByPCIBusId(bus_id))
            except rt.CUDARuntimeError as exc:
                raise CudaIpcError(f"{self._invisible(what, count)} ({exc})") from exc
            self._local[bus_id] = dev
        return dev

    @staticmethod
    def _invisible(what: str, count: int) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (
            f"a CuPy array on {what} arrived, but this process cannot access that "
            f"device ({count} device(s) visible); CUDA_VISIBLE_DEVICES={visible!r}. Make "
            "the device visible to every process that receives arrays on it"
        )

    def wait(self, event_handle: bytes, dev: int) -> None:
        cp, rt = self.cp, self.rt
        with self._on(dev):
            event = rt.ipcOpenEventHandle(event_handle)
            try:
                rt.streamWaitEvent(cp.cuda.get_current_stream().ptr, event)
            finally:
                # The wait is enqueued already; destroying our handle does not undo it.
                rt.eventDestroy(event)

    def wait_local(self, event: Any, dev: int) -> None:
        with self._on(dev):
            self.cp.cuda.get_current_stream().wait_event(event)

    def open(self, handle: bytes, dev: int) -> int:
        with self._on(dev):
            return int(self.rt.ipcOpenMemHandle(handle))

    def close(self, ptr: int, dev: int) -> None:
        with self._on(dev):
            self.rt.ipcCloseMemHandle(ptr)

    def wrap(
        self,
        ptr: int,
        size: int,
        owner: object,
        dev: int,
        offset: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: str,
    ) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, size, owner, dev)
        with self._on(dev):
            return cp.ndarray(
                shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, offset), strides=strides
            )

    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> Any:
        with self._on(dev):
            return self.cp.empty(shape, dtype=dtype)

    def error_type(self) -> type[BaseException]:
        return cast("type[BaseException]", self.rt.CUDARuntimeError)


_backend: Backend | None = None


def get_backend() -> Backend:
    global _backend
    if _backend is None:
        try:
            _backend = _CupyBackend()
        except ImportError as exc:
            raise CudaIpcError(
                f"a CuPy array arrived but cupy cannot be imported here: {exc}"
            ) from exc
    return _backend


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

    @finalizer
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


@finalizer
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
    backend = _backend
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
    lib = _libcuda(noload=True)
    if lib is None:
        return False
    import ctypes

    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return rc not in (_CUDA_ERROR_NOT_INITIALIZED, _CUDA_ERROR_NO_DEVICE)


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
