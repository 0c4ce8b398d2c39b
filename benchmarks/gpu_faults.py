"""CUDA IPC under SIGKILL, on a real GPU: nothing pinned, nothing leaked.

    python -m benchmarks.gpu_faults

Two faults, each with 1 GiB of device memory in flight (four 256 MiB arrays, two from
``aiomp.cuda.empty`` and two from CuPy's pool), the parent never touching CUDA itself:

1. the consumer is SIGKILLed while it holds the producer's arrays: the producer's
   ``ipc_collect()`` reaches 0 (its blocks are released), and it keeps working;
2. the producer is SIGKILLed while the consumer holds its arrays: the consumer drops them
   without a crash or a hang and exits cleanly.

After each, the device's used memory (``nvidia-smi``) returns to what it was before, and
no aiomp name is left in ``/dev/shm``. Prints one line per check and exits 1 on a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio

import aiomp

N_ARRAYS, ELEMS = 4, 64 << 20  # four float32 arrays of 256 MiB
TIMEOUT = 120


def used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


def make_arrays() -> list[object]:
    import cupy

    from aiomp import cuda

    arrays = []
    for i in range(N_ARRAYS):
        a = (
            cuda.empty(ELEMS, dtype=cupy.float32)
            if i % 2 == 0
            else cupy.empty(ELEMS, dtype=cupy.float32)
        )
        a.fill(float(i + 1))
        arrays.append(a)
    cupy.cuda.get_current_stream().synchronize()
    return arrays


def producer(rank: int, q: object, ctl: object) -> tuple[int, int, int]:
    """Send the arrays, drop them, wait for the word, then collect (bounded)."""
    import cupy

    from aiomp import cuda

    arrays = make_arrays()
    for a in arrays:
        q.sync.put(a)  # type: ignore[attr-defined]
    del arrays, a
    held_before = cuda.ipc_collect()
    ctl.sync.get(timeout=TIMEOUT)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while (held := cuda.ipc_collect()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel closes a dead consumer's lease fds at once
    # Still usable: one more array through the same queue.
    again = cupy.full(1 << 20, 7.0, dtype=cupy.float32)
    q.sync.put(again)  # type: ignore[attr-defined]
    ctl.sync.get(timeout=TIMEOUT)  # type: ignore[attr-defined]
    return held_before, held, cuda.ipc_collect()


def holder(rank: int, q: object, back: object) -> None:
    """Receive the arrays, check them, say so, and hold them until killed."""
    got = [q.sync.get(timeout=TIMEOUT) for _ in range(N_ARRAYS)]  # type: ignore[attr-defined]
    back.sync.put([float(a[0]) for a in got])  # type: ignore[attr-defined]
    signal.pause()


def reader(rank: int, q: object, back: object) -> str:
    """Take one array from the restarted exchange and check it."""
    a = q.sync.get(timeout=TIMEOUT)  # type: ignore[attr-defined]
    value = float(a[0])
    del a
    back.sync.put(value)  # type: ignore[attr-defined]
    return "ok"


def orphan_producer(rank: int, q: object) -> None:
    """Send the arrays, then wait to be killed."""
    arrays = make_arrays()
    for a in arrays:
        q.sync.put(a)  # type: ignore[attr-defined]
    signal.pause()


def orphaned_holder(rank: int, q: object, back: object, ctl: object) -> object:
    """Hold the arrays while their producer is killed, then drop them."""
    import gc

    import cupy

    from aiomp import cuda

    got = [q.sync.get(timeout=TIMEOUT) for _ in range(N_ARRAYS)]  # type: ignore[attr-defined]
    back.sync.put([float(a[0]) for a in got])  # type: ignore[attr-defined]
    ctl.sync.get(timeout=TIMEOUT)  # type: ignore[attr-defined]  # the producer is dead now
    del got
    gc.collect()
    cupy.cuda.Device().synchronize()
    return tuple(cuda.statistics())


async def settle(base: int, what: str) -> bool:
    deadline = time.monotonic() + 20
    # The driver frees a dead process's memory asynchronously: nothing to wait on but it.
    while (now := used_mib()) > base + 64 and time.monotonic() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.2)
    ok = now <= base + 64
    print(f"{'ok' if ok else 'FAIL'}: {what}: device memory {base} MiB before, {now} MiB after")
    return ok


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "aiomp" in n}


async def consumer_killed() -> bool:
    base, shm = used_mib(), shm_names()
    q, back, ctl = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        cctx = await aiomp.spawn(holder, 1, args=(q, back), grace_period=2)
        try:
            async with aiomp.spawn(producer, 1, args=(q, ctl), grace_period=5) as pctx:
                firsts = await back.get()
                peak = used_mib()
                os.kill(cctx.pids()[0], signal.SIGKILL)
                try:
                    await cctx.join()
                except aiomp.ProcessExitedException:
                    pass
                await ctl.put("killed")
                async with aiomp.spawn(reader, 1, args=(q, back), grace_period=2):
                    value = await back.get()
                await ctl.put("done")
        finally:
            await cctx.terminate()
    held_before, held_after, held_end = pctx.results[0]
    ok = firsts == [1.0, 2.0, 3.0, 4.0] and held_after == 0 and value == 7.0 and held_end == 0
    print(
        f"{'ok' if ok else 'FAIL'}: consumer SIGKILLed holding {N_ARRAYS} x 256 MiB (device at "
        f"{peak} MiB): producer held {held_before} before, {held_after} after; "
        f"the queue still carried an array ({value})"
    )
    ok &= await settle(base, "after the consumer's SIGKILL")
    leaked = shm_names() - shm
    print(f"{'ok' if not leaked else 'FAIL'}: /dev/shm names left: {sorted(leaked)}")
    return ok and not leaked


async def producer_killed() -> bool:
    base, shm = used_mib(), shm_names()
    q, back, ctl = aiomp.Queue(), aiomp.Queue(), aiomp.Queue()
    with anyio.fail_after(TIMEOUT):
        pctx = await aiomp.spawn(orphan_producer, 1, args=(q,), grace_period=2)
        try:
            async with aiomp.spawn(orphaned_holder, 1, args=(q, back, ctl), grace_period=5) as cctx:
                firsts = await back.get()
                peak = used_mib()
                os.kill(pctx.pids()[0], signal.SIGKILL)
                try:
                    await pctx.join()
                except aiomp.ProcessExitedException:
                    pass
                await ctl.put("killed")
        finally:
            await pctx.terminate()
    stats = aiomp.cuda.IpcStatistics(*cctx.results[0])
    ok = firsts == [1.0, 2.0, 3.0, 4.0] and stats.received_held == stats.received_open == 0
    print(
        f"{'ok' if ok else 'FAIL'}: producer SIGKILLed while its consumer held {N_ARRAYS} x "
        f"256 MiB (device at {peak} MiB): the consumer dropped them and exited cleanly ({stats})"
    )
    ok &= await settle(base, "after the producer's SIGKILL")
    leaked = shm_names() - shm
    print(f"{'ok' if not leaked else 'FAIL'}: /dev/shm names left: {sorted(leaked)}")
    return ok and not leaked


async def main() -> int:
    results = []
    for check in (consumer_killed, producer_killed):
        try:
            results.append(await check())
        except Exception as exc:  # noqa: BLE001 (report it, then run the next fault)
            print(f"FAIL: {check.__name__}: {type(exc).__name__}: {exc}")
            results.append(False)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
