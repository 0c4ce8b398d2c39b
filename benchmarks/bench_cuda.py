"""CuPy arrays through an aiomp Queue as CUDA IPC handles (needs a GPU; skips without).

    python -m benchmarks.bench_cuda [--quick] [--json PATH]

Put-to-get latency of a CuPy array from the parent to a spawned GPU consumer and its tiny
ack back, once the consumer has opened the block, for 4 KiB, 4 MiB and 1 GiB (targets: a
1 GiB handoff under 1 ms and within 2x a 4 KiB one), against:

- ``torch.multiprocessing``: a CUDA tensor of the same size through its Queue to a spawned
  consumer that acks the same way (target: no slower), when torch with CUDA is present;
- a host round trip of the same array (``cupy.asnumpy`` in the producer, the host array
  through an aiomp Queue, upload in the consumer).

Both consumers hold each received array until the next one arrives and then drop it, so
the producers' release bookkeeping runs as in a real pipeline. Two patterns: one array
sent again and again, and a ring of four 4 MiB arrays sent in turn (a pipeline's buffers).
For the first, torch's consumer does no CUDA work at all: ``rebuild_cuda_tensor`` finds the
storage it still holds in its cache and skips the event wait (stream order) that aiomp
makes on every get. The ring makes both sides open, wait on and release each array.

Small arrays (the 2 MiB rule in ``aiomp.cuda``): the 4 KiB array is an IPC-safe block
(``aiomp.cuda.zeros``), which travels in place; the same array from CuPy's pool travels
as a copy into an IPC-safe staging block, and its row gives the cost of that copy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from benchmarks import _common as c

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIZES = (4 << 10, 4 << 20, 1 << 30)
RING, RING_SIZE = 4, 4 << 20
ROUNDS = 50
#: Untimed round trips before each timed series, on both sides: the first opens the block,
#: and an idle GPU's clocks take some rounds to rise (the first series was measured slow).
WARM = 20


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


def label(n: int) -> str:
    return (
        f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    )


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


def torch_consumer(qin: object, qout: object) -> None:
    """torch.multiprocessing's side: the same protocol with CUDA tensors."""
    import torch

    torch.cuda.init()
    held = None
    while (x := qin.get()) is not None:  # type: ignore[attr-defined]
        held = x
        qout.put(b"k")  # type: ignore[attr-defined]
    del held


