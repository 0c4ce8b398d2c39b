"""Data loading: examples/data_loader.py against ``torch.utils.data.DataLoader``.

Run as ``python -m benchmarks.bench_loader``. The same dataset (examples/data_loader.py's
``SyntheticImages``: a seeded 3 x 64 x 64 float32 image and a label per index, a few
arithmetic passes), the same batch size (64), 2 workers each, passes of 80 batches, the
consumer reading every batch whole (a sum):

- torch: ``DataLoader(dataset, batch_size=64, num_workers=2)``, its default collate
  (``torch.stack`` into a fresh shared storage in the worker) and its default start
  method here (fork);
- aiomp: the example's loader with ``start_method="fork"`` (like for like with torch),
  batches collated into ``aiomp.empty`` arrays, and again into plain numpy arrays that
  ``put`` copies into shared memory. Each loader has its own default number of batches
  in flight: 4 for torch (``prefetch_factor=2`` per worker), 8 for the example, whose
  in-order stream runs dry with 4 (torch's gains nothing from more: its CPU per batch
  bounds it).

Time per batch is a pass's steady state, from its first batch to its last. A run is
:data:`ROUNDS` short passes per loader, alternating, so that a burst of load from the
machine's other users lands on every loader alike; each loader's figure is the median of
its passes. The time to the first batch is measured apart, from :data:`STARTS` short
starts per loader and run (start, take one batch, leave), alternating, median per run.
Unpinned: this is throughput of three processes on the machine's cores, for both
libraries alike. Every ratio is taken within one run; the rows show the run with the
median ratio, and the notes give all :data:`RUNS` runs and the load average.

Wall time on a shared machine measures the other users as much as the loaders, so each
pass also records the CPU time it cost, parent and workers together (``getrusage`` of
this process and of its reaped children): with three processes on two busy cores,
batches/s is bounded by the cores over that figure, whatever else runs.
"""

from __future__ import annotations

import os
import resource

from benchmarks import _common as c

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

BATCH = 64
WORKERS = 2
RUNS = 3
ROUNDS = 4
STARTS = 5


def batches() -> int:
    return c.reps(80, 20)


def _touch(images: object) -> float:
    # a consumer reads the whole batch (as a copy to a device would): the same for all
    return float(images.sum())  # type: ignore[attr-defined]


def cpu_seconds() -> float:
    """CPU time of this process and of its children reaped so far."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def torch_pass(dataset: object, n: int) -> tuple[float, float, float]:
    """(seconds to the first batch, seconds from it to the last, CPU seconds of the whole
    pass) with torch's DataLoader."""
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)  # type: ignore[arg-type]
    cpu0 = cpu_seconds()
    t0 = c.now()
    first = None
    seen = 0
    for images, _labels in loader:
        if first is None:
            first = c.now() - t0
        _touch(images.numpy())
        seen += 1
    assert seen == n and first is not None
    total = c.now() - t0 - first  # steady state: the first batch to the last
    # The exhausted iterator has joined its workers; its queues' feeder threads end when
    # the queues are collected. Wait for them: the next fork must not inherit them.
    del loader, images, _labels
    _join_threads()
    return first, total, cpu_seconds() - cpu0


async def aiomp_pass(dataset: object, n: int, shared: bool) -> tuple[float, float, float]:
    from examples.data_loader import DataLoader

    cpu0 = cpu_seconds()
    t0 = c.now()
    first = None
    seen = 0
    async with DataLoader(
        dataset,
        BATCH,
        num_workers=WORKERS,
        shared=shared,  # type: ignore[arg-type]
        start_method="fork",
        grace_period=1.0,
    ) as loader:
        async for images, _labels in loader:
            if first is None:
                first = c.now() - t0
            _touch(images)
            seen += 1
            del images, _labels  # as torch's loop: hold one batch at a time
    assert seen == n and first is not None
    total = c.now() - t0 - first  # steady state: the first batch to the last
    return first, total, cpu_seconds() - cpu0


def _join_threads() -> None:
    import gc
    import threading

    gc.collect()
    for t in threading.enumerate():
        if t is not threading.main_thread():
            t.join(10)


def torch_first(dataset: object) -> float:
    """Seconds from creating torch's iterator to its first batch (then it shuts down)."""
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS)  # type: ignore[arg-type]
    t0 = c.now()
    it = iter(loader)
    images, _labels = next(it)
    first = c.now() - t0
    _touch(images.numpy())
    del it, loader, images, _labels  # shuts the workers down, joins them
    _join_threads()
    return first


async def aiomp_first(dataset: object, shared: bool) -> float:
    from examples.data_loader import DataLoader

    t0 = c.now()
    async with DataLoader(
        dataset,
        BATCH,
        num_workers=WORKERS,
        shared=shared,  # type: ignore[arg-type]
        start_method="fork",
        grace_period=1.0,
    ) as loader:
        async for images, _labels in loader:
            first = c.now() - t0
            _touch(images)
            break
    return first


