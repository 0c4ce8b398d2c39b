"""Spawn: start 4 processes and wait until all have run; failure-propagation latency.

Run as ``python -m benchmarks.bench_spawn`` (the runner does): spawn children import this
module as ``__mp_main__``, so it imports only the standard library at the top.

- ``async with aiomp.spawn(noop, 4)`` vs four ``multiprocessing`` spawn processes started one
  by one and joined (target <= 1.0x), vs ``torch.multiprocessing.spawn(noop, nprocs=4)``;
  the same with ``start_method="forkserver"`` against ``multiprocessing``'s forkserver
  (target <= 1.0x; one fork server, started by aiomp, serves both).
  Start-up is throughput on both cores, so this part runs unpinned, for all alike.
- A child raises (rank 0 of 2, once rank 1 is up): time from the raise (the child's
  ``time.monotonic_ns()`` in the exception text) to the parent catching the
  ProcessRaisedException, aiomp vs ``torch.multiprocessing.spawn`` (target < 50 ms).
  Parent on one core, children on the other.

Variants alternate within each repetition, so load from other users hits all alike.
Top-level imports are kept to ``time`` and the tiny helper modules: whatever this module
imports, every spawned child (aiomp's and the baselines') pays for.
"""

from __future__ import annotations

import time

from benchmarks import _common as c
from benchmarks._targets import noop, print_lines, raise_when_ready, raised_at


def mp_spawn4(method: str = "spawn") -> float:
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    t0 = c.now()
    procs = [ctx.Process(target=noop, args=(i,)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    dt = c.now() - t0
    assert all(p.exitcode == 0 for p in procs)
    return dt


async def aiomp_spawn4(output: str = "prefix", method: str = "spawn") -> float:
    import aiomp

    t0 = c.now()
    async with aiomp.spawn(noop, 4, output=output, start_method=method):
        pass
    return c.now() - t0


LINES = 100_000


async def aiomp_print_lines(output: str) -> float:
    """One child prints LINES short lines: forwarded ("prefix", to a parent stdout that
    is /dev/null) or written straight to an inherited pipe that a thread drains."""
    import contextlib
    import os
    import sys
    import threading

    import aiomp

    saved = os.dup(1)
    r, w = os.pipe()
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(r, 1 << 16), b"")])
    drain.start()
    try:
        os.dup2(w, 1)  # what an "inherit" child writes to: a pipe, drained
        os.close(w)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # noqa: ASYNC230
            sys.stdout.flush()
            t0 = c.now()
            async with aiomp.spawn(print_lines, 1, args=(LINES,), output=output):
                pass
            dt = c.now() - t0
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        drain.join()
        os.close(r)
    return dt


def torch_spawn4() -> float:
    import torch.multiprocessing as tmp

    t0 = c.now()
    tmp.spawn(noop, nprocs=4)
    return c.now() - t0


async def aiomp_failure() -> float:
    import shutil
    import tempfile

    import aiomp

    ready = tempfile.mkdtemp(prefix="aiomp-bench-")
    try:
        async with aiomp.spawn(raise_when_ready, 2, args=(2, ready), grace_period=2.0):
            pass
    except aiomp.ProcessRaisedException as exc:
        caught = time.monotonic_ns()
        return (caught - raised_at(str(exc))) / 1e9
    finally:
        shutil.rmtree(ready, ignore_errors=True)
    raise AssertionError("the child did not raise")


def torch_failure() -> float:
    import shutil
    import tempfile

    import torch.multiprocessing as tmp

    ready = tempfile.mkdtemp(prefix="aiomp-bench-")
    try:
        tmp.spawn(raise_when_ready, args=(2, ready), nprocs=2)
    except tmp.ProcessRaisedException as exc:
        caught = time.monotonic_ns()
        return (caught - raised_at(str(exc))) / 1e9
    finally:
        shutil.rmtree(ready, ignore_errors=True)
    raise AssertionError("the child did not raise")


