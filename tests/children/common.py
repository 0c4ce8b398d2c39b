"""Functions that test children run, shared by many areas, grouped by what they exercise.

spawn and forkserver children import this module to unpickle their function, so it must
stay light: the standard library only at module level (no typing, anyio, asyncio, numpy),
or ``tests/meta/test_public.py``'s child-import check would see them. Import heavy modules
inside the functions that need them.
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


# -- spawning (tests/spawn, tests/meta/test_public.py) ----------------------------------


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


# --- queues and shared memory (tests/queue, tests/memory, examples) -----------------------
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


async def q_mpmc_async(
    rank: int, q: object, done: object, nproducers: int, count: int
) -> list[object]:
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
    inner.sync.put(
        {  # type: ignore[attr-defined]
            "args_and_message_same": q_again is q,
            "twice_in_one_message_same": inner is inner_twice,
            "twice_in_two_messages_same": inner_later is inner,
            "event_type": type(event).__name__,
        }
    )
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


def ev_ping(
    rank: int, go: object, ready: object, done: object, timeout: float
) -> tuple[bool, bool]:
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
            return (
                "array",
                aiomp.is_shared(obj),
                obj.flags.writeable,
                obj.dtype.str,
                obj.shape,
                obj.strides,
                obj.tobytes(),
            )
        if isinstance(obj, dict):
            return {k: describe(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(describe(v) for v in obj)
        return obj

    return [describe(a) for a in args]


def shm_stripe(rank: int, nprocs: int, w: object, flag: object, q: object, go: object) -> float:
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
    return {
        "plain": np.arange(n, dtype=np.float32) + rank,
        "shared": shared,
        "small": np.arange(3) + rank,
    }


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
    ready.sync.put(
        sorted(  # type: ignore[attr-defined]
            name for name in os.listdir("/dev/shm") if name.startswith(f"aiomp-{os.getpid()}-")
        )
    )
    block_forever()
    del held


# --- pool ---
# Tasks for tests/pool/. A task the test must wait for meets it at a Gate
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