def torch_handoffs(rounds: int) -> dict[int, float] | str:
    """Median put -> ack of a CUDA tensor per size through torch.multiprocessing, or why not."""
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA"
    ctx = tmp.get_context("spawn")
    qin, qout = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=torch_consumer, args=(qin, qout))
    proc.start()
    out: dict[int, float] = {}
    try:
        for n in SIZES:
            t = torch.ones(n // 4, dtype=torch.float32, device="cuda")
            torch.cuda.synchronize()
            for _ in range(WARM):  # the first opens the block
                qin.put(t)
                qout.get()
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                qin.put(t)
                qout.get()
                times.append(time.perf_counter() - start)
            out[n] = c.median(times)
            del t
        ring = [torch.ones(RING_SIZE // 4, device="cuda") for _ in range(RING)]
        torch.cuda.synchronize()
        times = []
        for i in range(WARM + rounds):
            start = time.perf_counter()
            qin.put(ring[i % RING])
            qout.get()
            if i >= WARM:  # after each array's first open
                times.append(time.perf_counter() - start)
        out[0] = c.median(times)
        del ring
        qin.put(None)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out


async def aiomp_handoffs(rounds: int) -> dict[str, float]:
    import cupy

    import aiomp

    async def timed(arr: object, n: int) -> float:
        for _ in range(WARM):  # the first opens the block
            await qin.put(arr)
            await qout.get()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await qin.put(arr)
            await qout.get()
            times.append(time.perf_counter() - t)
        return c.median(times)

    qin, qout = aiomp.Queue(), aiomp.Queue()
    results: dict[str, float] = {}
    async with aiomp.spawn(consumer, 1, args=(qin, qout)):
        for n in SIZES:
            # Below 2 MiB, a pool array would be copied at put: in place means IPC-safe.
            arr = (
                cupy.ones(n // 4, dtype=cupy.float32)
                if n >= 2 << 20
                else aiomp.cuda.zeros(n // 4, dtype=cupy.float32)
            )
            results[f"ipc {n}"] = await timed(arr, rounds)
            host = cupy.asnumpy(arr)
            times = []
            for _ in range(max(3, rounds // 10)):
                t = time.perf_counter()
                await qin.put(cupy.asnumpy(arr))
                await qout.get()
                times.append(time.perf_counter() - t)
            results[f"host {n}"] = c.median(times)
            del arr, host
            aiomp.cuda.ipc_collect()
        pooled = cupy.ones(SIZES[0] // 4, dtype=cupy.float32)
        results["small pool"] = await timed(pooled, rounds)
        del pooled
        ring = [cupy.ones(RING_SIZE // 4, dtype=cupy.float32) for _ in range(RING)]
        times = []
        for i in range(WARM + rounds):
            t = time.perf_counter()
            await qin.put(ring[i % RING])
            await qout.get()
            if i >= WARM:  # after each array's first open
                times.append(time.perf_counter() - t)
        results["ring"] = c.median(times)
        del ring
        await qin.put(None)
    aiomp.cuda.ipc_collect()
    return results


def skipped_rows(why: str) -> list[dict[str, object]]:
    what, base = "CuPy {} put -> get (IPC)", "torch CUDA tensor"
    return [c.row(what.format(label(n)), None, None, base, None, f"skipped: {why}") for n in SIZES]


def table(results: dict[str, float], torch_times: dict[int, float] | str) -> list[dict[str, Any]]:
    """The rows: aiomp's handoffs (``results``) against the budget, the 4 KiB one, torch's
    (``torch_times``, or why it was skipped) and the host round trip."""
    small, big = SIZES[0], SIZES[-1]
    ipc = {n: results[f"ipc {n}"] for n in SIZES}
    what = {n: f"CuPy {label(n)} put -> get (IPC)" for n in SIZES}
    in_place = "CuPy 4 KiB put -> get (IPC, in place)"
    rows = [
        c.row(what[big], ipc[big], 1e-3, "budget", c.under(1e-3)),
        c.row(what[big], ipc[big], ipc[small], in_place, c.at_most(2)),
    ]
    tm = "torch.multiprocessing CUDA tensor"
    for n in SIZES:
        if isinstance(torch_times, str):
            rows.append(c.row(what[n], ipc[n], None, tm, None, f"skipped: {torch_times}"))
        else:
            rows.append(c.row(what[n], ipc[n], torch_times[n], f"{tm} {label(n)}", c.at_most(1)))
    ring = f"CuPy a ring of {RING} x {label(RING_SIZE)}, each put -> get in turn"
    if isinstance(torch_times, str):
        rows.append(c.row(ring, results["ring"], None, "torch", None, torch_times))
    else:
        same_ring = f"{tm}s, same ring"
        rows.append(c.row(ring, results["ring"], torch_times[0], same_ring, c.at_most(1)))
    for n in SIZES:
        rows.append(c.row(what[n], ipc[n], results[f"host {n}"], "asnumpy + aiomp queue + upload"))
    what_pool = "CuPy 4 KiB from CuPy's pool (copied into a staging block)"
    in_place = "aiomp.cuda.zeros 4 KiB (in place)"
    rows.append(c.row(what_pool, results["small pool"], ipc[small], in_place))
    return rows


async def main() -> None:
    notes: list[str] = []
    why = gpu_present()
    if why is not None:
        c.emit("cuda", skipped_rows(why), notes)
        return
    import cupy

    rounds = c.reps(ROUNDS, 10)
    results = await aiomp_handoffs(rounds)
    rows = table(results, torch_handoffs(rounds))
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    notes.append(
        f"cuda: median of {rounds} put -> ack round trips after {WARM} untimed ones; device "
        f"{name.decode() if isinstance(name, bytes) else name}, CUDA runtime "
        f"{cupy.cuda.runtime.runtimeGetVersion()}, cupy {cupy.__version__}; pid {os.getpid()}"
    )
    c.emit("cuda", rows, notes)


if __name__ == "__main__":
    asyncio.run(main())
