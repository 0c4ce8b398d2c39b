"""A GPU-less CUDA backend and modelled CuPy modules, for the CUDA IPC tests (tests/cuda/):
:class:`FakeBackend` stands in for ``aiomp._cuda.driver.CupyBackend``, on the model of
the device in ``tests.children.cuda_device``; :func:`no_gpu_cupy` is CuPy on a machine
without a GPU, :func:`model_cupy` a CuPy module (and :class:`ModelLibcuda` a driver) on
that model.
"""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiomp._cuda.driver import Memory, View
from tests.children.cuda_device import (
    FakeArray,
    FakeCudaError,
    FakeGPU,
    FakeMemory,
    FakeOutOfMemory,
    FakePool,
    FakeUnowned,
)


class FakeBackend:
    """The interface of ``aiomp._cuda.driver.CupyBackend`` on :class:`FakeGPU`.

    ``calls`` logs every call that would reach CUDA, in order.
    """

    def __init__(
        self, gpu: FakeGPU | None = None, devices: tuple[str, ...] = ("0000:01:00.0",)
    ) -> None:
        self.gpu = gpu if gpu is not None else FakeGPU()
        self.pool = FakePool(self.gpu)
        self.devices = devices
        self.calls: list[tuple[object, ...]] = []
        self.events = 0
        self.idle_events: list[tuple[object, bytes]] = []

    def array(
        self, shape: tuple[int, ...], dtype: str = "<f4", fill: float | None = None
    ) -> FakeArray:
        """``cupy.full``/``cupy.empty`` through CuPy's pool."""
        return self.pool.array(shape, dtype, fill)

    def names(self) -> list[object]:
        return [c[0] for c in self.calls]

    # producer side

    def describe(self, arr: FakeArray) -> Any:
        from aiomp._cuda.driver import Described

        return Described(
            arr.device,
            arr.ptr,
            arr.shape,
            arr.strides,
            arr.dtype,
            arr.itemsize,
            arr.mem,
            getattr(arr.mem, "_owner", None),
        )

    def bus_id(self, dev: int) -> str:
        self.calls.append(("bus_id", dev))
        return self.devices[dev]

    def address_range(self, dev: int, ptr: int) -> tuple[int, int]:
        self.calls.append(("address_range", dev, ptr))
        return self.gpu.address_range(ptr)

    def ipc_handle(self, dev: int, base: int) -> bytes:
        self.calls.append(("ipc_handle", dev, base))
        try:
            return self.gpu.ipc_handle(base)
        except FakeCudaError as exc:
            from aiomp._errors import CudaIpcError

            raise CudaIpcError(f"cannot export this memory: {exc}") from exc

    def malloc(self, dev: int, size: int) -> tuple[int, object]:
        self.calls.append(("malloc", dev, size))
        mem = FakeMemory(self.gpu, size, dev)
        return mem.ptr, mem

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, FakeOutOfMemory)

    def free_cached(self, dev: int) -> None:
        self.calls.append(("free_cached", dev))
        self.pool.free_all_blocks()

    def copy(self, dev: int, dst: int, src: int, nbytes: int) -> None:
        self.calls.append(("copy", dev, dst, src, nbytes))
        self.gpu.write(dst, self.gpu.read(src, nbytes))

    def memset(self, dev: int, ptr: int, nbytes: int) -> None:
        self.calls.append(("memset", dev, ptr, nbytes))
        self.gpu.write(ptr, bytes(nbytes))

    def current_device(self) -> int:
        return 0

    def record_event(self, dev: int) -> tuple[object, bytes]:
        if self.idle_events:
            event, handle = self.idle_events.pop()
        else:
            self.events += 1
            event, handle = object(), b"E" + self.events.to_bytes(8, "little") + bytes(55)
        self.calls.append(("record", dev, handle))
        return event, handle

    def record(self, event: object, dev: int) -> None:
        self.calls.append(("record_again", dev))

    def recycle_event(self, dev: int, event: object, handle: bytes) -> None:
        self.calls.append(("recycle", dev, handle))
        self.idle_events.append((event, handle))

    def sync(self, dev: int) -> None:
        self.calls.append(("sync", dev))

    # consumer side

    def local_device(self, bus_id: str, device: int) -> int:
        if bus_id not in self.devices:
            from aiomp._errors import CudaIpcError

            raise CudaIpcError(f"fake: device {bus_id} is not visible")
        return self.devices.index(bus_id)

    def wait(self, event_handle: bytes, dev: int) -> None:
        self.calls.append(("wait", dev, event_handle))

    def wait_local(self, event: object, dev: int) -> None:
        self.calls.append(("wait_local", dev))

    def open(self, handle: bytes, dev: int) -> int:
        self.calls.append(("open", dev, handle))
        return self.gpu.open(handle)

    def close(self, ptr: int, dev: int) -> None:
        self.calls.append(("close", dev, ptr))
        self.gpu.close(ptr)

    def wrap(self, memory: Memory, view: View) -> FakeArray:
        ptr, dev = memory.ptr, memory.device
        mem = FakeUnowned(ptr, memory.size, memory, dev)
        return FakeArray(
            self.gpu, mem, ptr + view.offset, view.shape, view.dtype, view.strides, dev
        )

    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> FakeArray:
        return FakeArray(
            self.gpu, FakeUnowned(0, 0, None, dev), 0, shape, dtype, (0,) * len(shape), dev
        )

    def error_type(self) -> type[BaseException]:
        return FakeCudaError


