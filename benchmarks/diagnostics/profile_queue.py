"""Where a small item's time goes in ``aiomp.Queue`` (issue 17, targets 2 and 3).

Three measurements, each deterministic or in one process where it can be:

- ``calls``: Python calls (function and C calls, ``sys.setprofile``) per operation, in one
  process, on the loop named: ``await q.put`` of 64 B, ``await q.get`` of a waiting item,
  a ``get`` that waits and is woken by another task's ``put`` (the whole hand-over, loop
  included), and ``put_nowait``/``get_nowait`` through the overflow log (the socket full,
  as in the many-to-many steady state). Counts, not times: the same on a busy machine.
- ``cpu``: CPU time per operation of the same, in one process (``time.process_time``,
  best of 5 passes).
- ``rt``: the async-child round trip of ``bench_queue`` (parent on the loop named, the
  child an ``async def`` echo on aiomp's child loop), CPU per round trip of the parent and
  of the child; with ``--cprofile`` the child's top functions by own time. Run it under
  ``strace -c -f`` for syscalls per round trip.

    python -m benchmarks.diagnostics.profile_queue calls --loop uvloop
    python -m benchmarks.diagnostics.profile_queue cpu --loop asyncio
    python -m benchmarks.diagnostics.profile_queue rt --loop trio --n 5000 [--cprofile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from typing import Any

PAYLOAD = b"x" * 64
LOOPS = ("asyncio", "uvloop", "trio")


def run_on(loop: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``fn()`` on a plain loop of the kind named (as users run them)."""
    if loop == "trio":
        import trio

        return trio.run(fn)
    import asyncio

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(fn())  # type: ignore[arg-type]
    with asyncio.Runner() as runner:
        return runner.run(fn())  # type: ignore[arg-type]


class Counter:
    """Counts Python and C calls made in this thread while active."""

    def __init__(self) -> None:
        self.n = 0

    def _hook(self, frame: object, event: str, arg: object) -> None:
        if event == "call" or event == "c_call":
            self.n += 1

    def __enter__(self) -> Counter:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


#: More 64 B items than a queue's socket holds (its 4 MiB buffer takes about 1 KiB a
#: datagram): after this many puts the socket is full and the rest are in the overflow log.
SOCKET_ITEMS = 50_000


def fill_socket(q: Any) -> None:
    """Put until the socket is surely full: later puts go to the overflow log."""
    for _ in range(SOCKET_ITEMS):
        q.put_nowait(PAYLOAD)


def drain_socket(q: Any) -> None:
    """Take as many items as :func:`fill_socket` put: the socket's are among them (a get
    takes the socket's items before the log's), so later gets read the log."""
    for _ in range(SOCKET_ITEMS):
        q.get_nowait()


def drain(q: Any) -> None:
    """Take every item left in ``q`` (socket and overflow log)."""
    import aiomp

    while True:
        try:
            q.get_nowait()
        except aiomp.Empty:
            return


