"""Functions that benchmark children run, for aiomp and every baseline alike.

Module level, so spawn children can import them by name; standard library only at import
time (torch, numpy and aiomp are imported inside the functions that need them), so a child
pays only for what its library makes it import. Every function pins its process to the
core the parent chose (see ``_common.pin_child``) before doing anything else.
"""

from __future__ import annotations

import os
import time

from benchmarks._common import pin_child

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

PAYLOAD = b"x" * 64


# -- spawn ------------------------------------------------------------------------------


def noop(rank: int) -> None:
    """Spawn target: run and return (aiomp, multiprocessing and torch all call fn(rank))."""


def print_lines(rank: int, n: int) -> None:
    """Spawn target: ``n`` short lines on stdout (output forwarding's throughput)."""
    for i in range(n):
        print("line", i)


def raise_when_ready(rank: int, nprocs: int, ready_dir: str) -> None:
    """Rank 0 raises once every other rank is up; the others wait to be terminated.

    The exception text carries ``T=<time.monotonic_ns()>`` taken just before the raise:
    CLOCK_MONOTONIC is system-wide on Linux, so the parent can subtract it from its own.
    """
    pin_child()
    if rank != 0:
        open(os.path.join(ready_dir, str(rank)), "w").close()
        time.sleep(60)
        return
    deadline = time.monotonic() + 30
    while len(os.listdir(ready_dir)) < nprocs - 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # the parent is waiting in join by now
    raise RuntimeError(f"T={time.monotonic_ns()}")


def raised_at(text: str) -> int:
    """The ``T=`` timestamp (ns) from an exception text produced by :func:`raise_when_ready`."""
    import re

    return int(re.findall(r"T=(\d+)", text)[-1])


# -- echo servers (small-message round trip) ----------------------------------------------


def echo_socket(sock: socket.socket) -> None:
    """Raw floor: echo 64-byte messages over a stream socket until EOF."""
    pin_child()
    sock.setblocking(True)
    recv, send = sock.recv, sock.sendall
    while True:
        data = recv(64)
        if not data:
            break
        while len(data) < 64:
            more = recv(64 - len(data))
            if not more:
                return
            data += more
        send(data)
    sock.close()


def echo_socket_async(sock: socket.socket, kept_reader: bool = False) -> None:
    """Raw floor with an async child: :func:`echo_socket` awaiting the loop's
    ``sock_recv``/``sock_sendall``, on the loop kind aiomp's async children run (uvloop
    when installed, else asyncio: ``aiomp._child.bootstrap.new_runner``; not imported from there, so
    the floor's child loads no aiomp).

    ``kept_reader``: the leanest async child instead, as aiomp's own waits are: one reader
    registered for good, a plain non-blocking ``recv`` first, a future awaited only when
    the socket is empty, and a plain ``send`` (64 bytes always fit)."""
    pin_child()
    import asyncio

    factory: Any
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        recv, send = loop.sock_recv, loop.sock_sendall
        while True:
            data = await recv(sock, 64)
            if not data:
                break
            while len(data) < 64:
                more = await recv(sock, 64 - len(data))
                if not more:
                    return
                data += more
            await send(sock, data)

    async def serve_kept() -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] | None = None

        def readable() -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        loop.add_reader(sock.fileno(), readable)
        try:
            while True:
                try:
                    data = sock.recv(64)
                except BlockingIOError:
                    waiter = loop.create_future()
                    await waiter
                    continue
                if len(data) < 64:  # EOF (this floor runs on datagrams: whole messages)
                    break
                sock.send(data)
        finally:
            loop.remove_reader(sock.fileno())

    sock.setblocking(False)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve_kept() if kept_reader else serve())
    sock.close()


def echo_mp_queue(qin: object, qout: object) -> None:
    """multiprocessing.Queue baseline: echo until None."""
    pin_child()
    get, put = qin.get, qout.put  # type: ignore[attr-defined]
    while (x := get()) is not None:
        put(x)


async def echo_aiomp_async(rank: int, qin: object, qout: object) -> None:
    """aiomp.Queue, async child: echo until None."""
    pin_child()
    get, put = qin.get, qout.put  # type: ignore[attr-defined]
    while (x := await get()) is not None:
        await put(x)


def echo_aiomp_sync(rank: int, qin: object, qout: object) -> None:
    """aiomp.Queue, sync child through ``q.sync``: echo until None."""
    pin_child()
    get, put = qin.sync.get, qout.sync.put  # type: ignore[attr-defined]
    while (x := get()) is not None:
        put(x)


async def echo_coro(x: object) -> object:
    """aiomultiprocess (which runs coroutines only): return the argument."""
    pin_child()
    return x


# -- backlog: enqueue 100k small items, then a child drains them --------------------------
# Each child says it is ready, waits for the parent to finish enqueueing, drains every item
# and says it is done: the parent times from its first put to that answer.


def drain_mp(q: Any, ready: Any, go: Any, done: Any) -> None:
    """multiprocessing.Queue: drain as many items as ``go`` says."""
    pin_child()
    get = q.get
    ready.put(True)
    for _ in range(go.get()):
        get()
    done.put(True)


def drain_aiomp(rank: int, q: Any, ready: Any, go: Any, done: Any) -> None:
    """aiomp.Queue through ``q.sync``: the same protocol."""
    pin_child()
    get = q.sync.get
    ready.sync.put(True)
    for _ in range(go.sync.get()):
        get()
    done.sync.put(True)


# -- arrays -------------------------------------------------------------------------------


def ack_aiomp_sync(rank: int, qin: object, qout: object) -> None:
    """Receive arrays through ``q.sync`` and ack each, until None (a blocking child, like
    the torch baseline's)."""
    pin_child()
    get, put = qin.sync.get, qout.sync.put  # type: ignore[attr-defined]
    while (a := get()) is not None:
        del a
        put(b"k")


def ack_torch(qin: object, qout: object) -> None:
    """torch.multiprocessing.Queue: receive shared tensors, ack each, until None."""
    pin_child()
    import torch  # noqa: F401  (the tensors' rebuild needs it loaded anyway)

    get, put = qin.get, qout.put  # type: ignore[attr-defined]
    put(b"ready")
    while (t := get()) is not None:
        del t
        put(b"k")


# -- pool ---------------------------------------------------------------------------------


def trivial(x: object = None) -> object:
    """A task that does nothing: what is left is the pool's own round trip."""
    pin_child()
    return x


def compute_floor(n: int) -> float:
    """Seconds, in this process, for what any pool must do serially for
    ``map(trivial, range(n))``: the calls, and pickling and unpickling their results
    (every result crosses to the parent). The pool's own messages and wake-ups are not in
    it."""
    import pickle

    pin_child()
    t0 = time.perf_counter()
    out = list(map(trivial, range(n)))
    pickle.loads(pickle.dumps(out, pickle.HIGHEST_PROTOCOL))
    return time.perf_counter() - t0


async def trivial_coro(x: object = None) -> object:
    pin_child()
    return x
