"""Fresh global random seeds for a child that a fork copied them into.

A ``fork`` or ``forkserver`` child starts with a copy of its parent's (or the fork
server's) memory, global generators included: Python's ``random`` reseeds itself after a
fork, numpy's and torch's do not, so every worker would draw the same "random" numbers
(dropout masks, augmentations, sampled batches). torch's DataLoader seeds each worker;
aiomp does the same for every child a fork starts: :func:`child_seed` derives its seed
from a base its pool (or spawn call) draws once and the worker's slot (a spawn child's
rank) and start, and :func:`reseed` seeds ``random``, and numpy and torch where this
process has already imported them (a module imported later seeds itself from the OS, as
in a ``spawn`` child). Owns nothing; standard library only (every child imports it).
"""

from __future__ import annotations

import os
import sys

_MASK = (1 << 64) - 1


def base_seed() -> int:
    """A fresh 64-bit base for one pool's or spawn call's children."""
    return int.from_bytes(os.urandom(8), "little")


def child_seed(base: int, slot: int, start: int = 0) -> int:
    """The 64-bit seed of the ``start``-th worker started in ``slot`` under ``base``:
    distinct for every slot and start (splitmix64's finaliser over their sum)."""
    z = (base + (slot << 32) + start + 1) * 0x9E3779B97F4A7C15 & _MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def reseed(seed: int) -> None:
    """Seed ``random``, and numpy's and torch's global generators if already imported."""
    import random  # a fork child has it already; a spawn child never comes here

    random.seed(seed)
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        # The legacy global RandomState takes 32-bit words: both halves of the seed.
        np_random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch = sys.modules.get("torch")
    manual_seed = getattr(torch, "manual_seed", None)
    if manual_seed is not None:
        manual_seed(seed)
