"""What a Pool takes and gives besides its calls: the options every kind of pool checks,
the inputs ``map`` and ``imap`` accept, and :class:`PoolStatistics`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterable, Callable, Iterable
from typing import TypeAlias, TypeVar

from .._process import checks as _process

S = TypeVar("S")
#: What map and imap take: items, from a sync or an async iterable.
Inputs: TypeAlias = Iterable[S] | AsyncIterable[S]
#: ``on_progress(done, total)``, called as results come in.
Progress: TypeAlias = Callable[[int, int], object] | None


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a :class:`Pool`, from :meth:`Pool.statistics`.

    A "task" is one ``apply`` call or one chunk of a ``map`` / ``imap``.
    """

    #: Worker processes that take tasks (starting ones included; retiring ones not).
    workers: int
    #: Workers that are ready and hold no task.
    idle: int
    #: Workers that hold at least one task.
    busy: int
    #: Tasks held by workers.
    running: int
    #: Tasks waiting in the pool for a worker.
    queued: int
    #: Tasks finished, successfully or not.
    completed: int
    #: Workers started to replace one that died, was killed or retired.
    replaced: int


def check_options(
    processes: int | None, concurrency: int, maxtasksperchild: int | None, grace_period: float
) -> tuple[int | None, int, int | None, float]:
    """The options every kind of pool takes, checked: a wrong type is a TypeError, a
    number below 1 a ValueError, as Python's pools raise."""
    if processes is not None:
        processes = _process.count("processes", processes)
    concurrency = _process.count("concurrency", concurrency)
    if maxtasksperchild is not None:
        maxtasksperchild = _process.count("maxtasksperchild", maxtasksperchild)
    if grace_period < 0:
        raise ValueError(f"grace_period must be >= 0, not {grace_period!r}")
    return processes, concurrency, maxtasksperchild, float(grace_period)