async def main() -> None:
    from examples.data_loader import SyntheticImages

    n = batches()
    dataset = SyntheticImages(n * BATCH)
    has_torch = c.have("torch")
    variants = ["aiomp.empty", "aiomp numpy"] + (["torch"] if has_torch else [])
    runs: list[dict[str, tuple[float, float, float]]] = []
    loads: list[float] = []
    for r in range(c.reps(RUNS, 1)):
        loads.append(os.getloadavg()[0])
        steady: dict[str, list[float]] = {v: [] for v in variants}
        cpu = dict.fromkeys(variants, 0.0)
        firsts: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(c.reps(ROUNDS, 1)):
            # short passes, alternating, so a burst of load lands on every loader alike
            for v in variants if i % 2 == 0 else variants[::-1]:
                if v == "torch":
                    _, total, used = torch_pass(dataset, n)
                else:
                    _, total, used = await aiomp_pass(dataset, n, shared=v == "aiomp.empty")
                steady[v].append(total / (n - 1))
                cpu[v] += used / n
            print(
                f"  round {i + 1}: "
                + ", ".join(f"{v} {1 / steady[v][-1]:.1f} batches/s" for v in variants),
                flush=True,
            )
        for i in range(c.reps(STARTS, 1)):
            for v in variants if i % 2 == 0 else variants[::-1]:
                firsts[v].append(
                    torch_first(dataset)
                    if v == "torch"
                    else await aiomp_first(dataset, shared=v == "aiomp.empty")
                )
        # per loader: (first batch, time per batch, CPU per batch), medians over the run
        got = {
            v: (c.median(firsts[v]), c.median(steady[v]), cpu[v] / c.reps(ROUNDS, 1))
            for v in variants
        }
        runs.append(got)
        print(
            f"run {r + 1}: "
            + ", ".join(
                f"{v} {1 / t[1]:.1f} batches/s, first {t[0] * 1e3:.0f} ms, "
                f"CPU {t[2] * 1e3:.2f} ms/batch"
                for v, t in got.items()
            ),
            flush=True,
        )
    loads.append(os.getloadavg()[0])

    def median_run(key: str, base: str, which: int) -> tuple[float, float, list[float]]:
        """(aiomp, baseline) of the run with the median ratio, and all runs' ratios."""
        ratios = sorted((run[key][which] / run[base][which], i) for i, run in enumerate(runs))
        _, i = ratios[len(ratios) // 2]
        return runs[i][key][which], runs[i][base][which], [x for x, _ in ratios]

    def spread(ratios: list[float]) -> str:
        return f"runs {', '.join(f'{x:.2f}x' for x in ratios)}"

    rows: list[dict[str, object]] = []
    per = f"{n} batches of {BATCH}, {WORKERS} workers"
    if has_torch:
        measures = [
            (1, "time per batch, {key} batches ({per})", c.faster(2)),
            (2, "CPU time per batch, all processes, {key} batches", None),
            (0, "time to the first batch, {key} batches", c.at_most(1.0)),
        ]
        for index, what, target in measures:
            for key in ("aiomp.empty", "aiomp numpy"):
                a, b, ratios = median_run(key, "torch", index)
                rows.append(
                    c.row(
                        what.format(key=key, per=per),
                        a,
                        b,
                        "torch DataLoader, fork",
                        target,
                        spread(ratios),
                    )
                )
    else:
        rows.append(
            c.row(
                "time per batch vs torch", None, None, "torch", c.faster(2), "torch not installed"
            )
        )
    a, b, ratios = median_run("aiomp.empty", "aiomp numpy", 1)
    rows.append(
        c.row(
            "time per batch, aiomp.empty batches",
            a,
            b,
            "aiomp, numpy batches copied at put",
            None,
            spread(ratios),
        )
    )
    a, b, ratios = median_run("aiomp.empty", "aiomp numpy", 2)
    rows.append(
        c.row(
            "CPU time per batch, aiomp.empty batches",
            a,
            b,
            "aiomp, numpy batches copied at put",
            None,
            spread(ratios),
        )
    )
    notes = [
        f"loader: {c.reps(RUNS, 1)} runs; in each, {c.reps(ROUNDS, 1)} passes of {n} "
        f"batches of {BATCH} per loader, alternating; time per batch: the first batch to "
        "the last (steady state), median of the run's passes; CPU time: parent and workers "
        "together over whole passes (start included) per batch; time to the first batch: "
        f"median of {c.reps(STARTS, 1)} short starts per loader and run; each row is the "
        "run with the median ratio; unpinned.",
        f"1-min load average at the start of each run and at the end: "
        f"{', '.join(f'{x:.2f}' for x in loads)}",
    ]
    for i, run in enumerate(runs):
        notes.append(
            f"run {i + 1}: "
            + "; ".join(
                f"{v} {1 / t[1]:.1f} batches/s, first batch {t[0] * 1e3:.0f} ms, "
                f"CPU {t[2] * 1e3:.2f} ms/batch"
                for v, t in run.items()
            )
        )
    c.emit("loader", rows, notes)


if __name__ == "__main__":
    import anyio

    c.allow_bytecode()
    anyio.run(main)
