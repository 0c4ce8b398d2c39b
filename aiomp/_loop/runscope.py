"""What lives as long as the running event loop: its key, and a task its end cancels.

asyncio and uvloop: the running loop is the key, and a task made with
``loop.create_task`` is cancelled by ``asyncio.run`` (or an ``asyncio.Runner``, what
uvicorn runs) once the main coroutine returns, which then waits for it to finish. trio:
the run's root task is the key, and a system task is cancelled once the main task
returns. A loop driven by hand and never closed cancels nothing: the interpreter's exit
(``aiomp._process.child``'s hook) ends the children left then.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from . import running_asyncio_loop

#: Tasks started by :func:`start_for_run` (asyncio keeps only weak references to tasks).
_tasks: set[object] = set()


def run_key() -> object:
    """The running asyncio loop, or the running trio run's root task; RuntimeError where
    no event loop runs in this thread."""
    loop = running_asyncio_loop()
    if loop is not None:
        return loop
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_root_task()
        except RuntimeError:
            pass
    raise RuntimeError("no event loop is running in this thread (asyncio, uvloop or trio)")


def start_for_run(fn: Callable[[], Awaitable[None]]) -> None:
    """Start ``fn()`` in a task of its own that the end of the running loop or run cancels
    (see the module docstring); ``fn`` must catch its own errors (a trio system task
    that raises crashes the run)."""
    loop = running_asyncio_loop()
    if loop is None:
        sys.modules["trio"].lowlevel.spawn_system_task(fn)
        return

    async def run() -> None:
        await fn()

    task = loop.create_task(run(), name="aiomp default pool")
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
