"""``aiomp.run_sync``: one trivial call, warm and first, against anyio and trio-parallel.

Run as ``python -m benchmarks.bench_run_sync``. Targets (docs/design.md section 4, issue 29):

- warm: ``await aiomp.run_sync(trivial)`` at least 1.3x faster than
  ``anyio.to_process.run_sync(trivial)`` on asyncio, and than
  ``trio_parallel.run_sync(trivial)`` on trio;
- first call (no worker started yet, every import done): no slower than anyio's first
  call; trio-parallel's first call is shown for information;
- a function that travels by value (a lambda) no slower, called again and again, than one
  that travels by reference (a module's function): both are sent once per worker.

Warm calls: the parent on one core, the workers on the other (``trivial`` pins its
process on first use; the default pool then has one worker, as the parent may use one
core), batches alternating. First calls: each in a fresh interpreter, unpinned, the
variants alternating; timed from just before the call to its result, imports done.

Imports are absolute: anyio's worker re-runs this file (``runpy.run_path``) as
``__mp_main__``, where relative imports would fail.
"""

from __future__ import annotations

import subprocess
import sys

from benchmarks import _common as c
from benchmarks import _harness as h
from benchmarks._targets import trivial

#: travels by value: a lambda, which no child can import by name
by_value = lambda x=None: trivial(x)  # noqa: E731


class RunSync(h.Variant):
    name = "aiomp.run_sync"
    fn = staticmethod(trivial)

    def pids(self) -> list[int]:
        from aiomp._first import default

        pool = default.default_pool()
        return [] if pool is None else pool.pids()

    async def once(self) -> None:
        import aiomp

        await aiomp.run_sync(self.fn)


class RunSyncByValue(RunSync):
    name = "aiomp.run_sync, a lambda (by value)"
    fn = staticmethod(by_value)


class AnyioToProcess(h.Variant):
    name = "anyio.to_process.run_sync"

    async def once(self) -> None:
        import anyio.to_process

        await anyio.to_process.run_sync(trivial)


class TrioParallel(h.Variant):
    name = "trio_parallel.run_sync"

    async def once(self) -> None:
        import trio_parallel

        await trio_parallel.run_sync(trivial)


# -- first calls, each in a fresh interpreter ----------------------------------------------


async def _first_call(which: str) -> float:
    """Seconds for ``which``'s first call, imports done beforehand."""
    import anyio.to_process

    import aiomp

    if which == "trio_parallel":
        import trio_parallel
    t0 = c.now()
    if which == "aiomp":
        await aiomp.run_sync(trivial)
    elif which == "anyio":
        await anyio.to_process.run_sync(trivial)
    else:
        await trio_parallel.run_sync(trivial)
    return c.now() - t0


def first_call_in_a_fresh_interpreter(which: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_run_sync", "--first", which],
        text=True,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    return float(out.split()[-1])


# -- the comparison ------------------------------------------------------------------------


async def warm_asyncio(batches: int, n: int) -> dict[str, list[float]]:
    return await h.interleave([RunSync(), AnyioToProcess(), RunSyncByValue()], batches, n)


async def warm_trio(batches: int, n: int) -> dict[str, list[float]]:
    return await h.interleave([RunSync(), TrioParallel()], batches, n)


def main() -> None:
    import anyio

    rows: list[dict[str, object]] = []
    notes: list[str] = []
    missing = c.aiomp_missing("_first.default")
    have_tp = c.have("trio_parallel")
    batches, n = c.reps(20, 2), c.reps(120, 50)
    pinning = c.pin_parent()
    med = {k: c.median(v) for k, v in anyio.run(warm_asyncio, batches, n).items()}
    a = med[RunSync.name]
    what = "run_sync(trivial), warm"
    rows.append(
        c.row(f"{what} (asyncio)", a, med[AnyioToProcess.name], AnyioToProcess.name, c.faster(1.3))
    )
    rows.append(
        c.row(
            "run_sync of a lambda (by value), warm (asyncio)",
            med[RunSyncByValue.name],
            a,
            "run_sync of a module's function (by reference)",
            c.at_most(1.05),
            "sent once per worker, as a function by reference is",
        )
    )
    if have_tp:
        med_t = {
            k: c.median(v) for k, v in anyio.run(warm_trio, batches, n, backend="trio").items()
        }
        rows.append(
            c.row(
                f"{what} (trio)",
                med_t[RunSync.name],
                med_t[TrioParallel.name],
                TrioParallel.name,
                c.faster(1.3),
            )
        )
    else:
        notes.append("trio-parallel not installed: its rows are skipped")
    c.unpin_parent()
    k = c.reps(15, 3)  # fresh interpreters vary by 20 ms and more: the median of many
    order = ["aiomp", "anyio"] + (["trio_parallel"] if have_tp else [])
    firsts: dict[str, list[float]] = {w: [] for w in order}
    for i in range(k):
        for which in order if i % 2 == 0 else order[::-1]:
            firsts[which].append(first_call_in_a_fresh_interpreter(which))
    first = {w: c.median(v) for w, v in firsts.items()}
    rows.append(
        c.row(
            "run_sync(trivial), first call (asyncio)",
            first["aiomp"],
            first["anyio"],
            "anyio.to_process.run_sync, first call",
            c.at_most(1.0),
            f"the default pool of {_cpus()} worker(s) launches its first before importing "
            "the rest of the pool, and its keeper once it is ready; the call waits for it",
        )
    )
    if have_tp:
        rows.append(
            c.row(
                "run_sync(trivial), first call (asyncio)",
                first["aiomp"],
                first["trio_parallel"],
                "trio_parallel.run_sync, first call (trio)",
                None,
            )
        )
    notes.append(
        f"run_sync: warm calls: {pinning}, the default pool of one worker; median of "
        f"{batches * n} calls per variant in {batches} alternating batches; first calls: "
        f"median of {k} fresh interpreters per variant, unpinned, alternating"
        + ("" if missing is None else f"; {missing}")
    )
    c.emit("run_sync", rows, notes)


def _cpus() -> int:
    from aiomp._process.cpus import cpu_count

    return cpu_count()


if __name__ == "__main__":
    c.allow_bytecode()
    if "--first" in sys.argv:
        import anyio

        which = sys.argv[sys.argv.index("--first") + 1]
        backend = "trio" if which == "trio_parallel" else "asyncio"
        print(anyio.run(_first_call, which, backend=backend))
    else:
        main()
