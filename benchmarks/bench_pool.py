"""Pool: the round trip of one trivial task, and a map of 10,000 trivial items.

Run as ``python -m benchmarks.bench_pool``. Every pool has one worker; the parent is on
one core and the worker on the other (the task pins its process on first use).

- ``await pool.apply(trivial)``: <= 1.2x the raw async socketpair floor; >= 1.3x faster
  than ``anyio.to_process.run_sync(trivial)``; >= 2x faster than a ``ProcessPoolExecutor``
  through ``loop.run_in_executor``.
- ``await pool.apply(trivial)`` with ``max_memory`` set (its check between tasks, issue
  30): <= 1.1x ``apply`` without it.
- ``await pool.map(trivial, range(10_000))``: >= 10x aiomultiprocess ``Pool.map``'s
  throughput; <= 0.6x the time of ``multiprocessing.Pool.map`` (default chunksize).

Rows marked ``info`` bound those targets: apply's CPU per round trip (parent + worker)
against the floor's (parent + echo child), and a compute floor for map, the calls and the
pickling of their results timed inside one worker, against ``multiprocessing.Pool.map``.

Imports are absolute: anyio's worker re-runs this file (``runpy.run_path``) as
``__mp_main__``, where relative imports would fail.
"""

from __future__ import annotations

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import compute_floor, trivial, trivial_coro

N_MAP = 10_000
APPLY, APPLY_MAX_MEMORY = "aiomp Pool.apply", "aiomp Pool.apply, max_memory set"
MAP = "aiomp Pool.map"


class AnyioToProcess(h.Variant):
    name = "anyio.to_process.run_sync"

    async def once(self) -> None:
        import anyio.to_process

        await anyio.to_process.run_sync(trivial)


class Executor(h.Variant):
    name = "ProcessPoolExecutor via run_in_executor"

    async def start(self) -> None:
        import asyncio
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.loop = asyncio.get_running_loop()
        self.ex = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    async def once(self) -> None:
        await self.loop.run_in_executor(self.ex, trivial)

    async def stop(self) -> None:
        self.ex.shutdown()


# -- map ------------------------------------------------------------------------------


class AiomultiprocessMap(h.AiomultiprocessPool):
    name = "aiomultiprocess Pool.map"
    budget = None

    async def once(self) -> None:
        out = await self.pool.map(trivial_coro, range(N_MAP))
        assert len(out) == N_MAP


class MpPoolMap(h.Variant):
    name = "multiprocessing.Pool.map"
    is_async = False

    async def start(self) -> None:
        import multiprocessing

        self.pool = multiprocessing.get_context("spawn").Pool(1)

    def once_sync(self) -> None:
        out = self.pool.map(trivial, range(N_MAP))
        assert len(out) == N_MAP

    async def stop(self) -> None:
        self.pool.terminate()
        self.pool.join()


class ComputeFloor(MpPoolMap):
    """Not a pool's map: the time a worker takes for :func:`compute_floor` (the calls of a
    map of ``N_MAP`` items and the pickling of their results), timed inside the worker of a
    one-process ``multiprocessing.Pool`` started for it."""

    name = "compute floor"

    async def batch(self, n: int) -> list[float]:
        return [self.pool.apply(compute_floor, (N_MAP,)) for _ in range(n)]


