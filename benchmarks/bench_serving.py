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

On the same pool:

- **A lone call on an idle pool**: one caller, one call at a time, batched against
  ``apply`` (alternating rounds, medians): the batched call must cost no more than
  ``apply`` plus 2 ms (it must not wait ``max_delay`` for company no one brings).
- **Against the usual executors**: the same 64 callers through a ``ThreadPoolExecutor(2)``
  and a ``ProcessPoolExecutor(2)`` (``run_in_executor``, one call per row), rounds
  alternating with batched ones: batched must serve more rows per second than the
  process pool. The threads are a reference only: this model is one small matmul that
  releases the GIL, which threads run with no inter-process cost at all; a model that
  holds the GIL, or may crash the process, is what a process pool is for.
- **Batch fill under a burst while the workers are busy**: both workers held by a
  0.25 s task while 320 callers (10 full batches' worth) arrive spread over 0.2 s; the
  mean rows per batch (rows / batched tasks) must be at least 0.9x ``max_batch_size``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the pool is the parallelism


from benchmarks import _common as c

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CALLERS = 64
MAX_BATCH = 32
MAX_DELAY = 0.005
#: The burst: callers, the seconds over which they arrive, and how long the workers are
#: busy (longer: every call arrives while they are).
BURST, BURST_OVER, BUSY = 10 * MAX_BATCH, 0.2, 0.25
#: How much a lone batched call may cost over apply's.
LONE_SLACK = 0.002


def inputs(seed: int, *shape: int) -> Any:
    """Random float32 rows of the model's width, of ``shape`` (none: one row)."""
    import numpy as np

    from benchmarks._targets_serving import DIM

    return np.random.default_rng(seed).standard_normal((*shape, DIM)).astype(np.float32)


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))]


async def round_(call: object, per_caller: int, latencies: list[float]) -> float:
    """Seconds per row for ``CALLERS`` tasks each making ``per_caller`` calls."""
    import anyio

    from benchmarks._targets_serving import DIM

    rows = inputs(0, CALLERS)

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


async def lone(call: object, n: int) -> float:
    """Median seconds of ``n`` calls made one at a time by one caller."""
    x = inputs(2)
    times = []
    for _ in range(n):
        t0 = c.now()
        await call(x)  # type: ignore[operator]
        times.append(c.now() - t0)
    return c.median(times)


async def burst(pool: object, b: object) -> float:
    """Mean rows per batch of a burst of ``BURST`` calls arriving over ``BURST_OVER``
    seconds while both workers are busy for ``BUSY`` seconds."""
    import time

    import anyio

    rows = inputs(3, BURST)
    before = pool.statistics().completed  # type: ignore[attr-defined]

    async def caller(i: int) -> None:
        await anyio.sleep(i * BURST_OVER / BURST)
        await b(rows[i])  # type: ignore[operator]

    async with anyio.create_task_group() as tg:
        for _ in range(2):  # both workers busy
            tg.start_soon(pool.apply, time.sleep, (BUSY,))  # type: ignore[attr-defined]
        await anyio.lowlevel.checkpoint()
        for i in range(BURST):
            tg.start_soon(caller, i)
    batches = pool.statistics().completed - before - 2  # type: ignore[attr-defined]
    return BURST / batches