# -- a cupy module without a usable GPU (defect 5) ----------------------------------------


class NoGpuRuntimeError(RuntimeError):
    """cupy's CUDARuntimeError, as raised with no driver or no device."""

    def __init__(self, status: int = 100) -> None:
        self.status = status
        super().__init__("cudaErrorNoDevice: no CUDA-capable device is detected")


def no_gpu_cupy() -> types.ModuleType:
    """A ``cupy`` module as installed on a machine without a usable GPU: arrays exist (as
    unpickled or created before the driver went away), every CUDA call fails."""

    def fail(*_: object) -> object:
        raise NoGpuRuntimeError()

    class Device:
        def __init__(self, id: int = 0) -> None:
            self.id = id

        def __enter__(self) -> Device:
            raise NoGpuRuntimeError()

        def __exit__(self, *exc: object) -> None:
            pass

    class ndarray:
        def __init__(self) -> None:
            import numpy

            self.data = types.SimpleNamespace(
                ptr=0x7F00_0000_0000, device_id=0, mem=types.SimpleNamespace()
            )
            self.shape = (4,)
            self.strides = (4,)
            self.dtype = numpy.dtype("<f4")
            self.size = 4
            self.device = Device(0)

    runtime = types.SimpleNamespace(
        CUDARuntimeError=NoGpuRuntimeError,
        getDeviceCount=fail,
        getDevice=fail,
        deviceGetPCIBusId=fail,
        deviceGetByPCIBusId=fail,
        memGetInfo=fail,
        ipcGetMemHandle=fail,
        ipcOpenMemHandle=fail,
        ipcOpenEventHandle=fail,
    )
    cuda = types.SimpleNamespace(
        Device=Device, runtime=runtime, memory=types.SimpleNamespace(OutOfMemoryError=MemoryError)
    )
    mod = types.ModuleType("cupy")
    mod.cuda = cuda  # type: ignore[attr-defined]
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    return mod


# -- a cupy module on the model, for the real backend (CupyBackend) ----------------------


class ModelRuntimeError(RuntimeError):
    """cupy's CUDARuntimeError (``status``: the cudaError_t)."""

    def __init__(self, status: int, msg: str = "") -> None:
        self.status = status
        super().__init__(msg or f"CUDA runtime error {status}")


