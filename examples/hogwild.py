"""Hogwild: four processes train one linear model by SGD, sharing its weights lock-free.

::

    parent: w = aiomp.zeros(...)      one weight vector in shared memory
            X, y (numpy)              the data set: travels to the workers as shared arrays
    worker i: for each minibatch of its shard:  w -= lr * grad(w)   (in place, no lock)
              after each epoch: report its loss on a queue

Every worker updates the same memory: ``w`` reaches them through ``spawn(args=...)`` as a
handle, not a copy, and their writes race (that is Hogwild: sparse-enough updates make
the races harmless). The parent prints the loss after each epoch as it falls, then the
final loss of the shared weights, and ``ok``::

    python examples/hogwild.py --workers 4 --epochs 6 --backend trio
"""

from __future__ import annotations

import argparse

import anyio
import numpy as np

import aiomp


def make_data(n: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A linear regression problem ``y = X @ w_true + noise``."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, features))
    w_true = rng.standard_normal(features)
    y = X @ w_true + 0.1 * rng.standard_normal(n)
    return X, y, w_true


def mse(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((X @ w - y) ** 2))


def train(
    rank: int,
    nprocs: int,
    w: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    losses: aiomp.Queue,
    epochs: int,
    lr: float,
    batch: int,
) -> int:
    """One Hogwild worker: SGD on its shard, writing straight into the shared ``w``."""
    assert aiomp.is_shared(w) and aiomp.is_shared(X), "handles, not copies"
    rng = np.random.default_rng(rank)
    shard = np.arange(rank, len(X), nprocs)
    steps = 0
    for epoch in range(epochs):
        rng.shuffle(shard)
        for start in range(0, len(shard), batch):
            idx = shard[start : start + batch]
            xb, yb = X[idx], y[idx]
            grad = 2.0 * xb.T @ (xb @ w - yb) / len(idx)
            w -= lr * grad  # in place, in shared memory, no lock: Hogwild
            steps += 1
        losses.sync.put((epoch, rank, mse(w, X[shard], y[shard])))
    return steps


async def main(workers: int, epochs: int, samples: int, features: int, lr: float) -> None:
    X, y, w_true = make_data(samples, features)
    w = aiomp.zeros(features)  # the model, in shared memory
    losses = aiomp.Queue()
    start_loss = mse(w, X, y)
    print(f"{workers} workers, {samples} samples, {features} features")
    print(f"epoch  -  loss {start_loss:.4f}")
    per_epoch: dict[int, list[float]] = {}
    with anyio.fail_after(60):
        async with aiomp.spawn(
            train, workers, grace_period=1.0, args=(workers, w, X, y, losses, epochs, lr, 16)
        ) as ctx:
            for _ in range(workers * epochs):
                epoch, _rank, loss = await losses.get()
                per_epoch.setdefault(epoch, []).append(loss)
                if len(per_epoch[epoch]) == workers:
                    print(f"epoch {epoch + 1:2d} loss {np.mean(per_epoch[epoch]):.4f}")
    final = mse(w, X, y)
    print(
        f"final loss {final:.5f} after {sum(ctx.results)} steps "  # type: ignore[arg-type]
        f"(|w - w_true| = {np.linalg.norm(w - w_true):.4f})"
    )
    means = [float(np.mean(per_epoch[e])) for e in range(epochs)]
    assert means[-1] < means[0] < start_loss, "the loss fell"
    assert final < 0.05 * start_loss
    print("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    a = parser.parse_args()
    anyio.run(main, a.workers, a.epochs, a.samples, a.features, a.lr, backend=a.backend)
