"""Rank functions for tests/ray/test_spawn.py (``aiomp.ray.spawn``), importable by actors.

Ranks meet the test at a :class:`tests._gate.Gate` (an abstract unix socket: every node of
the test's ``ray.cluster_utils.Cluster`` runs on this machine), so no test sleeps on a rank.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiomp
from tests.children.common import gate_connect, gate_wait


def where(rank: int, x: int) -> tuple[int, int, Any, str, int]:
    """Say hello on stdout and stderr; ``(rank, x, worker info, node id, pid)``."""
    import ray

    print(f"hello from rank {rank}", flush=True)
    os.write(2, b"to stderr\n")
    info = aiomp.get_worker_info()
    who = None if info is None else (info.id, info.num_workers)
    return rank, x, who, ray.get_runtime_context().get_node_id(), os.getpid()


def all_reduce(rank: int) -> tuple[float, dict[str, str]]:
    """A gloo all-reduce of ``rank + 1`` over the job, by torchrun's variables alone."""
    import torch
    import torch.distributed as dist

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    env = {k: os.environ[k] for k in names}
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t.item()), env
    finally:
        dist.destroy_process_group()


def fail_or_wait(rank: int, address: str) -> None:
    """Rank 0 waits at the gate (a sync rank: only a kill stops it); rank 1 raises once
    rank 0 is there."""
    if rank == 0:
        gate_wait(rank, address)
        return
    with gate_connect(rank, address) as s:
        s.recv(1)  # the test releases rank 1 once rank 0 waits
    raise ValueError(f"rank {rank} failed")


def at_gate(rank: int, address: str) -> int:
    gate_wait(rank, address)
    return rank


async def async_at_gate(rank: int, address: str, path: str) -> None:
    """Wait at the gate; cancelled, write ``cancelled`` to ``path`` and go on."""
    s = gate_connect(rank, address)
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        with open(f"{path}.{rank}", "w") as f:  # noqa: ASYNC230 - a few bytes
            f.write("cancelled")
        raise
    finally:
        s.close()


def square(rank: int) -> int:
    return rank * rank


def unpicklable(rank: int) -> object:
    """A return value no pickler can carry (a generator)."""
    return (i for i in range(rank + 1))
