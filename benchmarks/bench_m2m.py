"""Many-to-many throughput: 4 producer processes and 2 consumer processes on one queue.

Run as ``python -m benchmarks.bench_m2m``. Two kinds of item:

- small: 64-byte ``bytes``;
- arrays: 100 KiB float32 numpy arrays, a fresh one per item (``src.copy()`` in the
  producer, for every library alike). ``multiprocessing.Queue`` pickles the bytes through
  its pipe; ``torch.multiprocessing.Queue`` gets ``torch.from_numpy(src.copy())``, which
  its ``put`` moves into a new shared-memory storage (torch's way); ``aiomp.Queue``'s
  ``put`` copies the array into a pooled shared-memory block and sends a handle. aiomp is
  also run with the array built straight into an ``aiomp.empty`` block (one copy of
  ``src``, then a handle): its best idiom for data made fresh per item.

Variants, each with its six children started once (spawn) and kept for the whole run:
``aiomp.Queue`` with async children (``await q.put/get``) and with sync children
(``q.sync``), ``multiprocessing.Queue`` and ``torch.multiprocessing.Queue`` (sync
children). Consumers only count what they take (they do not read the arrays). The
protocol is in :mod:`benchmarks._targets_m2m`: a round is timed from the parent's first
"go" to the consumers' report of the fourth producer's end mark, so every item has been
taken by then.

Baseline for arrays: the memory bandwidth of this machine in the same run, one
``np.copyto`` of 100 KiB into a ring of pre-faulted buffers (64 MiB, beyond the caches)
in the parent. Targets: aiomp at least 2x ``multiprocessing.Queue``'s messages/s for
small items, and arrays at memory bandwidth (time per array at most one memcpy of it).

Floors, in the same run (rows marked ``info``): for small items, :class:`DatagramFloor`,
the same processes and protocol with one raw 64 B ``send``/``recv`` per item on a shared
``SOCK_SEQPACKET`` pair; for arrays, :func:`fd_pass_per_message`, what passing and mapping
an fd per message costs in one process, with a fresh memfd and with one kept.

A run is :data:`ROUNDS` rounds of every variant and kind, alternating, so that a burst of
load from the machine's other users lands on all of them alike; each figure is a median
within a run. Every ratio is taken within one run; the rows show the run with the median
ratio, and the notes give all :data:`RUNS` runs and the load average. Unpinned: this is
throughput of six processes on the machine's cores, for every library alike.
"""

from __future__ import annotations

import os

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets_m2m import ARRAY_LEN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PRODUCERS = 4
CONSUMERS = 2
RUNS = 3
ROUNDS = 3
ARRAY_BYTES = ARRAY_LEN * 4
#: bytes of the memcpy baseline's ring of destinations: well beyond the caches
RING_BYTES = 64 << 20


def items(kind: str, variant: AiompVariant | MpVariant | None = None) -> int:
    """Items per producer per round (torch's queue takes about 30x as long per array:
    it gets a tenth of the arrays, so that a run stays within the runner's time limit)."""
    if kind == "small":
        return c.reps(10_000, 1_000)
    n = c.reps(500, 40)
    return n // 10 if isinstance(variant, MpVariant) and variant.use_torch else n


class AiompVariant:
    """One queue library with its 4 producers and 2 consumers, started once; ``round``:
    seconds for every producer to put ``n`` items and the consumers to take them."""

    kinds: tuple[str, ...] = ("small", "array", "empty")

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.name = f"aiomp.Queue, {'sync children (q.sync)' if sync else 'async children'}"

    async def start(self) -> None:
        import anyio

        import aiomp
        from benchmarks import _targets_m2m as t

        self.data, self.done = aiomp.Queue(), aiomp.Queue()
        self.pgos = [aiomp.Queue() for _ in range(PRODUCERS)]
        self.cgos = [aiomp.Queue() for _ in range(CONSUMERS)]
        produce = t.produce_aiomp_sync if self.sync else t.produce_aiomp_async
        consume = t.consume_aiomp_sync if self.sync else t.consume_aiomp_async
        self.ctxs = []
        for fn, n, gos in ((consume, CONSUMERS, self.cgos), (produce, PRODUCERS, self.pgos)):
            ctx = await aiomp.spawn(fn, n, args=(self.data, gos, self.done), grace_period=1.0)
            self.ctxs.append(ctx)
        with anyio.fail_after(120):
            for _ in range(PRODUCERS + CONSUMERS):
                assert await self.done.get() == "ready"

    def pids(self) -> list[int]:
        return [pid for ctx in self.ctxs for pid in ctx.pids()]

    async def round(self, kind: str, n: int) -> float:
        import anyio

        with anyio.fail_after(300):
            t0 = c.now()
            for g in self.cgos:
                g.put_nowait(True)
            for g in self.pgos:
                g.put_nowait((kind, n))
            for _ in range(PRODUCERS):
                assert await self.done.get() == "mark"
            elapsed = c.now() - t0
            for _ in range(CONSUMERS):
                self.data.put_nowait(None)
            counts = [await self.done.get() for _ in range(CONSUMERS)]
        assert sum(counts) == PRODUCERS * n, counts
        return elapsed

    async def stop(self) -> None:
        for g in self.pgos:
            g.put_nowait(("stop", 0))
        for g in self.cgos:
            g.put_nowait(False)
        for ctx in self.ctxs:
            await h.end_spawn(ctx, 10)


