"""CuPy arrays through an aiomp Queue as CUDA IPC handles (needs a GPU; skips without).

    python -m benchmarks.bench_cuda [--quick] [--json PATH]

Put-to-get latency of a 1 GiB (and a 4 MiB) CuPy array from the parent to a spawned GPU
consumer and its tiny ack back, once the consumer has opened the block (target: well under
1 ms, flat in size), against a host round trip of the same array (``cupy.asnumpy`` in the
producer, the host array through an aiomp Queue, upload in the consumer), and against
``torch.multiprocessing`` with a CUDA tensor when torch with CUDA is present.

The consumer holds each received array until the next one arrives and then drops it, so
the producer's lease bookkeeping runs as in a real pipeline.

Small arrays (issue 16's 2 MiB rule): a 64 KiB array from CuPy's pool travels as a copy
in an IPC-safe staging block; the same array from ``aiomp.cuda.empty`` travels in place.
Their ratio is the cost of the staging copy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from benchmarks import _common as c

SIZES = (4 << 20, 1 << 30)
SMALL = 64 << 10
ROUNDS = 50


def gpu_present() -> str | None:
    """None when cupy sees a device (asked in a throwaway interpreter), else why not."""
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cupy probe failed: {exc}"
    if out.returncode != 0:
        return "cupy is not installed or CUDA is not usable"
    return None if int(out.stdout.strip() or 0) > 0 else "no CUDA device"


def consumer(rank: int, qin: object, qout: object) -> None:
    """Receive CuPy (or host) arrays and ack each; hold one until the next arrives."""
    import cupy

    held = None
    get, put = qin.sync.get, qout.sync.put  # type: ignore[attr-defined]
    while (x := get()) is not None:
        if not isinstance(x, cupy.ndarray):
            x = cupy.asarray(x)  # the host round trip uploads
        held = x
        put(b"k")
    del held


async def main() -> None:
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    why = gpu_present()
    if why is not None:
        for n in SIZES:
            rows.append(
                c.row(
                    f"CuPy {n >> 20} MiB put -> get",
                    None,
                    None,
                    "host round trip",
                    None,
                    f"skipped: {why}",
                )
            )
        rows.append(
            c.row(
                "CuPy 64 KiB put -> get (copied into a staging block)",
                None,
                None,
                "aiomp.cuda.zeros 64 KiB (in place)",
                None,
                f"skipped: {why}",
            )
        )
        c.emit("cuda", rows, notes)
        return
    import cupy

    import aiomp

    rounds = c.reps(ROUNDS, 10)
    qin, qout = aiomp.Queue(), aiomp.Queue()
    results: dict[str, float] = {}
    async with aiomp.spawn(consumer, 1, args=(qin, qout)):
        for n in SIZES:
            arr = cupy.ones(n // 4, dtype=cupy.float32)
            await qin.put(arr)  # first send: the consumer opens the block
            await qout.get()
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                await qin.put(arr)
                await qout.get()
                times.append(time.perf_counter() - t)
            results[f"ipc {n}"] = c.median(times)
            times = []
            for _ in range(max(3, rounds // 10)):
                t = time.perf_counter()
                await qin.put(cupy.asnumpy(arr))
                await qout.get()
                times.append(time.perf_counter() - t)
            results[f"host {n}"] = c.median(times)
            del arr
            aiomp.cuda.ipc_collect()
        for kind in ("pool", "ipc_safe"):
            if kind == "pool":
                arr = cupy.ones(SMALL // 4, dtype=cupy.float32)
            else:
                arr = aiomp.cuda.zeros(SMALL // 4, dtype=cupy.float32)
            await qin.put(arr)
            await qout.get()
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                await qin.put(arr)
                await qout.get()
                times.append(time.perf_counter() - t)
            results[f"small {kind}"] = c.median(times)
            del arr
            aiomp.cuda.ipc_collect()
        await qin.put(None)
    small, big = SIZES
    rows.append(
        c.row(
            "CuPy 1 GiB put -> get (IPC)", results[f"ipc {big}"], 1e-3, "budget", c.under(1e-3), ""
        )
    )
    rows.append(
        c.row(
            "CuPy 1 GiB put -> get (IPC)",
            results[f"ipc {big}"],
            results[f"ipc {small}"],
            "CuPy 4 MiB put -> get (IPC)",
            c.at_most(2),
            "",
        )
    )
    for n in SIZES:
        rows.append(
            c.row(
                f"CuPy {n >> 20} MiB put -> get (IPC)",
                results[f"ipc {n}"],
                results[f"host {n}"],
                "asnumpy + aiomp queue + upload",
                None,
                "",
            )
        )
    rows.append(
        c.row(
            "CuPy 64 KiB put -> get (copied into a staging block)",
            results["small pool"],
            results["small ipc_safe"],
            "aiomp.cuda.zeros 64 KiB put -> get (in place)",
            None,
            "",
        )
    )
    notes.append(
        f"cuda: median of {rounds} puts after the first open; device "
        f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
        f"pid {os.getpid()}. torch CUDA comparison: not implemented yet."
    )
    c.emit("cuda", rows, notes)


if __name__ == "__main__":
    asyncio.run(main())
