"""CUDA IPC for CuPy arrays (aiomp._cuda.ipc, aiomp.cuda): allocations and blocks:
several arrays in one allocation, forwarding refused, the consumer's mapping, small arrays
in IPC-safe blocks, no GPU, out of memory, the CuPy backend on a modelled CuPy.

With a fake CUDA backend (``tests.children.cuda_backend.FakeBackend``, a model of CuPy's memory
pool and the driver's allocator) driven through aiomp's real message path: no GPU, no cupy.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy
import pytest

import aiomp
from aiomp._cuda import driver as _driver
from aiomp._cuda import ipc as _cuda
from aiomp._cuda.meta import IpcArrayMeta
from aiomp._cuda.slots import DEFAULT_IPC_LIMIT
from aiomp._cuda.state import state as _state
from aiomp._memory import lease as _lease
from aiomp._wire import pickling as _reduction
from tests.children import cuda_backend as _cuda_backend
from tests.children.cuda_backend import FakeBackend
from tests.children.cuda_device import FakeArray, FakeGPU, FakeUnowned
from tests.cuda._cuda import MiB, received

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


# -- issue 16: the defects the review found, each pinned ------------------------------------


def test_two_arrays_in_one_allocation_both_stay_alive(fake: FakeBackend) -> None:
    """Defect 1: the record of a message kept only the first array's memory per
    allocation; CuPy's pool splits allocations into chunks and frees each with its last
    reference, so the second array's chunk was reused while the consumer read it."""
    whole = fake.array((8 * MiB,), "|u1")  # one cudaMalloc, cached by the pool...
    del whole
    x = fake.array((MiB,), "<f4", fill=1.0)  # ...and split for x and y
    y = fake.array((MiB,), "<f4", fill=2.0)
    assert fake.gpu.address_range(x.ptr) == fake.gpu.address_range(y.ptr)
    assert x.mem is not y.mem
    got = received((x, y))
    del x, y
    gc.collect()
    assert fake.pool.in_use == 2  # both chunks kept for the consumer
    junk = [fake.array((MiB,), "<f4", fill=-1.0) for _ in range(2)]  # lands on freed chunks
    assert float(got[0].get().sum()) == 1.0 * MiB
    assert float(got[1].get().sum()) == 2.0 * MiB
    del got, junk
    gc.collect()
    assert _cuda.ipc_collect() == 0
    assert fake.pool.in_use == 0


def test_forwarding_is_refused_before_any_cuda_call(fake: FakeBackend) -> None:
    """Defect 2: export() asked the driver for the range and an IPC handle of imported
    memory before checking whether it was received; the driver's refusal hid the real
    error (test_gpu_sending_a_received_array_onward_raises)."""
    big, small = fake.array((MiB,)), fake.array((16,))
    got_big, got_small = received((big, small))
    # a derived view, and an array on mapped memory whose owner aiomp did not make
    derived = got_big.view(4096, (100,))
    foreign = FakeArray(fake.gpu, FakeUnowned(got_big.ptr, 4096, None, 0), got_big.ptr, (1024,))
    for arr in (got_big, got_small, derived, foreign):
        fake.calls.clear()
        with pytest.raises(aiomp.cuda.CudaIpcError, match="received from another process"):
            _reduction.dumps({"x": arr})
        assert fake.calls == []  # refused before any CUDA call
    del got_big, got_small, derived, foreign
    gc.collect()
    assert _cuda.ipc_collect() == 0