async def executors(b: object, rounds: int, per_caller: int) -> dict[str, list[float]]:
    """Seconds per row of the same callers through a ``ThreadPoolExecutor(2)`` (the model
    in this process: numpy's matmul releases the GIL) and a ``ProcessPoolExecutor(2)``
    (one task per row), rounds alternating with ``b``'s."""
    import asyncio
    import functools
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    from benchmarks._targets_serving import load, model_row

    loop = asyncio.get_running_loop()
    load()  # the threads' copy of the model
    out: dict[str, list[float]] = {"batched": [], "threads": [], "ppe": []}
    with ThreadPoolExecutor(2) as tpe, ProcessPoolExecutor(2, initializer=load) as ppe:
        one_thread = functools.partial(loop.run_in_executor, tpe, model_row)
        one_ppe = functools.partial(loop.run_in_executor, ppe, model_row)
        await round_(one_ppe, 2, [])  # warm-up: both processes up
        for _ in range(rounds):
            out["batched"].append(await round_(b, per_caller, []))
            out["threads"].append(await round_(one_thread, per_caller, []))
            out["ppe"].append(await round_(one_ppe, per_caller, []))
    return out


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
        lone_apply: list[float] = []
        lone_batched: list[float] = []
        for _ in range(rounds):
            lone_apply.append(await lone(one_apply, c.reps(200, 40)))
            lone_batched.append(await lone(b, c.reps(200, 40)))
        fills = [await burst(pool, b) for _ in range(c.reps(3, 1))]
        others = await executors(b, rounds, per_caller)
        compute = await pool.apply(batch_compute, (MAX_BATCH, 50))
        stats = pool.statistics()
    a, base = c.median(batched_s), c.median(apply_s)
    budget = MAX_DELAY + 2 * compute
    alone, alone_apply = c.median(lone_batched), c.median(lone_apply)
    fill = c.median(fills)
    what = f"time per row, {CALLERS} concurrent callers, Pool(2): pool.batched(stack=True)"
    rates = f"{1 / a:,.0f} rows/s vs {1 / base:,.0f} rows/s"
    rows = [c.row(what, a, base, "pool.apply, one task per row", c.faster(5), rates)]
    compute_text = f"2 x one full batch's compute ({c.fmt_time(compute)})"
    base_text = f"max_delay {MAX_DELAY * 1e3:g} ms + {compute_text}"
    note = f"apply's p99: {c.fmt_time(p99(lat_apply))}"
    what = "p99 latency of a batched call"
    rows.append(c.row(what, p99(lat_batched), budget, base_text, c.at_most(1.0), note))
    base_text = f"pool.apply's time ({c.fmt_time(alone_apply)}) + {LONE_SLACK * 1e3:g} ms"
    note = f"batched / apply: {alone / alone_apply:.2f}x; max_delay {MAX_DELAY * 1e3:g} ms"
    what = "a lone call on an idle Pool(2), one caller: pool.batched(stack=True)"
    rows.append(c.row(what, alone, alone_apply + LONE_SLACK, base_text, c.at_most(1.0), note))
    what = f"mean rows per batch, {BURST} callers arriving over {BURST_OVER * 1e3:g} ms"
    note = f"batches of {min(fills):.1f} to {max(fills):.1f} rows in {len(fills)} bursts"
    what += " while both workers are busy"
    target = c.at_least(0.9)
    rows.append(c.row(what, fill, float(MAX_BATCH), "max_batch_size", target, note, unit="rows"))
    again = c.median(others["batched"])
    per_row = f"time per row, {CALLERS} concurrent callers: pool.batched(stack=True)"
    for name, what, target in (
        ("threads", "ThreadPoolExecutor(2), the model in the parent", None),
        ("ppe", "ProcessPoolExecutor(2), one task per row", c.faster(1)),
    ):
        t = c.median(others[name])
        rates = f"{1 / again:,.0f} rows/s vs {1 / t:,.0f} rows/s"
        rows.append(c.row(per_row, again, t, what, target, rates))
    notes = [
        f"serving: {rounds} alternating rounds per variant of {CALLERS} callers x "
        f"{per_caller} calls; rows/s from the median round; p99 over all "
        f"{len(lat_batched)} batched calls; max_batch_size {MAX_BATCH}, max_delay "
        f"{MAX_DELAY * 1e3:g} ms; {stats.completed} tasks in all; one BLAS thread per worker."
    ]
    c.emit("serving", rows, notes)


if __name__ == "__main__":
    c.run_main(main)
