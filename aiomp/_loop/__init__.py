"""The one place that tells asyncio (uvloop included) from trio.

The seam, for the rest of aiomp:
- here: ``running_asyncio_loop()``, ``running_loop()`` (one look for both: ``TRIO`` while
  trio runs; typed :data:`RunningLoop`), ``trio_running()``, ``sleep(delay)``, and
  ``is_cancellation(exc)`` (which exceptions cancel a task, per loop library);
- ``watch``: ``fd_watch``, one callback per readable fd (a reader callback, a trio task);
- ``turns``: ``read_watch``, a socket read in bounded, coalesced turns on that watch;
- ``fdset.FdSet``: many fds behind one epoll fd, watched while a task waits;
- ``readers``: kept readers for waits (``wait_readable``, ``kept_readable``, ``wait_kept``,
  ``forget``); ``waiters.FdWaiters``: one waiting task per fd, the others fanned out;
- ``wakeup.Signal``, ``wakeup.Wakeup``: wake-ups that loop callbacks may set;
- ``taskhost.TaskHost``, ``taskhost.exit_task_group``: the hosted task group;
- ``cancel.CancelProbe``: the only reads of asyncio's and anyio's private records;
- ``finalizers`` (KeyboardInterrupt protection), ``forked`` (a fork's loop marks cleared).

Stdlib-only at module level (children import it): anyio and trio are imported lazily.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    import asyncio
    from typing import Final, Literal, TypeAlias

    #: A running loop as :func:`running_loop` names it: the asyncio loop, or :data:`TRIO`.
    RunningLoop: TypeAlias = "asyncio.AbstractEventLoop | Literal['trio']"

#: What :func:`running_loop` returns while trio runs in this thread.
TRIO: Final = "trio"


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop (uvloop's included), or None: no loop runs in this
    thread, or another library's does (trio). Looks only at a module already imported:
    a process that never imported asyncio cannot be running its loop."""
    aio = sys.modules.get("asyncio")
    loop: asyncio.AbstractEventLoop | None = None if aio is None else aio._get_running_loop()
    return loop


def running_loop() -> RunningLoop | None:
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


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is (or, a group, holds) the cancellation of a task by an event loop
    library (asyncio's ``CancelledError``, trio's ``Cancelled``).

    Looked up in ``sys.modules``: an exception of a module never imported cannot exist.
    """
    for module, name in _CANCELLATIONS:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    if isinstance(exc, BaseExceptionGroup):
        return any(is_cancellation(e) for e in exc.exceptions)
    return False


#: (module, exception) that each event loop library cancels a task with.
_CANCELLATIONS = (("asyncio", "CancelledError"), ("trio", "Cancelled"))
