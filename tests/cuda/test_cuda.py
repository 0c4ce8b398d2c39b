"""CUDA IPC for CuPy arrays (aiomp._cuda.ipc, aiomp.cuda).

Two kinds of tests:

- Everywhere (no GPU, no cupy): the pure parts (what is pickled, offset arithmetic, lease
  ranges, slot bookkeeping) and the whole lifetime protocol driven through aiomp's real
  message path with a fake CUDA backend (``tests.children.cuda.FakeBackend``, a model of
  CuPy's memory pool and the driver's allocator): slots, handoff
  fds, consumer leases, the handle cache, finalizers, collection, limits, a consumer
  killed with SIGKILL.
- ``@pytest.mark.gpu``: real CuPy in spawned children. The test process itself never
  imports cupy or initialises CUDA (so later fork-based tests in the same session stay
  legal); it only probes for a device in a throwaway subprocess. They skip with the
  reason when cupy is missing or no device is visible.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import types
import weakref
from pathlib import Path
from typing import Any

import anyio
import numpy
import pytest

import aiomp
from aiomp._cuda import driver as _driver
from aiomp._cuda import ipc as _cuda
from aiomp._cuda import producer as _producer
from aiomp._cuda.meta import IpcArrayMeta
from aiomp._cuda.slots import DEFAULT_IPC_LIMIT
from aiomp._cuda.state import state as _state
from aiomp._memory import lease as _lease
from aiomp._process import checks as _context
from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction
from tests.children import common as _funcs
from tests.children import cuda as _funcs_cuda
from tests.children.cuda import FakeArray, FakeBackend, FakeGPU, FakeUnowned

ROOT = Path(__file__).resolve().parents[2]

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


@pytest.fixture
def anyio_backend() -> object:
    # This module tests the CUDA transport, not aiomp's async APIs: one backend is enough.
    return ("asyncio", {})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route aiomp._cuda.ipc's CUDA calls to a fake backend; FakeArray reduces like cupy.ndarray."""
    backend = FakeBackend()
    _state.reset()
    monkeypatch.setattr(_driver, "backend", backend)
    _reduction.register(FakeArray, _cuda.reduce_array)
    yield backend
    gc.collect()
    _state.reset()
    _cuda.set_ipc_limit(DEFAULT_IPC_LIMIT)


def roundtrip(obj: object) -> Any:
    """Pickle for a message and unpickle in this process (fds: dups of the message's)."""
    out = _reduction.dumps(obj)
    try:
        fds = [os.dup(fd) for fd in out.fds]
        return _reduction.loads(out.body, fds)
    finally:
        out.close()


def received(obj: object) -> Any:
    """Like :func:`roundtrip`, but unpickled as another process would: through the IPC
    handles (the consumer opens them), not through the producer's own records."""
    out = _reduction.dumps(obj)
    try:
        fds = [os.dup(fd) for fd in out.fds]
        prod = _state.producer
        _state.producer = None
        try:
            return _reduction.loads(out.body, fds)
        finally:
            _state.producer = prod
    finally:
        out.close()


MiB = 1 << 20


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
    cupy = _funcs_cuda.no_gpu_cupy()
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
    cupy = _funcs_cuda.model_cupy(gpu)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_driver, "backend", None)
    monkeypatch.setattr(_driver, "_lib", _funcs_cuda.ModelLibcuda(gpu))
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
    cupy = _funcs_cuda.model_cupy(gpu)
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


# -- the protocol in one process (fake backend) -----------------------------------------------


