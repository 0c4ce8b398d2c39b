"""Datasets that tests/meta/test_examples_loader.py hands to loader workers (importable by
children)."""

from __future__ import annotations

from typing import Any

from examples.data_loader import SyntheticImages


class BrokenAt(SyntheticImages):
    """Sample ``bad`` raises, as a corrupt file would."""

    def __init__(self, length: int, bad: int) -> None:
        super().__init__(length, shape=(3, 8, 8))
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return super().__getitem__(i)


def send_each_twice(rank: int, q: Any, acks: Any, count: int, nbytes: int) -> None:
    """Put ``count`` arrays of a segment each, twice round, waiting for an ack after each
    put (the parent has dropped the array by then): the parent sees each segment come back
    after all the others."""
    import numpy as np

    import aiomp

    arrays = [aiomp.empty(nbytes, np.uint8) for _ in range(count)]
    for _ in range(2):
        for a in arrays:
            q.sync.put(a)
            acks.sync.get(timeout=60)
