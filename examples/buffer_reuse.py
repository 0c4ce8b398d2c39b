"""Reuse buffers passed through a queue: the consumer sends each batch buffer back.

torch.multiprocessing's advice ("Reuse buffers passed through a Queue"): an array that is
already in shared memory travels as a handle, anything else is copied into shared memory
on every put. So a producer that fills *fresh* arrays pays a copy (and, for new segments,
page faults) per batch, while one that fills buffers it got back pays nothing::

    producer i                                    consumer (this process)
      buf = free[i].get()   (or a new aiomp.empty)
      fill buf  ------------- batches ------------>  use batch
                <------------ free[i] -------------  free[i].put(buf)   # nearly free

The consumer gives each buffer back to the producer that made it, where it arrives as the
same memory. Each mode runs for the same number of batches; the reuse mode allocates only
``--buffers`` buffers per producer however many batches flow. Prints both throughputs and
``ok``::

    python examples/buffer_reuse.py --producers 2 --batches 200 --backend trio
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import aiomp

SHAPE = (64, 128, 128)  # a batch of 64 single-channel 128 x 128 images, float32: 4 MiB


def produce(
    rank: int, batches: aiomp.Queue, free: list[aiomp.Queue], count: int, nbuffers: int, reuse: bool
) -> int:
    """Fill ``count`` batches; return how many arrays this producer allocated (reusing:
    the distinct buffers it filled, which the consumer's returns keep to ``nbuffers``)."""
    made: list[np.ndarray] = []
    addresses = set()
    for i in range(count):
        if not reuse:
            buf = np.empty(SHAPE, np.float32)  # not shared: put copies it
        elif len(made) < nbuffers:
            buf = aiomp.empty(SHAPE, np.float32)  # shared from the start
            made.append(buf)
        else:
            buf = free[rank].sync.get(timeout=30)  # a buffer the consumer gave back
        addresses.add(buf.ctypes.data)
        buf.fill(rank * 1_000_000 + i)  # "load" the batch
        batches.sync.put((rank, i, buf))
        del buf  # hold no buffer the consumer may hand out again
    batches.sync.put((rank, None, None))
    return len(addresses) if reuse else count


async def run(mode: str, producers: int, count: int, nbuffers: int) -> tuple[float, list[int]]:
    batches = aiomp.Queue(maxsize=2 * producers)
    free = [aiomp.Queue() for _ in range(producers)]
    reuse = mode == "reuse"
    done = 0
    total = 0.0
    start = time.perf_counter()
    with anyio.fail_after(60):
        async with aiomp.spawn(
            produce, producers, grace_period=1.0, args=(batches, free, count, nbuffers, reuse)
        ) as ctx:
            while done < producers:
                rank, i, buf = await batches.get()
                if buf is None:
                    done += 1
                    continue
                assert aiomp.is_shared(buf) and buf[0, 0, 0] == rank * 1_000_000 + i
                total += float(buf[:, ::16, ::16].mean())  # "use" the batch
                if reuse:
                    await free[rank].put(buf)  # a handle: nothing is copied
                del buf
    elapsed = time.perf_counter() - start
    gib = producers * count * np.prod(SHAPE) * 4 / 2**30
    print(
        f"{mode:>6}: {producers * count} batches, {gib / elapsed:6.2f} GiB/s, "
        f"arrays allocated per producer: {ctx.results}"
    )
    return elapsed, ctx.results  # type: ignore[return-value]


async def main(producers: int, count: int, nbuffers: int) -> None:
    fresh_time, _ = await run("fresh", producers, count, nbuffers)
    reuse_time, used = await run("reuse", producers, count, nbuffers)
    assert used == [nbuffers] * producers, "reuse allocates only the first buffers"
    print(f"reusing buffers: {fresh_time / reuse_time:.1f}x the throughput of fresh arrays")
    print("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=100, help="per producer")
    parser.add_argument("--buffers", type=int, default=4, help="per producer, when reusing")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    a = parser.parse_args()
    anyio.run(main, a.producers, a.batches, a.buffers, backend=a.backend)