def test_same_process_roundtrip_keeps_then_frees_the_block(fake: FakeBackend) -> None:
    arr = fake.array((3 * MiB,), "|u1")
    chunk = weakref.ref(arr.mem)
    view = roundtrip(arr.view(8192, (4, 1 << 19), (1 << 19, 1)))  # 2 MiB: in place
    assert isinstance(view, FakeArray)
    assert view.ptr == arr.ptr + 8192  # no IPC open: our own memory
    assert (view.shape, view.strides) == ((4, 1 << 19), (1 << 19, 1))
    assert _cuda.ipc_collect() == 1
    stats = aiomp.cuda.statistics()
    assert (stats.sent_held, stats.events, stats.received_held) == (1, 1, 1)
    assert "wait_local" in fake.names() and "open" not in fake.names()
    del arr
    gc.collect()
    assert chunk() is not None  # the producer keeps it: a consumer holds it
    del view
    gc.collect()
    assert ("sync", 0) in fake.calls  # the consumer synchronised before releasing
    assert _cuda.ipc_collect() == 0
    assert chunk() is None and fake.pool.in_use == 0
    assert aiomp.cuda.statistics()[:4] == (0, 0, 0, 0)
    assert "recycle" in fake.names()


def test_arrays_from_one_allocation_share_one_slot(fake: FakeBackend) -> None:
    whole = fake.array((8 * MiB,), "|u1")
    other = fake.array((2 * MiB,), "|u1")
    a = whole.view(0, (3 * MiB,))
    msg = (a, whole.view(4 * MiB, (MiB, 2)), other, a)
    out = _reduction.dumps(msg)
    try:
        assert len(out.fds) == 1  # one handoff description per message
        assert _cuda.ipc_collect() == 2  # two allocations, two slots
        got = _reduction.loads(out.body, [os.dup(out.fds[0])])
    finally:
        out.close()
    assert isinstance(got, tuple)
    assert got[0].mem._owner is got[1].mem._owner is got[3].mem._owner
    assert got[2].mem._owner is not got[0].mem._owner
    assert fake.names().count("record") == 2  # one event per slot
    assert aiomp.cuda.statistics().received_held == 2
    del got
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_in_flight_message_holds_the_block(fake: FakeBackend) -> None:
    arr = fake.array((MiB,))
    chunk = weakref.ref(arr.mem)
    out = _reduction.dumps(arr)
    del arr
    in_flight = os.dup(out.fds[0])  # what a queued datagram holds
    out.close()
    gc.collect()
    assert _cuda.ipc_collect() == 1
    assert chunk() is not None
    os.close(in_flight)
    assert _cuda.ipc_collect() == 0
    assert chunk() is None


def test_message_never_received_releases_with_its_socket(fake: FakeBackend) -> None:
    a, b = _transport.socketpair()
    out = _reduction.dumps([fake.array((16,))])
    try:
        assert _transport.try_send(a, *out.datagram())
    finally:
        out.close()
    assert _cuda.ipc_collect() == 1
    a.close()
    b.close()  # the kernel drops the fds queued in the socket
    assert _cuda.ipc_collect() == 0


def test_failed_dumps_releases_the_slot(fake: FakeBackend) -> None:
    with pytest.raises(TypeError, match="Unpicklable refuses"):
        _reduction.dumps((fake.array((MiB,)), fake.array((4,)), _funcs.Unpicklable()))
    assert _cuda.ipc_collect() == 0
    gc.collect()
    assert fake.pool.in_use == 0


def test_outstanding_limit_raises_at_put(fake: FakeBackend) -> None:
    aiomp.cuda.set_ipc_limit(2)
    assert aiomp.cuda.get_ipc_limit() == 2
    held = [_reduction.dumps(fake.array((16,))) for _ in range(2)]
    with pytest.raises(aiomp.cuda.IpcLimitError, match="still held by their consumers"):
        _reduction.dumps(fake.array((MiB,)))
    assert isinstance(aiomp.cuda.IpcLimitError("x"), aiomp.cuda.CudaIpcError)
    held.pop().close()
    _reduction.dumps(fake.array((16,))).close()  # collected at send: room again
    for out in held:
        out.close()
    with pytest.raises(ValueError):
        aiomp.cuda.set_ipc_limit(0)


