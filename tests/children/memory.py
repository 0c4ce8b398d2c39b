"""Functions that the shared-memory regression tests and the chaos suite run in children.

Kept apart from ``tests.children.common`` (shared by every area). Standard library only at
module level: spawn children import this module to unpickle their function.
"""

from __future__ import annotations

import os


def drain(rank: int, q: object, n: int, strategy: str) -> list[int]:
    """Take ``n`` arrays and return each one's first value."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    seen = []
    for _ in range(n):
        arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        seen.append(int(arr[0]))
        del arr
    return seen


def put_unread_and_wait(rank: int, q: object, ready: object, strategy: str) -> None:
    """Put a shared array on ``q`` that nobody will read, say ready, and wait to die."""
    import signal

    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    q.sync.put(np.full(200_000, rank, np.float64))  # type: ignore[attr-defined]
    ready.sync.put(os.getpid())  # type: ignore[attr-defined]
    while True:
        signal.pause()


def signal_then_wait(started: object, go: object) -> bool:
    """Pool task: say it runs, then wait for ``go`` (keeps its worker busy)."""
    started.set()  # type: ignore[attr-defined]
    return bool(go.sync.wait(timeout=60))  # type: ignore[attr-defined]


def nbytes(arr: object) -> int:
    return int(arr.nbytes)  # type: ignore[attr-defined]
