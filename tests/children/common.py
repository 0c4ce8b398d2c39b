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
# A test listens on a unix socket (``tests._gate.Gate``); a child connects, says
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


# --- queues and shared memory -------------------------------------------------------------
# What children of the queue and shared-memory tests run is in ``tests.children.queue`` and
# ``tests.children.memory``.


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


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
