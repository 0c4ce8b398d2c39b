"""What the chaos scenarios check with (test side; children import ``_chaos``): bounds,
exactly-once delivery, names, rss and fds, processes gone. Importing it prints the
session's random seed.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import pytest

from tests.chaos import _chaos

GRACE = 0.5
TIMEOUT = 60
SEEDS = pytest.mark.parametrize("seed", _chaos.SEEDS, ids=[f"seed{s}" for s in _chaos.SEEDS])


def exactly_once(expected: list[Any], got: list[Any]) -> tuple[int, int]:
    """(lost, duplicated); asserts both are 0."""
    counts = Counter(got)
    lost = sum(1 for k in expected if k not in counts)
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    unknown = set(counts) - set(expected)
    assert not (lost or duplicated or unknown), (lost, duplicated, sorted(unknown)[:5])
    return lost, duplicated


def names_of(pids: list[int]) -> set[str]:
    return _chaos.shm_names_of(pids)


print(
    f"\naiomp chaos: random seed {_chaos.RANDOM_SEED} (AIOMP_CHAOS_SEED={_chaos.RANDOM_SEED} "
    "replays it)",
    file=sys.stderr,
)
