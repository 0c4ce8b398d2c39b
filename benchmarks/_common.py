"""What every comparison shares: CPU pinning, timing, result rows, the table.

Standard library only, and cheap to import: the spawn children of every benchmark
import the comparison module (as ``__mp_main__``) and so this one.

Pinning: on this 2-vCPU machine a wake-up across cores costs far more than on one core,
so latency comparisons put the parent on one core and every child on the other, for
aiomp and its baselines alike. The parent calls :func:`pin_parent`; it sets
:data:`CHILD_CPU_ENV`, which children inherit, and every function a child runs
(``benchmarks/_targets.py``) calls :func:`pin_child` first. A child pins itself, whichever
library started it, so no baseline needs a hook for it.
"""

from __future__ import annotations

import os
import sys
import time

# Not `typing`/`statistics`/`json` at the top: every benchmark child imports this module,
# and what it imports would be added to aiomp's spawn time and the baseline's alike.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

#: Environment variable naming the core children pin themselves to.
CHILD_CPU_ENV = "AIOMP_BENCH_CHILD_CPU"

_child_pinned = False


def _set_affinity_all_threads(cpus: set[int]) -> None:
    # sched_setaffinity(0) moves only the calling thread; move every thread of the
    # process (a feeder or resource-sharer thread may already exist). Threads created
    # later inherit their creator's mask.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def pin_parent() -> str:
    """Pin this process to the first core and tell children to use the second.

    Returns a description for the results. With one core, nothing is pinned. A process
    started by a pinned benchmark (``CHILD_CPU_ENV`` set) first widens the one-core mask it
    inherited: otherwise it would find one core and share it with its children.
    """
    if CHILD_CPU_ENV in os.environ:
        unpin_parent()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        os.environ.pop(CHILD_CPU_ENV, None)
        return "unpinned (one core available)"
    _set_affinity_all_threads({cpus[0]})
    os.environ[CHILD_CPU_ENV] = str(cpus[1])
    return f"parent on core {cpus[0]}, children on core {cpus[1]}"


def unpin_parent() -> str:
    """Let this process and its future children run on every core again."""
    cpus = set(range(os.cpu_count() or 1))
    _set_affinity_all_threads(cpus)
    os.environ.pop(CHILD_CPU_ENV, None)
    return "unpinned"


def pin_child() -> None:
    """In a child: move to the core the parent named (once per process)."""
    global _child_pinned
    if _child_pinned:
        return
    _child_pinned = True
    cpu = os.environ.get(CHILD_CPU_ENV)
    if cpu is not None:
        _set_affinity_all_threads({int(cpu)})


