"""Functions that Pool workers run in tests/pool/ (importable by children)."""

from __future__ import annotations

import logging
import os
import signal

from tests.children.common import gate_wait


def init_at_gate(address: str) -> None:
    """An initializer that says ready (keyed by pid) and waits for the test's release."""
    gate_wait(os.getpid(), address)


def append(path: str, word: str) -> None:
    with open(path, "a") as f:
        f.write(word + "\n")


def pid(*_: object) -> int:
    return os.getpid()


def square(x: int) -> int:
    return x * x


def kill_self_at(x: int, victim: int) -> int:
    """``x * x``, except that input ``victim`` SIGKILLs its worker."""
    if x == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def init_kill_self() -> None:
    """An initializer whose worker dies by a signal (as under the OOM killer)."""
    os.kill(os.getpid(), signal.SIGKILL)


def deaf_at_gate(address: str) -> None:
    """Ignore SIGTERM (a worker slow to stop), say ready, wait for the test's release."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gate_wait(os.getpid(), address)


def block_at_gate(key: int, address: str) -> None:
    gate_wait(key, address)


def nbytes(a: object) -> int:
    return int(a.nbytes)  # type: ignore[attr-defined]


def deaf_and_report() -> None:
    """Ignore SIGTERM, say ``ready <pid>`` on stdout, then wait forever."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        signal.pause()


def square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def say(x: int) -> int:
    """Print a line to stdout and to stderr, and log a record (this module imports
    logging at its top: a worker forwards records once logging is imported)."""
    import sys

    print(f"out {x}")
    print(f"err {x}", file=sys.stderr)
    logging.getLogger("aiomp.test.worker").warning("log %d", x)
    return x


# -- faults that must end in an error in one caller (tests/pool/test_faults.py) ----------------


def exit_task(code: int) -> None:
    """A task that asks to exit (``sys.exit``): the caller gets SystemExit, not the worker."""
    import sys

    sys.exit(code)


async def exit_task_async(code: int) -> None:
    import asyncio
    import sys

    await asyncio.sleep(0)  # handshake-free: one loop turn, so the exit is inside a task
    sys.exit(code)


def interrupt_task() -> None:
    raise KeyboardInterrupt("from the task")


def exit_at(x: int) -> int:
    """``x * x``, except that input 3 raises SystemExit(3)."""
    if x == 3:
        import sys

        sys.exit(3)
    return x * x


class _ExitsWhenUnpickled:
    """Pickles fine; unpickling it calls ``sys.exit(4)`` (in the parent, for a result)."""

    def __reduce__(self) -> tuple[object, ...]:
        import sys

        return sys.exit, (4,)


def result_that_exits_when_unpickled() -> object:
    return _ExitsWhenUnpickled()


async def nothing_async() -> None:
    return None


# -- tasks queued ahead in a worker (tests/pool/test_queued_ahead.py) -------------------------


def die_at_gate(key: int, address: str) -> None:
    """Say ready, wait for the test's release, then SIGKILL this worker."""
    gate_wait(key, address)
    os.kill(os.getpid(), signal.SIGKILL)


def grow_at_gate(key: int, address: str, mib: int) -> int:
    """Say ready, wait for the test's release, then keep ``mib`` MiB more of private
    memory (every page written); return the pid."""
    gate_wait(key, address)
    _kept.append(b"\1" * (mib << 20))
    return os.getpid()


#: What a growing worker keeps (a module global: it lives as long as the worker).
_kept: list[bytes] = []