def test_event_cap_falls_back_to_synchronising(
    fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_producer, "MAX_IPC_EVENTS", 1)
    first = _reduction.dumps(fake.array((MiB,)))
    fake.calls.clear()
    second = _reduction.dumps(fake.array((MiB,)))
    try:
        names = fake.names()
        assert "record" not in names and names.count("sync") == 1  # no event: synchronised
        assert aiomp.cuda.statistics().events == 1
        fake.calls.clear()
        third = _reduction.dumps((fake.array((4,)), fake.array((4,))))  # staged, no event
        assert fake.names().count("sync") == 2  # after each copy
        third.close()
    finally:
        first.close()
        second.close()


def test_sending_a_received_array_onward_raises(fake: FakeBackend) -> None:
    view = roundtrip(fake.array((MiB,)))
    with pytest.raises(aiomp.cuda.CudaIpcError, match="received from another process"):
        _reduction.dumps({"x": view})
    del view
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_empty_array_needs_no_handle(fake: FakeBackend) -> None:
    view = roundtrip(fake.array((16,)).view(0, (0, 3)))
    assert isinstance(view, FakeArray) and view.shape == (0, 3)
    assert _cuda.ipc_collect() == 0
    assert not {"record", "open", "copy", "malloc"} & set(fake.names())


def test_get_raises_cuda_ipc_error_for_a_device_it_cannot_see(fake: FakeBackend) -> None:
    # Issue 32, first run on a GPU (H100): a consumer with CUDA_VISIBLE_DEVICES="" got
    # QueueItemError at get, where aiomp.cuda and the README promise CudaIpcError.
    q = aiomp.Queue()
    try:
        q.sync.put(fake.array((16,)).view(0, (0, 4)))  # rebuilt on the device it names
        fake.devices = ()  # this process sees no GPU
        with pytest.raises(aiomp.cuda.CudaIpcError, match="is not visible"):
            q.sync.get(timeout=10)
        q.sync.put("next")
        assert q.sync.get(timeout=10) == "next"  # the item is lost; the queue goes on
    finally:
        q.close()


def test_release_syncs_only_the_last_view_of_a_mapping(fake: FakeBackend) -> None:
    # Issue 32 (profile on an H100): the stream sync at each release cost a handoff about
    # 0.1 ms. While another received slot still maps the allocation, the producer cannot
    # free or reuse it, so that release needs no sync; the last one syncs for them all.
    whole = fake.array((8 * MiB,), "|u1")
    first = received(whole.view(0, (3 * MiB,)))
    second = received(whole.view(4 * MiB, (3 * MiB,)))
    fake.calls.clear()
    del first
    gc.collect()
    assert "sync" not in fake.names() and "close" not in fake.names()
    assert _cuda.ipc_collect() == 1
    fake.calls.clear()
    del second
    gc.collect()
    assert fake.names()[:2] == ["sync", "close"]  # synced, closed, then released
    assert _cuda.ipc_collect() == 0


def test_reducer_only_works_inside_a_message(fake: FakeBackend) -> None:
    with pytest.raises(pickle.PicklingError, match="can only travel inside aiomp"):
        _cuda.reduce_array(fake.array((4,)))


# -- the protocol across processes (fake backend, forked consumer) ----------------------------


async def _recv(sock: Any) -> object:
    while (got := _transport.try_recv(sock)) is None:
        await anyio.wait_readable(sock)
    _kind, body, fds = _transport.decode(*got)
    return _reduction.loads(body, fds)


def _send(sock: Any, obj: object) -> None:
    _funcs_cuda.send_obj(sock, obj)


async def _stats(sock: Any, expect: str = "stats") -> _cuda.IpcStatistics:
    """The consumer's reply: its aiomp.cuda.statistics()."""
    reply = await _recv(sock)
    assert isinstance(reply, tuple) and reply[0] == expect
    return _cuda.IpcStatistics(*reply[1])


