"""Helpers shared by the shared-memory tests: bounds, name and fd counts, round trips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiomp._arrays import numpy as _numpy
from aiomp._arrays import shared as _shared
from aiomp._memory import blocks as _blocks
from aiomp._memory import janitor as _janitor
from aiomp._memory import registry as _registry
from aiomp._memory.segment import Segment

TIMEOUT = 20
GRACE = 0.5
REPO = Path(__file__).resolve().parents[2]
INLINE = _numpy.INLINE_THRESHOLD
#: Array tests whose subject is the shared-memory layer, not the event loop, run on one.
ONE_LOOP = pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
BOTH_STRATEGIES = pytest.mark.parametrize(
    "strategy", ["file_descriptor", "file_system"], indirect=True
)


def shm_names() -> set[str]:
    return {n for n in os.listdir(_janitor.SHM_DIR) if n.startswith("aiomp")}


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def segment_count() -> int:
    return sum(len(segs) for segs in _registry.REGISTRY.pool.segments.values())


def segment_of(arr: np.ndarray[Any, Any]) -> Segment:
    ref = _blocks.block_of(_shared.root(arr))
    assert ref is not None
    return ref.segment


def big(dtype: Any = np.float64, factor: int = 2) -> np.ndarray[Any, Any]:
    """An array above the inline threshold, filled with distinct values."""
    dtype = np.dtype(dtype)
    n = factor * INLINE // dtype.itemsize + 3
    return np.arange(n).astype(dtype)
