"""A GPU-less model of what sits under CuPy, for the CUDA IPC tests (tests/cuda/); the
fake backend built on it is in ``tests.children.cuda_backend``.

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
"""

from __future__ import annotations

import mmap
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


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