async def measure_calls(reps: int = 200) -> dict[str, float]:
    """Calls per operation (the median over ``reps``, after a warm-up)."""
    import anyio

    import aiomp

    out: dict[str, float] = {}
    q = aiomp.Queue()
    try:

        async def per(name: str, op: Callable[[], Awaitable[object]]) -> None:
            counts = []
            for _ in range(reps):
                with Counter() as c:
                    await op()
                counts.append(c.n)
            counts.sort()
            out[name] = counts[len(counts) // 2]

        async def put_get() -> None:
            await q.put(PAYLOAD)
            await q.get()

        for _ in range(50):
            await put_get()
        await per("await put (socket)", lambda: q.put(PAYLOAD))
        await per("await get (item waiting)", q.get)
        await per("await put + await get", put_get)

        # A get that waits, woken by another task's put: the whole hand-over.
        async def handover() -> None:
            got = anyio.Event()

            async def consumer() -> None:
                await q.get()
                got.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer)
                for _ in range(2):  # let it reach its wait
                    await anyio.lowlevel.checkpoint()
                with Counter() as c:
                    await q.put(PAYLOAD)
                    await got.wait()
                counts.append(c.n)

        counts: list[int] = []
        for _ in range(20):
            await handover()
        counts.clear()
        for _ in range(reps):
            await handover()
        counts.sort()
        out["put + woken get (hand-over, loop included)"] = counts[len(counts) // 2]

        # The overflow: the socket full, every put goes to the log and every get takes
        # from it (the many-to-many steady state).
        fill_socket(q)
        for _ in range(2 * reps):
            q.put_nowait(PAYLOAD)
        with Counter() as c:
            for _ in range(reps):
                q.put_nowait(PAYLOAD)
        out["put_nowait (overflow log)"] = c.n / reps
        drain_socket(q)  # the socket's items first: the gets below read the log
        with Counter() as c:
            for _ in range(reps):
                q.get_nowait()
        out["get_nowait (overflow log)"] = c.n / reps
        with Counter() as c:
            for _ in range(reps):
                await q.get()
        out["await get (overflow log)"] = c.n / reps
    finally:
        drain(q)
    return out


async def measure_cpu(n: int = 20000) -> dict[str, float]:
    """CPU µs per operation, best of 5 passes of ``n``."""
    import aiomp

    out: dict[str, float] = {}
    q = aiomp.Queue()
    clock = time.process_time

    def best(passes: list[float]) -> float:
        return min(passes) / n * 1e6

    async def put_get() -> None:
        put, get = q.put, q.get
        for _ in range(n):
            await put(PAYLOAD)
            await get()

    passes = []
    for _ in range(5):
        t = clock()
        await put_get()
        passes.append(clock() - t)
    out["await put + await get (socket)"] = best(passes)

    fill_socket(q)
    passes_put, passes_get = [], []
    for _ in range(5):
        t = clock()
        for _ in range(n):
            q.put_nowait(PAYLOAD)
        passes_put.append(clock() - t)
        if not passes_get:  # take the socket's items first: then gets read the log
            drain_socket(q)
        t = clock()
        for _ in range(n):
            q.get_nowait()
        passes_get.append(clock() - t)
    out["put_nowait (overflow log)"] = best(passes_put)
    out["get_nowait (overflow log)"] = best(passes_get)
    drain(q)
    return out


def _user_sys(pid: int) -> tuple[int, int]:
    """A process's user and system CPU ticks (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def _child_cpu_ns(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


async def profiled_echo(rank: int, qin: Any, qout: Any, path: str) -> None:
    """The async echo child of ``bench_queue``, under cProfile; stats written to ``path``."""
    import cProfile

    from benchmarks._common import pin_child

    pin_child()
    get, put = qin.get, qout.put
    prof = cProfile.Profile()
    prof.enable()
    while (x := await get()) is not None:
        await put(x)
    prof.disable()
    prof.dump_stats(path)


async def round_trips(n: int, cprofile: bool) -> None:
    import tempfile

    import anyio

    import aiomp
    from benchmarks._common import pin_parent
    from benchmarks._targets import echo_aiomp_async

    print(pin_parent())
    qin, qout = aiomp.Queue(), aiomp.Queue()
    path = tempfile.mktemp(suffix=".prof")
    if cprofile:
        ctx = await aiomp.spawn(profiled_echo, 1, args=(qin, qout, path), grace_period=1.0)
    else:
        ctx = await aiomp.spawn(echo_aiomp_async, 1, args=(qin, qout), grace_period=1.0)
    pid = ctx.pids()[0]
    put, get = qin.put, qout.get
    with anyio.fail_after(60):
        for _ in range(500):
            await put(PAYLOAD)
            await get()
        rows = []
        us0, t0 = _user_sys(pid), os.times()
        for _ in range(5):
            t, p, c = time.perf_counter(), time.process_time(), _child_cpu_ns(pid)
            for _ in range(n):
                await put(PAYLOAD)
                await get()
            rows.append(
                (
                    (time.perf_counter() - t) / n * 1e6,
                    (time.process_time() - p) / n * 1e6,
                    (_child_cpu_ns(pid) - c) / n / 1e3,
                )
            )
        us1, t1 = _user_sys(pid), os.times()
        await put(None)
        await ctx.join()
    tick = os.sysconf("SC_CLK_TCK")
    user, system = ((b - a) / tick / (5 * n) * 1e6 for a, b in zip(us0, us1, strict=True))
    print(
        f"user/system CPU per round trip: parent {(t1.user - t0.user) / (5 * n) * 1e6:.1f}"
        f" / {(t1.system - t0.system) / (5 * n) * 1e6:.1f} µs, child {user:.1f} / {system:.1f} µs"
    )
    for wall, parent, child in rows:
        print(f"round trip {wall:6.1f} µs; CPU parent {parent:5.1f} µs, child {child:5.1f} µs")
    if cprofile:
        import pstats

        pstats.Stats(path).sort_stats("tottime").print_stats(25)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("calls", "cpu", "rt"))
    ap.add_argument("--loop", choices=LOOPS, default="asyncio")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    if args.what == "rt":
        run_on(args.loop, lambda: round_trips(args.n, args.cprofile))
        return
    fn = measure_calls if args.what == "calls" else measure_cpu
    out = run_on(args.loop, fn)
    unit = "calls" if args.what == "calls" else "µs CPU"
    for name, value in out.items():
        print(f"{args.loop:8s} {name:45s} {value:8.1f} {unit}")


if __name__ == "__main__":
    main()