@pytest.mark.parametrize("release_raises", [False, True])
def test_consumer_closes_the_mapping_before_releasing(
    fake: FakeBackend, monkeypatch: pytest.MonkeyPatch, release_raises: bool
) -> None:
    """Defect 3: the consumer released its lease (letting the producer free the memory)
    before closing its IPC mapping, which the driver calls undefined behaviour; and a
    release that raised skipped the close entirely."""
    real_release = _lease.release
    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))

    def release(fd: int, start: int, length: int) -> None:
        fake.calls.append(("release", start))
        if release_raises:
            raise OSError(9, "release failed")
        real_release(fd, start, length)

    monkeypatch.setattr(_lease, "release", release)
    got = received(fake.array((MiB,)))
    assert fake.gpu.mapped
    fake.calls.clear()
    del got
    gc.collect()
    assert [c[0] for c in fake.calls] == ["sync", "close", "release"]
    assert not fake.gpu.mapped
    if release_raises:
        assert len(unraisable) == 1 and isinstance(unraisable[0], OSError)
    else:
        assert unraisable == []
    # Either way the lease description is closed: nothing holds the block any more.
    assert _cuda.ipc_collect() == 0
    assert aiomp.cuda.statistics()[3:5] == (0, 0)


def test_small_arrays_travel_in_ipc_safe_blocks(fake: FakeBackend) -> None:
    """Defect 4: the driver sub-allocates small cudaMallocs from one block, and an IPC
    handle shares the whole block: neighbouring data reached consumers, and one consumer
    had to open two handles backed by one block (the driver refuses the second)."""
    a = fake.array((1000,), "<f4")
    a.set(numpy.arange(1000, dtype="<f4"))
    secret = fake.array((256,), "<f8", fill=7.5)
    b = fake.array((10,), "<i8")
    b.set(numpy.arange(10, 20))
    blocks = {fake.gpu.block_of(p) for p in (a.ptr, b.ptr, secret.ptr)}
    assert len(blocks) == 1  # the fake driver packed them into one block
    msg = (a, b.view(72, (10,), (-8,)), a.view(400, (5, 20), (80, 4)))  # b reversed
    fake.calls.clear()
    got = received(msg)
    opened = [c[2] for c in fake.calls if c[0] == "open"]
    assert len(opened) == 1  # the message's small arrays share one staging block
    assert fake.gpu.is_whole(opened[0])  # a 2 MiB-aligned allocation of its own
    assert fake.gpu.parse(opened[0])[0] not in blocks  # the secret's block stays unseen
    assert [c[0] for c in fake.calls].count("copy") == 3
    assert numpy.array_equal(got[0].get(), numpy.arange(1000))
    assert numpy.array_equal(got[1].get(), numpy.arange(19, 9, -1))
    assert numpy.array_equal(got[2].get(), numpy.arange(100, 200).reshape(5, 20))
    # The copies were queued after the slot's event: it was recorded again after them.
    names = [c[0] for c in fake.calls]
    assert names.index("record") < max(i for i, n in enumerate(names) if n == "copy")
    assert names.count("record_again") == 2
    del got
    gc.collect()
    assert _cuda.ipc_collect() == 0
    assert aiomp.cuda.statistics().idle_blocks == 1  # the staging block, for reuse
    fake.calls.clear()
    got = received(a)
    assert "malloc" not in [c[0] for c in fake.calls]  # recycled
    del got, a, b, secret