async def main() -> None:
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    pinning = c.pin_parent()
    missing = c.aiomp_missing("_pool")

    # -- apply round trip ----------------------------------------------------------------
    # Many short batches: the machine's speed drifts within seconds, and alternating often
    # spreads a drift over every variant alike.
    batches, n = c.reps(20, 2), c.reps(120, 100)
    floor, apply_ = h.SocketFloor(), h.PoolCalls(APPLY, h.aiomp_pool(), cpu=True)
    variants: list[h.Variant] = [floor, AnyioToProcess(), Executor()]
    if missing is None:
        # max_memory: the workers check their memory between tasks (a limit never reached)
        variants[:0] = [apply_, h.PoolCalls(APPLY_MAX_MEMORY, h.aiomp_pool(max_memory=1 << 40))]
    s = await h.interleave(variants, batches, n)
    med = {k: c.median(v) for k, v in s.items()}
    a, missing_note = med.get(APPLY), missing or ""
    what = "Pool.apply(trivial) round trip"
    for base, base_name, target in (
        (h.SocketFloor.name, "raw async socketpair", c.at_most(1.2)),
        (AnyioToProcess.name, AnyioToProcess.name, c.faster(1.3)),
        (Executor.name, Executor.name, c.faster(2)),
    ):
        rows.append(c.row(what, a, med[base], base_name, target, missing_note))
    a_mm = med.get(APPLY_MAX_MEMORY)
    rows.append(c.row(f"{what}, max_memory set", a_mm, a, APPLY, c.at_most(1.1), missing_note))
    floor_cpu, apply_cpu = floor.cpu_medians(), apply_.cpu_medians()
    if floor_cpu is not None and apply_cpu is not None and a is not None:
        wall = a / med[h.SocketFloor.name]
        split = f"{apply_cpu[0] * 1e6:.1f} µs parent + {apply_cpu[1] * 1e6:.1f} µs worker vs "
        split += f"{floor_cpu[0] * 1e6:.1f} µs parent + {floor_cpu[1] * 1e6:.1f} µs child"
        what = "Pool.apply(trivial), CPU per round trip (parent + worker)"
        base = "raw async socketpair (parent + echo child)"
        note = f"{split}; wall-clock {wall:.2f}x"
        rows.append(c.row(what, sum(apply_cpu), sum(floor_cpu), base, None, note))

    # -- map ------------------------------------------------------------------------------
    # Many maps: each takes a few ms, and under load one in three or so meets a stall of
    # several ms (a wake-up that waits for a core); with 15 the same tree's ratio to
    # multiprocessing ranged 0.76x-1.82x over runs at a 1-min load of 10-16.
    mb = c.reps(61, 3)
    maps: list[h.Variant] = [MpPoolMap(), ComputeFloor()]
    if missing is None:
        maps.insert(0, h.PoolCalls(MAP, h.aiomp_pool(), n_map=N_MAP))
    s = await h.interleave(maps, mb, 1, warmup=1)
    # aiomultiprocess alone: its loop polls every 5 ms and would slow the others.
    have_amp = c.have("aiomultiprocess")
    if have_amp:
        s.update(await h.interleave([AiomultiprocessMap()], c.reps(3, 1), 1, warmup=0))
    else:
        notes.append("aiomultiprocess not installed: its row is skipped")
    med = {k: c.median(v) for k, v in s.items()}
    a, mp, mp_name = med.get(MAP), med[MpPoolMap.name], MpPoolMap.name + " (default chunksize)"
    what = f"Pool.map(trivial, range({N_MAP:_}))"
    if have_amp:
        amp = AiomultiprocessMap.name
        rows.append(c.row(what, a, med[amp], amp, c.faster(10), missing_note))
    rows.append(c.row(what, a, mp, mp_name, c.at_most(0.6), missing_note))
    floor_map = med[ComputeFloor.name]
    what = f"compute floor: list(map(trivial, range({N_MAP:_}))) + pickle.dumps + loads"
    note = "bounds the 0.6x target: a pool's map cannot take less"
    if a is not None:
        note += f"; aiomp's map is {a / floor_map:.2f}x this floor"
    rows.append(c.row(f"{what} of the results, in one worker", floor_map, mp, mp_name, None, note))
    notes.append(
        f"pool: {pinning}; one worker per pool; loop {h.loop_name()}; apply: median of "
        f"{batches * n} round trips per variant in {batches} alternating batches; map: "
        f"median of {mb} maps (aiomultiprocess: {len(s.get(AiomultiprocessMap.name, []))}, "
        "run alone); the compute floor: median of as many calls, timed inside the worker of "
        "its own one-process multiprocessing.Pool, alternating with the maps."
    )
    c.emit("pool", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
