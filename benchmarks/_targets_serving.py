"""What the serving comparison's workers run (importable by children): issue 28's model,
``tanh(x @ W)`` with a 512 x 512 float32 ``W`` loaded by the pool's initializer."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

DIM = 512
_W: Any = None


def load(dim: int = DIM, seed: int = 0) -> None:
    global _W
    rng = np.random.default_rng(seed)
    _W = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)


def model(batch: Any) -> Any:
    """A batch of rows (stacked: axis 0)."""
    return np.tanh(batch @ _W)


def model_row(x: Any) -> Any:
    """One row, as a plain ``apply`` serves it."""
    return np.tanh(x @ _W)


def batch_compute(rows: int, reps: int) -> float:
    """Median seconds of ``model`` on a batch of ``rows``, timed inside the worker."""
    batch = np.random.default_rng(1).standard_normal((rows, DIM)).astype(np.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(batch)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
