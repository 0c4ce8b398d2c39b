"""Where a CuPy handoff's time goes, on a GPU machine (a diagnostic, not a comparison).

    python -m benchmarks.profile_cuda

A spawned consumer acks each item. Printed: the median round trip of plain bytes (the
queue's floor), of a 4 KiB ``aiomp.cuda.zeros`` array and of a 1 GiB CuPy array (each
re-sent, as in bench_cuda), with the consumer dropping each array when the next arrives
and with it keeping every array, with the producer's interprocess events recycled (a pool
of 64) and not; and, for each side, the mean time of every CUDA call aiomp makes (its
backend's methods, timed in place).

It imports ``aiomp._cuda.ipc`` to wrap its backend's calls: the one script here that reaches
past the public API, because the CUDA calls are what it times (it is run by
``gpu_check.sh`` on a GPU machine, and a rename inside ``aiomp/`` must update it).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict
from typing import Any

import aiomp

ROUNDS = 200


def instrument() -> dict[str, list[float]]:
    """Time every call of aiomp's CUDA backend in this process."""
    from aiomp._cuda import ipc as _cuda

    backend = _cuda.get_backend()
    spent: dict[str, list[float]] = defaultdict(list)
    for name in dir(type(backend)):
        fn = getattr(backend, name)
        if name.startswith("_") or not callable(fn):
            continue

        def timed(*args: Any, _fn: Any = fn, _name: str = name) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                spent[_name].append(time.perf_counter() - t)

        setattr(backend, name, timed)
    return spent


def report(spent: dict[str, list[float]], title: str) -> str:
    lines = [f"--- {title}: CUDA backend calls"]
    for name, ts in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{name:>16}: {len(ts):5d} calls, mean {sum(ts) / len(ts) * 1e6:8.1f} us")
    spent.clear()
    return "\n".join(lines)


def consumer(rank: int, qin: object, qout: object) -> None:
    import cupy  # noqa: F401

    spent = instrument()
    held: list[object] = []
    keep = False
    get, put = qin.sync.get, qout.sync.put  # type: ignore[attr-defined]
    while (x := get()) is not None:
        if isinstance(x, str):
            if x == "report":
                held.clear()
                print(report(spent, f"consumer (keep={keep})"), file=sys.stderr)
            keep = x == "keep"
            put(b"k")
            continue
        if not keep:
            held.clear()
        held.append(x)
        put(b"k")


async def rounds(qin: aiomp.Queue, qout: aiomp.Queue, item: object, n: int) -> float:
    await qin.put(item)
    await qout.get()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await qin.put(item)
        await qout.get()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


async def main() -> None:
    import cupy

    from aiomp._cuda import driver as _driver
    from aiomp._cuda import ipc as _cuda

    spent = instrument()
    qin, qout = aiomp.Queue(), aiomp.Queue()
    async with aiomp.spawn(consumer, 1, args=(qin, qout)):
        small = aiomp.cuda.zeros(1024, dtype=cupy.float32)
        big = cupy.ones(1 << 28, dtype=cupy.float32)
        print(f"bytes 4 KiB: median {await rounds(qin, qout, b'x' * 4096, ROUNDS) * 1e6:.1f} us")
        default_pool = _driver.EVENT_POOL_SIZE
        for mode, pool in (("drop", default_pool), ("drop", 64), ("keep", default_pool)):
            _driver.EVENT_POOL_SIZE = pool
            _cuda.get_backend()._events.clear()  # type: ignore[attr-defined]
            await qin.put(mode)
            await qout.get()
            spent.clear()
            for name, item in (("cuda.zeros 4 KiB", small), ("cupy 1 GiB", big)):
                median = await rounds(qin, qout, item, ROUNDS)
                print(f"{name}, consumer {mode}s, event pool {pool}: median {median * 1e6:.1f} us")
            print(report(spent, f"producer, consumer {mode}s, event pool {pool}"))
            await qin.put("report")
            await qout.get()
            aiomp.cuda.ipc_collect()
        await qin.put(None)


if __name__ == "__main__":
    asyncio.run(main())