class MpVariant:
    """``multiprocessing.Queue`` (or torch's, ``use_torch``); the parent blocks on it."""

    kinds: tuple[str, ...] = ("small", "array")

    def __init__(self, use_torch: bool) -> None:
        self.use_torch = use_torch
        self.name = "torch.multiprocessing.Queue" if use_torch else "multiprocessing.Queue"

    async def start(self) -> None:
        from benchmarks import _targets_m2m as t

        if self.use_torch:
            import torch.multiprocessing as mp
        else:
            import multiprocessing as mp
        ctx: Any = mp.get_context("spawn")
        self.data = ctx.Queue()
        self.launch(ctx, t.consume_mp, t.produce_mp, (self.data, self.data), self.use_torch)

    def launch(self, ctx: Any, consume: Any, produce: Any, chans: Any, *extra: Any) -> None:
        """Start the children, each ``fn(rank, chan, gos, done, *extra)`` (``chans``: the
        consumers' and the producers'), and wait until every one is ready."""
        self.done = ctx.Queue()
        self.pgos = [ctx.Queue() for _ in range(PRODUCERS)]
        self.cgos = [ctx.Queue() for _ in range(CONSUMERS)]
        self.procs = []
        for fn, n, gos, chan in (
            (consume, CONSUMERS, self.cgos, chans[0]),
            (produce, PRODUCERS, self.pgos, chans[1]),
        ):
            for rank in range(n):
                args = (rank, chan, gos, self.done, *extra)
                p = ctx.Process(target=fn, args=args, daemon=True)
                p.start()
                self.procs.append(p)
        for _ in range(PRODUCERS + CONSUMERS):
            assert self.done.get(timeout=120) == "ready"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def round(self, kind: str, n: int) -> float:
        t0 = c.now()
        for g in self.cgos:
            g.put(True)
        for g in self.pgos:
            g.put((kind, n))
        for _ in range(PRODUCERS):
            assert self.done.get(timeout=300) == "mark"
        elapsed = c.now() - t0
        self.end_round()
        counts = [self.done.get(timeout=60) for _ in range(CONSUMERS)]
        assert sum(counts) == PRODUCERS * n, counts
        return elapsed

    def end_round(self) -> None:
        """Tell each consumer to report its count."""
        for _ in range(CONSUMERS):
            self.data.put(None)

    async def stop(self) -> None:
        for g in self.pgos:
            g.put(("stop", 0))
        for g in self.cgos:
            g.put(False)
        for p in self.procs:
            h.reap(p, 10)


class DatagramFloor(MpVariant):
    """The floor for small items: the same 4 x 2 processes and protocol, each item one raw
    64 B ``send``/``recv`` on one shared ``SOCK_SEQPACKET`` pair in blocking mode, no
    pickling (what one datagram per item costs with a Python loop around it)."""

    name = "datagram floor"
    kinds = ("small",)

    def __init__(self) -> None:
        self.use_torch = False

    async def start(self) -> None:
        import multiprocessing
        import socket

        from benchmarks import _targets_m2m as t

        self.tx, rx = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ctx = multiprocessing.get_context("spawn")
        self.launch(ctx, t.consume_dgram, t.produce_dgram, (rx, self.tx))
        rx.close()  # the children have their own copies by now (spawn sent them)

    def end_round(self) -> None:
        for _ in range(CONSUMERS):
            self.tx.send(b"e")

    async def stop(self) -> None:
        await super().stop()
        self.tx.close()


