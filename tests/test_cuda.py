"""CUDA IPC for CuPy arrays (aiomp._cuda, aiomp.cuda).

Two kinds of tests:

- Everywhere (no GPU, no cupy): the pure parts (what is pickled, offset arithmetic, lease
  ranges, slot bookkeeping) and the whole lifetime protocol driven through aiomp's real
  message path with a fake CUDA backend (``tests._funcs.FakeBackend``): slots, handoff
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
import pytest

import aiomp
from aiomp import _context, _cuda, _lease, _reduction, _transport
from tests import _funcs
from tests._funcs import FakeArray, FakeBackend, FakeBlock, FakeView

ROOT = Path(__file__).resolve().parent.parent

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


@pytest.fixture
def anyio_backend() -> object:
    # This module tests the CUDA transport, not aiomp's async APIs: one backend is enough.
    return ("asyncio", {})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route aiomp._cuda's CUDA calls to a fake backend; FakeArray reduces like cupy.ndarray."""
    backend = FakeBackend()
    _cuda._reset()
    monkeypatch.setattr(_cuda, "_backend", backend)
    _reduction.register(FakeArray, _cuda.reduce_array)
    _reduction.register(FakeView, _cuda.reduce_array)
    yield backend
    gc.collect()
    _cuda._reset()
    _cuda.set_ipc_limit(_cuda.DEFAULT_IPC_LIMIT)


def roundtrip(obj: object) -> object:
    """Pickle for a message and unpickle in this process (fds: dups of the message's)."""
    out = _reduction.dumps(obj)
    try:
        fds = [os.dup(fd) for fd in out.fds]
        return _reduction.loads(out.body, fds)
    finally:
        out.close()


# -- pure parts ------------------------------------------------------------------------------


def test_meta_roundtrips_through_pickle() -> None:
    meta = _cuda.IpcArrayMeta(
        handle=bytes(range(64)), alloc_size=2 << 20, offset=4096, shape=(3, 4),
        strides=(16, 4), dtype="<f4", device=1, bus_id="0000:3b:00.0",
        event=b"\x01" * 64, pid=1234, slot=7, fd_index=0,
    )
    again = pickle.loads(pickle.dumps(meta, protocol=5))
    assert again == meta and type(again) is _cuda.IpcArrayMeta
    assert len(pickle.dumps(meta, protocol=5)) < 400  # a small message


@pytest.mark.parametrize(
    ("shape", "strides", "itemsize", "expected"),
    [
        ((10,), (4,), 4, (0, 40)),
        ((3, 4), (16, 4), 4, (0, 48)),
        ((4, 3), (4, 16), 4, (0, 48)),  # transposed
        ((5,), (-8,), 8, (-32, 8)),  # reversed
        ((2, 3), (-24, 8), 8, (-24, 24)),
        ((0, 5), (20, 4), 4, (0, 0)),  # empty
        ((1,), (0,), 2, (0, 2)),
        ((4,), (0,), 4, (0, 4)),  # broadcast
    ],
)
def test_extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                expected: tuple[int, int]) -> None:
    assert _cuda.extent(shape, strides, itemsize) == expected


def test_locate_inside_a_pooled_block() -> None:
    base, size = 0x7F00_0000_0000, 2 << 20
    # a slice at an offset inside a larger allocation
    assert _cuda.locate(base + 4096, base, size, (100,), (4,), 4) == 4096
    # the last bytes of the allocation exactly
    assert _cuda.locate(base + size - 40, base, size, (10,), (4,), 4) == size - 40
    # negative strides: element 0 is the highest address
    assert _cuda.locate(base + 36, base, size, (10,), (-4,), 4) == 36
    # empty arrays need no bytes
    assert _cuda.locate(base + size, base, size, (0,), (4,), 4) == size


