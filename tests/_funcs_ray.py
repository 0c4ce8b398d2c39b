"""Functions that aiomp.ray.Pool actors run in tests/test_ray.py (importable by actors).

Actors meet the test at a :class:`tests._gate.Gate` (an abstract unix socket: the actors
of a local Ray run on this machine), so no test sleeps on an actor.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests._funcs import gate_connect, gate_wait

#: Set by :func:`init_state` in each actor.
STATE: list[Any] = []


def square(x: int) -> int:
    return x * x


def add(x: int, y: int = 0) -> int:
    return x + y


def pid(*_: object) -> int:
    return os.getpid()


def fail(message: str) -> None:
    raise ValueError(message)


async def async_square(x: int) -> int:
    await asyncio.sleep(0)  # handshake-free: one real suspension, so it runs as a coroutine
    return x * x


def init_state(value: object) -> None:
    STATE.append(value)


def state(*_: object) -> list[Any]:
    return list(STATE)


def init_fail() -> None:
    raise KeyError("no config")


def at_gate(rank: int, address: str) -> int:
    """Say ready at the gate, wait for release (or the test's end): a sync task that
    holds its actor until the test lets it go."""
    gate_wait(rank, address)
    return rank


async def async_at_gate(rank: int, address: str, path: str) -> str:
    """An async task that says ready and waits; if cancelled, it writes ``cancelled`` to
    ``path`` (its cleanup ran inside the actor) and lets the cancellation go on."""
    s = gate_connect(rank, address)
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        with open(path, "w") as f:  # noqa: ASYNC230 - a few bytes, the test waits on it
            f.write("cancelled")
        raise
    finally:
        s.close()
    return "unreachable"


def record(path: str) -> None:
    with open(path, "a") as f:
        f.write("ran\n")


def array_info(a: Any, offset: int = 0) -> tuple[int, bool, float]:
    """``(pid, a writable?, a.sum() + offset)``."""
    return os.getpid(), bool(a.flags.writeable), float(a.sum()) + offset


def ones(n: int) -> Any:
    import numpy as np

    return np.ones(n)


def node_and_pid(*_: object) -> tuple[str, int]:
    import ray

    return ray.get_runtime_context().get_node_id(), os.getpid()


def unpicklable_result() -> object:
    import threading

    return threading.Lock()