class ModelLibcuda:
    """The two driver entry points aiomp calls through ctypes, on :class:`FakeGPU`."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu

    def cuMemGetAddressRange_v2(self, pbase: Any, psize: Any, ptr: int) -> int:
        try:
            base, size = self.gpu.address_range(ptr)
        except FakeCudaError:
            return 1  # CUDA_ERROR_INVALID_VALUE
        pbase._obj.value = base  # ctypes.byref(x)._obj is x
        psize._obj.value = size
        return 0

    def cuGetErrorName(self, rc: int, pname: Any) -> int:
        return 1


def model_cupy(gpu: FakeGPU) -> types.ModuleType:
    """A ``cupy`` module on :class:`FakeGPU` with the names, argument orders and types
    of the CuPy API that ``aiomp._cuda.driver.CupyBackend`` calls, so that the real backend's
    code runs (and its mistakes show) without a GPU. ``calls`` logs the runtime calls."""
    import numpy

    calls: list[str] = []
    current = [0]
    pool = FakePool(gpu)

    def call(name: str) -> None:
        calls.append(name)

    class Device:
        def __init__(self, id: int | None = None) -> None:
            self.id = current[0] if id is None else id
            self._prev = 0

        def __enter__(self) -> Device:
            self._prev, current[0] = current[0], self.id
            return self

        def __exit__(self, *exc: object) -> None:
            current[0] = self._prev

    class Stream:
        ptr = 0

        def synchronize(self) -> None:
            call("synchronize")

        def wait_event(self, event: object) -> None:
            call("wait_event")

    stream = Stream()

    class Event:
        _next = 1

        def __init__(
            self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
        ) -> None:
            assert interprocess and disable_timing
            self.ptr = Event._next
            Event._next += 1

        def record(self, stream: object = None) -> None:
            call("record")

    class Memory:
        def __init__(self, size: int) -> None:
            try:
                self.ptr = gpu.malloc(size)
            except FakeOutOfMemory as exc:
                raise ModelRuntimeError(2, f"cudaErrorMemoryAllocation: {exc}") from exc
            self.size = size
            self.device_id = current[0]
            weakref.finalize(self, gpu.free, self.ptr)

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem = mem
            self.ptr = mem.ptr + offset
            self.device_id = mem.device_id

    class ndarray(FakeArray):
        def __init__(
            self,
            shape: tuple[int, ...],
            dtype: Any = float,
            memptr: MemoryPointer | None = None,
            strides: tuple[int, ...] | None = None,
        ) -> None:
            dt = numpy.dtype(dtype)
            if memptr is None:
                memptr = MemoryPointer(pool.malloc(int(numpy.prod(shape)) * dt.itemsize), 0)
            super().__init__(gpu, memptr.mem, memptr.ptr, shape, dt.str, strides, memptr.device_id)
            self.data = memptr
            self.dtype = dt  # type: ignore[assignment]

    def empty(shape: tuple[int, ...], dtype: Any = float) -> ndarray:
        return ndarray(shape, dtype)

    def ipc_get_mem_handle(ptr: int) -> bytes:
        call("ipcGetMemHandle")
        try:
            return gpu.ipc_handle(ptr)
        except (FakeCudaError, KeyError) as exc:
            raise ModelRuntimeError(1, f"cudaErrorInvalidValue: {exc}") from exc

    def ipc_open_mem_handle(handle: bytes, flags: int = 1) -> int:
        call("ipcOpenMemHandle")
        try:
            return gpu.open(bytes(handle))
        except FakeCudaError as exc:
            raise ModelRuntimeError(217, str(exc)) from exc

    def ipc_close_mem_handle(ptr: int) -> None:
        call("ipcCloseMemHandle")
        gpu.close(ptr)

    def memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        assert kind == 3, "expected cudaMemcpyDeviceToDevice"
        call("memcpyAsync")
        gpu.write(dst, gpu.read(src, size))

    def memset_async(ptr: int, value: int, size: int, stream: int) -> None:
        call("memsetAsync")
        gpu.write(ptr, bytes([value]) * size)

    def device_get_by_pci_bus_id(bus: str) -> int:
        if bus != "0000:01:00.0":
            raise ModelRuntimeError(101, "cudaErrorInvalidDevice: invalid device ordinal")
        return 0

    runtime = types.SimpleNamespace(
        CUDARuntimeError=ModelRuntimeError,
        memcpyDeviceToDevice=3,
        getDeviceCount=lambda: 1,
        getDevice=lambda: current[0],
        deviceGetPCIBusId=lambda dev: "0000:01:00.0",
        deviceGetByPCIBusId=device_get_by_pci_bus_id,
        memGetInfo=lambda: (gpu.capacity, gpu.capacity),
        ipcGetMemHandle=ipc_get_mem_handle,
        ipcOpenMemHandle=ipc_open_mem_handle,
        ipcCloseMemHandle=ipc_close_mem_handle,
        ipcGetEventHandle=lambda ptr: b"E" + ptr.to_bytes(8, "little") + bytes(55),
        ipcOpenEventHandle=lambda handle: 1000 + int.from_bytes(handle[1:9], "little"),
        streamWaitEvent=lambda stream, event: call("streamWaitEvent"),
        eventDestroy=lambda event: call("eventDestroy"),
        memcpyAsync=memcpy_async,
        memsetAsync=memset_async,
    )
    cuda = types.SimpleNamespace(
        Device=Device,
        Event=Event,
        Memory=Memory,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        runtime=runtime,
        get_current_stream=lambda: stream,
        memory=types.SimpleNamespace(OutOfMemoryError=FakeOutOfMemory),
    )
    mod = types.ModuleType("cupy")
    mod.cuda = cuda  # type: ignore[attr-defined]
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    mod.empty = empty  # type: ignore[attr-defined]
    mod.get_default_memory_pool = lambda: pool  # type: ignore[attr-defined]
    mod.calls = calls  # type: ignore[attr-defined]
    mod.pool = pool  # type: ignore[attr-defined]
    return mod
