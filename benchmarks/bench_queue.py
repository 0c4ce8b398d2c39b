"""Small-message round trip: 64 bytes parent -> child -> parent.

Run as ``python -m benchmarks.bench_queue``. Parent on one core, the child on the other,
for every variant.

- aiomp: two ``aiomp.Queue``s; the child echoes (an ``async def``, and a sync function
  using ``q.sync``). Targets: <= 2x the raw floor, faster than ``multiprocessing.Queue``,
  >= 50x faster than aiomultiprocess.
- raw floor: the same loop awaiting ``sock_sendall``/``sock_recv`` on a socketpair whose
  other end a child echoes.
- ``multiprocessing.Queue``: two queues, a sync parent (its best case) and a sync child.
- aiomultiprocess: ``await pool.apply(echo, (payload,))`` on a one-process ``Pool``, the
  library's idiom for a request and its answer. It runs alone (its parent loop and worker
  poll every 5 ms, which would disturb the others).

Backlog: "enqueue 100k small items, then drain them". The parent puts 100,000 64-byte
items with nobody reading (aiomp's ``put_nowait``, ``multiprocessing.Queue.put``), then
tells a waiting child to drain them all; timed from the first put to the child's answer.
``multiprocessing`` pickles and writes in its feeder thread meanwhile, aiomp fills its
socket and then its overflow in shared memory. Target: at least 1.5x faster.

Every loop: the async-parent, async-child round trip and the raw floor are measured again
with the parent on asyncio, uvloop and trio (each in a fresh interpreter, ``--parent-loop``;
trio's floor awaits ``trio.socket``'s ``send``/``recv``). Targets: at most 1.4x the floor
on every loop, and at least 1.5x faster than ``multiprocessing.Queue``. Rows marked
``info`` bound those targets: the same floor over a ``SOCK_SEQPACKET`` pair (a queue's
kind), and both with an async echo child on the loop aiomp's async children run, so that
what any async child pays and what datagrams cost show apart; and the CPU per round trip
(parent + child) of aiomp, the floor and ``multiprocessing.Queue`` next to their times.
"""

from __future__ import annotations

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import (
    PAYLOAD,
    drain_aiomp,
    drain_mp,
    echo_aiomp_async,
    echo_aiomp_sync,
    echo_coro,
    echo_mp_queue,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class AiompQueue(h.Variant):
    """Two aiomp.Queues; the parent awaits (or blocks on ``q.sync``), the child echoes."""

    def __init__(self, parent_sync: bool, child_sync: bool) -> None:
        self.parent_sync, self.child_sync = parent_sync, child_sync
        self.is_async = not parent_sync
        self.name = aiomp_name(parent_sync, child_sync)

    def pids(self) -> list[int]:
        return self.ctx.pids()

    async def start(self) -> None:
        import aiomp

        self.qin, self.qout = aiomp.Queue(), aiomp.Queue()
        fn = echo_aiomp_sync if self.child_sync else echo_aiomp_async
        self.ctx = await aiomp.spawn(fn, 1, args=(self.qin, self.qout), grace_period=1.0)
        self.put, self.get = self.qin.put, self.qout.get
        self.sput, self.sget = self.qin.sync.put, self.qout.sync.get

    async def once(self) -> None:
        await self.put(PAYLOAD)
        await self.get()

    def once_sync(self) -> None:
        self.sput(PAYLOAD)
        self.sget()

    async def stop(self) -> None:
        await self.qin.put(None)
        await h.end_spawn(self.ctx)


def aiomp_name(parent_sync: bool, child_sync: bool) -> str:
    p = "sync parent (q.sync)" if parent_sync else "async parent"
    ch = "sync child (q.sync)" if child_sync else "async child"
    return f"aiomp.Queue, {p}, {ch}"


class TrioSocketFloor(h.SocketFloor):
    """The raw floor on trio: ``trio.socket``'s own ``send``/``recv`` on the socketpair."""

    async def start(self) -> None:
        import trio

        a = self.pair()
        self.tsock = trio.socket.from_stdlib_socket(a)
        self.sock = a

    async def once(self) -> None:
        sock = self.tsock
        await sock.send(PAYLOAD)
        got = 0
        while got < 64:
            data = await sock.recv(64 - got)
            if not data:
                raise EOFError("echo child went away")
            got += len(data)


class MpQueue(h.Variant):
    name = "multiprocessing.Queue"
    is_async = False

    async def start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.qin, self.qout = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=echo_mp_queue, args=(self.qin, self.qout), daemon=True)
        self.proc.start()

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc.pid is not None else []

    def once_sync(self) -> None:
        self.qin.put(PAYLOAD)
        self.qout.get()

    async def stop(self) -> None:
        self.qin.put(None)
        h.reap(self.proc)


class Aiomultiprocess(h.AiomultiprocessPool):
    name = "aiomultiprocess Pool.apply"

    async def once(self) -> None:
        await self.pool.apply(echo_coro, (PAYLOAD,))


