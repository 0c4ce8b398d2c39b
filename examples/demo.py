"""aiomp in one page: async workers, zero-copy numpy queues, errors with tracebacks.

Run: python examples/demo.py
"""

from __future__ import annotations

import time

import anyio
import numpy as np

import aiomp


async def worker(rank: int, jobs: aiomp.Queue, results: aiomp.Queue) -> int:
    """An async worker: takes frames, writes into them in place, sends them back."""
    done = 0
    async for frame in jobs:  # ends when the parent closes the queue
        frame *= 2.0  # the parent's memory: no copy was made either way
        await results.put((rank, frame))
        done += 1
    return done


def bad_worker(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 could not read its shard")
    time.sleep(60)  # the others are terminated as soon as rank 1 fails


async def main() -> None:
    jobs, results = aiomp.Queue(maxsize=8), aiomp.Queue()
    frames = [aiomp.zeros((1024, 1024), np.float32) for _ in range(16)]  # 4 MiB each
    for i, frame in enumerate(frames):
        frame[:] = i

    start = time.perf_counter()
    async with aiomp.spawn(worker, 4, args=(jobs, results)) as ctx:
        async with anyio.create_task_group() as tg:

            async def feed() -> None:
                for frame in frames:
                    await jobs.put(frame)  # only a handle travels: the data is shared
                jobs.close()

            tg.start_soon(feed)
            for _ in frames:
                _, frame = await results.get()
                assert aiomp.is_shared(frame)
    elapsed = time.perf_counter() - start
    print(
        f"4 async workers doubled 16 shared 4 MiB frames in place in {elapsed * 1e3:.0f} ms, "
        f"start-up included (frames per rank: {ctx.results}, uneven: whichever worker is "
        f"free takes the next frame); frame 3 now holds "
        f"{frames[3][0, 0]:.0f}"
    )

    start = time.perf_counter()
    try:
        async with aiomp.spawn(bad_worker, 4, grace_period=1.0):
            await anyio.sleep_forever()  # cancelled when a child fails
    except aiomp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        print(
            f"rank {exc.error_index} (pid {exc.pid}) failed, the other 3 were terminated, "
            f"all within {(time.perf_counter() - start) * 1e3:.0f} ms of spawning: {last}"
        )


if __name__ == "__main__":
    anyio.run(main)
