"""CUDA IPC across processes: consumers releasing, dying, opening each allocation once,
reading what the producer wrote; CUDA initialisation, fork refused, imports, the public
names, the example without a GPU.

With a fake CUDA backend (``tests.children.cuda_backend.FakeBackend``, a model of CuPy's memory
pool and the driver's allocator) driven through aiomp's real message path: no GPU, no cupy.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import types
import weakref
from typing import Any

import anyio
import pytest

import aiomp
from aiomp._cuda import ipc as _cuda
from aiomp._cuda.state import state as _state
from aiomp._process import checks as _context
from aiomp._wire import datagram as _transport
from aiomp._wire import pickling as _reduction
from tests.children import cuda as _funcs_cuda
from tests.children.cuda_backend import FakeBackend
from tests.cuda._cuda import ROOT, MiB, _env

# Fake-backend tests fork on purpose (a fork child may not use CUDA, which they check);
# a thread left by an earlier test's forkserver start makes aiomp warn, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


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
        from tests.children import cuda_backend as _cuda_backend
        from tests.children import cuda_device as _cuda_device
        _driver.backend = backend = _cuda_backend.FakeBackend()
        _reduction.register(_cuda_device.FakeArray, _cuda.reduce_array)
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
