"""DistributedDataParallel across the nodes of a Ray cluster, with ``aiomp.ray.spawn``.

::

    async with aiomp.ray.spawn(train, 2, rendezvous=True, address=...) as ctx:
        ...                      # the parent's event loop is free: serve, watch, log
    losses = ctx.results         # each rank's return value, in rank order

The same program as a local ``aiomp.spawn(train, 2, rendezvous=True)`` job, with the ranks
as Ray actors that a placement group puts on the cluster's nodes, all or none. Each rank
finds torchrun's variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` on rank 0's node, a free ``MASTER_PORT``), so
``init_process_group("gloo")`` needs no other argument; its prints reach this terminal as
``[rank N] ...``. A rank that raises ends the job at once with its traceback
(``aiomp.ProcessRaisedException``), the others are stopped and the cluster's resources
come back; ``--fail`` shows that. ``train`` is defined in this script: it travels by value
(cloudpickle), so the nodes need aiomp and torch, not this file.

Without ``--address`` it starts a local Ray instance (or joins the one running on this
machine) and stops what it started at the end. Prints ``ok`` and exits::

    python examples/ray_ddp.py [--address auto] [--ranks 2] [--steps 20] [--fail]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiomp
import aiomp.ray

DIM = 16


def train(rank: int, steps: int, fail: bool) -> tuple[float, float]:
    """One DDP rank: fit a linear model to this rank's shard of a synthetic problem;
    ``(its last loss, a checksum of its weights)``: DDP keeps the weights equal."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)  # the same initial model on every rank (DDP checks it too)
        model = DistributedDataParallel(torch.nn.Linear(DIM, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1000 + rank)  # this rank's shard of the data
        w_true = torch.arange(DIM, dtype=torch.float32) / DIM
        loss = torch.tensor(0.0)
        for step in range(steps):
            x = torch.randn(64, DIM, generator=g)
            y = x @ w_true + 0.5
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()  # gradients all-reduced across the ranks' nodes
            opt.step()
            if fail and rank == 1 and step == steps // 2:
                raise RuntimeError(f"rank {rank} gave up at step {step}")
        print(f"node {os.environ['MASTER_ADDR']}: loss {loss.item():.4f}", flush=True)
        checksum = float(sum(p.detach().sum() for p in model.parameters()))
        return float(loss.item()), checksum
    finally:
        dist.destroy_process_group()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default=None, help='a Ray cluster: "auto", "ray://..."')
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fail", action="store_true", help="rank 1 raises mid-training")
    args = parser.parse_args()

    start = time.monotonic()
    job = aiomp.ray.spawn(
        train,
        args.ranks,
        (args.steps, args.fail),
        address=args.address,
        rendezvous=True,
        strategy="SPREAD",  # one rank a node where the cluster has as many
        grace_period=2.0,
    )
    try:
        async with job as ctx:
            where = sorted({a.node_id for a in ctx.actors()})
            print(f"{args.ranks} ranks on {len(where)} node(s)")
    except aiomp.ProcessRaisedException as exc:
        assert args.fail, exc
        print(f"the job ended in {time.monotonic() - start:.1f} s: {exc.msg.splitlines()[0]}")
        print(f"  its cause: {exc.__cause__!r}")
        print("ok")
        return
    losses = [loss for loss, _ in ctx.results]
    checksums = {round(c, 4) for _, c in ctx.results}
    print(f"losses by rank: {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"{time.monotonic() - start:.1f} s, weights equal on every rank: {len(checksums) == 1}")
    assert not args.fail and len(checksums) == 1, ctx.results
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())  # Ray's async API is asyncio's (uvloop works too; trio does not)
