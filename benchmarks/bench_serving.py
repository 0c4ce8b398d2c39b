"""Serving: ``pool.batched`` against ``pool.apply`` with 64 concurrent callers (issue 28).

Run as ``python -m benchmarks.bench_serving``. A ``Pool(2)`` whose initializer loads
issue 28's model (``tanh(x @ W)``, ``W`` 512 x 512 float32; one BLAS thread per worker),
and 64 tasks that each send one 512-float row at a time, again as soon as the last is
answered:

- ``pool.apply(model_row, (x,))``: one task per row;
- ``pool.batched(model, max_batch_size=32, max_delay=0.005, stack=True)``: rows stacked
  into one shared-memory array per batch.

Targets: batched serves at least 5x the rows per second of apply, and its p99 latency
(from a caller's call to its answer) is at most ``max_delay`` plus twice one full batch's
compute (the model on 32 rows, timed inside a worker). Rounds alternate between the two
so that load from the machine's other users lands on both alike; rows/s is the median
round's, the p99 over every batched call of the run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the pool is the parallelism

from benchmarks import _common as c

CALLERS = 64
MAX_BATCH = 32
MAX_DELAY = 0.005


async def round_(call: object, per_caller: int, latencies: list[float]) -> float:
    """Seconds per row for ``CALLERS`` tasks each making ``per_caller`` calls."""
    import anyio
    import numpy as np

    from benchmarks._targets_serving import DIM

    rows = np.random.default_rng(0).standard_normal((CALLERS, DIM)).astype(np.float32)

    async def caller(i: int) -> None:
        x = rows[i]
        for _ in range(per_caller):
            t0 = c.now()
            y = await call(x)  # type: ignore[operator]
            latencies.append(c.now() - t0)
            assert y.shape == (DIM,)

    t0 = c.now()
    async with anyio.create_task_group() as tg:
        for i in range(CALLERS):
            tg.start_soon(caller, i)
    return (c.now() - t0) / (CALLERS * per_caller)


async def main() -> None:
    import aiomp
    from benchmarks._targets_serving import batch_compute, load, model, model_row

    rounds, per_caller = c.reps(5, 2), c.reps(40, 10)
    apply_s: list[float] = []
    batched_s: list[float] = []
    lat_apply: list[float] = []
    lat_batched: list[float] = []
    async with aiomp.Pool(2, initializer=load, grace_period=1.0) as pool:
        b = pool.batched(model, max_batch_size=MAX_BATCH, max_delay=MAX_DELAY, stack=True)

        async def one_apply(x: object) -> object:
            return await pool.apply(model_row, (x,))

        await round_(one_apply, 2, [])  # warm-up: both workers up, functions defined
        await round_(b, 2, [])
        for _ in range(rounds):
            apply_s.append(await round_(one_apply, per_caller, lat_apply))
            batched_s.append(await round_(b, per_caller, lat_batched))
        compute = await pool.apply(batch_compute, (MAX_BATCH, 50))
        stats = pool.statistics()
    a, base = c.median(batched_s), c.median(apply_s)
    lat_batched.sort()
    lat_apply.sort()
    p99 = lat_batched[int(0.99 * (len(lat_batched) - 1))]
    p99_apply = lat_apply[int(0.99 * (len(lat_apply) - 1))]
    budget = MAX_DELAY + 2 * compute
    rows = [
        c.row(
            f"time per row, {CALLERS} concurrent callers, Pool(2): pool.batched(stack=True)",
            a,
            base,
            "pool.apply, one task per row",
            c.faster(5),
            f"{1 / a:,.0f} rows/s vs {1 / base:,.0f} rows/s",
        ),
        c.row(
            "p99 latency of a batched call",
            p99,
            budget,
            f"max_delay {MAX_DELAY * 1e3:g} ms + 2 x one full batch's compute "
            f"({c.fmt_time(compute)})",
            c.at_most(1.0),
            f"apply's p99: {c.fmt_time(p99_apply)}",
        ),
    ]
    notes = [
        f"serving: {rounds} alternating rounds per variant of {CALLERS} callers x "
        f"{per_caller} calls; rows/s from the median round; p99 over all "
        f"{len(lat_batched)} batched calls; max_batch_size {MAX_BATCH}, max_delay "
        f"{MAX_DELAY * 1e3:g} ms; {stats.completed} tasks in all; one BLAS thread per worker."
    ]
    c.emit("serving", rows, notes)


if __name__ == "__main__":
    import anyio

    c.allow_bytecode()
    anyio.run(main)
