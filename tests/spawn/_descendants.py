"""Helpers shared by the descendant and keeper tests: bounds, watching pids until they exit."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import anyio

TIMEOUT = 30
GRACE = 0.3
#: How long the descendants may take to go once their ancestor has.
GONE_WITHIN = 10
METHODS = ["spawn", "forkserver", "fork"]


@contextmanager
def watching(pids: object) -> Iterator[list[int]]:
    """pidfds of ``pids`` (an iterable of them), taken while they run; whatever is still
    running at the end is SIGKILLed: a failed test leaves no orphan behind."""
    fds = [os.pidfd_open(pid) for pid in pids]  # type: ignore[attr-defined]
    try:
        yield fds
    finally:
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fd)


@contextmanager
def watching_later() -> Iterator[Callable[[object], list[int]]]:
    """:func:`watching`, for pids known later: ``watch(pids)`` returns their pidfds."""
    with ExitStack() as stack:
        yield lambda pids: stack.enter_context(watching(pids))


async def all_exit(fds: list[int]) -> None:
    """Wait (bounded) until every process behind ``fds`` has exited."""
    with anyio.fail_after(GONE_WITHIN):
        for fd in fds:
            await anyio.wait_readable(fd)
