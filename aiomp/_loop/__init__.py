"""The one place that tells asyncio (uvloop included) from trio.

Holds the running-loop probe, fd waiters and kept readers, wake-ups safe from loop
callbacks, the hosted task group, and the only reads of anyio or asyncio internals.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop (uvloop's included), or None: no loop runs in this
    thread, or another library's does (trio). Looks only at a module already imported:
    a process that never imported asyncio cannot be running its loop."""
    aio = sys.modules.get("asyncio")
    loop: asyncio.AbstractEventLoop | None = None if aio is None else aio._get_running_loop()
    return loop


def trio_running() -> bool:
    """Whether trio runs in this thread (looks only at a module already imported)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return False
        return True
    return False
