"""Children for the "enqueue 100k small items, then drain them" comparison.

Module level, standard library only at import time (see ``_targets``). Each child pins
itself, says it is ready, waits for the parent to finish enqueueing, drains every item and
says it is done: the parent times from its first put to that answer.
"""

from __future__ import annotations

from benchmarks._common import pin_child


def drain_mp(q: object, ready: object, go: object, done: object, n: int) -> None:
    """multiprocessing.Queue: drain n items after ``go``, once per round, until n == 0."""
    pin_child()
    get = q.get  # type: ignore[attr-defined]
    ready.put(True)  # type: ignore[attr-defined]
    while (count := go.get()) > 0:  # type: ignore[attr-defined]
        for _ in range(count):
            get()
        done.put(True)  # type: ignore[attr-defined]


def drain_aiomp(rank: int, q: object, ready: object, go: object, done: object, n: int) -> None:
    """aiomp.Queue through ``q.sync``: the same protocol."""
    pin_child()
    get = q.sync.get  # type: ignore[attr-defined]
    ready.sync.put(True)  # type: ignore[attr-defined]
    while (count := go.sync.get()) > 0:  # type: ignore[attr-defined]
        for _ in range(count):
            get()
        done.sync.put(True)  # type: ignore[attr-defined]
