"""Children's functions for the worker-health tests (tests/pool/test_health.py)."""

from __future__ import annotations

import os
import signal
import time

from tests.children.common import gate_connect

#: What a growing worker keeps (a module global: it lives as long as the worker).
_kept: list[bytes] = []


def hang_in_named_function(n: int, address: str) -> None:
    """Say ready, then hang in Python code: its name is what the stack must show."""
    gate_connect(n, address)
    while True:
        pass


def hang_in_c_sleep(n: int, address: str) -> None:
    """Say ready, then hang inside a C call (time.sleep)."""
    gate_connect(n, address)
    time.sleep(3600)  # handshake-free: the hang under test (said ready above)


def hang_in_c_read(n: int, address: str) -> None:
    """Say ready, then hang in a blocking read that nothing will ever answer."""
    gate_connect(n, address)
    r, _w = os.pipe()
    os.read(r, 1)


def hang_unable_to_print(n: int, address: str) -> None:
    """Block every signal but SIGTERM's default action... and SIGTERM too: the worker
    cannot print its stack and ignores SIGTERM; only SIGKILL ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    gate_connect(n, address)
    time.sleep(3600)  # handshake-free: the hang under test (said ready above)


def grow(mib: int) -> int:
    """Keep ``mib`` MiB more of private memory (every page written); return the pid."""
    _kept.append(b"\1" * (mib << 20))
    return os.getpid()


def read_shared(array: object) -> tuple[int, float]:
    """Touch every page of a shared array the parent sent (a sum reads them all)."""
    import numpy as np

    assert isinstance(array, np.ndarray)
    return os.getpid(), float(array.sum())


def join_cgroup(procs: str) -> None:
    """Initializer: move this worker into the memory cgroup whose ``cgroup.procs`` (or
    v1 ``tasks``) file is ``procs``."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def allocate_forever(step_mib: int) -> None:
    """Allocate and write ``step_mib`` MiB at a time until the OOM killer ends it."""
    while True:
        _kept.append(b"\1" * (step_mib << 20))


async def grow_async(mib: int) -> int:
    """:func:`grow` as a coroutine: the worker serves from its event loop."""
    return grow(mib)
