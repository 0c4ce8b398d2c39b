"""The CUDA calls behind a seam: libcuda through ctypes, the :class:`Backend` protocol,
and :class:`CupyBackend`, its implementation on CuPy's documented API; with the records
both sides of a backend share (:class:`DeviceRange`, :class:`Memory`, :class:`View`).

The bookkeeping of :mod:`.producer` and :mod:`.consumer` calls CUDA only through a
backend, so the tests drive it with a fake (a model of CuPy's pool and the driver's
allocator) on machines without a GPU. Importing this module imports neither cupy nor
ctypes. Owns no OS resource (CuPy owns the device memory and events).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, cast

from .._errors import CudaIpcError

#: Idle interprocess events kept per device for reuse.
EVENT_POOL_SIZE = 64

CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_CONTEXT = 201


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


class DeviceRange:
    """``size`` bytes of device memory at ``ptr`` on device ``device``: the record every
    allocation, opened handle and received slot of this package keeps."""

    __slots__ = ("device", "ptr", "size")

    def __init__(self, ptr: int, size: int, device: int) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device


class Memory(Protocol):
    """Device memory a view is made over, and the view's owner: the view keeps it alive."""

    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def device(self) -> int: ...


class View(Protocol):
    """Where a view lies in its :class:`Memory` (an ``IpcArrayMeta`` is one)."""

    @property
    def offset(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...


_lib: Any = None


def libcuda(noload: bool = False) -> Any:
    """``libcuda.so.1`` through ctypes, or None. ``noload``: only if already loaded."""
    global _lib
    if _lib is not None:
        return _lib
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
    _lib = lib
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

    lib = libcuda()
    if lib is None:
        raise CudaIpcError("cannot load libcuda.so.1 to find the allocation of a CuPy array")
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc == CUDA_ERROR_INVALID_CONTEXT and establish_context is not None:
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
    """The CUDA calls the bookkeeping makes: :class:`CupyBackend`, or the tests' fake.

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
    def wrap(self, memory: Memory, view: View) -> Any: ...
    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> Any: ...
    def error_type(self) -> type[BaseException]: ...


class CupyBackend:
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
                if getattr(exc, "status", None) != CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                # CuPy's own error for it, as its pool raises (a MemoryError)
                raise self.cp.cuda.memory.OutOfMemoryError(size, -1) from exc
        return int(mem.ptr), mem

    def is_oom(self, exc: BaseException) -> bool:
        if isinstance(exc, self.cp.cuda.memory.OutOfMemoryError):
            return True  # CuPy's pool, or malloc above
        return (
            isinstance(exc, self.rt.CUDARuntimeError)  # cudaEventCreate, ...
            and getattr(exc, "status", None) == CUDA_ERROR_MEMORY_ALLOCATION
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

    def wrap(self, memory: Memory, view: View) -> Any:
        cp = self.cp
        dev = memory.device
        mem = cp.cuda.UnownedMemory(memory.ptr, memory.size, memory, dev)
        ptr = cp.cuda.MemoryPointer(mem, view.offset)
        with self._on(dev):
            return cp.ndarray(view.shape, dtype=view.dtype, memptr=ptr, strides=view.strides)

    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> Any:
        with self._on(dev):
            return self.cp.empty(shape, dtype=dtype)

    def error_type(self) -> type[BaseException]:
        return cast("type[BaseException]", self.rt.CUDARuntimeError)


#: The backend in use here, made by :func:`get_backend` (tests put a fake here).
backend: Backend | None = None


def get_backend() -> Backend:
    """The backend, made on first use; :class:`CudaIpcError` if cupy cannot be imported."""
    global backend
    if backend is None:
        try:
            backend = CupyBackend()
        except ImportError as exc:
            raise CudaIpcError(
                f"a CuPy array arrived but cupy cannot be imported here: {exc}"
            ) from exc
    return backend