def memcpy_per_array(passes: int = 3) -> float:
    """Seconds for one ``np.copyto`` of 100 KiB into memory already mapped, beyond the
    caches (a ring of destinations), median over ``passes`` passes of the ring."""
    import numpy as np

    ring = np.zeros((RING_BYTES // ARRAY_BYTES, ARRAY_LEN), np.float32)  # faulted in
    src = np.arange(ARRAY_LEN, dtype=np.float32)
    copyto = np.copyto
    per = []
    for _ in range(passes + 1):  # the first pass warms up
        t0 = c.now()
        for dst in ring:
            copyto(dst, src)
        per.append((c.now() - t0) / len(ring))
    return c.median(per[1:])


def fd_pass_per_message(fresh: bool, count: int = 200, passes: int = 3) -> float:
    """Seconds for what a message that carries a shared block costs at least, in one
    process: ``memfd_create`` (``fresh``; else one memfd kept for every message, as a pool
    of recycled blocks would), ``write`` of 100 KiB into it, ``sendmsg`` of its fd
    (SCM_RIGHTS) and ``recvmsg`` of it over a ``SOCK_SEQPACKET`` pair, ``mmap`` of the
    received fd, ``munmap`` and the ``close``s. Median over ``passes`` passes of ``count``
    messages (after one that warms up)."""
    import mmap
    import socket

    src = bytes(ARRAY_BYTES)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    kept = -1 if fresh else os.memfd_create("aiomp-bench-floor", os.MFD_CLOEXEC)
    per = []
    try:
        for _ in range(passes + 1):
            t0 = c.now()
            for _ in range(count):
                fd = os.memfd_create("aiomp-bench-floor", os.MFD_CLOEXEC) if fresh else kept
                try:
                    if os.pwrite(fd, src, 0) != ARRAY_BYTES:
                        raise OSError("short write into a memfd")
                    socket.send_fds(a, [b"h"], [fd])
                finally:
                    if fresh:
                        os.close(fd)
                _, fds, _, _ = socket.recv_fds(b, 16, 1)
                try:
                    mmap.mmap(fds[0], ARRAY_BYTES).close()
                finally:
                    os.close(fds[0])
            per.append((c.now() - t0) / count)
    finally:
        a.close()
        b.close()
        if not fresh:
            os.close(kept)
    return c.median(per[1:])


def rates(per_item: float, nbytes: int) -> str:
    """Messages/s (and GB/s for arrays) of a time per item."""
    text = f"{1 / per_item:,.0f} msg/s"
    if nbytes > 64:
        text += f", {nbytes / per_item / 1e9:.2f} GB/s"
    return text


def describe(run: dict[str, float]) -> str:
    """One run's figures: rates, and CPU time per item."""
    return "; ".join(
        f"{k.replace('|', ', ')}: "
        + (
            f"{x * 1e6:.1f} µs CPU per item"
            if k.endswith("cpu")
            else rates(x, 64 if k.endswith("small") else ARRAY_BYTES)
        )
        for k, x in run.items()
    )


async def main() -> None:
    c.unpin_parent()
    missing = c.aiomp_missing("_spawn", "_queue")
    variants: list[AiompVariant | MpVariant] = [MpVariant(False), DatagramFloor()]
    if c.have("torch"):
        variants.append(MpVariant(True))
    if missing is None:
        variants += [AiompVariant(False), AiompVariant(True)]
    runs: list[dict[str, float]] = []
    loads: list[float] = []
    started: list[AiompVariant | MpVariant] = []
    try:
        for v in variants:
            await v.start()
            started.append(v)
            for kind in v.kinds:  # warm up: segments pooled, pages faulted in, caches warm
                await v.round(kind, max(1, items(kind, v) // 10))
        for r in range(c.reps(RUNS, 1)):
            loads.append(os.getloadavg()[0])
            samples: dict[str, list[float]] = {}
            for i in range(c.reps(ROUNDS, 1)):
                samples.setdefault("memcpy", []).append(memcpy_per_array())
                samples.setdefault("fd passing", []).append(fd_pass_per_message(fresh=True))
                kept = fd_pass_per_message(fresh=False)
                samples.setdefault("fd passing, kept memfd", []).append(kept)
                for v in variants if i % 2 == 0 else variants[::-1]:
                    for kind in v.kinds:
                        n = items(kind, v)
                        cpu0 = h.children_cpu(v.pids())
                        per = await v.round(kind, n) / (PRODUCERS * n)
                        used = (h.children_cpu(v.pids()) - cpu0) / (PRODUCERS * n)
                        samples.setdefault(f"{v.name}|{kind}", []).append(per)
                        samples.setdefault(f"{v.name}|{kind}|cpu", []).append(used)
            runs.append(run := {k: c.median(s) for k, s in samples.items()})
            print(f"run {r + 1}: {describe(run)}", flush=True)
        loads.append(os.getloadavg()[0])
    finally:
        for v in reversed(started):
            await v.stop()

    def median_run(key: str, base: str) -> tuple[float | None, float | None, str]:
        """(aiomp, baseline) of the run with the median ratio, and every run's figures."""
        if not runs or key not in runs[0] or base not in runs[0]:
            return None, None, missing or "not measured"
        ratios = sorted((run[key] / run[base], i) for i, run in enumerate(runs))
        _, i = ratios[len(ratios) // 2]
        spread = "runs " + ", ".join(f"{x:.2f}x" for x, _ in ratios)
        got, ref = runs[i][key], runs[i][base]
        if not key.endswith("cpu"):
            nbytes = 64 if key.endswith("small") else ARRAY_BYTES
            spread += f"; {rates(got, nbytes)} vs {rates(ref, nbytes)}"
        return got, ref, spread

    rows: list[dict[str, Any]] = []

    def add(
        what: str, key: str, base: str, target: Any = None, why: str = "", name: str = ""
    ) -> None:
        """A row of ``what``: the median run's ``key`` against its ``base`` (by default a
        queue's figure with sync children)."""
        got, ref, note = median_run(key, base)
        name = name or base.split("|")[0] + ", sync children"
        rows.append(c.row(f"{shape}, {what}", got, ref, name, target, why + note))

    mp, tq = "multiprocessing.Queue", "torch.multiprocessing.Queue"
    shape = f"{PRODUCERS} producers x {CONSUMERS} consumers"
    copy = "one np.copyto of 100 KiB into mapped memory"
    children = ("async children", "sync children (q.sync)")
    for v in children:
        for base, target in ((mp, c.faster(2)), (tq, None)):
            add(
                f"64 B items, time per item, {v}",
                f"aiomp.Queue, {v}|small",
                f"{base}|small",
                target,
            )
    dg, why = DatagramFloor.name, "bounds the 2x target: one datagram per item; "
    what = f"64 B items, time per item, {dg} (raw SOCK_SEQPACKET send/recv, no pickling)"
    add(what, f"{dg}|small", f"{mp}|small", why=why)
    add(f"CPU time per 64 B item, all six children, {dg}", f"{dg}|small|cpu", f"{mp}|small|cpu")
    for v in children:
        for kind, what in (("small", "64 B item"), ("array", "100 KiB numpy array")):
            what = f"CPU time per {what}, all six children, {v}"
            add(what, f"aiomp.Queue, {v}|{kind}|cpu", f"{mp}|{kind}|cpu")
    for v in children:
        a, per_array = f"aiomp.Queue, {v}", f"time per array, {v}"
        for kind, how in (("array", "numpy arrays copied at put"), ("empty", "aiomp.empty")):
            add(f"100 KiB {how}, {per_array}", f"{a}|{kind}", "memcpy", c.at_most(1.0), name=copy)
        add(f"100 KiB numpy arrays, {per_array}", f"{a}|array", f"{mp}|array")
        name = f"{tq}, sync children, torch.from_numpy tensors"
        add(f"100 KiB numpy arrays, {per_array}", f"{a}|array", f"{tq}|array", name=name)
    for key, what, why in (
        (
            "fd passing",
            ": memfd_create,",
            "bounds 'arrays at memory bandwidth' for a fresh fd per message; ",
        ),
        (
            "fd passing, kept memfd",
            ", one memfd kept (a recycled block):",
            "the same without a fresh memfd and its new pages; ",
        ),
    ):
        got, ref, note = median_run(key, "memcpy")
        what = f"fd-passing floor per message{what} write 100 KiB, SCM_RIGHTS sendmsg/recvmsg"
        what += ", mmap, munmap, close (one process)"
        rows.append(c.row(what, got, ref, copy, None, why + note))
    floor = "the fd-passing floor per message (one process)"
    for v in children:
        what = f"100 KiB numpy arrays, time per array, {v}"
        add(what, f"aiomp.Queue, {v}|array", "fd passing", name=floor)
    if not c.have("torch"):
        rows = [r for r in rows if tq not in r["baseline_name"]]
    notes = [
        f"m2m: {len(runs)} runs; in each, {c.reps(ROUNDS, 1)} rounds per library and kind, "
        f"alternating; a round: {items('small'):,} small items or {items('array')} arrays "
        f"({items('array') // 10} through torch's queue) per producer, timed from the "
        "first go to the fourth producer's end mark reaching the parent through a "
        "consumer; figures are medians within a run; each row is the run with the median "
        "ratio; children started once (spawn), unpinned; consumers count items without "
        "reading the arrays; CPU time: the six children's run time (every thread, "
        "/proc/PID/task/*/schedstat) over a round, per item; the memcpy baseline: "
        "np.copyto of 100 KiB into "
        f"a {RING_BYTES >> 20} MiB ring of mapped buffers, in the parent. The datagram "
        "floor: the same six processes and protocol (multiprocessing.Queues for go and "
        "done), each item a raw 64 B send/recv on one shared blocking SOCK_SEQPACKET pair. "
        "The fd-passing floors: in the parent, once per round like the memcpy, median of "
        "3 passes of 200 messages, with a fresh memfd per message and with one kept.",
        "1-min load average at the start of each run and at the end: "
        + ", ".join(f"{x:.2f}" for x in loads),
    ]
    notes += [f"run {i + 1}: {describe(run)}" for i, run in enumerate(runs)]
    c.emit("m2m", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
