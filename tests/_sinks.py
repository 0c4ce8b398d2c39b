"""What output and process tests share: a line sink, and a wait for a process to end."""

from __future__ import annotations

import os

import anyio


class Lines:
    """A callable sink that keeps ``(rank, stream, line)``."""

    def __init__(self) -> None:
        self.got: list[tuple[int, str, str]] = []

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.got.append((rank, stream, line))

    def of(self, rank: int, stream: str) -> list[str]:
        return [line for r, s, line in self.got if (r, s) == (rank, stream)]


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
