"""Functions that test children run, grouped by the test module that uses them.

spawn and forkserver children import this module to unpickle their function, so it must
stay light: the standard library only at module level (no typing, anyio, asyncio, numpy),
or ``test_public``'s child-import check would see them. Import heavy modules inside the
functions that need them.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

# -- handshakes ----------------------------------------------------------------------------
# A test listens on a unix socket (``tests.test_context.Gate``); a child connects, says
# "<rank> <pid>", and may then wait for the test to send a byte (or to close: EOF).


def gate_connect(rank: int, address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address)
    s.sendall(b"%d %d\n" % (rank, os.getpid()))
    return s


def gate_wait(rank: int, address: str) -> None:
    """Report ready, then wait until the test releases this rank."""
    with gate_connect(rank, address) as s:
        s.recv(1)


def block_forever() -> None:
    while True:
        signal.pause()


def block(rank: int) -> None:
    block_forever()


# -- spawning (test_context.py, test_public.py) --------------------------------------------


def echo(rank: int, *args: object) -> tuple[int, tuple[object, ...]]:
    return rank, args


async def async_echo(rank: int, *args: object) -> tuple[int, tuple[object, ...], str]:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    loop = asyncio.get_running_loop()
    return rank, args, type(loop).__module__


def return_none(rank: int) -> None:
    return None


def wait_then_return(rank: int, address: str) -> int:
    gate_wait(rank, address)
    return rank * 10


def wait_then_raise(rank: int, address: str) -> None:
    gate_wait(rank, address)
    raise ValueError(f"boom from rank {rank}")


def ready_then_block(rank: int, address: str) -> None:
    gate_connect(rank, address)
    block_forever()


def ignore_sigterm_then_block(rank: int, address: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gate_connect(rank, address)
    block_forever()


def raise_on(rank: int, fail_rank: int) -> int:
    """``fail_rank`` raises; every other rank returns its rank."""
    if rank == fail_rank:
        raise ValueError(f"boom from rank {rank}")
    return rank


def fail_or_block(rank: int, fail_rank: int, address: str) -> None:
    """``fail_rank`` raises when the test releases it; the others block forever."""
    if rank == fail_rank:
        wait_then_raise(rank, address)
    ready_then_block(rank, address)


def exit_on(rank: int, fail_rank: int, code: int) -> int:
    if rank == fail_rank:
        os._exit(code)
    return rank


def sys_exit(rank: int, code: object) -> None:
    sys.exit(code)


def kill_self(rank: int, signum: int) -> None:
    import faulthandler
    import resource

    faulthandler.disable()  # a forked child inherits pytest's: no dump in the test output
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's cwd
    os.kill(os.getpid(), signum)
    block_forever()


def raise_keyboard_interrupt(rank: int) -> None:
    raise KeyboardInterrupt


async def async_cancel_self(rank: int) -> None:
    import asyncio

    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait


async def async_raise(rank: int) -> None:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    raise RuntimeError(f"async boom from rank {rank}")


def loaded_modules(rank: int) -> list[str]:
    return sorted(sys.modules)


async def async_loaded_modules(rank: int) -> list[str]:
    return sorted(sys.modules)


class Unpicklable:
    def __reduce__(self) -> object:
        raise TypeError("Unpicklable refuses to be pickled")


def return_unpicklable(rank: int) -> Unpicklable:
    return Unpicklable()


class UnpicklableError(Exception):
    def __reduce__(self) -> object:
        raise TypeError("UnpicklableError refuses to be pickled")


def raise_unpicklable(rank: int) -> None:
    raise UnpicklableError(f"unpicklable boom from rank {rank}")


# --- queues and shared memory (test_queue.py, test_shm.py, examples) ----------------------
# Children import numpy and aiomp's modules inside the functions, never at module level.


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def q_forward(rank: int, qin: object, qout: object) -> int:
    """Move every item from ``qin`` to ``qout`` until ``qin`` is closed; return the count."""
    n = 0
    for item in qin.sync:  # type: ignore[attr-defined]
        qout.sync.put(item)  # type: ignore[attr-defined]
        del item  # hold no view of a shared block between items
        n += 1
    return n


async def q_forward_async(rank: int, qin: object, qout: object) -> int:
    """:func:`q_forward` on the child's event loop."""
    n = 0
    async for item in qin:  # type: ignore[attr-defined]
        await qout.put(item)  # type: ignore[attr-defined]
        del item
        n += 1
    return n