@pytest.mark.parametrize(
    ("ptr_off", "shape", "strides"),
    [
        (-4, (4,), (4,)),  # starts before the allocation
        ((2 << 20) - 12, (4,), (4,)),  # runs past its end
        (8, (4,), (-4,)),  # reversed, reaches before it
    ],
)
def test_locate_rejects_arrays_outside_their_allocation(
    ptr_off: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    base, size = 0x7F00_0000_0000, 2 << 20
    with pytest.raises(ValueError, match="outside its allocation"):
        _cuda.locate(base + ptr_off, base, size, shape, strides, 4)


def test_extent_rejects_mismatched_strides() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        _cuda.extent((2, 2), (4,), 4)


# -- lease bookkeeping -----------------------------------------------------------------------


def test_held_ranges_finds_every_held_slot() -> None:
    owner = os.memfd_create("aiomp-test-lease", os.MFD_CLOEXEC)
    fds = []
    try:
        assert _cuda.held_ranges(owner, 0, 100) == []
        # locks from different descriptions, created out of order
        for ranges in ([(50, 1), (10, 3)], [(90, 5)], [(0, 1)], [(11, 1), (60, 2)]):
            fds.append(_lease.handoff_fd(owner, ranges))
        held = _cuda.held_ranges(owner, 0, 100)
        covered = {i for a, b in held for i in range(a, b)}
        assert covered == {0, 10, 11, 12, 50, 60, 61, 90, 91, 92, 93, 94}
        assert _cuda.held_ranges(owner, 20, 55) == [(50, 51)]
        os.close(fds.pop(0))
        covered = {i for a, b in _cuda.held_ranges(owner, 0, 100) for i in range(a, b)}
        assert covered == {0, 11, 60, 61, 90, 91, 92, 93, 94}
    finally:
        for fd in (owner, *fds):
            os.close(fd)


def test_slot_table_allocates_collects_and_reuses() -> None:
    table = _cuda.SlotTable(limit=3)
    handoffs: dict[int, int] = {}
    try:
        for name in "abc":
            slot = table.allocate(name)
            handoffs[slot] = _lease.handoff_fd(table.fd, [(slot, 1)])
        assert sorted(table.records) == [0, 1, 2]
        with pytest.raises(_cuda.IpcLimitError, match="limit is 3"):
            table.allocate("d")
        assert table.collect() == []  # all held
        os.close(handoffs.pop(1))
        assert table.collect() == ["b"]
        assert table.allocate("d") == 1  # the lowest free slot is reused
        handoffs[1] = _lease.handoff_fd(table.fd, [(1, 1)])
        for fd in handoffs.values():
            os.close(fd)
        handoffs.clear()
        assert sorted(map(str, table.collect())) == ["a", "c", "d"]
        assert len(table) == 0
        assert table.allocate("e") == 0  # everything free: numbering restarts
        assert table.collect() == ["e"]  # nobody took its lease
    finally:
        for fd in handoffs.values():
            os.close(fd)
        table.close()


# -- the protocol in one process (fake backend) -----------------------------------------------


def test_same_process_roundtrip_keeps_then_frees_the_block(fake: FakeBackend) -> None:
    block = FakeBlock(1 << 20)
    arr = FakeArray(block, offset=8192, shape=(4, 8), dtype="<f8")
    view = roundtrip(arr)
    assert isinstance(view, FakeView)
    assert (view.base_ptr, view.offset) == (block.base, 8192)  # no IPC open: our own memory
    assert (view.shape, view.strides, view.dtype) == ((4, 8), (64, 8), "<f8")
    assert _cuda.ipc_collect() == 1
    stats = aiomp.cuda.statistics()
    assert (stats.sent_held, stats.events, stats.received_held) == (1, 1, 1)
    assert any(c[0] == "wait_local" for c in fake.calls)
    ref = weakref.ref(block)
    del arr, block
    gc.collect()
    assert ref() is not None  # the producer keeps it: a consumer holds it
    del view
    gc.collect()
    assert ("sync", 0) in fake.calls  # the consumer synchronised before releasing
    assert _cuda.ipc_collect() == 0
    assert ref() is None
    assert aiomp.cuda.statistics()[:4] == (0, 0, 0, 0)
    assert any(c[0] == "recycle" for c in fake.calls)


def test_arrays_from_one_allocation_share_one_slot(fake: FakeBackend) -> None:
    block = FakeBlock(1 << 20)
    other = FakeBlock(4096)
    msg = (FakeArray(block, 0), FakeArray(block, 4096, shape=(2, 2)), FakeArray(other, 16),
           FakeArray(block, 0))
    out = _reduction.dumps(msg)
    try:
        assert len(out.fds) == 1  # one handoff description per message
        assert _cuda.ipc_collect() == 2  # two allocations, two slots
        got = _reduction.loads(out.body, [os.dup(out.fds[0])])
    finally:
        out.close()
    assert isinstance(got, tuple)
    assert got[0].owner is got[1].owner is got[3].owner
    assert got[2].owner is not got[0].owner
    assert [c[0] for c in fake.calls].count("record") == 2  # one event per slot
    assert aiomp.cuda.statistics().received_held == 2
    del got
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_in_flight_message_holds_the_block(fake: FakeBackend) -> None:
    block = FakeBlock(4096)
    ref = weakref.ref(block)
    out = _reduction.dumps(FakeArray(block))
    del block
    in_flight = os.dup(out.fds[0])  # what a queued datagram holds
    out.close()
    gc.collect()
    assert _cuda.ipc_collect() == 1
    assert ref() is not None
    os.close(in_flight)
    assert _cuda.ipc_collect() == 0
    assert ref() is None


def test_message_never_received_releases_with_its_socket(fake: FakeBackend) -> None:
    a, b = _transport.socketpair()
    out = _reduction.dumps([FakeArray(FakeBlock(4096))])
    try:
        datagram, fds, _extra = _transport.encode(out.body, out.fds)
        assert _transport.try_send(a, datagram, fds)
    finally:
        out.close()
    assert _cuda.ipc_collect() == 1
    a.close()
    b.close()  # the kernel drops the fds queued in the socket
    assert _cuda.ipc_collect() == 0


def test_failed_dumps_releases_the_slot(fake: FakeBackend) -> None:
    with pytest.raises(TypeError, match="Unpicklable refuses"):
        _reduction.dumps((FakeArray(FakeBlock(4096)), _funcs.Unpicklable()))
    assert _cuda.ipc_collect() == 0


def test_outstanding_limit_raises_at_put(fake: FakeBackend) -> None:
    aiomp.cuda.set_ipc_limit(2)
    assert aiomp.cuda.get_ipc_limit() == 2
    held = [_reduction.dumps(FakeArray(FakeBlock(4096))) for _ in range(2)]
    with pytest.raises(aiomp.cuda.IpcLimitError, match="still held by their consumers"):
        _reduction.dumps(FakeArray(FakeBlock(4096)))
    assert isinstance(aiomp.cuda.IpcLimitError("x"), aiomp.cuda.CudaIpcError)
    held.pop().close()
    _reduction.dumps(FakeArray(FakeBlock(4096))).close()  # collected at send: room again
    for out in held:
        out.close()
    with pytest.raises(ValueError):
        aiomp.cuda.set_ipc_limit(0)


def test_event_cap_falls_back_to_synchronising(fake: FakeBackend,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda, "MAX_IPC_EVENTS", 1)
    first = _reduction.dumps(FakeArray(FakeBlock(4096)))
    fake.calls.clear()
    second = _reduction.dumps(FakeArray(FakeBlock(4096)))
    try:
        assert fake.calls == [("sync", 0)]  # synchronised; no event recorded
        assert aiomp.cuda.statistics().events == 1
    finally:
        first.close()
        second.close()


def test_sending_a_received_array_onward_raises(fake: FakeBackend) -> None:
    view = roundtrip(FakeArray(FakeBlock(4096)))
    with pytest.raises(aiomp.cuda.CudaIpcError, match="received from another process"):
        _reduction.dumps({"x": view})
    del view
    gc.collect()
    assert _cuda.ipc_collect() == 0


def test_empty_array_needs_no_handle(fake: FakeBackend) -> None:
    view = roundtrip(FakeArray(FakeBlock(4096), shape=(0, 3)))
    assert isinstance(view, FakeView) and view.shape == (0, 3)
    assert _cuda.ipc_collect() == 0
    assert not any(c[0] == "record" for c in fake.calls)


def test_reducer_only_works_inside_a_message(fake: FakeBackend) -> None:
    with pytest.raises(pickle.PicklingError, match="can only travel inside aiomp"):
        _cuda.reduce_array(FakeArray(FakeBlock(4096)))


# -- the protocol across processes (fake backend, forked consumer) ----------------------------


async def _recv(sock: Any) -> object:
    got = await _transport.recv_async(sock)
    _kind, body, fds = _transport.decode(*got)
    return _reduction.loads(body, fds)


def _send(sock: Any, obj: object) -> None:
    _funcs._send_obj(sock, obj)


async def _stats(sock: Any, expect: str = "stats") -> _cuda.IpcStatistics:
    """The consumer's reply: its aiomp.cuda.statistics()."""
    reply = await _recv(sock)
    assert isinstance(reply, tuple) and reply[0] == expect
    return _cuda.IpcStatistics(*reply[1])


@pytest.mark.anyio
@pytest.mark.parametrize("end", ["release", "sigkill"])
async def test_consumer_release_or_death_frees_the_block(fake: FakeBackend, end: str) -> None:
    block = FakeBlock(1 << 20)
    ref = weakref.ref(block)
    parent, child = _transport.socketpair()
    try:
        with anyio.fail_after(30):
            ctx = await aiomp.spawn(_funcs.cuda_fake_consumer, 1, args=(child.fileno(), 1),
                                    start_method="fork", grace_period=1)
            child.close()
            _send(parent, (FakeArray(block, offset=4096, shape=(16,)),))
            stats = await _stats(parent, "got")
            assert (stats.received_held, stats.received_open, stats.sent_held) == (1, 1, 0)
            del block
            gc.collect()
            assert _cuda.ipc_collect() == 1
            assert ref() is not None
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
            assert ref() is None
    finally:
        parent.close()
        child.close()


@pytest.mark.anyio
async def test_consumer_opens_each_allocation_once(fake: FakeBackend) -> None:
    block = FakeBlock(1 << 20)
    parent, child = _transport.socketpair()
    try:
        with anyio.fail_after(30):
            ctx = await aiomp.spawn(_funcs.cuda_fake_consumer, 1, args=(child.fileno(), 2),
                                    start_method="fork", grace_period=1)
            child.close()
            # two messages, two slots, one allocation: the fake refuses a second open
            _send(parent, FakeArray(block, offset=0))
            _send(parent, FakeArray(block, offset=65536))
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
async def test_fake_arrays_through_an_aiomp_queue(fake: FakeBackend) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    block = FakeBlock(1 << 20)
    with anyio.fail_after(30):
        async with aiomp.spawn(_funcs.cuda_fake_queue_consumer, 1, args=(q, back),
                               start_method="fork", grace_period=1) as ctx:
            await q.put({"batch": FakeArray(block, 512, shape=(8, 8)), "id": 7})
            tag, stats = await back.get()
            assert tag == "got"
            assert _cuda.IpcStatistics(*stats)[3:5] == (1, 1)
            assert _cuda.ipc_collect() == 1
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


@pytest.mark.parametrize(("lib", "expected"), [
    (None, False),  # libcuda not loaded: nothing initialised it
    (_FakeLibcuda(3), False),  # CUDA_ERROR_NOT_INITIALIZED: loaded, cuInit never ran
    (_FakeLibcuda(0), True),
    (_FakeLibcuda(4), True),  # deinitialised: was initialised
])
def test_cuda_initialized_asks_a_loaded_driver(monkeypatch: pytest.MonkeyPatch, lib: object,
                                               expected: bool) -> None:
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(_cuda, "_producer_state", None)
    monkeypatch.setattr(_cuda, "_consumer_state", None)
    calls = []

    def fake_libcuda(noload: bool = False) -> object:
        calls.append(noload)
        return lib

    monkeypatch.setattr(_cuda, "_libcuda", fake_libcuda)
    assert _cuda.cuda_initialized() is expected
    assert calls == [True]  # never loads the driver itself


def test_fork_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(_cuda, "cuda_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is initialised"):
        _context.check_fork_safe()


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=_env(),
                          check=False)


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
        from aiomp import _cuda, _reduction
        from tests import _funcs
        _cuda._backend = _funcs.FakeBackend()
        _reduction.register(_funcs.FakeArray, _cuda.reduce_array)
        out = _reduction.dumps([_funcs.FakeArray(_funcs.FakeBlock(4096))])
        consumer = os.dup(out.fds[0])  # still holding it at exit
        out.close()
        released = _reduction.dumps(_funcs.FakeArray(_funcs.FakeBlock(8192)))
        released.close()
    """)
    assert r.returncode == 0, r.stderr
    assert "consumers still hold 1 CUDA block(s) it sent (4096 bytes)" in r.stderr


def test_public_names() -> None:
    from aiomp import cuda

    for name in cuda.__all__:
        assert hasattr(cuda, name), name
    assert cuda.CudaIpcError.__module__ == "aiomp.cuda"
    assert "ipc_collect" in cuda.__all__
    assert aiomp.cuda is cuda


def test_example_exits_cleanly_without_a_gpu() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cuda_inference.py")], cwd=ROOT,
        capture_output=True, text=True, timeout=120, env=_env(CUDA_VISIBLE_DEVICES=""),
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
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120, check=False)
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


async def run_pair(producer: Any, pargs: tuple[object, ...], consumer: Any,
                   cargs: tuple[object, ...]) -> tuple[Any, Any]:
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
@pytest.mark.parametrize("arrays", ["whole", "slice", "several"])
async def test_gpu_transfer(gpu: None, arrays: str) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (verdict, held, producer_view), ok = await run_pair(
        _funcs.gpu_send, (q, back, arrays), _funcs.gpu_check, (q, back, arrays))
    same, held_in, open_in, held_after, open_after = verdict
    assert ok is True and same is True  # contents equal after transfer
    assert (held_in, open_in) == (1, 1)  # several arrays, one allocation: one slot, one open
    assert (held_after, open_after) == (0, 0)  # dropping the views released and closed
    assert held == 0  # the producer saw the release
    if arrays == "slice":
        assert producer_view == [-1.0] * 100  # the consumer's writes, seen by the producer


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_stream_ordering(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (pending, _done), (total, minimum) = await run_pair(
        _funcs.gpu_stream_order_send, (q, back), _funcs.gpu_stream_order_check, (q, back))
    assert pending, "the producer's kernel finished before put: the test proves nothing"
    assert minimum == 7.0
    assert total == 7.0 * (1 << 20)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_many_transfers_do_not_grow_device_memory(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    (held, samples, pstats), (bad, cstats) = await run_pair(
        _funcs.gpu_many_send, (q, back, 200), _funcs.gpu_many_check, (q, back))
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
        cctx = await aiomp.spawn(_funcs.gpu_hold_then_block, 1, args=(q, back), grace_period=1)
        try:
            async with aiomp.spawn(_funcs.gpu_send_then_collect, 1, args=(q, ctl),
                                   grace_period=2) as pctx:
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
            aiomp.spawn(_funcs.gpu_send_one, 1, args=(q, back), grace_period=2) as s,
            aiomp.spawn(_funcs.gpu_forward, 1, args=(q, q2, back, back2),
                        grace_period=2) as f,
            aiomp.spawn(_funcs.gpu_recv_forwarded, 1, args=(q2, back2), grace_period=2) as r,
        ):
            pass
    assert s.results == ["done"]
    assert str(f.results[0]).startswith("refused: cannot send a CuPy array that this process "
                                        "received")
    assert r.results[0] == list(range(16))  # the copy travelled


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_device_not_visible_to_the_consumer(gpu: None) -> None:
    q, back = aiomp.Queue(), aiomp.Queue()
    sent, got = await run_pair(_funcs.gpu_send_one, (q, back), _funcs.gpu_recv_invisible,
                               (q, back))
    assert sent == "failed"
    assert str(got).startswith("CudaIpcError: a CuPy array on the GPU at PCI bus id")
    assert "cannot access that device" in str(got)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.anyio
async def test_gpu_fork_with_cuda_initialised_raises(gpu: None) -> None:
    with anyio.fail_after(GPU_TIMEOUT):
        ctx = await aiomp.spawn(_funcs.gpu_fork_after_init, 1, grace_period=2)
        await ctx.join()
    assert "cannot fork: CUDA is initialised" in str(ctx.results[0])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_example_serves_requests(gpu: None) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "cuda_inference.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=GPU_TIMEOUT,
                       env=_env(), check=False)
    assert r.returncode == 0, r.stderr
    assert "served 32 requests" in r.stdout
    assert "still hold" not in r.stderr
