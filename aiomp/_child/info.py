"""Who am I: the worker information of a process aiomp started (``aiomp.get_worker_info``).

Set once by the process's own start (a Pool worker, a spawned child, a DataLoader worker)
before the user's code runs; ``None`` in any other process, including a process that a
worker starts itself (a fork of a worker inherits the value: it is kept with the pid it
was set for, and a process with another pid reads ``None``). Standard library only: every
child imports it.
"""

from __future__ import annotations

import os


class WorkerInfo:
    """torch's ``WorkerInfo`` names: ``id`` (the worker's slot ``0..n-1``, or a spawned
    child's rank), ``num_workers``, ``seed`` and ``dataset`` (a DataLoader's: the seed of
    the batch being built and the loader's dataset; None elsewhere), plus ``pid``.

    Read-only, as torch's: assigning an attribute raises RuntimeError (only aiomp's own
    worker code moves ``seed``, ``id`` and ``dataset``, through :func:`update`)."""

    __slots__ = ("dataset", "id", "num_workers", "pid", "seed")

    id: int
    num_workers: int
    seed: int | None
    dataset: object
    pid: int

    def __init__(
        self, id: int, num_workers: int, seed: int | None = None, dataset: object = None
    ) -> None:
        update(self, id=id, num_workers=num_workers, seed=seed, dataset=dataset, pid=os.getpid())

    def __setattr__(self, name: str, value: object) -> None:
        raise RuntimeError(f"Cannot assign attributes to {type(self).__name__} objects")

    def __delattr__(self, name: str) -> None:
        raise RuntimeError(f"Cannot delete attributes of {type(self).__name__} objects")

    def __repr__(self) -> str:
        return (
            f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
            f"pid={self.pid})"
        )


def update(info: WorkerInfo, **fields: object) -> None:
    """Set ``fields`` of ``info`` (aiomp's worker code: a DataLoader worker moves ``seed``
    per batch, and ``id`` and ``dataset`` per shard of an iterable dataset)."""
    for name, value in fields.items():
        object.__setattr__(info, name, value)


_info: WorkerInfo | None = None


def set_worker_info(
    id: int, num_workers: int, seed: int | None = None, dataset: object = None
) -> WorkerInfo:
    """Record this process's worker information (its start calls this, once; a
    DataLoader worker updates ``seed`` per batch on the object returned)."""
    global _info
    _info = WorkerInfo(id, num_workers, seed, dataset)
    return _info


def get_worker_info() -> WorkerInfo | None:
    """This process's :class:`WorkerInfo`, or None: aiomp did not start this process."""
    info = _info
    if info is None or info.pid != os.getpid():
        return None
    return info