def q_mpmc(rank: int, q: object, done: object, nproducers: int, count: int) -> list[object]:
    """Ranks below ``nproducers`` put ``count`` items each, then report on ``done``;
    the others take items until ``q`` is closed and return what they took."""
    if rank < nproducers:
        for i in range(count):
            q.sync.put((rank, i))  # type: ignore[attr-defined]
        done.sync.put(rank)  # type: ignore[attr-defined]
        return []
    return list(q.sync)  # type: ignore[attr-defined]


async def q_mpmc_async(rank: int, q: object, done: object, nproducers: int,
                       count: int) -> list[object]:
    """:func:`q_mpmc` with the async calls."""
    if rank < nproducers:
        for i in range(count):
            await q.put((rank, i))  # type: ignore[attr-defined]
        await done.put(rank)  # type: ignore[attr-defined]
        return []
    return [item async for item in q]  # type: ignore[attr-defined]


def q_identities(rank: int, q: object, reply: object) -> None:
    """Receive queues and events in messages; answer on them how they resolved here.

    The first message is ``(q_again, inner, inner)``, the second ``inner`` once more,
    the third an Event: the answer goes on ``inner`` so that it is proven usable.
    """
    first = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    q_again, inner, inner_twice = first
    inner_later = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    event = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    inner.sync.put({  # type: ignore[attr-defined]
        "args_and_message_same": q_again is q,
        "twice_in_one_message_same": inner is inner_twice,
        "twice_in_two_messages_same": inner_later is inner,
        "event_type": type(event).__name__,
    })
    event.set()  # type: ignore[attr-defined]
    reply.sync.put("done")  # type: ignore[attr-defined]


def q_close_from_child(rank: int, q: object, items: list[object]) -> None:
    for item in items:
        q.sync.put(item)  # type: ignore[attr-defined]
    q.close()  # type: ignore[attr-defined]


async def q_close_waiters_async(rank: int, full: object, empty: object, ready: object) -> str:
    """Rank 0 waits to put on the full queue ``full``, rank 1 waits to get from ``empty``,
    until the test closes them; return what happened."""
    ready.sync.put(rank)  # type: ignore[attr-defined]
    try:
        if rank == 0:
            await full.put("one too many")  # type: ignore[attr-defined]
            return "put returned"
        await empty.get()  # type: ignore[attr-defined]
        return "get returned"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__


def q_sync_timeouts(rank: int, q: object, timeout: float) -> tuple[str, str]:
    """``q`` is full with maxsize 1: time out putting, take the item, time out getting."""
    import time

    results = []
    start = time.monotonic()
    try:
        q.sync.put("x", timeout=timeout)  # type: ignore[attr-defined]
        results.append("put")
    except Exception as exc:  # noqa: BLE001
        results.append(type(exc).__name__)
    item = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    assert item == "first"
    try:
        q.sync.get(timeout=timeout)  # type: ignore[attr-defined]
        results.append("get")
    except Exception as exc:  # noqa: BLE001
        results.append(type(exc).__name__)
    assert time.monotonic() - start >= 2 * timeout
    return results[0], results[1]


def ev_ping(rank: int, go: object, ready: object, done: object,
            timeout: float) -> tuple[bool, bool]:
    """Time out waiting for ``go``, say ``ready``, wait for ``go``, clear it, set ``done``."""
    early = go.sync.wait(timeout=timeout)  # type: ignore[attr-defined]
    ready.set()  # type: ignore[attr-defined]
    later = go.sync.wait(timeout=20)  # type: ignore[attr-defined]
    go.clear()  # type: ignore[attr-defined]
    done.set()  # type: ignore[attr-defined]
    return early, later


