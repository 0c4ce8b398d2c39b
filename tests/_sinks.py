"""What output, queue and process tests share: a line sink, a meter of the loop's stalls,
and a wait for a process to end."""

from __future__ import annotations

import os
import time

import anyio


class Lines:
    """A callable sink that keeps ``(rank, stream, line)``."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str, str]] = []

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.got.append((rank, stream, line))

    def of(self, rank: int, stream: str) -> list[str]:
        return [line for r, s, line in self.got if (r, s) == (rank, stream)]


class Stalls:
    """Run :meth:`watch` as a task beside the code under test: ``worst`` is the longest its
    short sleeps overran, how long the loop ran nothing else; ``ticks`` how often it ran.
    (A deliberate sleep: it measures the loop, it waits for nothing.)"""

    TICK = 0.005

    def __init__(self) -> None:
        self.worst = 0.0
        self.ticks = 0

    async def watch(self) -> None:
        while True:
            start = time.monotonic()
            await anyio.sleep(self.TICK)  # handshake-free: the meter itself
            self.worst = max(self.worst, time.monotonic() - start - self.TICK)
            self.ticks += 1


async def wait_gone(pid: int) -> None:
    """Wait until ``pid`` (not our child: the kernel reaps it for us) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)