def allow_bytecode() -> None:
    """Let children read and write ``__pycache__`` (for aiomp and the baselines alike).

    This environment sets ``PYTHONDONTWRITEBYTECODE=1``, so without this every spawned
    child compiles aiomp's modules (and the benchmark's) from source, while the standard
    library's bytecode is precompiled: an installed aiomp has its bytecode too. The caches
    land in ``__pycache__`` folders, which git ignores.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def run_main(main: Callable[[], Any]) -> None:
    """A comparison's entry point: :func:`allow_bytecode`, then ``main`` on anyio's loop."""
    import anyio

    allow_bytecode()
    anyio.run(main)


# -- timing -----------------------------------------------------------------------------

now = time.perf_counter


def median(xs: Iterable[float]) -> float:
    import statistics

    return statistics.median(list(xs))


def time_calls(fn: Callable[[], object], n: int, budget: float | None = None) -> list[float]:
    """Seconds per call of a synchronous ``fn``, one sample per call.

    Stops early (with at least one sample) once ``budget`` seconds have gone.
    """
    out = []
    end = None if budget is None else now() + budget
    for _ in range(n):
        t0 = now()
        fn()
        t1 = now()
        out.append(t1 - t0)
        if end is not None and t1 > end:
            break
    return out


async def atime_calls(fn: Callable[[], Any], n: int, budget: float | None = None) -> list[float]:
    """Seconds per await of ``fn()``, one sample per call; ``budget`` as in time_calls."""
    out = []
    end = None if budget is None else now() + budget
    for _ in range(n):
        t0 = now()
        await fn()
        t1 = now()
        out.append(t1 - t0)
        if end is not None and t1 > end:
            break
    return out


def quick() -> bool:
    """``--quick`` (or AIOMP_BENCH_QUICK=1): fewer repetitions, for a smoke run."""
    return "--quick" in sys.argv or os.environ.get("AIOMP_BENCH_QUICK") == "1"


def reps(full: int, fast: int) -> int:
    return fast if quick() else full


# -- rows -------------------------------------------------------------------------------


def at_most(x: float) -> dict[str, Any]:
    """Target: aiomp's time is at most ``x`` times the baseline's."""
    return {"max": x, "strict": False, "text": f"<= {x:g}x"}


def faster(x: float = 1.0) -> dict[str, Any]:
    """Target: aiomp is at least ``x`` times faster (strictly faster for ``x == 1``)."""
    if x == 1.0:
        return {"max": 1.0, "strict": True, "text": "< 1x (faster)"}
    return {"max": 1.0 / x, "strict": False, "text": f"<= {1 / x:.3g}x ({x:g}x faster)"}


def at_least(x: float) -> dict[str, Any]:
    """Target: aiomp's figure is at least ``x`` times the baseline's (a count: rows)."""
    return {"min": x, "text": f">= {x:g}x"}


def under(budget: float) -> dict[str, Any]:
    """Target: an absolute budget; pass ``budget`` as the row's baseline too."""
    return {"max": 1.0, "strict": True, "text": f"< {fmt_time(budget)}"}


def row(
    measurement: str,
    aiomp: float | None,
    baseline: float | None,
    baseline_name: str,
    target: dict[str, Any] | None = None,
    note: str = "",
    unit: str = "s",
) -> dict[str, Any]:
    """One result: medians in seconds, or counts of ``unit`` (None: not measured,
    ``note`` says why)."""
    ratio = aiomp / baseline if aiomp is not None and baseline else None
    if target is None:
        status = "info"
    elif ratio is None:
        status = "skip"
    elif "min" in target:
        status = "pass" if ratio >= target["min"] else "FAIL"
    else:
        ok = ratio < target["max"] if target["strict"] else ratio <= target["max"]
        status = "pass" if ok else "FAIL"
    return {
        "measurement": measurement,
        "aiomp": aiomp,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "ratio": ratio,
        "target": target["text"] if target else "",
        "status": status,
        "note": note,
        "unit": unit,
    }


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_value(x: float | None, unit: str) -> str:
    """A row's figure: a time (``unit`` "s"), or a count of ``unit``."""
    if unit == "s":
        return fmt_time(x)
    return "—" if x is None else f"{x:.1f} {unit}"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = "| measurement | aiomp | baseline | ratio (aiomp/baseline) | target | result |"
    lines = [head, "|---|---:|---|---:|---|---|"]
    for r in rows:
        unit = r.get("unit", "s")
        base = f"{fmt_value(r['baseline'], unit)} ({r['baseline_name']})"
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.3g}x"
        status = r["status"]
        if r["note"]:
            status = f"{status}: {r['note']}"
        lines.append(
            f"| {r['measurement']} | {fmt_value(r['aiomp'], unit)} | {base} | {ratio} "
            f"| {r['target'] or '—'} | {status} |"
        )
    return "\n".join(lines)


def report(rows: list[dict[str, Any]], notes: list[str]) -> str:
    """A comparison's table, then its notes as a list."""
    return "\n".join([format_table(rows), "", *(f"- {n}" for n in notes)])


def emit(name: str, rows: list[dict[str, Any]], notes: list[str]) -> None:
    """Print the table; with ``--json PATH`` also write the rows for the runner."""
    print(report(rows, notes))
    if "--json" in sys.argv:
        import json

        path = sys.argv[sys.argv.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"name": name, "rows": rows, "notes": notes}, f)


def aiomp_missing(*modules: str) -> str | None:
    """None when the aiomp modules import, else a note saying which does not yet."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(f"aiomp.{m}")
        except ImportError:
            return f"aiomp.{m} not importable yet"
    return None


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