async def ev_ping_async(rank: int, go: object, done: object) -> bool:
    await go.wait()  # type: ignore[attr-defined]
    was_set = go.is_set()  # type: ignore[attr-defined]
    done.set()  # type: ignore[attr-defined]
    return was_set


# -- shared memory -------------------------------------------------------------------------


def shm_inspect(rank: int, *args: object) -> list[object]:
    """Describe each argument: for an array ``(is_shared, writeable, dtype, shape,
    strides, checksum bytes)``; containers recursively; others as they are."""
    import aiomp

    def describe(obj: object) -> object:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return ("array", aiomp.is_shared(obj), obj.flags.writeable, obj.dtype.str,
                    obj.shape, obj.strides, obj.tobytes())
        if isinstance(obj, dict):
            return {k: describe(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(describe(v) for v in obj)
        return obj

    return [describe(a) for a in args]


def shm_stripe(rank: int, nprocs: int, w: object, flag: object, q: object,
               go: object) -> float:
    """Hogwild-style: write into this rank's stripe of the shared ``w``, both as received
    in args and as received from ``q`` (the same memory); then, once ``go`` is set, return
    what the parent wrote into the shared ``flag`` after this process started."""
    w_from_queue = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    w[rank::nprocs] = rank + 1  # type: ignore[index]
    w_from_queue[rank::nprocs] += 100  # type: ignore[index]
    assert go.sync.wait(timeout=20)  # type: ignore[attr-defined]
    return float(flag[0])  # type: ignore[index]


def shm_return_arrays(rank: int, n: int, strategy: str) -> dict[str, object]:
    """Return fresh arrays (shared, and not yet shared) to the parent."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    shared = aiomp.zeros(n, np.int64)
    shared[:] = np.arange(n) * (rank + 1)
    return {"plain": np.arange(n, dtype=np.float32) + rank, "shared": shared,
            "small": np.arange(3) + rank}


def shm_write_marks(rank: int, q: object, reply: object) -> None:
    """For every array received, write ``rank + 1`` at index 0 and ack with its id."""
    for arr, token in q.sync:  # type: ignore[attr-defined]
        arr[0] = rank + 1
        reply.sync.put(token)  # type: ignore[attr-defined]
        del arr


def shm_views(rank: int, q: object, reply: object) -> dict[str, object]:
    """Receive two messages naming the same segments; report how they were mapped.

    The first message is ``(a, a[10:], b, x[:600], x[400:])``, the second ``a`` again.
    """
    import numpy as np

    a, a_tail, b, x_head, x_tail = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    a2 = q.sync.get(timeout=20)  # type: ignore[attr-defined]
    with open("/proc/self/maps") as f:
        maps = [line for line in f if "aiomp-shm" in line or "/dev/shm/aiomp" in line]
    out = {
        "a_tail_is_view_of_a": bool(np.shares_memory(a, a_tail)) and a_tail.base is a.base,
        "a_again_same_memory": bool(np.shares_memory(a, a2)),
        "a_again_same_base": a2.base is a.base,
        "a_b_separate": not np.shares_memory(a, b),
        "x_views_share_one_buffer": bool(np.shares_memory(x_head, x_tail)),
        "mappings": len(maps),
    }
    x_head[500] = -2.0  # seen through x_tail[100]
    out["x_write_seen_through_other_view"] = bool((x_tail[100] == -2.0).all())
    a_tail[0] = -1.0  # seen by the parent through a[10]
    reply.sync.put(out)  # type: ignore[attr-defined]
    return out


def shm_send_then_exit(rank: int, q: object, n: int, strategy: str) -> None:
    """Put arrays and return at once: the process exits before the parent reads them."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    q.sync.put(np.arange(n, dtype=np.float64))  # type: ignore[attr-defined]
    shared = aiomp.share_memory(np.full(n, 7, np.int32))
    q.sync.put(shared)  # type: ignore[attr-defined]
    q.sync.put([np.arange(2 * n, dtype=np.int16)[::2], "tail"])  # type: ignore[attr-defined]


def shm_send_and_wait(rank: int, q: object, received: object, n: int) -> None:
    """Under ``file_system``: put an array, wait until the parent has it, then exit."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy("file_system")
    q.sync.put(np.arange(n, dtype=np.float64))  # type: ignore[attr-defined]
    assert received.sync.wait(timeout=20)  # type: ignore[attr-defined]


def shm_make_named(rank: int) -> int:
    """Create a named segment under ``file_system`` and return normally, keeping nothing."""
    import aiomp

    aiomp.set_sharing_strategy("file_system")
    arr = aiomp.zeros(1000)
    del arr
    return len([n for n in os.listdir("/dev/shm") if n.startswith(f"aiomp-{os.getpid()}-")])


def shm_echo_many(rank: int, qin: object, qout: object) -> tuple[int, int]:
    """Echo arrays until ``qin`` is closed; return (fds at the first item, most fds seen)."""
    first = most = 0
    for i, arr in enumerate(qin.sync):  # type: ignore[attr-defined]
        qout.sync.put(arr)  # type: ignore[attr-defined]
        del arr
        n = fd_count()
        if i == 0:
            first = n
        most = max(most, n)
    return first, most


def shm_hold_named_then_block(rank: int, ready: object, n: int) -> None:
    """Create named segments under ``file_system``, hold them, say ready, and block."""
    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy("file_system")
    held = [aiomp.zeros(n, np.uint8), aiomp.share_memory(np.ones(3 * n, np.uint8))]
    ready.sync.put(sorted(  # type: ignore[attr-defined]
        name for name in os.listdir("/dev/shm") if name.startswith(f"aiomp-{os.getpid()}-")
    ))
    block_forever()
    del held


# --- cuda ---------------------------------------------------------------------------------
# test_cuda.py. The fake backend stands in for CuPy's CUDA calls so that the lifetime
# protocol (slots, leases, handle cache, finalizers) runs on machines without a GPU; the
# gpu_* functions run real CuPy in children (the test process never initialises CUDA).


class FakeCudaError(RuntimeError):
    pass


class FakeBlock:
    """A 'device allocation': an address range and an IPC handle naming it."""

    _next = 0x7F0000000000

    def __init__(self, size: int) -> None:
        self.base = FakeBlock._next
        FakeBlock._next += (size + 0xFFFF) & ~0xFFFF
        self.size = size
        self.handle = b"H" + self.base.to_bytes(8, "little") + bytes(55)


class FakeArray:
    """Stands in for a ``cupy.ndarray`` in a producer."""

    def __init__(self, block: FakeBlock, offset: int = 0, shape: tuple[int, ...] = (4,),
                 strides: tuple[int, ...] | None = None, dtype: str = "<f4",
                 device: int = 0) -> None:
        self.block = block
        self.offset = offset
        self.shape = shape
        if strides is None:  # C order
            acc, rev = int(dtype[2:]), []
            for n in reversed(shape):
                rev.append(acc)
                acc *= max(n, 1)
            strides = tuple(reversed(rev))
        self.strides = strides
        self.dtype = dtype
        self.device = device


class FakeView:
    """What a consumer gets: owner keeps the received slot alive, as UnownedMemory does."""

    def __init__(self, ptr: int, size: int, owner: object, device: int, offset: int,
                 shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> None:
        self.base_ptr = ptr
        self.size = size
        self.owner = owner
        self.device = device
        self.offset = offset
        self.shape = shape
        self.strides = strides
        self.dtype = dtype


class FakeBackend:
    """The interface of ``aiomp._cuda._CupyBackend``, on host bookkeeping only."""

    MAPPED = 1 << 44  # consumer-side addresses: producer base + MAPPED

    def __init__(self, devices: tuple[str, ...] = ("0000:01:00.0",)) -> None:
        self.devices = devices
        self.calls: list[tuple[object, ...]] = []
        self.open_handles: dict[bytes, int] = {}
        self.events = 0
        self.idle_events: list[tuple[object, bytes]] = []

    def export(self, arr: object) -> object:
        from aiomp._cuda import Export

        if isinstance(arr, FakeView):
            ptr = arr.base_ptr + arr.offset
            return Export(arr.device, self.devices[arr.device], ptr, arr.base_ptr, arr.size,
                          b"X" * 64, arr.shape, arr.strides, arr.dtype, int(arr.dtype[2:]),
                          arr, arr.owner)
        assert isinstance(arr, FakeArray)
        b = arr.block
        empty = any(n == 0 for n in arr.shape)
        return Export(arr.device, self.devices[arr.device], b.base + arr.offset, b.base,
                      b.size, None if empty else b.handle, arr.shape, arr.strides,
                      arr.dtype, int(arr.dtype[2:]), None if empty else b, None)

    def record_event(self, dev: int) -> tuple[object, bytes]:
        if self.idle_events:
            event, handle = self.idle_events.pop()
        else:
            self.events += 1
            event, handle = object(), b"E" + self.events.to_bytes(8, "little") + bytes(55)
        self.calls.append(("record", dev, handle))
        return event, handle

    def recycle_event(self, dev: int, event: object, handle: bytes) -> None:
        self.calls.append(("recycle", dev, handle))
        self.idle_events.append((event, handle))

    def sync(self, dev: int) -> None:
        self.calls.append(("sync", dev))

    def local_device(self, bus_id: str, device: int) -> int:
        if bus_id not in self.devices:
            from aiomp._cuda import CudaIpcError

            raise CudaIpcError(f"fake: device {bus_id} is not visible")
        return self.devices.index(bus_id)

    def wait(self, event_handle: bytes, dev: int) -> None:
        self.calls.append(("wait", dev, event_handle))

    def wait_local(self, event: object, dev: int) -> None:
        self.calls.append(("wait_local", dev))

    def open(self, handle: bytes, dev: int) -> int:
        if handle in self.open_handles:
            raise FakeCudaError("cudaErrorAlreadyMapped: a handle opens once per context")
        if handle[:1] != b"H":
            raise FakeCudaError("cudaErrorInvalidValue: not a memory handle")
        ptr = int.from_bytes(handle[1:9], "little") + self.MAPPED
        self.open_handles[handle] = ptr
        self.calls.append(("open", dev, handle))
        return ptr

    def close(self, ptr: int, dev: int) -> None:
        handle = next(h for h, p in self.open_handles.items() if p == ptr)
        del self.open_handles[handle]
        self.calls.append(("close", dev, handle))

    def wrap(self, ptr: int, size: int, owner: object, dev: int, offset: int,
             shape: tuple[int, ...], strides: tuple[int, ...], dtype: str) -> FakeView:
        return FakeView(ptr, size, owner, dev, offset, shape, strides, dtype)

    def empty(self, shape: tuple[int, ...], dtype: str, dev: int) -> FakeView:
        return FakeView(0, 0, None, dev, 0, shape, (0,) * len(shape), dtype)

    def error_type(self) -> type[BaseException]:
        return FakeCudaError


def _recv_obj(sock: socket.socket) -> object:
    from aiomp import _reduction, _transport

    got = _transport.recv_sync(sock)
    assert got is not None
    _kind, body, fds = _transport.decode(*got)
    return _reduction.loads(body, fds)


def _send_obj(sock: socket.socket, obj: object) -> None:
    from aiomp import _child, _reduction

    _child.send_message(sock, _reduction.dumps(obj))


def cuda_fake_consumer(rank: int, fd: int, messages: int) -> str:
    """Forked child: receive ``messages`` messages of fake arrays on socket ``fd`` and
    report; then obey "drop <i>" (drop message i's arrays) / "stats" / "exit"."""
    import gc

    from aiomp import _cuda

    sock = socket.socket(fileno=fd)
    received = [_recv_obj(sock) for _ in range(messages)]
    _send_obj(sock, ("got", tuple(_cuda.statistics())))
    while True:
        cmd = _recv_obj(sock)
        if cmd == "exit":
            sock.close()
            return "done"
        if isinstance(cmd, tuple) and cmd[0] == "drop":
            received[cmd[1]] = None
            gc.collect()
        _send_obj(sock, ("stats", tuple(_cuda.statistics())))


def cuda_fake_queue_consumer(rank: int, q: object, back: object) -> str:
    """Forked child: take fake arrays from an aiomp.Queue; report; drop on request."""
    import gc

    from aiomp import _cuda

    view = q.sync.get(timeout=30)  # type: ignore[attr-defined]
    back.sync.put(("got", tuple(_cuda.statistics())))  # type: ignore[attr-defined]
    assert q.sync.get(timeout=30) == "drop"  # type: ignore[attr-defined]
    del view
    gc.collect()
    back.sync.put(("stats", tuple(_cuda.statistics())))  # type: ignore[attr-defined]
    return "done"


# GPU children (real CuPy; run on a GPU machine only). Every one imports cupy itself.


def gpu_send(rank: int, q: object, back: object, arrays: str) -> object:
    """Producer: put arrays described by ``arrays``; wait for the consumer's verdict."""
    import cupy

    from aiomp import cuda

    base = cupy.arange(4096, dtype=cupy.float32)
    msg: tuple[object, ...]
    if arrays == "whole":
        msg = (base,)
    elif arrays == "slice":
        msg = (base[1000:1100],)
    elif arrays == "several":
        msg = (base[:10], base[100:110], base[::-512])
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
    ref = numpy.arange(4096, dtype=numpy.float32)
    if arrays == "whole":
        ok = numpy.array_equal(cupy.asnumpy(msg[0]), ref)
    elif arrays == "slice":
        ok = numpy.array_equal(cupy.asnumpy(msg[0]), ref[1000:1100])
        msg[0][:] = -1.0  # seen by the producer
        cupy.cuda.get_current_stream().synchronize()
    else:
        ok = (numpy.array_equal(cupy.asnumpy(msg[0]), ref[:10])
              and numpy.array_equal(cupy.asnumpy(msg[1]), ref[100:110])
              and numpy.array_equal(cupy.asnumpy(msg[2]), ref[::-512]))
    stats = cuda.statistics()
    del msg
    gc.collect()
    after = cuda.statistics()
    back.sync.put((ok, stats.received_held, stats.received_open,  # type: ignore[attr-defined]
                   after.received_held, after.received_open))
    return ok


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
    kernel(((arr.size + 255) // 256,), (256,), (arr, cupy.int32(arr.size), cupy.float32(7.0),
                                                 cupy.int64(cycles)))
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

    arr = cupy.arange(16, dtype=cupy.float32)
    q.sync.put(arr)  # type: ignore[attr-defined]
    return back.sync.get(timeout=60)  # type: ignore[attr-defined]


def gpu_forward(rank: int, q: object, q2: object, back: object, back2: object) -> str:
    """Receive an array and try to put it on another queue: must raise CudaIpcError.
    Then forward a copy, and keep it alive until its receiver is done."""
    from aiomp import cuda

    arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
    try:
        q2.sync.put(arr)  # type: ignore[attr-defined]
    except cuda.CudaIpcError as exc:
        outcome = f"refused: {exc}"
        q2.sync.put(arr.copy())  # type: ignore[attr-defined]
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

    cupy.zeros(1).sum()
    try:
        await aiomp.spawn(echo, 1, start_method="fork")
    except RuntimeError as exc:
        return str(exc)
    return "forked"


# --- pool ---
# Tasks for tests/test_pool.py. A task the test must wait for meets it at a Gate
# (``gate_connect``: it says "<n> <pid>") and, where it says so, waits for a byte.

_POOL_INIT: object = None
_POOL_LOOP: int | None = None


def pool_pid(*_: object) -> int:
    return os.getpid()


def pool_square(x: int) -> int:
    return x * x


def pool_add(a: int, b: int, *, c: int = 0) -> int:
    return a + b + c


async def pool_async_square(x: int) -> int:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    return x * x


async def pool_async_add(a: int, b: int) -> int:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    return a + b


def pool_gate(n: int, address: str, value: object = None) -> tuple[object, int]:
    """Say ready, wait for the test's byte, return ``(value, pid)``."""
    gate_wait(n, address)
    return value, os.getpid()


async def pool_async_gate(n: int, address: str, value: object = None) -> tuple[object, int]:
    """:func:`pool_gate` that waits on the worker's event loop."""
    import asyncio

    s = gate_connect(n, address)
    s.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_recv(s, 1)
    finally:
        s.close()
    return value, os.getpid()


def pool_block(n: int, address: str) -> None:
    gate_connect(n, address)
    block_forever()


async def pool_async_block(n: int, address: str, marker: str) -> None:
    """Say ready and wait forever; write ``marker`` when cancelled."""
    import asyncio

    s = gate_connect(n, address)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        with open(marker, "w") as f:  # noqa: ASYNC230 - a few bytes, then the task ends
            f.write("cancelled")
        raise
    finally:
        s.close()


async def pool_async_block_ignoring_cancel(n: int, address: str) -> None:
    """Say ready; when cancelled, block the worker's loop for good."""
    import asyncio

    gate_connect(n, address)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        block_forever()


def pool_append(path: str, text: str) -> str:
    with open(path, "a") as f:
        f.write(text + "\n")
    return text


def pool_exit(code: int) -> None:
    os._exit(code)


def pool_kill_self(signum: int) -> None:
    kill_self(0, signum)


def pool_raise(msg: str) -> None:
    raise ValueError(msg)


def pool_no_memory() -> None:
    """Raise MemoryError for real: cap the address space, then allocate past it."""
    import resource

    old = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), old[1]))
    try:
        bytearray(1 << 30)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


