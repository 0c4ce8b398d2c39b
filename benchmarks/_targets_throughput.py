"""Children for the per-call throughput comparison (``bench_throughput``).

Module level, standard library only at import time (see ``_targets``): the task every
pool runs, and the noisy neighbour's processes.
"""

from __future__ import annotations

import os
import time


def burn(ms: float) -> None:
    """``ms`` milliseconds of this thread's CPU time (not wall-clock time: a task whose
    worker waits for a core still does all of its work, so no pool gains from being
    descheduled, and more workers than cores cannot do more than the cores can)."""
    clock = time.thread_time
    end = clock() + ms / 1e3
    while clock() < end:
        pass


def spin() -> None:
    """A neighbour that wants a whole core, forever."""
    while True:
        pass


def ping_pong(rfd: int, wfd: int, first: bool) -> None:
    """One end of a pipe ping-pong pair: a neighbour that wakes up all the time, as a
    chatty service does (each wake-up takes a core from whoever runs there)."""
    if first:
        os.write(wfd, b"x")
    while True:
        os.read(rfd, 1)
        os.write(wfd, b"x")
