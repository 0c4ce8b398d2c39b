"""Per-call throughput: 32 concurrent one-call tasks on two workers, idle and beside noisy
neighbours (docs/design.md section 4; issue 41).

Run as ``python -m benchmarks.bench_throughput``. One *burst* is 32 tasks started at once,
each a call of :func:`~benchmarks._targets_throughput.burn` (0.1, 1 or 5 ms of CPU time),
awaited together; its time is the burst's wall-clock time. Three pools, their bursts
alternating (the order reversed every batch), nothing pinned (the two workers and the
parent share the machine's cores, as a service's do):

- ``aiomp.Pool(2).apply``;
- ``ProcessPoolExecutor(2)`` through ``loop.run_in_executor`` (spawn);
- ``anyio.to_process.run_sync`` with a ``CapacityLimiter(2)`` (two workers: its default,
  ``os.cpu_count()``, would give it as many workers as the machine has CPUs).

Three conditions: *idle*; *beside the noisy neighbour* (one process spinning, two pipe
ping-pong pairs); *beside the heavier one* (two spinning, two pairs). Targets: aiomp's
burst no slower than either baseline's in every cell, and at least 1.1x faster than PPE's
at 5 ms beside either neighbour.

Rows marked ``info`` give each pool's *busy fraction*: its workers' CPU time during the
bursts over twice the bursts' wall-clock time (1.0: both workers computed all the time),
and its *floor efficiency*: the two-worker floor (32 x the task's CPU time / 2) over the
burst's time. The task is CPU time, not a wall-clock spin, so that neither can pass 100 %
(see docs/decisions/0065-tasks-queued-ahead.md for the anomaly this rules out).

Imports are absolute: anyio's worker re-runs this file (``runpy.run_path``) as
``__mp_main__``, where relative imports would fail.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets_throughput import burn, ping_pong, spin

TASKS = 32
WORKERS = 2
DURATIONS = (0.1, 1.0, 5.0)  # ms of CPU time per task


class Burst(h.Variant):
    """A burst of :data:`TASKS` concurrent calls of ``burn(ms)``."""

    ms = 1.0
    budget = None
    #: The workers' voluntary context switches per task, one figure per timed batch: a
    #: worker that waits for its next task blocks once (a load-independent count of how
    #: often workers waited on the parent).
    waits: list[float]

    async def timed_batch(self, n: int) -> list[float]:
        if not hasattr(self, "waits"):
            self.waits = []
        pids = self.pids()
        before = switches(pids)
        out = await super().timed_batch(n)
        self.waits.append((switches(pids) - before) / (len(out) * TASKS))
        return out

    async def call(self) -> None:
        raise NotImplementedError

    async def once(self) -> None:
        import anyio

        async with anyio.create_task_group() as tg:
            for _ in range(TASKS):
                tg.start_soon(self.call)


class AiompPool(Burst):
    name = "aiomp Pool(2).apply"

    async def start(self) -> None:
        import aiomp

        self.pool = aiomp.Pool(WORKERS, grace_period=1.0)
        await self.pool.__aenter__()

    def pids(self) -> list[int]:
        return self.pool.pids()

    async def call(self) -> None:
        await self.pool.apply(burn, (self.ms,))

    async def stop(self) -> None:
        await self.pool.__aexit__(None, None, None)


class Executor(Burst):
    name = "ProcessPoolExecutor(2)"

    async def start(self) -> None:
        import asyncio
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.loop = asyncio.get_running_loop()
        self.ex = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))

    def pids(self) -> list[int]:
        return list(self.ex._processes)  # (private: for their CPU time only)

    async def call(self) -> None:
        await self.loop.run_in_executor(self.ex, burn, self.ms)

    async def stop(self) -> None:
        self.ex.shutdown()


class AnyioToProcess(Burst):
    name = "anyio.to_process (2 workers)"
    seen = 0  # its worker processes after a measurement

    async def start(self) -> None:
        import anyio

        self.limiter = anyio.CapacityLimiter(WORKERS)

    def pids(self) -> list[int]:
        """anyio's workers: this process's children running ``anyio.to_process``."""
        out = []
        for pid in children(os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"anyio.to_process" in f.read():
                        out.append(pid)
            except OSError:
                pass
        return out

    async def call(self) -> None:
        import anyio.to_process

        await anyio.to_process.run_sync(burn, self.ms, limiter=self.limiter)


def switches(pids: list[int]) -> int:
    """Voluntary context switches of the processes ``pids`` so far, every thread."""
    return sum(
        int(line.split()[1])
        for text in h.thread_files(pids, "status")
        for line in text.splitlines()
        if line.startswith("voluntary_ctxt_switches")
    )


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


class Neighbour:
    """Processes that compete with the pools for the cores: ``spinners`` spinning and
    ``pairs`` pipe ping-pong pairs."""

    def __init__(self, spinners: int, pairs: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.procs: list[Any] = []
        fds: list[int] = []
        for _ in range(spinners):
            self.procs.append(ctx.Process(target=spin, daemon=True))
        for _ in range(pairs):
            a_r, b_w = os.pipe()
            b_r, a_w = os.pipe()
            self.procs.append(ctx.Process(target=ping_pong, args=(a_r, a_w, True), daemon=True))
            self.procs.append(ctx.Process(target=ping_pong, args=(b_r, b_w, False), daemon=True))
            fds += [a_r, b_w, b_r, a_w]
        for p in self.procs:
            p.start()
        for fd in fds:
            os.close(fd)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()


CONDITIONS: list[tuple[str, tuple[int, int]]] = [
    ("idle", (0, 0)),
    ("beside the noisy neighbour (1 spinner, 2 ping-pong pairs)", (1, 2)),
    ("beside the heavier neighbour (2 spinners, 2 ping-pong pairs)", (2, 2)),
]


async def measure(
    variants: list[Burst], ms: float
) -> tuple[dict[str, float], dict[str, float], int]:
    """Median burst time and busy fraction per variant; the bursts each had."""
    for v in variants:
        v.ms = ms
    floor_burst = TASKS * ms / 1e3 / WORKERS
    n = max(2, min(40, round(0.25 / floor_burst)))  # bursts per batch: about 0.25 s
    batches = c.reps(6, 2)
    s = await h.interleave(list(variants), batches, n, warmup=2)
    for v in variants:
        if isinstance(v, AnyioToProcess):
            v.seen = len(v.pids())  # its workers stay, idle, until the loop ends
    times = {k: c.median(v) for k, v in s.items()}
    busy: dict[str, float] = {}
    for v in variants:
        # cpu: (parent, workers) seconds per burst, per batch; the batch's median burst.
        fractions = [w / (WORKERS * times[v.name]) for _, w in v.cpu]
        busy[v.name] = c.median(fractions)
    return times, busy, batches * n


async def main() -> None:
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    counts: list[int] = []  # bursts per pool, per cell
    missing = c.aiomp_missing("_pool")
    for label, (spinners, pairs) in CONDITIONS:
        neighbour = Neighbour(spinners, pairs) if spinners or pairs else None
        try:
            for ms in DURATIONS:
                variants: list[Burst] = [Executor(), AnyioToProcess()]
                if missing is None:
                    variants.insert(0, AiompPool())
                times, busy, bursts = await measure(variants, ms)
                counts.append(bursts)
                a = times.get(AiompPool.name)
                what = f"{TASKS} x {ms:g} ms tasks, {label}"
                ppe_target = c.faster(1.1) if ms >= 5 and neighbour else c.at_most(1.0)
                rows.append(
                    c.row(what, a, times[Executor.name], Executor.name, ppe_target, missing or "")
                )
                rows.append(
                    c.row(
                        what,
                        a,
                        times[AnyioToProcess.name],
                        AnyioToProcess.name,
                        c.at_most(1.0),
                        missing or "",
                    )
                )
                floor = TASKS * ms / 1e3 / WORKERS
                info = (
                    "; ".join(
                        f"{v.name}: busy {busy[v.name]:.0%}, "
                        f"{floor / times[v.name]:.0%} of the floor, "
                        f"{c.median(v.waits):.2f} waits per task"
                        for v in variants
                    )
                    + "; anyio's worker processes: "
                    + ", ".join(str(v.seen) for v in variants if isinstance(v, AnyioToProcess))
                )
                rows.append(
                    c.row(
                        f"{what}: workers' busy fraction",
                        a,
                        floor,
                        "two-worker floor",
                        None,
                        info,
                    )
                )
        finally:
            if neighbour is not None:
                neighbour.stop()
    notes.append(
        f"throughput: nothing pinned; {TASKS} concurrent apply-like calls per burst, 2 workers "
        f"per pool; loop {h.loop_name()}; median burst of {c.reps(6, 2)} alternating batches "
        f"of about 0.25 s of bursts per pool ({min(counts)}-{max(counts)} bursts per cell); "
        "the task burns CPU time (time.thread_time), so no pool passes 100 % of the "
        "two-worker floor; anyio gets CapacityLimiter(2)."
    )
    c.emit("throughput", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
