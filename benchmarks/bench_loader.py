"""Data loading: ``aiomp.DataLoader`` against ``torch.utils.data.DataLoader``.

Run as ``python -m benchmarks.bench_loader``. The same dataset, batch size (64) and
workers (2) on both sides, persistent workers on both (one loader per side, kept over
:data:`EPOCHS` epochs of :func:`batches` batches), ``prefetch_factor=2`` on both, each
library's default collate, the consumer reading every batch whole (a sum). Two datasets:

- light: slicing a preloaded array (``Preloaded``: 3 x 32 x 32 float32 and a label per
  index): the loader's own overhead dominates;
- heavy: examples/data_loader.py's ``SyntheticImages`` (a seeded 3 x 64 x 64 image and a
  few arithmetic passes per sample).

aiomp is iterated async (``async for`` under asyncio) and sync (``for`` with no event
loop); torch with its ``for``. Time per batch is the median epoch after the first
(steady state) over its batches; the sides alternate, so a burst of load from the
machine's other users lands on all alike. The first batch: from creating the loader (and
entering it) to the first batch, with ``spawn`` and with ``fork`` on both sides. Resume:
aiomp's time to the first batch after ``load_state_dict`` at the middle of an epoch,
against starting at batch 0. A user's script: a fresh interpreter per loader
(:func:`fresh_first`), aiomp with its default start method against torch's fork, the
first batch and the PSS of the process tree after an epoch, quiet and beside the noisy
neighbour of bench_throughput. Unpinned; every ratio is taken within one run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from benchmarks import _common as c

BATCH = 64
WORKERS = 2
EPOCHS = 4


def batches() -> int:
    return c.reps(60, 12)


class Preloaded:
    """A map-style dataset over one preloaded array: a sample is a slice and a label."""

    def __init__(self, n: int) -> None:
        self.images = np.random.default_rng(0).random((n, 3, 32, 32), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.images[i], i % 10


def _touch(images: Any) -> float:
    return float(images.sum())


def _epochs(loop: Any, n: int) -> list[float]:
    """Seconds per batch of each epoch after the first, from ``loop()`` (one epoch)."""
    per = []
    for e in range(c.reps(EPOCHS, 2)):
        t0 = time.perf_counter()
        seen = loop()
        assert seen == n, (seen, n)
        if e:
            per.append((time.perf_counter() - t0) / n)
    return per


def torch_run(dataset: Any, n: int, method: str) -> list[float]:
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(
        dataset,
        BATCH,
        num_workers=WORKERS,
        persistent_workers=True,
        prefetch_factor=2,
        multiprocessing_context=method,
    )

    def loop() -> int:
        seen = 0
        for images, _labels in loader:
            _touch(images.numpy())
            seen += 1
        return seen

    per = _epochs(loop, n)
    loader = None  # its persistent workers shut down before the next side starts
    return per


def aiomp_sync_run(dataset: Any, n: int, method: str) -> list[float]:
    import aiomp

    with aiomp.DataLoader(
        dataset, BATCH, num_workers=WORKERS, prefetch_factor=2, start_method=method
    ) as loader:

        def loop() -> int:
            seen = 0
            for images, _labels in loader:
                _touch(images)
                seen += 1
            return seen

        return _epochs(loop, n)


def aiomp_async_run(dataset: Any, n: int, method: str) -> list[float]:
    import anyio

    import aiomp

    async def main() -> list[float]:
        per = []
        async with aiomp.DataLoader(
            dataset, BATCH, num_workers=WORKERS, prefetch_factor=2, start_method=method
        ) as loader:
            for e in range(c.reps(EPOCHS, 2)):
                t0 = time.perf_counter()
                seen = 0
                async for images, _labels in loader:
                    _touch(images)
                    seen += 1
                assert seen == n
                if e:
                    per.append((time.perf_counter() - t0) / n)
        return per

    return anyio.run(main)


def torch_first(dataset: Any, method: str) -> float:
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    loader: Any = DataLoader(
        dataset, BATCH, num_workers=WORKERS, persistent_workers=True,
        multiprocessing_context=method,
    )  # fmt: skip
    it = iter(loader)
    images, _ = next(it)
    first = time.perf_counter() - t0
    _touch(images.numpy())
    del it, loader, images
    return first


def aiomp_first(dataset: Any, method: str, state: dict[str, Any] | None = None) -> float:
    import aiomp

    t0 = time.perf_counter()
    with aiomp.DataLoader(dataset, BATCH, num_workers=WORKERS, start_method=method) as loader:
        if state is not None:
            loader.load_state_dict(state)
        for images, _ in loader:
            first = time.perf_counter() - t0
            _touch(images)
            break
    return first


def fresh_first(lib: str, method: str) -> None:
    """Run as a user's script (``--fresh LIB METHOD``, in a new interpreter that imports
    torch and the loader class first): print the seconds from making the loader to its
    first batch, then the PSS of the process tree (KiB) once the epoch is read, the
    loader still open. A full collection first, on both sides: else whichever side
    allocates the collection due after torch's import pays it (0.2 s) in its timing."""
    import gc

    from torch.utils.data import DataLoader as TorchLoader

    from aiomp import DataLoader
    from benchmarks.bench_throughput import children
    from examples.data_loader import SyntheticImages

    dataset: Any = SyntheticImages(4 * WORKERS * BATCH)
    opt: dict[str, Any] = {} if method == "default" else {"multiprocessing_context": method}
    gc.collect()
    t0 = time.perf_counter()
    if lib == "torch":
        loader: Any = TorchLoader(
            dataset, BATCH, num_workers=WORKERS, persistent_workers=True, **opt
        )
    else:
        loader = DataLoader(dataset, BATCH, num_workers=WORKERS, **opt)
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    pids, kib = [os.getpid()], 0
    while pids:
        pid = pids.pop()
        pids += children(pid)
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kib += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    print(first, kib)


