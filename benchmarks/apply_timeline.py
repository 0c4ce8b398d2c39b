"""Where one ``Pool.apply(stamp)`` round trip spends its time, against the raw floor's.

A diagnostic, not a comparison: ``python -m benchmarks.apply_timeline [round trips]``
prints the median time of each event of a round trip, in microseconds from the call, on
one clock (``time.monotonic_ns``, shared by the parent and the worker), parent on one core
and worker on the other as in ``bench_pool``:

- ``Pool.apply``: ``send`` / ``sent`` (the parent's ``send`` on the worker's socket:
  ``WorkerHandle.send_first``, or ``Stream.try_send`` where the task is submitted);
  ``recv`` (the worker's ``recvmsg`` returned), ``ran`` (the task function ran),
  ``reply`` / ``replied`` (the worker's ``send``); ``woke`` (the parent's reader callback
  entered), ``read`` (its ``recvmsg`` returned), ``set`` (the caller's future resolved),
  ``returned`` (``apply`` returned to its caller, the result unpickled);
- the floor (``bench_pool``'s raw socketpair: ``sock_sendall``, then ``sock_recv``, to a
  blocking echo child): ``send`` / ``sent``, ``recv``, ``reply`` / ``replied`` in the
  child, ``returned`` (``sock_recv`` returned in the parent).

The hooks wrap private methods (a few hundred ns each), so the pool's figures are a little
later than without them; the floor's child records its events inline. See *Apply critical path*
in docs/architecture.md and the Findings in RESULTS.md.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import time
from typing import Any

from benchmarks import _common as c
from benchmarks._targets import PAYLOAD

_now = time.monotonic_ns
_events: list[tuple[str, int]] = []


def _note(what: str) -> None:
    _events.append((what, _now()))


def stamp() -> None:
    """The task: records when it ran."""
    _events.append(("ran", _now()))


def worker_hooks() -> None:
    """Pool initializer: pin the worker and record its events."""
    c.pin_child()
    from aiomp import _transport

    recv_sync, send_sync = _transport.Stream.recv_sync, _transport.Stream.send_sync

    def timed_recv_sync(self: Any, *a: Any) -> Any:
        got = recv_sync(self, *a)
        _note("recv")
        return got

    def timed_send_sync(self: Any, *a: Any) -> None:
        _note("reply")
        send_sync(self, *a)
        _note("replied")

    _transport.Stream.recv_sync = timed_recv_sync  # type: ignore[method-assign]
    _transport.Stream.send_sync = timed_send_sync  # type: ignore[method-assign]


def worker_events() -> list[tuple[str, int]]:
    out = list(_events)
    _events.clear()
    return out


def _parent_hooks() -> None:
    from aiomp import _handle, _scheduler, _transport

    try_send, try_recv = _transport.Stream.try_send, _transport.Stream.try_recv
    send_first = _handle.WorkerHandle.send_first
    finish = _scheduler.Task.finish

    def timed_send_first(self: Any, *a: Any) -> bool:
        _note("send")
        ok = send_first(self, *a)
        _note("sent")
        return ok

    def timed_try_send(self: Any, *a: Any) -> int:
        _note("send")
        n = try_send(self, *a)
        _note("sent")
        return n

    def timed_try_recv(self: Any) -> Any:
        _note("woke")
        got = try_recv(self)
        _note("read")
        return got

    def timed_finish(self: Any, *a: Any) -> None:
        finish(self, *a)
        _note("set")

    _transport.Stream.try_send = timed_try_send  # type: ignore[method-assign]
    _handle.WorkerHandle.send_first = timed_send_first  # type: ignore[method-assign]
    _transport.Stream.try_recv = timed_try_recv  # type: ignore[method-assign]
    _scheduler.Task.finish = timed_finish  # type: ignore[method-assign]


def echo_timed(sock: socket.socket, n: int, delay_ns: int = 0) -> None:
    """The floor's blocking echo child, recording its events; sends them at the end.

    ``delay_ns``: it spins that long before each reply, standing in for a worker's own
    work: how the reply's cost depends on how long the parent has been asleep."""
    import pickle

    c.pin_child()
    sock.setblocking(True)
    out: list[tuple[str, int]] = []
    note = out.append
    for _ in range(n):
        data = sock.recv(64)
        while len(data) < 64:
            data += sock.recv(64 - len(data))
        note(("recv", _now()))
        if delay_ns:
            until = _now() + delay_ns
            while _now() < until:
                pass
        note(("reply", _now()))
        sock.sendall(data)
        note(("replied", _now()))
    body = pickle.dumps(out)
    sock.sendall(len(body).to_bytes(8, "little") + body)
    sock.close()


