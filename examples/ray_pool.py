"""The pipeline of ``examples/pool_pipeline.py`` on Ray: the same code, the workers Ray actors.

::

    files on disk --(anyio threads)--> async source --(pool.imap)--> consumer
                      load .npy            batches      augment +      running
                                                       featurize      statistics
                                                     (Ray actors, any node)

Two lines differ from the local pipeline: ``import aiomp.ray`` and
``aiomp.ray.Pool(..., address=...)`` instead of ``aiomp.Pool(...)``. What changes with them:
each batch (256 KiB: arrays of 100 KiB or more go by reference) travels through Ray's
object store and arrives in the actor read-only (``featurize`` makes new arrays, so it does not
mind); the pool takes seconds to start (a Ray instance, if none runs, then one process per
actor) where a local pool takes milliseconds; and it runs on asyncio or uvloop, not trio.
``featurize`` is defined in this script: aiomp.ray pickles it by value (cloudpickle), so
the actors need not import this file.

Without ``--address`` it starts a local Ray instance (or joins the one running on this
machine) and stops what it started at the end. Prints ``ok`` and exits::

    python examples/ray_pool.py --batches 24 [--address auto]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np

import aiomp.ray

BATCH = (64, 32, 32)  # 64 images of 32 x 32


def write_dataset(root: Path, batches: int) -> list[Path]:
    """Stand-in for a real dataset: ``batches`` .npy files of random images."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(batches):
        path = root / f"batch-{i:04d}.npy"
        np.save(path, rng.random(BATCH, dtype=np.float32))
        paths.append(path)
    return paths


def featurize(batch: np.ndarray) -> np.ndarray:
    """CPU work in an actor: flip-augment, normalise, 2-D spectrum features."""
    augmented = np.concatenate([batch, batch[:, :, ::-1]])
    normalised = (augmented - augmented.mean()) / (augmented.std() + 1e-6)
    spectrum = np.abs(np.fft.rfft2(normalised))
    features: np.ndarray = spectrum.mean(axis=0).astype(np.float32)  # one map per batch
    return features


class Progress:
    """What has been loaded and consumed so far, to show the back-pressure."""

    def __init__(self) -> None:
        self.loaded = 0
        self.consumed = 0
        self.most_ahead = 0


async def load(paths: list[Path], progress: Progress) -> AsyncIterator[np.ndarray]:
    """The async source: reads each file on a worker thread, off the event loop."""
    for path in paths:
        batch = await anyio.to_thread.run_sync(np.load, path)
        progress.loaded += 1
        progress.most_ahead = max(progress.most_ahead, progress.loaded - progress.consumed)
        yield batch


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--buffersize", type=int, default=4)
    parser.add_argument("--address", default=None, help='a Ray cluster: "auto", "ray://..."')
    args = parser.parse_args()

    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="aiomp-ray-pipeline-") as tmp:
        paths = write_dataset(Path(tmp), args.batches)
        async with aiomp.ray.Pool(args.processes, address=args.address) as pool:
            total = np.zeros((BATCH[1], BATCH[2] // 2 + 1), dtype=np.float64)
            async with pool.imap(
                featurize, load(paths, progress), buffersize=args.buffersize
            ) as features:
                async for feature_map in features:
                    total += feature_map  # a training step would go here
                    progress.consumed += 1
                    await anyio.sleep(0.005)  # a consumer slower than the loader

    mean = total / progress.consumed
    print(
        f"{progress.consumed} batches; mean feature {mean.mean():.4f}; the loader was "
        f"at most {progress.most_ahead} batches ahead (buffersize {args.buffersize})"
    )
    assert progress.consumed == args.batches
    # The loader can run one batch past the buffer: the one it is handing over.
    assert progress.most_ahead <= args.buffersize + 1, progress.most_ahead
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())  # Ray's async API is asyncio's (uvloop works too; trio does not)