async def main() -> None:
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    missing = c.aiomp_missing("_spawn")
    has_torch = c.have("torch")
    if has_torch:
        import torch.multiprocessing  # noqa: F401  (imported before timing, not inside it)
    else:
        notes.append("torch not installed: torch rows skipped")
    if missing is None:
        import aiomp._spawn.context  # noqa: F401

    # -- spawn 4, unpinned -------------------------------------------------------------
    c.unpin_parent()
    n, n_torch = c.reps(25, 4), c.reps(5, 2)
    t_aiomp: list[float] = []
    t_mp: list[float] = []
    t_torch: list[float] = []
    t_inherit: list[float] = []
    mp_spawn4()  # warm the page cache and import paths for both
    if missing is None:
        await aiomp_spawn4()
    for i in range(n):
        # alternate which goes first: neither always follows the other
        if i % 2:
            t_mp.append(mp_spawn4())
        if missing is None:
            t_aiomp.append(await aiomp_spawn4())
            t_inherit.append(await aiomp_spawn4("inherit"))
        if not i % 2:
            t_mp.append(mp_spawn4())
        if has_torch and i < n_torch:
            t_torch.append(torch_spawn4())
    a = c.median(t_aiomp) if t_aiomp else None
    # output="prefix" (the default, above) against raw inherited fds
    if missing is None:
        rows.append(
            c.row(
                "spawn 4 procs, output='prefix' (default)",
                a,
                c.median(t_inherit),
                "aiomp spawn 4, output='inherit'",
                None,
            )
        )
        t_fwd: list[float] = []
        t_pipe: list[float] = []
        for _ in range(c.reps(7, 2)):
            t_fwd.append(await aiomp_print_lines("prefix"))
            t_pipe.append(await aiomp_print_lines("inherit"))
        rows.append(
            c.row(
                f"child prints {LINES // 1000}k lines, forwarded as [rank 0]",
                c.median(t_fwd),
                c.median(t_pipe),
                "the same child writing to an inherited pipe",
                c.at_most(2.0),
            )
        )
    rows.append(
        c.row(
            "spawn 4 procs, until all have run",
            a,
            c.median(t_mp),
            "multiprocessing spawn x4, one by one",
            c.at_most(1.0),
            missing or "",
        )
    )
    # forkserver: aiomp starts the server first (as an aiomp program does), so that it
    # preloads aiomp's child module; multiprocessing's children use the same server.
    fs_aiomp: list[float] = []
    fs_mp: list[float] = []
    if missing is None:
        await aiomp_spawn4(method="forkserver")
    mp_spawn4("forkserver")
    for i in range(n):
        if i % 2:
            fs_mp.append(mp_spawn4("forkserver"))
        if missing is None:
            fs_aiomp.append(await aiomp_spawn4(method="forkserver"))
        if not i % 2:
            fs_mp.append(mp_spawn4("forkserver"))
    rows.append(
        c.row(
            "forkserver 4 procs, until all have run",
            c.median(fs_aiomp) if fs_aiomp else None,
            c.median(fs_mp),
            "multiprocessing forkserver x4, one by one",
            c.at_most(1.0),
            missing or "",
        )
    )
    if has_torch:
        rows.append(
            c.row(
                "spawn 4 procs, until all have run",
                a,
                c.median(t_torch),
                "torch.multiprocessing.spawn",
                None,
                missing or "",
            )
        )

    # -- failure latency, pinned ---------------------------------------------------------
    pinning = c.pin_parent()
    n, n_torch = c.reps(12, 3), c.reps(5, 2)
    f_aiomp: list[float] = []
    f_torch: list[float] = []
    for i in range(max(n, n_torch)):
        if missing is None and i < n:
            f_aiomp.append(await aiomp_failure())
        if has_torch and i < n_torch:
            f_torch.append(torch_failure())
    a = c.median(f_aiomp) if f_aiomp else None
    if has_torch:
        t = c.median(f_torch)
        rows.append(
            c.row(
                "child raises -> parent catches",
                a,
                t,
                "torch.multiprocessing.spawn",
                None,
                missing or "",
            )
        )
    rows.append(
        c.row("child raises -> parent catches", a, 0.050, "budget", c.under(0.050), missing or "")
    )
    notes.append(
        f"spawn and forkserver: unpinned, medians of {len(t_mp)} (aiomp/multiprocessing) and "
        f"{len(t_torch)} (torch) runs, alternating; children run a no-op and read bytecode "
        "from __pycache__ (as an installed package does; see _common.allow_bytecode); "
        "torch children import torch. aiomp's default output='prefix' forwards each "
        "child's stdout/stderr through the parent's loop."
    )
    notes.append(
        "output forwarding: spawn of one child to its exit, the child printing "
        f"{LINES} short lines; 'prefix' forwards them through the parent's loop to its "
        "sys.stdout (/dev/null), the baseline writes them to an inherited pipe drained "
        "by a thread; target 'at least 50 % of the rate' = at most 2x the time."
    )
    notes.append(
        f"failure latency: {pinning}; medians of {len(f_aiomp)} (aiomp) and {len(f_torch)} "
        "(torch) runs; rank 0 of 2 raises once rank 1 is up; measured from the child's "
        "time.monotonic_ns() before the raise to the parent's after catching, "
        "sibling termination included. Samples (ms): aiomp "
        f"{[round(x * 1e3, 1) for x in f_aiomp]}, torch {[round(x * 1e3, 1) for x in f_torch]}."
    )
    c.emit("spawn", rows, notes)


if __name__ == "__main__":
    import anyio

    c.allow_bytecode()
    anyio.run(main)