def _report(name: str, trips: list[list[tuple[str, int]]]) -> None:
    per: dict[str, list[float]] = {}
    for events in trips:
        t0 = events[0][1]
        for what, t in events[1:]:
            per.setdefault(what, []).append((t - t0) / 1e3)
    line = ", ".join(
        f"{what} {statistics.median(v):.1f}"
        for what, v in sorted(per.items(), key=lambda kv: statistics.median(kv[1]))
    )
    print(f"{name}: {line}")


def _split(events: list[tuple[str, int]], starts: list[int]) -> list[list[tuple[str, int]]]:
    """Group events into round trips by the calls' start times."""
    trips: list[list[tuple[str, int]]] = [[("call", t)] for t in starts]
    i = 0
    for what, t in sorted(events, key=lambda e: e[1]):
        while i + 1 < len(starts) and t >= starts[i + 1]:
            i += 1
        if t >= starts[i]:
            trips[i].append((what, t))
    return trips


async def pool_trips(n: int) -> list[list[tuple[str, int]]]:
    import aiomp

    async with aiomp.Pool(1, initializer=worker_hooks) as pool:
        for _ in range(200):
            await pool.apply(stamp)
        await pool.apply(worker_events)
        _events.clear()
        starts: list[int] = []
        for _ in range(n):
            t = _now()
            starts.append(t)
            await pool.apply(stamp)
            _note("returned")
        mine = list(_events)
        _events.clear()
        theirs = await pool.apply(worker_events)
    return _split(mine + theirs, starts)


async def floor_trips(n: int, delay_ns: int = 0) -> list[list[tuple[str, int]]]:
    import multiprocessing
    import pickle

    a, b = socket.socketpair()
    proc = multiprocessing.get_context("spawn").Process(
        target=echo_timed, args=(b, n + 200, delay_ns)
    )
    proc.start()
    b.close()
    a.setblocking(False)
    loop = asyncio.get_running_loop()

    async def once() -> None:
        _note("send")
        await loop.sock_sendall(a, PAYLOAD)
        _note("sent")
        got = 0
        while got < 64:
            got += len(await loop.sock_recv(a, 64 - got))

    for _ in range(200):
        await once()
    _events.clear()
    starts: list[int] = []
    for _ in range(n):
        t = _now()
        starts.append(t)
        await once()
        _note("returned")
    mine = list(_events)
    _events.clear()
    head = b""
    while len(head) < 8:
        head += await loop.sock_recv(a, 8 - len(head))
    size = int.from_bytes(head, "little")
    body = b""
    while len(body) < size:
        body += await loop.sock_recv(a, size - len(body))
    a.close()
    proc.join(5)
    theirs = pickle.loads(body)[200:]
    return _split(mine + theirs, starts)


async def main(n: int) -> None:
    print(c.pin_parent(), f"; {n} round trips each")
    _parent_hooks()
    delays = [int(x) for x in sys.argv[2:]]  # µs the floor's child spins before replying
    for _ in range(2):
        _report("floor", await floor_trips(n))
        for d in delays:
            _report(f"floor, child spins {d} µs", await floor_trips(n, d * 1000))
        _report("apply", await pool_trips(n))


if __name__ == "__main__":
    c.allow_bytecode()
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