def fresh(side: str, method: str) -> tuple[float, float]:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "benchmarks.bench_loader", "--fresh", side, method]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    first, kib = out.stdout.split()[-2:]
    return float(first), float(kib)


def user_scripts(has_torch: bool) -> list[dict[str, object]]:
    """First batch and PSS of a fresh script: aiomp's default start method against
    torch's fork (its default on Linux), quiet and beside the noisy neighbour."""
    from benchmarks.bench_throughput import Neighbour

    if not has_torch:
        return []
    rows = []
    for cond, neighbour in (("quiet", None), ("beside the noisy neighbour", (1, 2))):
        noisy = None if neighbour is None else Neighbour(*neighbour)
        got: dict[str, list[tuple[float, float]]] = {"aiomp": [], "torch": []}
        try:
            for i in range(c.reps(5, 1)):
                for side in ("aiomp", "torch")[:: 1 if i % 2 == 0 else -1]:
                    got[side].append(fresh(side, "default" if side == "aiomp" else "fork"))
        finally:
            if noisy is not None:
                noisy.stop()
        (a_t, a_m), (t_t, t_m) = (
            (c.median(x for x, _ in got[s]), c.median(m for _, m in got[s]) / 1024)
            for s in ("aiomp", "torch")
        )
        base = "torch DataLoader, fork (a fresh script importing torch)"
        rows.append(c.row(f"first batch, default start method, {cond}", a_t, t_t, base,
                          c.at_most(1.0)))  # fmt: skip
        rows.append(c.row(f"PSS of the process tree after an epoch, {cond}", a_m, t_m, base,
                          c.at_most(1.1), unit="MiB"))  # fmt: skip
    return rows


RUNNERS = {"aiomp async": aiomp_async_run, "aiomp sync": aiomp_sync_run, "torch": torch_run}


def steady(dataset: Any, n: int, has_torch: bool) -> dict[str, float]:
    """Median seconds per batch of each variant, alternating variants round by round."""
    variants = [v for v in RUNNERS if has_torch or v != "torch"]
    got: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(c.reps(2, 1)):
        for v in variants if i % 2 == 0 else variants[::-1]:
            got[v].extend(RUNNERS[v](dataset, n, "fork"))
    return {v: c.median(xs) for v, xs in got.items()}


def firsts(dataset: Any, has_torch: bool) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], list[float]] = {}
    for method in ("spawn", "fork"):
        for _ in range(c.reps(3, 1)):
            out.setdefault(("aiomp", method), []).append(aiomp_first(dataset, method))
            if has_torch:
                out.setdefault(("torch", method), []).append(torch_first(dataset, method))
    return {k: c.median(v) for k, v in out.items()}


def resume(dataset: Any, n: int) -> tuple[float, float]:
    at0, atk = [], []
    for _ in range(c.reps(3, 1)):
        at0.append(aiomp_first(dataset, "fork"))
        atk.append(aiomp_first(dataset, "fork", {"epoch": 0, "batches": n // 2, "seed": 0}))
    return c.median(atk), c.median(at0)


def main() -> None:
    from benchmarks import bench_loader as me  # a module workers can import (not __main__)
    from examples.data_loader import SyntheticImages

    n = batches()
    has_torch = c.have("torch")
    datasets = {"light": me.Preloaded(n * BATCH), "heavy": SyntheticImages(n * BATCH)}
    rows: list[dict[str, object]] = []
    notes = [f"1-min load average at the start: {os.getloadavg()[0]:.2f}"]
    base = "torch DataLoader, fork, persistent workers"
    for name, dataset in datasets.items():
        t = steady(dataset, n, has_torch)
        notes.append(f"{name}: " + ", ".join(f"{v} {1 / s:.1f} batches/s" for v, s in t.items()))
        target = c.faster(2) if name == "light" else c.at_most(1.0)
        for v in ("aiomp async", "aiomp sync"):
            rows.append(
                c.row(
                    f"time per batch, {name} samples, {v} ({n} batches of {BATCH}, "
                    f"{WORKERS} workers)",
                    t[v],
                    t.get("torch"),
                    base,
                    target,
                )
            )
    f = firsts(datasets["heavy"], has_torch)
    for method, target in (("spawn", c.at_most(0.5)), ("fork", c.at_most(1.0))):
        rows.append(
            c.row(
                f"time to the first batch, {method}",
                f[("aiomp", method)],
                f.get(("torch", method)),
                f"torch DataLoader, {method}",
                target,
            )
        )
    rows += user_scripts(has_torch)
    atk, at0 = resume(datasets["heavy"], n)
    rows.append(
        c.row(
            f"first batch resuming at batch {n // 2}", atk, at0, "aiomp at batch 0", c.at_most(1.2)
        )
    )
    c.emit("loader", rows, notes)


if __name__ == "__main__":
    import sys

    c.allow_bytecode()
    if "--fresh" in sys.argv:
        fresh_first(*sys.argv[sys.argv.index("--fresh") + 1 :][:2])
    else:
        main()