@pytest.mark.anyio
@pytest.mark.parametrize("end", ["release", "sigkill"])
async def test_consumer_release_or_death_frees_the_block(fake: FakeBackend, end: str) -> None:
    arr = fake.array((MiB,))
    chunk = weakref.ref(arr.mem)
    parent, child = _transport.socketpair()
    try:
        with anyio.fail_after(30):
            ctx = await aiomp.spawn(
                _funcs_cuda.cuda_fake_consumer,
                1,
                args=(child.fileno(), 1),
                start_method="fork",
                grace_period=1,
            )
            child.close()
            _send(parent, (arr.view(4096, (16, 40000)),))
            stats = await _stats(parent, "got")
            assert (stats.received_held, stats.received_open, stats.sent_held) == (1, 1, 0)
            del arr
            gc.collect()
            assert _cuda.ipc_collect() == 1
            assert chunk() is not None
            if end == "release":
                _send(parent, ("drop", 0))
                stats = await _stats(parent)
                assert stats[3:5] == (0, 0)  # no views, handle closed
                assert _cuda.ipc_collect() == 0
                _send(parent, "exit")
                await ctx.join()
            else:
                os.kill(ctx.pids()[0], signal.SIGKILL)
                with pytest.raises(aiomp.ProcessExitedException, match="SIGKILL"):
                    await ctx.join()
                assert _cuda.ipc_collect() == 0
            assert chunk() is None
    finally:
        parent.close()
        child.close()


@pytest.mark.anyio
async def test_consumer_opens_each_allocation_once(fake: FakeBackend) -> None:
    whole = fake.array((8 * MiB,), "|u1")
    parent, child = _transport.socketpair()
    try:
        with anyio.fail_after(30):
            ctx = await aiomp.spawn(
                _funcs_cuda.cuda_fake_consumer,
                1,
                args=(child.fileno(), 2),
                start_method="fork",
                grace_period=1,
            )
            child.close()
            # two messages, two slots, one allocation: the fake refuses a second open
            _send(parent, whole.view(0, (3 * MiB,)))
            _send(parent, whole.view(4 * MiB, (3 * MiB,)))
            stats = await _stats(parent, "got")
            assert stats[3:5] == (2, 1)
            assert _cuda.ipc_collect() == 2
            _send(parent, ("drop", 0))
            stats = await _stats(parent)
            assert stats[3:5] == (1, 1)
            assert _cuda.ipc_collect() == 1
            _send(parent, ("drop", 1))
            stats = await _stats(parent)
            assert stats[3:5] == (0, 0)
            assert _cuda.ipc_collect() == 0
            _send(parent, "exit")
            await ctx.join()
    finally:
        parent.close()
        child.close()


@pytest.mark.anyio
async def test_consumer_reads_what_the_producer_wrote(fake: FakeBackend) -> None:
    """Across a real process boundary: two chunks of one allocation (defect 1) and small
    arrays staged after the fork (defect 4), read by the consumer after the producer has
    allocated over everything it dropped."""
    parent, child = _transport.socketpair()
    try:
        with anyio.fail_after(30):
            ctx = await aiomp.spawn(
                _funcs_cuda.cuda_fake_consumer,
                1,
                args=(child.fileno(), 1),
                start_method="fork",
                grace_period=1,
            )
            child.close()
            whole = fake.array((8 * MiB,), "|u1")
            del whole
            x = fake.array((MiB,), "<f4", fill=1.0)
            y = fake.array((MiB,), "<f4", fill=2.0)
            small = fake.array((100,), "<f8", fill=0.5)
            _send(parent, (x, y, small))
            del x, y, small
            gc.collect()
            await _stats(parent, "got")
            junk = [fake.array((MiB,), "<f4", fill=-1.0) for _ in range(2)]
            junk.append(fake.array((100,), "<f8", fill=-1.0))
            _send(parent, "sums")
            reply = await _recv(parent)
            assert reply == ("sums", [[1.0 * MiB, 2.0 * MiB, 50.0]])
            _send(parent, ("drop", 0))
            stats = await _stats(parent)
            assert stats[3:5] == (0, 0)
            assert _cuda.ipc_collect() == 0
            _send(parent, "exit")
            await ctx.join()
            del junk
    finally:
        parent.close()
        child.close()


