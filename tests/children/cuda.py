"""A GPU-less model of CuPy and the CUDA driver, and the functions children run, for
tests/cuda/test_cuda.py.

The fake backend (:class:`FakeBackend`) stands in for ``aiomp._cuda.driver.CupyBackend``. It is
built on a model of what sits under CuPy, close enough to catch the defects a GPU would
show, after CuPy's ``cupy/cuda/memory.pyx`` and the CUDA programming guide:

- :class:`FakeGPU`, the device and its driver. Memory is one anonymous ``MAP_SHARED``
  arena, so a forked consumer sees what the producer writes later, as every process sees
  device memory. ``cudaMalloc`` gives sizes of 2 MiB or more whole, 2 MiB-aligned
  granules; smaller ones are *sub-allocated* (512-byte units) from shared 2 MiB driver
  blocks. An IPC handle names the whole driver block; opening it maps all of it
  (neighbours included), a driver block maps once per process, and memory opened from a
  handle cannot be exported again (the driver refuses).
- :class:`FakePool`, CuPy's memory pool on top of it: requests rounded to 512 bytes, the
  best-fitting free chunk split, a chunk (:class:`FakeChunk`, CuPy's ``PooledMemory``)
  back in the pool, merged with free neighbours, as soon as its last Python reference
  goes; ``free_all_blocks`` frees wholly free allocations; out of memory: free them and
  retry, as CuPy does.
- :class:`FakeArray`, a ``cupy.ndarray``: device, pointer, shape, strides, dtype, and the
  memory object that keeps its bytes alive (``arr.data.mem``).

The gpu_* functions run real CuPy in spawned children (the test process never initialises
CUDA) and only on a machine with a GPU.
"""

from __future__ import annotations

import mmap
import os
import socket
import types
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiomp._cuda.driver import Memory, View

GRANULE = 2 << 20  # the driver's large-allocation unit; IPC-safe below this: nothing
_SMALL_UNIT = 512


class FakeCudaError(RuntimeError):
    """A CUDA runtime error (cupy's CUDARuntimeError)."""


class FakeOutOfMemory(MemoryError):
    """cudaErrorMemoryAllocation."""