class PoolUnpicklableError(Exception):
    """Cannot be pickled: it holds a lock."""

    def __init__(self, msg: str) -> None:
        import threading

        super().__init__(msg)
        self.lock = threading.Lock()


class PoolUnunpicklableError(Exception):
    """Pickles, but cannot be rebuilt: ``__init__`` wants two arguments, args holds one."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def pool_raise_unpicklable(msg: str) -> None:
    raise PoolUnpicklableError(msg)


def pool_raise_ununpicklable() -> None:
    raise PoolUnunpicklableError("left", "right")


def pool_return_unpicklable() -> Unpicklable:
    return Unpicklable()


async def pool_async_cancel_self() -> None:
    import asyncio

    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait


def pool_init(value: object) -> None:
    global _POOL_INIT
    _POOL_INIT = value


def pool_get_init(*_: object) -> object:
    return _POOL_INIT


def pool_init_fail() -> None:
    raise ValueError("the initializer refuses")


def pool_init_exit() -> None:
    os._exit(4)


async def pool_async_init(value: object) -> None:
    import asyncio

    global _POOL_INIT, _POOL_LOOP
    _POOL_INIT = value
    _POOL_LOOP = id(asyncio.get_running_loop())


async def pool_async_same_loop(*_: object) -> tuple[object, bool]:
    import asyncio

    return _POOL_INIT, id(asyncio.get_running_loop()) == _POOL_LOOP


def pool_np_double(arr: object) -> object:
    return arr * 2  # type: ignore[operator]


def pool_modules(*_: object) -> list[str]:
    return sorted(sys.modules)


def pool_is_daemon(*_: object) -> bool:
    import multiprocessing

    return multiprocessing.current_process().daemon


def pool_square_or_raise(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative: {x}")
    return x * x


async def pool_async_exit(code: int) -> None:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    os._exit(code)


def pool_returns_coroutine(x: int) -> object:
    """A sync function whose result is a coroutine: the worker awaits it."""
    return pool_async_square(x)


async def pool_async_len(data: bytes) -> int:
    import asyncio

    await asyncio.sleep(0)  # handshake-free: a checkpoint, not a wait
    return len(data)


def pool_log_square_or_raise(path: str, x: int) -> int:
    pool_append(path, str(x))
    return pool_square_or_raise(x)
