"""Hogwild with torch: four processes train one MLP, sharing its parameters lock-free.

torch's ``mnist_hogwild`` example, ported to aiomp, on synthetic data so that it runs in
seconds on a CPU::

    parent: model = Net(); model.share_memory()     parameters in shared memory (fds)
            X, y (torch)                             moved into shared memory when sent
    rank i: own optimizer over the *shared* parameters; for each minibatch of its shard:
            loss.backward(); optimizer.step()        (in place, no lock)
            after each epoch: report its loss on a queue

The model reaches the ranks through ``spawn(args=...)``: every parameter travels as the
fd of its storage, so all four write into the same memory (torch.multiprocessing would
send the same fds through its resource sharer). The parent watches the loss fall through
an async queue, then evaluates the shared model it never trained itself, and prints
``ok``::

    python examples/hogwild_torch.py --ranks 4 --epochs 3
"""

from __future__ import annotations

import argparse

import anyio

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ModuleNotFoundError as exc:
    raise SystemExit(
        f"this example needs torch ({exc}): pip install torch, or its CPU build: "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    ) from None

import aiomp


class Net(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def make_data(n: int, features: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gaussian blobs, one per class: an MNIST-sized problem an MLP learns in seconds."""
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (n,), generator=g)
    X = centers[y] + torch.randn(n, features, generator=g)
    split = n * 4 // 5
    return X[:split], y[:split], X[split:], y[split:]


def train(
    rank: int,
    nranks: int,
    model: Net,
    X: torch.Tensor,
    y: torch.Tensor,
    losses: aiomp.Queue,
    epochs: int,
    lr: float,
    batch: int,
) -> int:
    """One Hogwild rank: SGD on its shard, stepping the shared parameters in place."""
    torch.set_num_threads(1)  # as torch's example: ranks must not oversubscribe the cores
    torch.manual_seed(rank)
    assert all(p.is_shared() for p in model.parameters()), "the parent's memory, not a copy"
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    shard = torch.arange(rank, len(X), nranks)
    steps = 0
    for epoch in range(epochs):
        order = shard[torch.randperm(len(shard))]
        total = 0.0
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            optimizer.step()  # writes the shared parameters: Hogwild
            total += loss.item() * len(idx)
            steps += 1
        losses.sync.put((epoch, rank, total / len(order)))
    return steps


@torch.no_grad()
def accuracy(model: Net, X: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(X).argmax(1) == y).float().mean())


async def main(ranks: int, epochs: int, samples: int, lr: float) -> None:
    features, classes = 64, 10
    X, y, X_test, y_test = make_data(samples, features, classes)
    torch.manual_seed(0)
    model = Net(features, 128, classes)
    model.share_memory()  # as with torch.multiprocessing: the ranks get this memory
    before = accuracy(model, X_test, y_test)
    print(f"{ranks} ranks, {len(X)} samples; test accuracy before: {before:.3f}")
    losses = aiomp.Queue()
    per_epoch: dict[int, list[float]] = {}
    with anyio.fail_after(300):  # each rank imports torch: seconds on a busy machine
        async with aiomp.spawn(
            train, ranks, grace_period=1.0, args=(ranks, model, X, y, losses, epochs, lr, 32)
        ) as ctx:
            for _ in range(ranks * epochs):
                epoch, _rank, loss = await losses.get()
                per_epoch.setdefault(epoch, []).append(loss)
                if len(per_epoch[epoch]) == ranks:
                    print(f"epoch {epoch + 1:2d} loss {sum(per_epoch[epoch]) / ranks:.4f}")
    after = accuracy(model, X_test, y_test)  # the parent never trained: the ranks did
    print(f"test accuracy after {sum(ctx.results)} steps: {after:.3f}")  # type: ignore[arg-type]
    means = [sum(per_epoch[e]) / ranks for e in range(epochs)]
    assert means[-1] < means[0], "the loss fell"
    assert after > max(0.9, before), "the shared model learned"
    print("ok")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5_000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    a = parser.parse_args()
    anyio.run(main, a.ranks, a.epochs, a.samples, a.lr, backend=a.backend)
