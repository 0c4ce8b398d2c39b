"""Where a trio parent's round trip through ``aiomp.Queue`` spends more than the floor's.

Run as ``python -m benchmarks.queue_trio [batches] [n]``. The parent runs ``trio.run``
(pinned to one core, the children on the other, as ``bench_queue`` does); batches of
these variants alternate:

- ``floor``: the lean async-child floor of ``bench_queue`` on trio: 64 B over a
  ``SOCK_SEQPACKET`` pair with ``trio.socket``'s ``send``/``recv``, the echo child async
  with its reader kept;
- ``aiomp``: two ``aiomp.Queue``s, ``await put`` then ``await get``, an async echo child;
- ``aiomp_inline``: the same queues and child, the parent doing the work of ``put`` and
  ``get`` by hand (``_put_plain``, ``_try_get`` with a look first, trio's
  ``wait_readable``, ``_try_get``): what the calls of ``put``/``get`` themselves add;
- ``floor_lowlevel``: the floor's pair and child, the parent with a plain ``send``, then
  trio's ``wait_readable`` and a ``recv`` (no ``trio.socket`` layer, no checkpoints);
- ``aiomp_inline`` with a checkpoint after the put, as ``trio.socket``'s send has.

For each: the median round trip, the CPU per round trip of the parent (this thread's
clock) and of the child (schedstat), and, counted by a ``trio.abc.Instrument``, the
scheduler's task steps, I/O waits, and I/O waits that returned nothing at once
(``before_io_wait``/``after_io_wait``) per round trip. Then a timeline of ``aiomp_inline``:
``CLOCK_MONOTONIC`` stamps in a preallocated array around the put, the look, the wait
(until the scheduler resumes the task) and the read. Nothing is written to RESULTS.md.
"""

from __future__ import annotations

import array
import os
import sys
import time

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import PAYLOAD
from benchmarks.bench_queue import AiompQueue, TrioSocketFloor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Counts:
    """A trio instrument: scheduler task steps and I/O waits."""

    def __init__(self) -> None:
        self.steps = self.io_waits = 0

    def before_task_step(self, task: Any) -> None:
        self.steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.io_waits += 1


class InlineQueue(AiompQueue):
    """aiomp's queues and echo child; the parent does ``put``/``get``'s work by hand."""

    def __init__(self) -> None:
        super().__init__(False, False)
        self.name = "aiomp, put/get work inlined"

    async def once(self) -> None:
        import trio

        from aiomp import _queue

        qin, qout = self.qin, self.qout
        qin._put_plain(PAYLOAD)
        item = qout._try_get(peek=True)
        while item is _queue._MISSING:
            await trio.lowlevel.wait_readable(qout._wait_fd)
            item = qout._try_get()


class InlineQueueYield(InlineQueue):
    """:class:`InlineQueue` with a scheduler pass after the put (as ``trio.socket``'s send)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "aiomp inlined, a checkpoint after the put"

    async def once(self) -> None:
        import trio

        from aiomp import _queue

        qin, qout = self.qin, self.qout
        qin._put_plain(PAYLOAD)
        await trio.lowlevel.cancel_shielded_checkpoint()
        item = qout._try_get(peek=True)
        while item is _queue._MISSING:
            await trio.lowlevel.wait_readable(qout._wait_fd)
            item = qout._try_get()


class LowLevelFloor(TrioSocketFloor):
    """The floor's pair and child; the parent: ``send``, trio's ``wait_readable``, ``recv``."""

    def __init__(self) -> None:
        super().__init__(True, True, True)
        self.name = "floor, send + wait_readable + recv"

    async def once(self) -> None:
        import trio

        sock = self.sock
        sock.send(PAYLOAD)
        await trio.lowlevel.wait_readable(sock)
        sock.recv(64)


async def timeline(v: InlineQueue, n: int, floor: LowLevelFloor | None) -> dict[str, float]:
    """Median µs of each phase of ``n`` inlined round trips (stamps in a preallocated
    array); with ``floor``, the floor's send, look (none), wait and recv instead."""
    import trio

    from aiomp import _queue

    if floor is not None:
        sock = floor.sock
        qin_put: Any = lambda _: sock.send(PAYLOAD)  # noqa: E731
        look: Any = lambda peek=False: _queue._MISSING if peek else sock.recv(64)  # noqa: E731
        fd = sock.fileno()
    else:
        qin_put, look = v.qin._put_plain, v.qout._try_get
        fd = v.qout._wait_fd
    now = time.clock_gettime_ns
    mono = time.CLOCK_MONOTONIC
    st = array.array("q", bytes(8 * 6 * n))
    waits = 0
    for i in range(n):
        b = 6 * i
        st[b] = now(mono)
        qin_put(PAYLOAD)
        st[b + 1] = now(mono)
        item = look(peek=True)
        st[b + 2] = now(mono)
        if item is _queue._MISSING:
            await trio.lowlevel.wait_readable(fd)
            waits += 1
            st[b + 3] = now(mono)
            item = look()
            st[b + 4] = now(mono)
            assert item is not _queue._MISSING
        else:
            st[b + 3] = st[b + 4] = st[b + 2]
        st[b + 5] = now(mono)
    names = ("put", "look", "wait", "read", "rest")
    out = {
        name: c.median((st[6 * i + k + 1] - st[6 * i + k]) / 1e3 for i in range(n))
        for k, name in enumerate(names)
    }
    out["waited"] = waits / n
    return out


