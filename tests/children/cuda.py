"""The functions children run in the CUDA IPC tests (tests/cuda/): consumers of the fake
backend (``tests.children.cuda_backend``), and the gpu_* functions, which run real CuPy in
spawned children (the test process never initialises CUDA) and only on a machine with a GPU.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from tests.children.cuda_device import FakeArray

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
