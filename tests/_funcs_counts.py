"""Child functions for the queue-count and wake-up tests (tests/test_queue.py)."""

from __future__ import annotations

from typing import Any


def take_and_put(rank: int, q: Any, take: int, put: int) -> int:
    """Take ``take`` items, put ``put`` more; returns what qsize() said here after."""
    for _ in range(take):
        q.sync.get(timeout=30)
    for i in range(put):
        q.sync.put(i)
    return int(q.qsize())
