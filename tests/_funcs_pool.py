"""Functions that Pool workers run in tests/test_pool_lifecycle.py (importable by children)."""

from __future__ import annotations

import logging
import os
import signal

from tests._funcs import gate_wait


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
