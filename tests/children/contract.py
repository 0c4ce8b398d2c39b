"""Functions the worker-kind contract suite runs (importable by every kind's workers)."""

from __future__ import annotations

import os
import time


def square(x: int) -> int:
    return x * x


def refuse(what: str) -> None:
    raise LookupError(f"refused {what}")


def nap(seconds: float) -> float:
    """A sync task that runs longer than the test waits: stopping it kills its worker."""
    time.sleep(seconds)  # handshake-free: the work itself; the test stops it first
    return seconds


def die(code: int) -> None:
    """The worker dies while it runs this task."""
    os._exit(code)