def test_no_gpu_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 5: with cupy installed and no usable GPU, a put raised a raw
    CUDARuntimeError from Device.__enter__, receiving an empty array one from
    getDeviceCount, and the bus-id path blamed CUDA_VISIBLE_DEVICES."""
    cupy = _cuda_backend.no_gpu_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_driver, "backend", None)
    _reduction.register(cupy.ndarray, _cuda.reduce_array)
    try:
        with pytest.raises(
            aiomp.cuda.CudaIpcError, match="has no usable CUDA device: cudaErrorNoDevice"
        ) as sent:
            _reduction.dumps(cupy.ndarray())
        assert "nvidia-smi" in str(sent.value)
        empty = IpcArrayMeta(None, 0, 0, (0,), (4,), "<f4", 0, "0000:01:00.0", None, 1, -1, -1)
        with pytest.raises(
            aiomp.cuda.CudaIpcError, match=r"arrived, but process \d+ has no usable CUDA device"
        ):
            _cuda.rebuild(empty)
        with pytest.raises(
            aiomp.cuda.CudaIpcError, match="no usable CUDA device: cudaErrorNoDevice"
        ) as got:
            _cuda.get_backend().local_device("0000:3b:00.0", 1)
        assert "PCI bus id 0000:3b:00.0" in str(got.value)
        assert "cannot access that device" not in str(got.value)
        with pytest.raises(aiomp.cuda.CudaIpcError, match="no usable CUDA device"):
            aiomp.cuda.empty(16)
    finally:
        _state.reset()


def test_out_of_memory_collects_and_retries_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 6: memory held for sent blocks that consumers had released was freed only
    at the next send or ipc_collect(), so an allocation failed while it could have been
    reclaimed (torch frees such blocks from its allocator's out-of-memory callback)."""
    backend = FakeBackend(FakeGPU(capacity=8 * MiB))  # four 2 MiB granules
    _state.reset()
    monkeypatch.setattr(_driver, "backend", backend)
    _reduction.register(FakeArray, _cuda.reduce_array)
    gpu = backend.gpu
    try:
        sent = aiomp.cuda.zeros((MiB // 4,), "<f4")  # one granule
        got = received(sent)
        del got, sent  # the consumer released it; nobody collected yet
        gc.collect()
        idle = aiomp.cuda.empty(16)  # one more granule, idle once dropped
        del idle
        cached = [backend.array((2 * MiB,), "|u1") for _ in range(2)]
        del cached  # CuPy's pool caches those two granules
        assert all(gpu.granules)  # the device is full
        gpu.mallocs.clear()
        big = aiomp.cuda.empty((4 * MiB,), "|u1")  # two granules
        assert gpu.mallocs == [4 * MiB, 4 * MiB]  # failed, reclaimed, retried once
        assert "free_cached" in backend.names()
        assert aiomp.cuda.statistics().idle_blocks == 0
        # Sending a small array needs a staging block: the same reclaim on the way.
        held = aiomp.cuda.empty(16)  # a third granule
        small = backend.array((4,), "<f4", fill=3.0)  # the driver's small block: the last
        del big  # idle, but 4 MiB: no use for a 2 MiB staging block
        gc.collect()
        gpu.mallocs.clear()
        got = received(small)
        assert gpu.mallocs == [2 * MiB, 2 * MiB]  # failed, reclaimed big, retried once
        assert float(got.get().sum()) == 12.0
        # Truly out of memory (a consumer holds what is left): one retry, then the error.
        gpu.mallocs.clear()
        with pytest.raises(MemoryError, match="out of memory"):
            aiomp.cuda.empty((4 * MiB,), "|u1")
        assert gpu.mallocs == [4 * MiB, 4 * MiB]
        del got, held, small
        gc.collect()
        assert _cuda.ipc_collect() == 0
    finally:
        gc.collect()
        _state.reset()
        _cuda.set_ipc_limit(DEFAULT_IPC_LIMIT)


def test_cupy_backend_on_a_modelled_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real backend (CupyBackend: CuPy's names and argument orders, the driver's
    address-range query through ctypes), run on a model of CuPy since no GPU runs these
    tests: in place, staged and IPC-safe arrays, forwarding refused, release."""
    gpu = FakeGPU()
    cupy = _cuda_backend.model_cupy(gpu)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_driver, "backend", None)
    monkeypatch.setattr(_driver, "_lib", _cuda_backend.ModelLibcuda(gpu))
    _state.reset()
    _reduction.register(cupy.ndarray, _cuda.reduce_array)
    try:
        big = cupy.ndarray((MiB,), "<f4")
        big.set(numpy.arange(MiB, dtype="<f4"))
        small = cupy.ndarray((100,), "<f8")
        small.set(numpy.full(100, 0.25))
        safe = aiomp.cuda.zeros((10,), "<i4")
        assert isinstance(safe, cupy.ndarray) and safe.ptr % aiomp.cuda.IPC_BLOCK == 0
        got = received((big, small, safe))
        assert all(isinstance(g, cupy.ndarray) for g in got)
        assert numpy.array_equal(got[0].get(), numpy.arange(MiB))
        assert float(got[1].get().sum()) == 25.0
        assert not got[2].get().any()
        assert cupy.calls.count("ipcOpenMemHandle") == 3  # big, the staging block, safe
        assert "memcpyAsync" in cupy.calls and "memsetAsync" in cupy.calls
        assert "streamWaitEvent" in cupy.calls
        cupy.calls.clear()
        with pytest.raises(aiomp.cuda.CudaIpcError, match="received from another process"):
            _reduction.dumps(got[0])
        assert cupy.calls == []
        del got
        gc.collect()
        assert cupy.calls.count("ipcCloseMemHandle") == 3 and not gpu.mapped
        assert _cuda.ipc_collect() == 0
        del big, small, safe
    finally:
        gc.collect()
        _state.reset()


def test_cupy_backend_out_of_memory_on_a_modelled_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 6 through the real backend: cudaMalloc's cudaErrorMemoryAllocation is
    recognised, CuPy's cached blocks are freed, and the allocation retried once."""
    gpu = FakeGPU(capacity=4 * MiB)
    cupy = _cuda_backend.model_cupy(gpu)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_driver, "backend", None)
    _state.reset()
    try:
        held = aiomp.cuda.empty(16)
        cached = cupy.ndarray((MiB // 2,), "<f4")  # CuPy's pool keeps the last granule
        del cached
        assert all(gpu.granules)
        again = aiomp.cuda.empty(16)
        assert len(gpu.mallocs) == 4  # held, cached, a failure, the retry
        with pytest.raises(MemoryError):
            aiomp.cuda.empty(16)
        del held, again
    finally:
        gc.collect()
        _state.reset()


# -- IPC-safe blocks --------------------------------------------------------------------------


def test_ipc_safe_arrays_travel_in_place_and_are_recycled(fake: FakeBackend) -> None:
    x = aiomp.cuda.zeros((3, 1000), "<f4")
    assert isinstance(x, FakeArray) and isinstance(x.mem._owner, _cuda.IpcBlock)
    assert x.ptr % aiomp.cuda.IPC_BLOCK == 0
    assert float(x.get().sum()) == 0.0 and ("memset", 0, x.ptr, 12000) in fake.calls
    x.set(numpy.ones((3, 1000), "<f4"))
    fake.calls.clear()
    got = received(x.view(4000, (2, 1000)))  # x[1:]
    names = fake.names()
    assert "copy" not in names and names.count("open") == 1
    assert fake.gpu.is_whole(next(c[2] for c in fake.calls if c[0] == "open"))
    got.set(numpy.full((2, 1000), 5.0, "<f4"))  # the consumer's writes reach the producer
    assert float(x.get().sum()) == 1000 + 2 * 5000
    ptr = x.ptr
    del x
    gc.collect()
    assert aiomp.cuda.statistics().idle_blocks == 0  # the consumer still holds it
    del got
    gc.collect()
    assert _cuda.ipc_collect() == 0
    assert aiomp.cuda.statistics().idle_blocks == 1
    fake.calls.clear()
    again = aiomp.cuda.empty((MiB,), "|u1")
    assert again.ptr == ptr and "malloc" not in fake.names()  # recycled
    bigger = aiomp.cuda.empty((3 * MiB,), "|u1")
    assert ("malloc", 0, 4 * MiB) in fake.calls  # whole 2 MiB multiples
    assert aiomp.cuda.empty((0, 4)).shape == (0, 4)
    del again, bigger


@pytest.mark.parametrize(
    ("shape", "dtype", "error"),
    [
        ((-1, 4), "<f4", ValueError),
        ((2.5,), "<f4", TypeError),
        ((4,), object, TypeError),
    ],
)
def test_ipc_safe_allocation_rejects_bad_arguments(
    fake: FakeBackend, shape: Any, dtype: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        aiomp.cuda.empty(shape, dtype)
    assert "malloc" not in fake.names()