async def main(batches: int, n: int) -> None:
    import trio

    pinning = c.pin_parent()
    variants: list[h.Variant] = [
        TrioSocketFloor(True, True, True),
        AiompQueue(False, False),
        InlineQueue(),
        LowLevelFloor(),
        InlineQueueYield(),
    ]
    counts = Counts()
    trio.lowlevel.add_instrument(counts)
    per: dict[str, list[tuple[float, float, float]]] = {v.name: [] for v in variants}
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    started: list[h.Variant] = []
    try:
        for v in variants:
            v.cpu = []
            await v.start()
            started.append(v)
            await v.batch(100)
        for b in range(batches):
            for v in variants if b % 2 == 0 else variants[::-1]:
                await v.batch(10)
                pids = v.pids()
                ch0 = h.children_cpu(pids)
                s0, w0 = counts.steps, counts.io_waits
                p0 = time.thread_time()
                got = await v.batch(n)
                p1 = time.thread_time()
                k = len(got)
                per[v.name].append(
                    ((counts.steps - s0) / k, (counts.io_waits - w0) / k, (p1 - p0) / k)
                )
                v.cpu.append(((p1 - p0) / k, (h.children_cpu(pids) - ch0) / k))
                samples[v.name].extend(got)
        tl = await timeline(variants[2], n, None)  # type: ignore[arg-type]
        tlf = await timeline(variants[2], n, variants[3])  # type: ignore[arg-type]
    finally:
        for v in reversed(started):
            await v.stop()
        trio.lowlevel.remove_instrument(counts)
    print(f"{pinning}; {batches} batches of {n}; load {os.getloadavg()[0]:.2f}")
    base = c.median(samples[variants[0].name])
    base_cpu = variants[0].cpu_medians() or (1.0, 1.0)
    for v in variants:
        cpu = v.cpu_medians() or (0.0, 0.0)
        steps = c.median(x[0] for x in per[v.name])
        waits = c.median(x[1] for x in per[v.name])
        print(
            f"{v.name:42s} {c.median(samples[v.name]) * 1e6:6.1f} µs "
            f"({c.median(samples[v.name]) / base:4.2f}x)  cpu parent {cpu[0] * 1e6:5.1f} "
            f"child {cpu[1] * 1e6:5.1f} ({sum(cpu) / sum(base_cpu):4.2f}x)  "
            f"steps {steps:4.2f} io_waits {waits:4.2f}"
        )
    print("aiomp inlined, median µs per phase:", {k: round(x, 2) for k, x in tl.items()})
    print("floor low-level, median µs per phase:", {k: round(x, 2) for k, x in tlf.items()})


if __name__ == "__main__":
    import trio

    c.allow_bytecode()
    args = [int(a) for a in sys.argv[1:]]
    trio.run(main, *(args + [10, 500][len(args) :]))