BACKLOG = 100_000
MP_SYNC = "multiprocessing.Queue, sync parent, sync child"


async def backlog_aiomp() -> float:
    """Seconds to put BACKLOG items and have a fresh child drain them all."""
    import aiomp

    q, ready, go, done = (aiomp.Queue() for _ in range(4))
    async with aiomp.spawn(drain_aiomp, 1, args=(q, ready, go, done), grace_period=1.0):
        await ready.get()
        t0 = c.now()
        put = q.put_nowait
        for _ in range(BACKLOG):
            put(PAYLOAD)
        await go.put(BACKLOG)
        await done.get()
        return c.now() - t0  # leaving the block joins the child


def backlog_mp() -> float:
    """:func:`backlog_aiomp` through a ``multiprocessing.Queue``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q, ready, go, done = (ctx.Queue() for _ in range(4))
    proc = ctx.Process(target=drain_mp, args=(q, ready, go, done), daemon=True)
    proc.start()
    try:
        ready.get()
        t0 = c.now()
        put = q.put
        for _ in range(BACKLOG):
            put(PAYLOAD)
        go.put(BACKLOG)
        done.get()
        return c.now() - t0
    finally:
        h.reap(proc, 30)


async def backlog(rounds: int) -> tuple[list[float], list[float]]:
    """Alternate the two, ``rounds`` each; the samples (aiomp, multiprocessing)."""
    a: list[float] = []
    m: list[float] = []
    for i in range(rounds):
        if i % 2:
            a.append(await backlog_aiomp())
            m.append(backlog_mp())
        else:
            m.append(backlog_mp())
            a.append(await backlog_aiomp())
    return a, m


LOOPS = ("asyncio", "uvloop", "trio")


#: The floors measured on every loop: (key, datagrams, async child, reader kept)
FLOORS = (
    ("floor", False, False, False),
    ("floor_seqpacket", True, False, False),
    ("floor_async", False, True, False),
    ("floor_async_seqpacket", True, True, False),
    ("floor_async_kept", True, True, True),
)


async def per_loop(loop: str) -> dict[str, Any]:
    """The floors and the async-async round trip with the parent on ``loop``: medians of
    the time per round trip (``key``) and of its CPU (``key|cpu_parent``, ``key|cpu_child``)."""
    pinning = c.pin_parent()
    cls = TrioSocketFloor if loop == "trio" else h.SocketFloor
    variants: dict[str, h.Variant] = {k: cls(*how) for k, *how in FLOORS}
    variants["mp"] = MpQueue()
    variants["aiomp"] = AiompQueue(False, False)
    s = await h.interleave(list(variants.values()), c.reps(10, 2), c.reps(500, 200))
    out: dict[str, Any] = {"pinning": pinning}
    for key, v in variants.items():
        out[key] = c.median(s[v.name])
        out[f"{key}|cpu_parent"], out[f"{key}|cpu_child"] = v.cpu_medians() or (0.0, 0.0)
    return out


def run_on(loop: str) -> dict[str, Any]:
    """:func:`per_loop` in a fresh interpreter whose parent runs ``loop``."""
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "benchmarks.bench_queue", "--parent-loop", loop]
    if c.quick():
        argv.append("--quick")
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


async def main() -> None:
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    pinning = c.pin_parent()
    missing = c.aiomp_missing("_spawn", "_queue")
    batches, n = c.reps(10, 2), c.reps(500, 200)

    variants: list[h.Variant] = [h.SocketFloor(), MpQueue()]
    if missing is None:
        variants += [AiompQueue(False, True), AiompQueue(False, False), AiompQueue(True, True)]
    s = await h.interleave(variants, batches, n)
    med = {k: c.median(v) for k, v in s.items()}

    have_amp = c.have("aiomultiprocess")
    n_amp = 0
    if have_amp:
        amp = await h.interleave([Aiomultiprocess()], 1, c.reps(60, 20), warmup=5)
        n_amp = len(amp[Aiomultiprocess.name])
        med.update({k: c.median(v) for k, v in amp.items()})
    else:
        notes.append("aiomultiprocess not installed: its row is skipped")

    def add(sync: tuple[bool, bool], base: str, base_desc: str, target: dict[str, Any]) -> None:
        name = aiomp_name(*sync)
        what = "64 B round trip, " + name[len("aiomp.Queue, ") :]
        rows.append(c.row(what, med.get(name), med.get(base), base_desc, target, missing or ""))

    floor = h.SocketFloor.name
    # Like for like first: the floor's parent awaits and its child is a blocking echo;
    # multiprocessing.Queue is used blocking at both ends.
    for sync in ((False, True), (False, False)):
        add(sync, floor, "raw async socketpair, sync echo child", c.at_most(2))
    for sync in ((True, True), (False, False)):
        add(sync, MpQueue.name, MP_SYNC, c.faster())
    if have_amp:
        add((False, False), Aiomultiprocess.name, Aiomultiprocess.name, c.faster(50))
    notes.append(
        f"round trips: {pinning}; loop {h.loop_name()}; median of {batches * n} round trips "
        f"per variant in {batches} alternating batches (aiomultiprocess: {n_amp}, run "
        "alone: its loop polls every 5 ms)."
    )
    if missing is None:
        rounds = c.reps(6, 2)
        sa, sm = await backlog(rounds)
        what = f"enqueue {BACKLOG:,} 64 B items, then a child drains them"
        a, m = c.median(sa), c.median(sm)
        rows.append(c.row(what, a, m, "multiprocessing.Queue, the same", c.faster(1.5)))
        notes.append(
            f"backlog: {pinning}; aiomp puts with put_nowait and its child drains with "
            f"q.sync.get; median of {rounds} alternating runs each (a fresh child per run). "
            f"Samples (s): aiomp {[round(x, 3) for x in sa]}, multiprocessing "
            f"{[round(x, 3) for x in sm]}."
        )
    if missing is None:
        pinned = []
        for loop in LOOPS:
            got = run_on(loop)
            pinned.append(f"{loop}: {got['pinning']}")
            what, a = f"64 B round trip, async parent ({loop}), async child", got["aiomp"]
            rows.append(c.row(what, a, got["floor"], f"raw floor on {loop}", c.at_most(1.4)))
            rows.append(c.row(what, a, got["mp"], f"{MP_SYNC} (same run)", c.faster(1.5)))
            rows += loop_limits(loop, got)
        notes.append(
            "per loop: the parent on asyncio, uvloop and trio, each in a fresh interpreter "
            "with only the five floors, multiprocessing.Queue and aiomp alive, interleaved as "
            "above (the asyncio rows at the top run with four other variants' children "
            "alive). The floors: the parent on that loop's own socket calls; the pair a stream "
            "or SOCK_SEQPACKET (an aiomp.Queue's kind); the echo child a blocking recv, or "
            "sock_recv/sock_sendall awaited on the loop aiomp's async children run (uvloop "
            "when installed; its sock_recv adds and removes a reader per call, which aiomp's "
            "kept reader does not), or, leanest, with one reader kept registered, a plain "
            "non-blocking recv first and a future awaited only on an empty socket (the "
            "'reader kept' floor, SOCK_SEQPACKET). CPU per round trip: the parent's process "
            "clock and the child's scheduler run time (/proc/PID/task/*/schedstat, every "
            "thread) over each batch, median of the batches. Pinning per loop: "
            + "; ".join(pinned)
            + "."
        )
    c.emit("queue", rows, notes)


def cpu_of(got: dict[str, float], key: str) -> float:
    """Parent + child CPU per round trip of ``key`` in a :func:`per_loop` result."""
    return got[f"{key}|cpu_parent"] + got[f"{key}|cpu_child"]


def cpu_split(got: dict[str, float], key: str) -> str:
    return (
        f"{got[f'{key}|cpu_parent'] * 1e6:.1f} µs parent + "
        f"{got[f'{key}|cpu_child'] * 1e6:.1f} µs child"
    )


def loop_limits(loop: str, got: dict[str, float]) -> list[dict[str, object]]:
    """The rows that bound the per-loop targets: aiomp against the floors with a datagram
    pair and an async child, and the CPU per round trip next to the time."""
    rows = []
    what = f"64 B round trip, async parent ({loop}), async child"
    for key, *how in FLOORS[1:]:
        name = h.floor_name(*how).replace("raw async socketpair", f"raw floor on {loop}")
        note = f"this floor is {got[key] / got['floor']:.2f}x the stream, sync-child floor"
        rows.append(c.row(what, got["aiomp"], got[key], name, None, note))
    what = f"CPU per 64 B round trip (parent + child), async parent ({loop}), async child"
    for key, desc in (("floor", f"raw floor on {loop}, stream, sync echo child"), ("mp", MP_SYNC)):
        note = (
            f"{cpu_split(got, 'aiomp')} vs {cpu_split(got, key)}; wall-clock "
            f"{got['aiomp'] / got[key]:.2f}x"
        )
        if key == "floor":
            note += "; the other floors: " + "; ".join(
                f"{h.floor_name(*how).replace('raw async socketpair ', '')} {cpu_split(got, k)}"
                for k, *how in FLOORS[1:]
            )
        rows.append(c.row(what, cpu_of(got, "aiomp"), cpu_of(got, key), desc, None, note))
    return rows


if __name__ == "__main__":
    import json
    import sys

    import anyio

    if "--parent-loop" not in sys.argv:
        c.run_main(main)
    else:
        c.allow_bytecode()
        loop = sys.argv[sys.argv.index("--parent-loop") + 1]
        backend = "trio" if loop == "trio" else "asyncio"
        options = {"use_uvloop": True} if loop == "uvloop" else {}
        print(json.dumps(anyio.run(per_loop, loop, backend=backend, backend_options=options)))