def _round(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


class FakeGPU:
    """Device memory and the driver's allocator (see the module docstring)."""

    BASE = 0x7F00_0000_0000  # 2 MiB-aligned
    MAPPED = 1 << 48  # an opened handle maps its driver block at address + MAPPED

    def __init__(self, capacity: int = 32 << 20) -> None:
        self.capacity = capacity
        self.arena = mmap.mmap(-1, capacity)  # MAP_SHARED: forked children see writes
        self.granules = [False] * (capacity // GRANULE)
        # driver block base -> [size, shared by small allocations?, bump offset, live]
        self.blocks: dict[int, list[Any]] = {}
        self.allocs: dict[int, tuple[int, int]] = {}  # cudaMalloc base -> (size, block)
        self.mapped: dict[int, int] = {}  # opened driver block (mapped base) -> size
        self.mallocs: list[int] = []  # sizes asked for, failed ones too

    # cudaMalloc / cudaFree

    def _granules(self, size: int) -> int:
        n = _round(size, GRANULE) // GRANULE
        run = 0
        for i, used in enumerate(self.granules):
            run = 0 if used else run + 1
            if run == n:
                first = i - n + 1
                for j in range(first, i + 1):
                    self.granules[j] = True
                base = self.BASE + first * GRANULE
                return base
        raise FakeOutOfMemory(f"cudaErrorMemoryAllocation: out of memory ({size} bytes)")

    def malloc(self, size: int) -> int:
        self.mallocs.append(size)
        if size >= GRANULE:
            base = self._granules(size)
            self.blocks[base] = [_round(size, GRANULE), False, size, 1]
            self.allocs[base] = (size, base)
            return base
        size = _round(max(size, 1), _SMALL_UNIT)
        bbase = next(
            (
                b
                for b, (bsize, small, used, _live) in self.blocks.items()
                if small and used + size <= bsize
            ),
            None,
        )
        if bbase is None:
            bbase = self._granules(GRANULE)
            self.blocks[bbase] = [GRANULE, True, 0, 0]
        block = self.blocks[bbase]
        ptr = bbase + block[2]
        block[2] += size
        block[3] += 1
        self.allocs[ptr] = (size, bbase)
        return ptr

    def free(self, ptr: int) -> None:
        _size, bbase = self.allocs.pop(ptr)
        block = self.blocks[bbase]
        block[3] -= 1
        if block[3] == 0:
            del self.blocks[bbase]
            first = (bbase - self.BASE) // GRANULE
            for j in range(first, first + block[0] // GRANULE):
                self.granules[j] = False

    def address_range(self, ptr: int) -> tuple[int, int]:
        """cuMemGetAddressRange: the cudaMalloc allocation holding ``ptr``."""
        for base, (size, _block) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size
        raise FakeCudaError(f"CUDA_ERROR_NOT_FOUND: {ptr:#x} is not allocated")

    def block_of(self, ptr: int) -> int:
        """The driver block under an allocated address."""
        return self.allocs[self.address_range(ptr)[0]][1]

    # IPC

    def ipc_handle(self, base: int) -> bytes:
        """cudaIpcGetMemHandle: names the whole driver block under allocation ``base``."""
        if base >= self.MAPPED:
            raise FakeCudaError(
                "cudaErrorInvalidValue: memory opened from an IPC handle cannot be exported"
            )
        bbase = self.allocs[base][1]
        bsize = self.blocks[bbase][0]
        return (
            b"H"
            + bbase.to_bytes(8, "little")
            + bsize.to_bytes(8, "little")
            + (base - bbase).to_bytes(8, "little")
        ).ljust(64, b"\0")

    @staticmethod
    def parse(handle: bytes) -> tuple[int, int, int]:
        """(driver block base, its size, the allocation's offset in it)."""
        if handle[:1] != b"H":
            raise FakeCudaError("cudaErrorInvalidValue: not a memory handle")
        return tuple(
            int.from_bytes(handle[i : i + 8], "little")  # type: ignore[return-value]
            for i in (1, 9, 17)
        )

    def is_whole(self, handle: bytes) -> bool:
        """Does the handle name a block that is one 2 MiB-aligned allocation of its own?"""
        bbase, bsize, offset = self.parse(handle)
        return (
            offset == 0
            and bbase % GRANULE == 0
            and bsize % GRANULE == 0
            and (self.allocs.get(bbase, (0, 0))[0] == bsize)
        )

    def open(self, handle: bytes) -> int:
        bbase, bsize, offset = self.parse(handle)
        mapped = bbase + self.MAPPED
        if mapped in self.mapped:
            raise FakeCudaError(
                "cudaErrorAlreadyMapped: this process has the memory "
                "block under that handle mapped already"
            )
        self.mapped[mapped] = bsize
        return mapped + offset

    def close(self, ptr: int) -> None:
        for mapped, size in self.mapped.items():
            if mapped <= ptr < mapped + size:
                del self.mapped[mapped]
                return
        raise FakeCudaError(f"cudaErrorInvalidResourceHandle: {ptr:#x} is not mapped")

    # bytes

    def _index(self, ptr: int, n: int) -> int:
        if ptr >= self.MAPPED:
            for mapped, size in self.mapped.items():
                if mapped <= ptr and ptr + n <= mapped + size:
                    return ptr - self.MAPPED - self.BASE
            raise FakeCudaError(f"illegal address: {ptr:#x} is not mapped in this process")
        return ptr - self.BASE

    def read(self, ptr: int, n: int) -> bytes:
        i = self._index(ptr, n)
        return self.arena[i : i + n]

    def write(self, ptr: int, data: bytes) -> None:
        i = self._index(ptr, len(data))
        self.arena[i : i + len(data)] = data


class FakeMemory:
    """``cupy.cuda.Memory``: one cudaMalloc, freed when collected."""

    def __init__(self, gpu: FakeGPU, size: int, device: int = 0) -> None:
        self.ptr = gpu.malloc(size)
        self.size = size
        self.device_id = device
        weakref.finalize(self, gpu.free, self.ptr)


class FakeChunk:
    """CuPy's ``PooledMemory``: part of a pool allocation, back in the pool when collected."""

    def __init__(self, pool: FakePool, mem: FakeMemory, offset: int, size: int) -> None:
        self.ptr = mem.ptr + offset
        self.size = size
        self.device_id = mem.device_id
        weakref.finalize(self, pool._release, mem, offset, size)


class FakeUnowned:
    """``cupy.cuda.UnownedMemory(ptr, size, owner, device_id)``."""

    def __init__(self, ptr: int, size: int, owner: object, device: int) -> None:
        self.ptr = ptr
        self.size = size
        self._owner = owner
        self.device_id = device


class FakePool:
    """CuPy's ``SingleDeviceMemoryPool`` (see the module docstring)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.mems: dict[int, FakeMemory] = {}  # every allocation the pool holds
        self.free: list[tuple[FakeMemory, int, int]] = []  # (allocation, offset, size)
        self.in_use = 0

    def malloc(self, nbytes: int) -> FakeChunk:
        size = _round(max(nbytes, 1), _SMALL_UNIT)
        fits = [c for c in self.free if c[2] >= size]
        if fits:
            mem, offset, csize = min(fits, key=lambda c: c[2])
            self.free.remove((mem, offset, csize))
            if csize > size:  # split: the rest stays free
                self.free.append((mem, offset + size, csize - size))
        else:
            try:
                mem = FakeMemory(self.gpu, size)
            except FakeOutOfMemory:
                self.free_all_blocks()
                mem = FakeMemory(self.gpu, size)
            self.mems[mem.ptr] = mem
            offset = 0
        self.in_use += 1
        return FakeChunk(self, mem, offset, size)

    def _release(self, mem: FakeMemory, offset: int, size: int) -> None:
        self.in_use -= 1
        for c in list(self.free):  # merge with free neighbours in the same allocation
            if c[0] is mem and c[1] + c[2] == offset:
                self.free.remove(c)
                offset, size = c[1], c[2] + size
            elif c[0] is mem and offset + size == c[1]:
                self.free.remove(c)
                size += c[2]
        self.free.append((mem, offset, size))

    def free_all_blocks(self) -> None:
        whole = [c for c in self.free if c[1] == 0 and c[2] == c[0].size]
        for c in whole:
            self.free.remove(c)
            del self.mems[c[0].ptr]  # the last reference: cudaFree

    def array(
        self, shape: tuple[int, ...], dtype: str = "<f4", fill: float | None = None
    ) -> FakeArray:
        import numpy

        nbytes = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
        chunk = self.malloc(nbytes)
        arr = FakeArray(self.gpu, chunk, chunk.ptr, shape, dtype)
        if fill is not None:
            arr.set(numpy.full(shape, fill, dtype=dtype))
        return arr


class FakeArray:
    """A ``cupy.ndarray``: ``mem`` is what ``arr.data.mem`` would be."""

    def __init__(
        self,
        gpu: FakeGPU,
        mem: Any,
        ptr: int,
        shape: tuple[int, ...],
        dtype: str = "<f4",
        strides: tuple[int, ...] | None = None,
        device: int = 0,
    ) -> None:
        import numpy

        self.gpu = gpu
        self.mem = mem
        self.ptr = ptr
        self.shape = tuple(shape)
        self.dtype = numpy.dtype(dtype).str
        self.itemsize = numpy.dtype(dtype).itemsize
        if strides is None:  # C order
            acc, rev = self.itemsize, []
            for n in reversed(self.shape):
                rev.append(acc)
                acc *= max(n, 1)
            strides = tuple(reversed(rev))
        self.strides = tuple(strides)
        self.device = device

    def view(
        self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None
    ) -> FakeArray:
        """Another view of the same memory, element 0 ``offset`` bytes further on."""
        return FakeArray(
            self.gpu, self.mem, self.ptr + offset, shape, self.dtype, strides, self.device
        )

    def _span(self) -> tuple[int, int]:
        from aiomp._cuda.meta import extent

        return extent(self.shape, self.strides, self.itemsize)

    def get(self) -> Any:
        """The contents, as a numpy array (``cupy.asnumpy``)."""
        import numpy

        lo, hi = self._span()
        raw = bytearray(self.gpu.read(self.ptr + lo, hi - lo)) if hi > lo else bytearray(1)
        return numpy.ndarray(
            self.shape, self.dtype, buffer=raw, offset=-lo, strides=self.strides
        ).copy()

    def set(self, values: Any) -> None:
        """Write ``values`` (C-contiguous arrays only)."""
        import numpy

        data = numpy.ascontiguousarray(values, dtype=self.dtype).tobytes()
        self.gpu.write(self.ptr, data)


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


# -- children of the fake-backend tests ---------------------------------------------------


def _recv_obj(sock: socket.socket) -> object:
    from aiomp._wire import datagram as _transport
    from aiomp._wire import pickling as _reduction

    got = _transport.recv_sync(sock)
    assert got is not None
    _kind, body, fds = _transport.decode(*got)
    return _reduction.loads(body, fds)


def send_obj(sock: socket.socket, obj: object) -> None:
    from aiomp._child import report as _child
    from aiomp._wire import pickling as _reduction

    _child.send_message(sock, _reduction.dumps(obj))


def cuda_fake_consumer(rank: int, fd: int, messages: int) -> str:
    """Forked child: receive ``messages`` messages of fake arrays on socket ``fd`` and
    report; then obey "drop <i>" (drop message i's arrays) / "sums" / "exit"."""
    import gc

    from aiomp._cuda import ipc as _cuda

    sock = socket.socket(fileno=fd)
    received: list[Any] = [_recv_obj(sock) for _ in range(messages)]
    send_obj(sock, ("got", tuple(_cuda.statistics())))
    while True:
        cmd = _recv_obj(sock)
        if cmd == "exit":
            sock.close()
            return "done"
        if cmd == "sums":  # what every received array holds now, read through its mapping
            send_obj(sock, ("sums", [[float(a.get().sum()) for a in _arrays(m)] for m in received]))
            continue
        if isinstance(cmd, tuple) and cmd[0] == "drop":
            received[cmd[1]] = None
            gc.collect()
        send_obj(sock, ("stats", tuple(_cuda.statistics())))


def _arrays(msg: object) -> list[FakeArray]:
    if isinstance(msg, FakeArray):
        return [msg]
    if isinstance(msg, tuple | list):
        return [a for m in msg for a in _arrays(m)]
    return []


def cuda_fake_queue_consumer(rank: int, q: object, back: object) -> str:
    """Forked child: take fake arrays from an aiomp.Queue; report; drop on request."""
    import gc

    from aiomp._cuda import ipc as _cuda

    view = q.sync.get(timeout=30)  # type: ignore[attr-defined]
    back.sync.put(("got", tuple(_cuda.statistics())))  # type: ignore[attr-defined]
    assert q.sync.get(timeout=30) == "drop"  # type: ignore[attr-defined]
    del view
    gc.collect()
    back.sync.put(("stats", tuple(_cuda.statistics())))  # type: ignore[attr-defined]
    return "done"


def block_forever() -> None:
    import signal

    while True:
        signal.pause()


# -- GPU children (real CuPy; run on a GPU machine only). Every one imports cupy itself. --


def gpu_send(rank: int, q: object, back: object, arrays: str) -> object:
    """Producer: put arrays described by ``arrays``; wait for the consumer's verdict."""
    import cupy

    from aiomp import cuda

    base = cupy.arange(1 << 20, dtype=cupy.float32)  # 4 MiB: travels in place
    msg: tuple[object, ...]
    if arrays == "whole":
        msg = (base,)
    elif arrays == "slice":
        msg = (base[1000:1100],)
    elif arrays == "several":  # small: copied into one staging block
        base = cupy.arange(4096, dtype=cupy.float32)
        msg = (base[:10], base[100:110], base[::-512])
    elif arrays == "ipc_safe":
        base = cuda.empty(1 << 20, dtype=cupy.float32)
        base[...] = cupy.arange(1 << 20, dtype=cupy.float32)
        msg = (base[1000:1100],)
    else:
        raise ValueError(arrays)
    q.sync.put(msg)  # type: ignore[attr-defined]
    verdict = back.sync.get(timeout=60)  # type: ignore[attr-defined]
    expected_writes = cupy.asnumpy(base[1000:1100]).tolist()
    return verdict, cuda.ipc_collect(), expected_writes


def gpu_check(rank: int, q: object, back: object, arrays: str) -> object:
    """Consumer of gpu_send: check contents, write, report, drop."""
    import gc

    import cupy
    import numpy

    from aiomp import cuda

    msg = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    ref = numpy.arange(1 << 20, dtype=numpy.float32)
    if arrays == "whole":
        ok = numpy.array_equal(cupy.asnumpy(msg[0]), ref)
    elif arrays in ("slice", "ipc_safe"):
        ok = numpy.array_equal(cupy.asnumpy(msg[0]), ref[1000:1100])
        msg[0][:] = -1.0  # seen by the producer: these travel in place
        cupy.cuda.get_current_stream().synchronize()
    else:  # small arrays: copied into one IPC-safe staging block
        ref = ref[:4096]
        ok = (
            numpy.array_equal(cupy.asnumpy(msg[0]), ref[:10])
            and numpy.array_equal(cupy.asnumpy(msg[1]), ref[100:110])
            and numpy.array_equal(cupy.asnumpy(msg[2]), ref[::-512])
        )
    stats = cuda.statistics()
    del msg
    gc.collect()
    after = cuda.statistics()
    back.sync.put(
        (
            ok,
            stats.received_held,
            stats.received_open,  # type: ignore[attr-defined]
            after.received_held,
            after.received_open,
        )
    )
    return ok


def gpu_two_chunks_send(rank: int, q: object, back: object) -> object:
    """Defect 1 on hardware: two arrays split from one pool allocation, in one message,
    both deleted; then allocate over whatever the pool got back, and let the consumer
    check its checksums."""
    import cupy

    from aiomp import cuda
    from aiomp._cuda import driver as _driver

    n = 1 << 20  # 4 MiB of float32 each: they travel in place
    whole = cupy.empty(4 * n, dtype=cupy.float32)  # one 16 MiB cudaMalloc...
    del whole  # ...cached by the pool, split for x and y below
    x = cupy.full(n, 1.0, dtype=cupy.float32)
    y = cupy.full(n, 2.0, dtype=cupy.float32)
    rt = cupy.cuda.runtime
    one_allocation = (
        _driver.address_range(x.data.ptr, rt.memGetInfo)[0]
        == _driver.address_range(y.data.ptr, rt.memGetInfo)[0]
    )
    q.sync.put((x, y))  # type: ignore[attr-defined]
    del x, y
    assert back.sync.get(timeout=60) == "received"  # type: ignore[attr-defined]
    junk = [cupy.full(n, -1.0, dtype=cupy.float32) for _ in range(6)]
    cupy.cuda.get_current_stream().synchronize()
    q.sync.put("check")  # type: ignore[attr-defined]
    sums = back.sync.get(timeout=60)  # type: ignore[attr-defined]
    del junk
    return one_allocation, sums, cuda.ipc_collect()


def gpu_two_chunks_check(rank: int, q: object, back: object) -> object:
    import gc

    x, y = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    back.sync.put("received")  # type: ignore[attr-defined]
    assert q.sync.get(timeout=60) == "check"  # type: ignore[attr-defined]
    sums = (float(x.sum()), float(y.sum()))
    del x, y
    gc.collect()
    back.sync.put(sums)  # type: ignore[attr-defined]
    return sums


def gpu_ipc_safe_blocks(rank: int) -> object:
    """aiomp.cuda.empty/zeros: whole 2 MiB-aligned allocations, recycled."""
    import cupy

    from aiomp import cuda

    a = cuda.zeros((1000,), dtype=cupy.float32)
    ptr = a.data.ptr
    aligned = ptr % (2 << 20) == 0 and float(a.sum()) == 0.0
    del a
    b = cuda.empty((3 << 20,), dtype=cupy.uint8)  # 3 MiB: a 4 MiB block
    c = cuda.empty((10,), dtype=cupy.float64)
    return aligned, c.data.ptr == ptr, b.data.ptr % (2 << 20) == 0


_SLOW_KERNEL = r"""
extern "C" __global__ void slow_fill(float* out, int n, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""


def gpu_stream_order_send(rank: int, q: object, back: object) -> object:
    """Launch a long kernel writing the array and put it at once, without synchronising."""
    import cupy

    arr = cupy.zeros(1 << 20, dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    kernel = cupy.RawKernel(_SLOW_KERNEL, "slow_fill")
    rate_khz = cupy.cuda.runtime.getDeviceProperties(arr.device.id).get("clockRate", 1500000)
    cycles = int(rate_khz) * 1000 * 2  # about two seconds of spinning
    assert back.sync.get(timeout=120) == "ready"  # type: ignore[attr-defined]
    kernel(
        ((arr.size + 255) // 256,),
        (256,),
        (arr, cupy.int32(arr.size), cupy.float32(7.0), cupy.int64(cycles)),
    )
    pending = not cupy.cuda.get_current_stream().done
    q.sync.put(arr)  # type: ignore[attr-defined]
    return pending, back.sync.get(timeout=60)  # type: ignore[attr-defined]


def gpu_stream_order_check(rank: int, q: object, back: object) -> object:
    import cupy

    cupy.zeros(1).sum()  # initialise CUDA first: receiving must be fast enough to race
    back.sync.put("ready")  # type: ignore[attr-defined]
    arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    # Runs on this process's current stream, which waits on the producer's event.
    total = float(arr.sum())
    minimum = float(arr.min())
    del arr
    back.sync.put("done")  # type: ignore[attr-defined]
    return total, minimum


def gpu_many_send(rank: int, q: object, back: object, rounds: int) -> object:
    """Send a fresh 8 MiB array per round; measure pool and device memory as it goes."""
    import cupy

    from aiomp import cuda

    pool = cupy.get_default_memory_pool()
    samples = []
    for i in range(rounds):
        arr = cupy.full(2 << 20, i, dtype=cupy.float32)
        q.sync.put((i, arr))  # type: ignore[attr-defined]
        del arr
        assert back.sync.get(timeout=60) == i  # type: ignore[attr-defined]
        cuda.ipc_collect()
        if i in (rounds // 4, rounds - 1):
            free, _total = cupy.cuda.runtime.memGetInfo()
            samples.append((pool.used_bytes(), pool.total_bytes(), free))
    q.sync.put(None)  # type: ignore[attr-defined]
    held = cuda.ipc_collect()
    return held, samples, tuple(cuda.statistics())


def gpu_many_check(rank: int, q: object, back: object) -> object:
    from aiomp import cuda

    bad = 0
    while True:
        item = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        if item is None:
            break
        i, arr = item
        if float(arr[0]) != i or float(arr[-1]) != i:
            bad += 1
        del item, arr  # releases: the producer may reuse the block
        back.sync.put(i)  # type: ignore[attr-defined]
    return bad, tuple(cuda.statistics())


def gpu_hold_then_block(rank: int, q: object, back: object) -> None:
    """Receive an array, say so, and hold it until killed."""
    arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    back.sync.put(("holding", float(arr[0])))  # type: ignore[attr-defined]
    block_forever()


def gpu_send_then_collect(rank: int, q: object, ctl: object) -> object:
    """Send one array; after the test says its consumer was killed, collect."""
    import cupy

    from aiomp import cuda

    arr = cupy.full(1 << 20, 3.0, dtype=cupy.float32)
    q.sync.put(arr)  # type: ignore[attr-defined]
    del arr
    held_before = cuda.ipc_collect()
    assert ctl.sync.get(timeout=60) == "killed"  # type: ignore[attr-defined]
    return held_before, cuda.ipc_collect()


def gpu_send_one(rank: int, q: object, back: object) -> object:
    import cupy

    arr = cupy.arange(1 << 20, dtype=cupy.float32)
    q.sync.put(arr)  # type: ignore[attr-defined]
    return back.sync.get(timeout=60)  # type: ignore[attr-defined]


def gpu_forward(rank: int, q: object, q2: object, back: object, back2: object) -> str:
    """Receive an array and try to put it on another queue: must raise CudaIpcError.
    Then forward a copy, and keep it alive until its receiver is done."""
    from aiomp import cuda

    arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    try:
        q2.sync.put(arr[:16])  # type: ignore[attr-defined]
    except cuda.CudaIpcError as exc:
        outcome = f"refused: {exc}"
        q2.sync.put(arr[:16].copy())  # type: ignore[attr-defined]
    else:
        outcome = "forwarded without error"
    back2.sync.get(timeout=60)  # type: ignore[attr-defined]
    del arr
    back.sync.put("done")  # type: ignore[attr-defined]
    return outcome


def gpu_recv_forwarded(rank: int, q2: object, back2: object) -> object:
    import cupy

    arr = q2.sync.get(timeout=60)  # type: ignore[attr-defined]
    values = cupy.asnumpy(arr).tolist()
    del arr
    back2.sync.put("done")  # type: ignore[attr-defined]
    return values


def gpu_recv_invisible(rank: int, q: object, back: object) -> str:
    """Hide every GPU (before CUDA initialises here), then receive: must raise."""
    from aiomp import cuda

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        q.sync.get(timeout=60)  # type: ignore[attr-defined]
    except cuda.CudaIpcError as exc:
        back.sync.put("failed")  # type: ignore[attr-defined]
        return f"{type(exc).__name__}: {exc}"
    back.sync.put("received")  # type: ignore[attr-defined]
    return "received"


async def gpu_fork_after_init(rank: int) -> str:
    """Initialise CUDA, then ask aiomp to fork: must raise RuntimeError (R14)."""
    import cupy

    import aiomp
    from tests.children.common import echo

    cupy.zeros(1).sum()
    try:
        await aiomp.spawn(echo, 1, start_method="fork")
    except RuntimeError as exc:
        return str(exc)
    return "forked"
