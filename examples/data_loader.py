"""Training with ``aiomp.DataLoader``: torch's DataLoader, async or sync, that survives its
workers and resumes mid-epoch.

From torch, the change is the import and a block that starts the workers::

    loader = torch.utils.data.DataLoader(ds, 64, shuffle=True, num_workers=2)
    with aiomp.DataLoader(ds, 64, shuffle=True, num_workers=2) as loader:   # sync
    async with aiomp.DataLoader(ds, 64, shuffle=True, num_workers=2) as loader:   # async

The dataset is ImageFolder-like synthetic data (a seeded image and a label per index);
the "model" is a linear classifier trained by numpy SGD, so the example needs no torch.
Prints batches/s, the loss, and ``ok``::

    python examples/data_loader.py --workers 2 --batches 40 --backend trio
    python examples/data_loader.py --sync
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import aiomp

# The workers import this module to find the dataset: the parent-only imports (anyio)
# are inside the functions that need them, so workers start lighter.

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


class Linear:
    """A linear classifier over the flattened image, trained by plain SGD."""

    def __init__(self, features: int, classes: int = 10) -> None:
        self.w = np.zeros((features, classes), np.float32)

    def step(self, images: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> float:
        x = images.reshape(len(images), -1) / np.float32(x_scale(images))
        logits = x @ self.w
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[np.arange(len(labels)), labels] + 1e-9).mean())
        p[np.arange(len(labels)), labels] -= 1
        self.w -= 0.1 * (x.T @ p) / len(labels)
        return loss


def x_scale(images: np.ndarray[Any, Any]) -> float:
    return float(np.sqrt(images[0].size))


def report(seen: int, elapsed: float, loss: float, state: dict[str, Any]) -> None:
    print(f"{seen} batches, {seen / elapsed:.1f} batches/s, last loss {loss:.3f}, at {state}")


async def train_async(args: argparse.Namespace) -> None:
    dataset = SyntheticImages(args.batches * args.batch_size)
    model = Linear(int(np.prod(dataset.shape)))
    start, seen, loss = time.perf_counter(), 0, 0.0
    async with aiomp.DataLoader(
        dataset, args.batch_size, shuffle=True, num_workers=args.workers, seed=0
    ) as loader:
        for _epoch in range(args.epochs):
            async for images, labels in loader:
                assert aiomp.is_shared(images)  # the workers' memory: no copy
                loss = model.step(images, labels)
                seen += 1
        state = loader.state_dict()  # resume from here with load_state_dict(state)
    report(seen, time.perf_counter() - start, loss, state)
    assert seen == args.epochs * len(loader)


def train_sync(args: argparse.Namespace) -> None:
    dataset = SyntheticImages(args.batches * args.batch_size)
    model = Linear(int(np.prod(dataset.shape)))
    start, seen, loss = time.perf_counter(), 0, 0.0
    with aiomp.DataLoader(
        dataset, args.batch_size, shuffle=True, num_workers=args.workers, seed=0
    ) as loader:
        for _epoch in range(args.epochs):
            for images, labels in loader:
                loss = model.step(images, labels)
                seen += 1
        state = loader.state_dict()
    report(seen, time.perf_counter() - start, loss, state)
    assert seen == args.epochs * len(loader)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--sync", action="store_true", help="a plain for loop, no event loop")
    a = parser.parse_args()
    if a.sync:
        train_sync(a)
    else:
        import anyio

        anyio.run(train_async, a, backend=a.backend)
    print("ok")
