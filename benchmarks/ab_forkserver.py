"""A/B of forkserver start-up: two aiomp trees, each against multiprocessing, same run.

``python -m benchmarks.ab_forkserver --base /tmp/fork-base [--rounds 3] [--reps 16]``

Each round runs this module once per tree (alternating which goes first), in a fresh
interpreter whose ``aiomp`` and ``benchmarks`` come from that tree (``PYTHONPATH``). One
such run does ``reps`` repetitions of ``spawn(noop, 4, start_method="forkserver")`` until
all have run (``output="prefix"``, the default, and ``"inherit"``) alternating with four
``multiprocessing`` forkserver processes started one by one and joined, one fork server
(started by aiomp) serving both, on a plain ``asyncio`` loop. It reports medians of wall
time and of the parent's CPU (``time.process_time``) per spawn-4, and the wall ratio
against multiprocessing measured in the same interpreter; "cpu a/b" is the parent's CPU
(median) and the children's (mean: the fork server's reaped-children time, 10 ms ticks)
per spawn-4, in ms. The child imports only the standard library at the top (it is every
child's ``__mp_main__``).
"""

from __future__ import annotations

import os
import sys
import time


def _children_cpu() -> float:
    """CPU seconds of the fork server's reaped children so far (its cutime + cstime)."""
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _mp4() -> tuple[float, float]:
    import multiprocessing

    from benchmarks._targets import noop

    ctx = multiprocessing.get_context("forkserver")
    c0, t0 = time.process_time(), time.perf_counter()
    procs = [ctx.Process(target=noop, args=(i,)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    t1, c1 = time.perf_counter(), time.process_time()
    assert all(p.exitcode == 0 for p in procs)
    return t1 - t0, c1 - c0


async def _aiomp4(output: str) -> tuple[float, float]:
    import aiomp
    from benchmarks._targets import noop

    c0, t0 = time.process_time(), time.perf_counter()
    async with aiomp.spawn(noop, 4, output=output, start_method="forkserver"):
        pass
    t1, c1 = time.perf_counter(), time.process_time()
    return t1 - t0, c1 - c0


def _one(reps: int) -> dict[str, float]:
    import asyncio
    import statistics

    from benchmarks import _common as c

    c.allow_bytecode()
    c.unpin_parent()
    res: dict[str, list[tuple[float, float]]] = {"prefix": [], "inherit": [], "mp": []}
    kids = {"prefix": 0.0, "inherit": 0.0, "mp": 0.0}  # children's CPU, summed

    async def timed(name: str) -> None:
        before = _children_cpu()
        got = _mp4() if name == "mp" else await _aiomp4(name)
        res[name].append(got)
        kids[name] += _children_cpu() - before

    async def run() -> None:
        await _aiomp4("prefix")  # starts the fork server with aiomp's preloads
        _mp4()
        for i in range(reps):
            if i % 2:
                await timed("mp")
            await timed("prefix")
            await timed("inherit")
            if not i % 2:
                await timed("mp")

    asyncio.run(run())
    out: dict[str, float] = {}
    for k, v in res.items():
        out[f"{k}_wall"] = statistics.median(x[0] for x in v) * 1e3
        out[f"{k}_cpu"] = statistics.median(x[1] for x in v) * 1e3
        out[f"{k}_kids"] = kids[k] / len(v) * 1e3
    out["ratio_prefix"] = out["prefix_wall"] / out["mp_wall"]
    out["ratio_inherit"] = out["inherit_wall"] / out["mp_wall"]
    return out


def main() -> None:
    import argparse
    import json
    import subprocess

    p = argparse.ArgumentParser()
    p.add_argument("--base", help="the other tree (the A of the A/B)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--one", action="store_true", help="measure this tree once (internal)")
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.reps)))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"new": here, "base": os.path.abspath(a.base)}
    for r in range(a.rounds):
        order = ["new", "base"] if r % 2 else ["base", "new"]
        for name in order:
            env = dict(os.environ, PYTHONPATH=trees[name])
            cmd = [sys.executable, "-m", "benchmarks.ab_forkserver", "--one", "--reps", str(a.reps)]
            load = os.getloadavg()[0]
            got = json.loads(subprocess.check_output(cmd, cwd=trees[name], env=env))
            print(
                f"round {r} {name:4} load {load:4.1f}: "
                f"prefix {got['prefix_wall']:6.2f} ms ({got['ratio_prefix']:.3f}x mp) "
                f"cpu {got['prefix_cpu']:4.2f}/{got['prefix_kids']:5.2f} | "
                f"inherit {got['inherit_wall']:6.2f} ms ({got['ratio_inherit']:.3f}x) "
                f"cpu {got['inherit_cpu']:4.2f}/{got['inherit_kids']:5.2f} | "
                f"mp {got['mp_wall']:6.2f} ms cpu {got['mp_cpu']:4.2f}/{got['mp_kids']:5.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
