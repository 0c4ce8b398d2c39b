"""Functions that aiomp.ray.Pool actors run in tests/ray/pool/ (importable by actors).

Actors meet the test at a :class:`tests._gate.Gate` (an abstract unix socket: the actors
of a local Ray run on this machine), so no test sleeps on an actor.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests.children.common import gate_connect, gate_wait

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


async def nested_pool(num_cpus: float) -> str:
    """Open an ``aiomp.ray.Pool`` of one actor asking ``num_cpus`` inside this actor (which
    holds its own CPU): ``"ok ..."``, or the ``ValueError`` it raised, as text."""
    import anyio

    import aiomp.ray

    try:
        with anyio.fail_after(20):
            async with aiomp.ray.Pool(1, num_cpus=num_cpus, grace_period=0.3) as p:
                return f"ok {await p.apply(square, (3,))}"
    except ValueError as exc:
        return f"ValueError: {exc}"


def connect_faults() -> None:
    """(In a fresh interpreter, not connected to Ray; on asyncio, then uvloop) An address
    where nothing listens fails at once with ``ConnectionError``; at one that accepts and
    never answers ``ray.init`` hangs, and a deadline around the pool fires on time (its
    thread abandoned). Prints ``ok``; exits at once (``os._exit``): the abandoned
    ``ray.init`` threads would hold the interpreter for minutes."""
    import socket
    import sys
    import time

    import anyio

    import aiomp.ray

    closed = socket.socket()
    closed.bind(("0.0.0.0", 0))  # bound, not listening: refused (Ray dials the node's IP)
    silent = socket.socket()
    silent.bind(("0.0.0.0", 0))
    silent.listen()  # the kernel accepts; nothing ever answers

    async def main() -> None:
        start = time.monotonic()
        try:
            with anyio.fail_after(60):
                async with aiomp.ray.Pool(1, address=f"127.0.0.1:{closed.getsockname()[1]}"):
                    pass
        except ConnectionError as exc:
            assert "no Ray cluster answers" in str(exc), exc
        else:
            raise AssertionError("no ConnectionError for an address where nothing listens")
        assert time.monotonic() - start < 10, f"ConnectionError after {time.monotonic() - start}"
        start = time.monotonic()
        with anyio.move_on_after(2) as scope:
            async with aiomp.ray.Pool(1, address=f"127.0.0.1:{silent.getsockname()[1]}"):
                pass
        assert scope.cancelled_caught
        assert time.monotonic() - start < 6, f"cancelled after {time.monotonic() - start}"

    anyio.run(main)
    anyio.run(main, backend_options={"use_uvloop": True})
    print("ok", flush=True)
    sys.stderr.flush()
    os._exit(0)
