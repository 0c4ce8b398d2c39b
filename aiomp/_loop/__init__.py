"""The one place that tells asyncio (uvloop included) from trio.

The seam, for the rest of aiomp:
- ``running_asyncio_loop()``, ``trio_running()``, ``running_loop()`` (one look for both;
  ``TRIO`` while trio runs), ``sleep(delay)``: here;
- ``readers``: kept readers (``wait_readable``, ``kept_readable``, ``wait_kept``, ``forget``);
- ``waiters.FdWaiters``: one waiting task per fd, the others fanned out behind it;
- ``wakeup.Signal``, ``wakeup.Wakeup``: wake-ups that loop callbacks may set;
- ``taskhost.TaskHost``, ``taskhost.exit_task_group``: the hosted task group.

Stdlib-only at module level (children import it): anyio and trio are imported lazily.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    import asyncio
    from typing import Final, Literal

#: What :func:`running_loop` returns while trio runs in this thread.
TRIO: Final = "trio"


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop (uvloop's included), or None: no loop runs in this
    thread, or another library's does (trio). Looks only at a module already imported:
    a process that never imported asyncio cannot be running its loop."""
    aio = sys.modules.get("asyncio")
    loop: asyncio.AbstractEventLoop | None = None if aio is None else aio._get_running_loop()
    return loop


def running_loop() -> asyncio.AbstractEventLoop | Literal["trio"] | None:
    """The running asyncio loop, :data:`TRIO` while trio runs in this thread, or None
    where no event loop runs: both probes in one call, for a hot path that needs to know
    which (a sync child that imported neither pays two dict lookups)."""
    aio = sys.modules.get("asyncio")
    if aio is not None and (loop := aio._get_running_loop()) is not None:
        running: asyncio.AbstractEventLoop = loop
        return running
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return None
        return TRIO
    return None


def trio_running() -> bool:
    """Whether trio runs in this thread (looks only at modules already imported)."""
    return running_loop() is TRIO


async def sleep(delay: float) -> None:
    """Sleep on the running loop (asyncio, uvloop or trio), without importing anyio."""
    if running_asyncio_loop() is None:
        await sys.modules["trio"].sleep(delay)
    else:
        await sys.modules["asyncio"].sleep(delay)
