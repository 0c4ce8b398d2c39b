"""Parent-side machinery for latency comparisons: variants, interleaved batches, the floor.

A *variant* is one way of doing a round trip (aiomp, a baseline, the raw floor). Its child
is started once; then batches of every variant alternate, so a burst of load from another
user of the machine lands on all of them alike, and each figure is the median of all its
samples.

CPU: every batch also records the CPU time per round trip of the parent (its process
clock, every thread) and of the variant's children (``/proc/PID/task/*/schedstat``, the
scheduler's nanosecond run time, every thread; ``/proc/PID/stat``'s utime and stime tick
only every 10 ms, coarser than a batch), on :attr:`Variant.cpu`.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator

from benchmarks import _common as c
from benchmarks._targets import PAYLOAD, echo_socket, echo_socket_async, trivial

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any


class Variant:
    """One round trip to measure. Subclasses define ``start``, ``once`` and ``stop``."""

    name = "?"
    #: sync variants block the loop in ``once`` (they do not use it at all)
    is_async = True
    #: seconds a batch may take before it stops early (a slow variant must not stall a run)
    budget: float | None = 5.0

    #: (parent, children) CPU seconds per round trip, one pair per timed batch
    #: (:func:`interleave` gives each variant its list: subclasses need no ``__init__``)
    cpu: list[tuple[float, float]]

    def pids(self) -> list[int]:
        """The variant's child processes, for their CPU time (none: not counted)."""
        return []

    async def start(self) -> None:
        pass

    async def once(self) -> None:
        raise NotImplementedError

    def once_sync(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        pass

    async def batch(self, n: int) -> list[float]:
        if self.is_async:
            return await c.atime_calls(self.once, n, self.budget)
        return c.time_calls(self.once_sync, n, self.budget)

    async def timed_batch(self, n: int) -> list[float]:
        """:meth:`batch`, recording its CPU per round trip on :attr:`cpu`."""
        pids = self.pids()
        child0 = children_cpu(pids)
        parent0 = time.process_time()
        out = await self.batch(n)
        parent1 = time.process_time()
        child1 = children_cpu(pids)
        per = ((parent1 - parent0) / len(out), (child1 - child0) / len(out))
        self.cpu.append(per)
        return out

    def cpu_medians(self) -> tuple[float, float] | None:
        """Median (parent, children) CPU seconds per round trip over the timed batches."""
        cpu = getattr(self, "cpu", None)
        if not cpu:
            return None
        return c.median(p for p, _ in cpu), c.median(ch for _, ch in cpu)


class PoolCalls(Variant):
    """A pool, entered once: each call is ``apply(trivial)``, or ``map(trivial,
    range(n_map))`` when ``n_map`` is set. ``make`` builds the pool (its library is
    imported there, not here); ``workers``: wait until that many are up before timing
    (a map before then runs on fewer); ``cpu``: count its workers' CPU time."""

    def __init__(
        self,
        name: str,
        make: Callable[[], Any],
        n_map: int = 0,
        workers: int = 0,
        cpu: bool = False,
        budget: float | None = 5.0,
    ) -> None:
        self.name, self.make, self.n_map, self.workers = name, make, n_map, workers
        self.count_cpu, self.budget = cpu, budget

    async def start(self) -> None:
        import anyio

        self.pool = self.make()
        await self.pool.__aenter__()
        with anyio.fail_after(120):
            while len(self.pool.pids()) < self.workers:  # noqa: ASYNC110 - no event for it
                await anyio.sleep(0.05)

    def pids(self) -> list[int]:
        return list(self.pool.pids()) if self.count_cpu else []

    async def once(self) -> None:
        if self.n_map:
            assert len(await self.pool.map(trivial, range(self.n_map))) == self.n_map
        else:
            await self.pool.apply(trivial)

    async def stop(self) -> None:
        await self.pool.__aexit__(None, None, None)


def aiomp_pool(processes: int = 1, **kwargs: Any) -> Callable[[], Any]:
    """``make`` for :class:`PoolCalls`: an ``aiomp.Pool(processes, **kwargs)``."""

    def make() -> Any:
        import aiomp

        return aiomp.Pool(processes, grace_period=1.0, **kwargs)

    return make


def thread_files(pids: list[int], name: str) -> Iterator[str]:
    """The text of ``/proc/PID/task/TID/<name>`` for every live thread of ``pids`` (a
    process or thread that has ended is skipped)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                    yield f.read()
            except (FileNotFoundError, ProcessLookupError):
                pass


def children_cpu(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` have run so far, every thread (a thread that
    ended is no longer counted: the variants' children keep theirs)."""
    return sum(int(text.split()[0]) for text in thread_files(pids, "schedstat")) / 1e9


async def interleave(
    variants: list[Variant], batches: int, n: int, warmup: int = 50
) -> dict[str, list[float]]:
    """Start every variant, warm each up, then alternate batches of ``n`` round trips.

    Each batch starts with ``n // 10`` (at most 10) round trips that are not timed, for
    every variant alike: the first ten of a batch measured 8-15 % slower than the rest
    (``Pool.apply`` and the floor, alternating or alone; cause not pinned down), which
    moved a median of 120 by 1-2 %. See benchmarks/RESULTS.md, Findings.
    """
    rewarm = min(10, n // 10)
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    started: list[Variant] = []
    try:
        for v in variants:
            v.cpu = []
            await v.start()
            started.append(v)
            await v.batch(warmup)
        for b in range(batches):
            order = variants if b % 2 == 0 else variants[::-1]
            for v in order:
                if rewarm:
                    await v.batch(rewarm)
                samples[v.name].extend(await v.timed_batch(n))
    finally:
        for v in reversed(started):
            await v.stop()
    return samples


class SocketFloor(Variant):
    """The raw floor: 64 bytes over a socketpair to a child that echoes them, awaited with
    the event loop's own ``sock_sendall``/``sock_recv``.

    By default the pair is a stream and the child a blocking ``recv`` (the fastest
    wake-up there is). ``seqpacket`` makes it a ``SOCK_SEQPACKET`` pair (datagrams, as an
    ``aiomp.Queue``'s); ``async_child`` makes the child await ``sock_recv`` and
    ``sock_sendall`` on the loop aiomp's async children run (see
    :func:`~benchmarks._targets.echo_socket_async`). Together they separate what any async
    child pays from what datagrams cost. ``kept_reader`` (with both) makes the async child
    the leanest one: one reader kept registered, as aiomp's waits do.
    """

    name = "raw async socketpair"

    def __init__(
        self, seqpacket: bool = False, async_child: bool = False, kept_reader: bool = False
    ) -> None:
        self.seqpacket, self.async_child, self.kept_reader = seqpacket, async_child, kept_reader
        if seqpacket or async_child:
            self.name = floor_name(seqpacket, async_child, kept_reader)

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc.pid is not None else []

    def pair(self) -> socket.socket:
        """Start the echo child on one end of a new pair; the parent's end (blocking)."""
        import socket

        kind = socket.SOCK_SEQPACKET if self.seqpacket else socket.SOCK_STREAM
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        ctx = multiprocessing.get_context("spawn")
        if self.async_child:
            self.proc = ctx.Process(
                target=echo_socket_async, args=(b, self.kept_reader), daemon=True
            )
        else:
            self.proc = ctx.Process(target=echo_socket, args=(b,), daemon=True)
        self.proc.start()
        b.close()
        return a

    async def start(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        a = self.pair()
        a.setblocking(False)
        self.sock: socket.socket = a

    async def once(self) -> None:
        loop, sock = self.loop, self.sock
        await loop.sock_sendall(sock, PAYLOAD)
        got = 0
        while got < 64:
            data = await loop.sock_recv(sock, 64 - got)
            if not data:
                raise EOFError("echo child went away")
            got += len(data)

    async def stop(self) -> None:
        self.sock.close()
        reap(self.proc)


def reap(proc: Any, timeout: float = 5) -> None:
    """Join a ``multiprocessing`` process that was told to end; kill it after ``timeout``."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()


async def end_spawn(ctx: Any, timeout: float = 5) -> None:
    """Join an ``aiomp.spawn`` context whose children were told to end; terminate them
    after ``timeout``."""
    import anyio

    with anyio.move_on_after(timeout):
        await ctx.join()
    await ctx.terminate()


class AiomultiprocessPool(Variant):
    """A one-process ``aiomultiprocess.Pool`` (its loop polls every 5 ms: run it alone)."""

    async def start(self) -> None:
        import aiomultiprocess

        self.pool = aiomultiprocess.Pool(processes=1)

    async def stop(self) -> None:
        self.pool.terminate()
        await self.pool.join()


def floor_name(seqpacket: bool, async_child: bool, kept_reader: bool = False) -> str:
    kind = "SOCK_SEQPACKET" if seqpacket else "stream"
    child = "async echo child (aiomp's child loop)" if async_child else "sync echo child"
    if kept_reader:
        child += ", reader kept"
    return f"raw async socketpair ({kind}), {child}"


def loop_name() -> str:
    import asyncio

    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"