@pytest.mark.anyio
async def test_fake_arrays_through_an_aiomp_queue(fake: FakeBackend) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    arr = fake.array((MiB,))
    with anyio.fail_after(30):
        async with aiomp.spawn(
            _funcs_cuda.cuda_fake_queue_consumer,
            1,
            args=(q, back),
            start_method="fork",
            grace_period=1,
        ) as ctx:
            await q.put({"batch": arr.view(512, (8, 8)), "id": 7, "big": arr})
            tag, stats = await back.get()
            assert tag == "got"
            assert _cuda.IpcStatistics(*stats)[3:5] == (2, 2)  # staged and in place
            assert _cuda.ipc_collect() == 2
            await q.put("drop")
            tag, stats = await back.get()
            assert _cuda.IpcStatistics(*stats)[3:5] == (0, 0)
            assert _cuda.ipc_collect() == 0
    assert ctx.results == ["done"]


# -- R14, imports, exit --------------------------------------------------------------------


class _FakeLibcuda:
    def __init__(self, rc: int) -> None:
        self.rc = rc

    def cuDeviceGetCount(self, count: object) -> int:  # the driver's name
        return self.rc


def test_cuda_initialized_is_false_without_cupy() -> None:
    if "cupy" in sys.modules:
        pytest.skip("cupy is imported in this process")
    assert _cuda.cuda_initialized() is False


@pytest.mark.parametrize(
    ("lib", "expected"),
    [
        (None, False),  # libcuda not loaded: nothing initialised it
        (_FakeLibcuda(3), False),  # CUDA_ERROR_NOT_INITIALIZED: loaded, cuInit never ran
        (_FakeLibcuda(0), True),
        (_FakeLibcuda(4), True),  # deinitialised: was initialised
    ],
)
def test_cuda_initialized_asks_a_loaded_driver(
    monkeypatch: pytest.MonkeyPatch, lib: object, expected: bool
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(_state, "producer", None)
    monkeypatch.setattr(_state, "consumer", None)
    calls = []

    def fake_libcuda(noload: bool = False) -> object:
        calls.append(noload)
        return lib

    monkeypatch.setattr(_cuda, "libcuda", fake_libcuda)
    assert _cuda.cuda_initialized() is expected
    assert calls == [True]  # never loads the driver itself


def test_fork_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = type("ndarray", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_cuda, "cuda_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is initialised"):
        _context.check_fork_safe()


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        check=False,
    )


