"""torch's DataLoader idiom with aiomp: workers build and collate batches in shared memory,
and an async consumer takes them in order, with back-pressure.

::

    parent (async consumer)                     worker r (sync, one of num_workers)
      tasks.put(k) for the first `prefetch`       k = tasks.sync.get()
        batch numbers (the credits)                 images = aiomp.empty((B, 3, 64, 64))
                                                    images[j], labels[j] = dataset[i]  (collate
                                                      in place: one copy per sample, as torch)
      k, images, labels = batches.get()  <-------  batches.sync.put((k, images, labels))
      reorder buffer: batch k, k+1, ... in order    (a handle: the batch is not copied again)
      each batch handed out: tasks.put(next k)
      every k sent: tasks.close()   ------------>  QueueClosed: the worker returns, and the
                                                    last one out closes ``batches``:
      async for ends  <------------------------    the consumer's stream ends

Back-pressure: at most ``prefetch`` batches are requested and not yet handed out, so the
queue of finished batches and the reorder buffer never hold more than ``prefetch``, however
fast the workers are (``batches`` is bounded too, as a second line). Workers take the next
batch number when they are free, so a slow batch does not stall the other worker as
torch's round-robin does; the reorder buffer restores the order.

The stream ends by closing, not by counting: the last worker to return closes
``batches`` (each takes one of ``num_workers`` tokens from a third queue; whoever leaves it
empty is last), so ``async for`` ends after the last batch, with no task in the parent.
A worker that raises or dies cancels the consumer and the failure
(:class:`aiomp.ProcessRaisedException`) is raised from ``async with``. Leaving the block
early closes both queues: the workers stop at their next get or put.

``shared=False`` makes the workers collate into plain numpy arrays, which ``put`` copies
into shared memory; see the README's "Data loading" for when each is the better choice.
Prints batches/s and ``ok``::

    python examples/data_loader.py --workers 2 --batches 100 --backend trio
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import aiomp

# The workers import this module to find `_worker` and the dataset: the parent-only
# imports (anyio) are inside the functions that need them, so workers start lighter.

MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None] * 255
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None] * 255


class SyntheticImages:
    """A map-style dataset (``__len__``, ``__getitem__``, as torch's): sample ``i`` is a
    3 x 64 x 64 float32 image and an int label, made from ``(seed, i)`` alone, so any
    process builds the same sample. The work stands in for decoding and augmenting."""

    def __init__(self, length: int, seed: int = 0, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        self.length, self.seed, self.shape = length, seed, shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        if not 0 <= i < self.length:
            raise IndexError(f"sample {i} out of range for {self.length} samples")
        rng = np.random.default_rng((self.seed, i))
        img = rng.random(self.shape, dtype=np.float32)  # "decode": pixels in [0, 1)
        img *= 255.0
        np.floor(img, out=img)  # 8-bit levels
        img -= MEAN  # normalise per channel
        img /= STD
        if i % 2:
            img = np.ascontiguousarray(img[:, :, ::-1])  # horizontal flip
        return img, int(rng.integers(10))


def batch_count(dataset: SyntheticImages, batch_size: int) -> int:
    return -(-len(dataset) // batch_size)


def _worker(
    rank: int,
    dataset: SyntheticImages,
    batch_size: int,
    tasks: aiomp.Queue,
    batches: aiomp.Queue,
    alive: aiomp.Queue,
    shared: bool,
) -> int:
    """Build batch ``k`` for every ``k`` taken from ``tasks`` until it is closed; return
    how many this worker built. A closed ``batches`` (the consumer left) ends it too.
    The last worker to return closes ``batches``; one that raises leaves it open (the
    parent's spawn block reports the failure instead of a short stream)."""
    built = _build(dataset, batch_size, tasks, batches, shared)
    alive.get_nowait()  # our token
    if alive.empty():  # all have taken theirs: every batch is on the queue
        batches.close()  # two closing at once is harmless: close is idempotent
    return built


def _build(
    dataset: SyntheticImages,
    batch_size: int,
    tasks: aiomp.Queue,
    batches: aiomp.Queue,
    shared: bool,
) -> int:
    built = 0
    shape = dataset.shape
    while True:
        try:
            k = tasks.sync.get()
        except aiomp.QueueClosed:
            return built
        first = k * batch_size
        n = min(batch_size, len(dataset) - first)
        make = aiomp.empty if shared else np.empty
        images = make((n, *shape), np.float32)
        labels = np.empty(n, np.int64)  # 8 bytes a sample: travels inline
        for j in range(n):
            images[j], labels[j] = dataset[first + j]  # collate: one copy, in place
        try:
            batches.sync.put((k, images, labels))
        except aiomp.QueueClosed:
            return built
        # Drop our view now, not at the next allocation: the block can then be reused as
        # soon as the consumer drops it (leases: see aiomp/_memory/).
        del images, labels
        built += 1


class DataLoader:
    """``async with DataLoader(dataset, 64, num_workers=2) as loader:
    async for images, labels in loader: ...``.

    Batches come in order, ``images`` a ``(B, *sample_shape)`` float32 array in shared
    memory and ``labels`` int64. One pass over the dataset per ``async with`` (the workers
    start on entry and are joined on exit). ``prefetch`` (default ``4 * num_workers``)
    bounds the batches in flight. It is twice torch's default (``prefetch_factor=2``)
    because batches come out in order: a worker that falls behind holds back the credits,
    and with 4 in flight the other worker ran dry (on 2 quiet cores, 167 batches/s with 4
    in flight, 220 with 8, 298 with 16; torch's loader gained nothing from a larger
    prefetch_factor, being bound by its own CPU per batch). On cancellation, or any
    other way out of the block before the end, the queues are closed and the workers are
    stopped (joined, or terminated after ``grace_period`` seconds) before it propagates.

    ``start_method="fork"`` by default, as torch's loader on Linux: the workers start
    without importing anything (spawn or forkserver workers import numpy first, which
    made the first batch about 1 s later here). Use ``"forkserver"`` when the parent
    runs threads or has CUDA initialised (aiomp warns, or refuses, for fork then).
    """

    def __init__(
        self,
        dataset: SyntheticImages,
        batch_size: int,
        *,
        num_workers: int = 2,
        prefetch: int | None = None,
        shared: bool = True,
        start_method: str = "fork",
        grace_period: float = 5.0,
    ) -> None:
        if batch_size < 1 or num_workers < 1:
            raise ValueError("batch_size and num_workers must be at least 1")
        self.dataset, self.batch_size = dataset, batch_size
        self.num_workers = num_workers
        self.prefetch = max(1, prefetch if prefetch is not None else 4 * num_workers)
        self.shared, self.start_method, self.grace_period = shared, start_method, grace_period
        self.nbatches = batch_count(dataset, batch_size)
        self.ctx: aiomp.ProcessContext | None = None

    async def __aenter__(self) -> DataLoader:
        self._tasks = aiomp.Queue()
        self._batches = aiomp.Queue(maxsize=self.prefetch)
        self._sent = 0  # batch numbers requested so far
        self._next = 0  # the batch number to hand out next
        self._ready: dict[int, tuple[Any, Any]] = {}  # the reorder buffer
        alive = aiomp.Queue()
        for _ in range(self.num_workers):
            alive.put_nowait(None)
        for _ in range(min(self.prefetch, self.nbatches)):
            self._request()
        if self._sent == self.nbatches:
            self._tasks.close()
        self._spawn = aiomp.spawn(
            _worker,
            self.num_workers,
            start_method=self.start_method,
            grace_period=self.grace_period,
            args=(self.dataset, self.batch_size, self._tasks, self._batches, alive, self.shared),
        )
        self.ctx = await self._spawn.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        # Leaving early: workers blocked on either queue get QueueClosed and return.
        self._tasks.close()
        self._batches.close()
        self._ready.clear()
        return bool(await self._spawn.__aexit__(exc_type, exc, tb))

    def _request(self) -> None:
        self._tasks.put_nowait(self._sent)  # never full: unbounded, a few bytes each
        self._sent += 1

    def __aiter__(self) -> DataLoader:
        return self

    async def __anext__(self) -> tuple[Any, Any]:
        """The next batch in order. Cancellation loses nothing: a batch taken off the
        queue is in the reorder buffer before anything else can be awaited."""
        while self._next not in self._ready:
            try:
                k, images, labels = await self._batches.get()
            except aiomp.QueueClosed:
                if self._next < self.nbatches:
                    raise RuntimeError(f"the stream ended before batch {self._next}") from None
                raise StopAsyncIteration from None
            self._ready[k] = (images, labels)
        batch = self._ready.pop(self._next)
        self._next += 1
        if self._sent < self.nbatches:
            self._request()  # a credit for the batch just handed out
            if self._sent == self.nbatches:
                self._tasks.close()  # workers return once the last numbers are taken
        return batch


async def main(
    workers: int, nbatches: int, batch_size: int, shared: bool, start_method: str
) -> None:
    dataset = SyntheticImages(nbatches * batch_size - batch_size // 2)  # a short last batch
    expected = batch_count(dataset, batch_size)
    seen = 0
    start = time.perf_counter()
    first = None
    async with DataLoader(
        dataset,
        batch_size,
        num_workers=workers,
        shared=shared,
        start_method=start_method,
        grace_period=1.0,
    ) as loader:
        async for images, labels in loader:
            if first is None:
                first = time.perf_counter() - start
            assert images.shape[1:] == dataset.shape and len(images) == len(labels)
            assert aiomp.is_shared(images)
            k = seen  # batches arrive in order: batch k holds samples k*B, k*B+1, ...
            img, label = dataset[k * batch_size + len(images) - 1]
            assert np.array_equal(images[-1], img) and labels[-1] == label, f"batch {k}"
            seen += 1
    elapsed = time.perf_counter() - start
    assert seen == expected and first is not None, (seen, expected)
    assert loader.ctx is not None and sum(loader.ctx.results) == expected  # type: ignore[arg-type]
    print(
        f"{seen} batches of {batch_size} from {workers} workers "
        f"({'aiomp.empty' if shared else 'numpy'} batches, {start_method}): "
        f"{seen / elapsed:.1f} batches/s, first batch after {first * 1e3:.0f} ms; "
        f"per worker {loader.ctx.results}"
    )
    print("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--numpy", action="store_true", help="collate into plain numpy arrays (put copies them)"
    )
    parser.add_argument("--start-method", default="fork", choices=["fork", "forkserver", "spawn"])
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    a = parser.parse_args()
    import anyio

    anyio.run(
        main, a.workers, a.batches, a.batch_size, not a.numpy, a.start_method, backend=a.backend
    )