def test_importing_aiomp_cuda_loads_no_cupy() -> None:
    r = _python("""
        import sys
        import aiomp, aiomp.cuda
        aiomp.cuda.ipc_collect(); aiomp.cuda.statistics()
        print(sorted(m for m in ("cupy", "ctypes", "numpy") if m in sys.modules))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_producer_exit_warns_while_blocks_are_held() -> None:
    r = _python("""
        import os
        from aiomp._cuda import driver as _driver
        from aiomp._cuda import ipc as _cuda
        from aiomp._wire import pickling as _reduction
        from tests.children import common as _funcs
        from tests.children import cuda as _funcs_cuda
        _driver.backend = backend = _funcs_cuda.FakeBackend()
        _reduction.register(_funcs_cuda.FakeArray, _cuda.reduce_array)
        out = _reduction.dumps([backend.array((1 << 20,))])
        consumer = os.dup(out.fds[0])  # still holding it at exit
        out.close()
        released = _reduction.dumps(backend.array((1 << 20,)))
        released.close()
    """)
    assert r.returncode == 0, r.stderr
    assert "consumers still hold 1 CUDA block(s) it sent (4194304 bytes)" in r.stderr


def test_public_names() -> None:
    from aiomp import cuda

    for name in cuda.__all__:
        assert hasattr(cuda, name), name
    assert cuda.CudaIpcError.__module__ == "aiomp.cuda"
    assert "ipc_collect" in cuda.__all__
    assert aiomp.cuda is cuda


def test_example_exits_cleanly_without_a_gpu() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cuda_inference.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(CUDA_VISIBLE_DEVICES=""),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "no GPU" in r.stdout


# -- on a GPU ------------------------------------------------------------------------------


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install aiomp[cuda])"
    # Probe in a throwaway process: initialising CUDA here would make every later
    # fork-based test in this session refuse to fork (R14).
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        r = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return "probing for a CUDA device timed out"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"no usable CUDA device ({last})"
    if int(r.stdout.strip() or "0") < 1:
        return "no CUDA device visible"
    return None


@pytest.fixture(scope="session")
def _gpu_reason() -> str | None:
    return _gpu_skip_reason()


@pytest.fixture
def gpu(_gpu_reason: str | None) -> None:
    if _gpu_reason is not None:
        pytest.skip(_gpu_reason)


GPU_TIMEOUT = 180  # children import cupy and initialise CUDA: seconds, not milliseconds


async def run_pair(
    producer: Any, pargs: tuple[object, ...], consumer: Any, cargs: tuple[object, ...]
) -> tuple[Any, Any]:
    # Leaving joins the consumer, then the producer (which outlives what it sent).
    with anyio.fail_after(GPU_TIMEOUT):
        async with (
            aiomp.spawn(producer, 1, args=pargs, grace_period=2) as pctx,
            aiomp.spawn(consumer, 1, args=cargs, grace_period=2) as cctx,
        ):
            pass
    return pctx.results[0], cctx.results[0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("arrays", ["whole", "slice", "several", "ipc_safe"])
async def test_gpu_transfer(gpu: None, arrays: str) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (verdict, held, producer_view), ok = await run_pair(
        _funcs_cuda.gpu_send, (q, back, arrays), _funcs_cuda.gpu_check, (q, back, arrays)
    )
    same, held_in, open_in, held_after, open_after = verdict
    assert ok is True and same is True  # contents equal after transfer
    # several small arrays: copied into one staging block, one slot, one open
    assert (held_in, open_in) == (1, 1)
    assert (held_after, open_after) == (0, 0)  # dropping the views released and closed
    assert held == 0  # the producer saw the release
    if arrays == "ipc_safe":  # in place: the consumer's writes, seen by the producer
        assert producer_view == [-1.0] * 100
    elif arrays == "slice":  # under 2 MiB: it travelled as a copy
        assert producer_view == [float(i) for i in range(1000, 1100)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_two_arrays_in_one_allocation_both_stay_alive(gpu: None) -> None:
    """Defect 1 (issue 16) on hardware: two arrays split from one pool allocation, in one
    message, both deleted by the producer, which then allocates over freed memory."""
    q, back = aiomp.Queue(), aiomp.Queue()
    (one_allocation, sums, held), got = await run_pair(
        _funcs_cuda.gpu_two_chunks_send, (q, back), _funcs_cuda.gpu_two_chunks_check, (q, back)
    )
    assert one_allocation, "CuPy did not split one allocation: the test proves nothing"
    assert tuple(sums) == tuple(got) == (1.0 * (1 << 20), 2.0 * (1 << 20))
    assert held == 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_ipc_safe_blocks(gpu: None) -> None:
    with anyio.fail_after(GPU_TIMEOUT):
        ctx = await aiomp.spawn(_funcs_cuda.gpu_ipc_safe_blocks, 1, grace_period=2)
        await ctx.join()
    aligned_and_zeroed, recycled, bigger_aligned = ctx.results[0]
    assert aligned_and_zeroed and recycled and bigger_aligned


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_stream_ordering(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (pending, _done), (total, minimum) = await run_pair(
        _funcs_cuda.gpu_stream_order_send, (q, back), _funcs_cuda.gpu_stream_order_check, (q, back)
    )
    assert pending, "the producer's kernel finished before put: the test proves nothing"
    assert minimum == 7.0
    assert total == 7.0 * (1 << 20)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_many_transfers_do_not_grow_device_memory(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (held, samples, pstats), (bad, cstats) = await run_pair(
        _funcs_cuda.gpu_many_send, (q, back, 200), _funcs_cuda.gpu_many_check, (q, back)
    )
    assert bad == 0
    assert held == 0
    (used0, total0, free0), (used1, total1, free1) = samples
    assert used1 <= used0  # every sent block went back to the pool
    assert total1 <= total0  # ...and was reused, not reallocated
    assert free1 >= free0 - (64 << 20)
    assert aiomp.cuda.IpcStatistics(*pstats).events == 0
    assert aiomp.cuda.IpcStatistics(*cstats)[3:5] == (0, 0)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_consumer_killed_does_not_pin_memory(gpu: None) -> None:
    q, back, ctl = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(GPU_TIMEOUT):
        cctx = await aiomp.spawn(_funcs_cuda.gpu_hold_then_block, 1, args=(q, back), grace_period=1)
        try:
            async with aiomp.spawn(
                _funcs_cuda.gpu_send_then_collect, 1, args=(q, ctl), grace_period=2
            ) as pctx:
                tag, first = await back.get()
                assert (tag, first) == ("holding", 3.0)
                os.kill(cctx.pids()[0], signal.SIGKILL)
                with pytest.raises(aiomp.ProcessExitedException):
                    await cctx.join()
                await ctl.put("killed")
        finally:
            await cctx.terminate()
    # (still held or in flight before the kill, held by nobody after it)
    assert pctx.results == [(1, 0)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_sending_a_received_array_onward_raises(gpu: None) -> None:
    q, q2, back, back2 = aiomp.Queue(), aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(GPU_TIMEOUT):
        async with (
            aiomp.spawn(_funcs_cuda.gpu_send_one, 1, args=(q, back), grace_period=2) as s,
            aiomp.spawn(_funcs_cuda.gpu_forward, 1, args=(q, q2, back, back2), grace_period=2) as f,
            aiomp.spawn(_funcs_cuda.gpu_recv_forwarded, 1, args=(q2, back2), grace_period=2) as r,
        ):
            pass
    assert s.results == ["done"]
    assert str(f.results[0]).startswith(
        "refused: cannot send a CuPy array that this process received"
    )
    assert r.results[0] == list(range(16))  # the copy travelled


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_device_not_visible_to_the_consumer(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    sent, got = await run_pair(
        _funcs_cuda.gpu_send_one, (q, back), _funcs_cuda.gpu_recv_invisible, (q, back)
    )
    assert sent == "failed"
    assert str(got).startswith("CudaIpcError: a CuPy array on the GPU at PCI bus id")
    # CUDA_VISIBLE_DEVICES="" hides every device: the runtime's own reason is given
    assert "has no usable CUDA device" in str(got) and "CUDA_VISIBLE_DEVICES" in str(got)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_fork_with_cuda_initialised_raises(gpu: None) -> None:
    with anyio.fail_after(GPU_TIMEOUT):
        ctx = await aiomp.spawn(_funcs_cuda.gpu_fork_after_init, 1, grace_period=2)
        await ctx.join()
    assert "cannot fork: CUDA is initialised" in str(ctx.results[0])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_example_serves_requests(gpu: None) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cuda_inference.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GPU_TIMEOUT,
        env=_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "served 32 requests" in r.stdout
    assert "still hold" not in r.stderr
