"""When a call may add a task to a pool, and waiting until a worker can take one.

* **Load shedding** (``Pool(max_pending=N)``): a call whose task would be the (N+1)-th
  not started yet (queued in the pool, or waiting in a worker behind the task it runs)
  raises :class:`aiomp.PoolOverloadedError` at once (:func:`admit`); a task that would
  start on a worker at once is always admitted. A ``map`` is one call: it is refused
  when its first chunk would be, and once admitted all its chunks queue.
* **Room** (:class:`Room`): the tasks that wait for a worker to have room for a task
  (each batcher's dispatcher, :func:`wait_ready`) are woken together by the scheduler's
  ``on_room`` hook, installed only while one waits: a pool without waiters pays one
  ``None`` test per finished task.
* **Readiness** (:func:`wait_ready`): every worker has run the initializer, or the pool
  is broken.

:func:`has_room` and :func:`pending` read the scheduler's records of its workers (both
may be called from loop callbacks: they never await).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio.lowlevel

from .._errors import BrokenPoolError, BrokenWorkerError, PoolOverloadedError
from .._loop.wakeup import Wakeup
from .._process.checks import count

if TYPE_CHECKING:
    from .engine import Engine
    from .scheduler import Scheduler


def check_max_pending(value: object) -> int:
    """``Pool(max_pending=)`` as an int >= 0 (0: a call that no worker can start at once
    is refused): ``TypeError`` for another type, ``ValueError`` below 0."""
    return count("max_pending", value, least=0)


def has_room(engine: Engine, weight: int) -> bool:
    """Whether a task of ``weight`` submitted to ``engine`` now would start on a worker
    at once rather than wait in the queue."""
    sched = engine.sched
    if sched.queued:
        return False
    if sched.idle:
        return True
    limit = sched.concurrency
    if weight >= limit:
        return False
    return any(w.usable and w.load + weight <= limit for w in sched.workers.values())


def pending(sched: Scheduler) -> int:
    """Tasks not started yet: queued in the pool, or queued ahead in a worker behind the
    one it runs (the scheduler's own count)."""
    return sched.unstarted


def overloaded(engine: Engine, weight: int) -> bool:
    """Whether a task of ``weight`` would now be refused by ``max_pending``."""
    limit = engine.max_pending
    if limit is None:
        return False
    return pending(engine.sched) >= limit and not has_room(engine, weight)


def admit(engine: Engine, is_async: bool) -> None:
    """Raise :class:`aiomp.PoolOverloadedError` if a call of one task of a sync (or
    ``is_async``) function would be refused by ``max_pending``."""
    if overloaded(engine, 1 if is_async else engine.concurrency):
        raise overload_error(engine)


def overload_error(engine: Engine) -> PoolOverloadedError:
    limit = engine.max_pending or 0
    return PoolOverloadedError(
        f"the pool holds {limit} tasks not started yet (max_pending={limit}): this call was "
        f"refused and will not run; calls are accepted again as the queue drains",
        limit,
    )


class Room:
    """The wake-ups of the tasks waiting for a worker to have room, or for the pool to
    change (it broke, or shut down): see the module docstring."""

    __slots__ = ("_sched", "_waiters")

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._waiters: dict[Wakeup, None] = {}

    def watch(self, wakeup: Wakeup) -> None:
        """Set ``wakeup`` each time a worker may have room, until :meth:`unwatch`."""
        self._waiters[wakeup] = None
        self._sched.on_room = self._wake

    def unwatch(self, wakeup: Wakeup) -> None:
        self._waiters.pop(wakeup, None)
        if not self._waiters:
            self._sched.on_room = None

    def _wake(self) -> None:
        for wakeup in self._waiters:  # (set() never calls back into this)
            wakeup.set()


async def wait_ready(engine: Engine) -> None:
    """:meth:`aiomp.Pool.wait_ready`."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    wakeup: Wakeup | None = None
    try:
        while True:
            broken = engine.broken
            if broken is not None:
                raise ready_error(broken)
            engine.check_open()
            if sum(1 for w in engine.sched.workers.values() if w.usable) >= engine.processes:
                return
            if wakeup is None:
                wakeup = Wakeup(engine.loop)
                engine.room.watch(wakeup)
            await wakeup.wait()
    finally:
        if wakeup is not None:
            engine.room.unwatch(wakeup)


def ready_error(broken: BaseException) -> BrokenPoolError:
    """What ``wait_ready`` raises for a pool broken by ``broken``: its message, with what
    broke it as ``__cause__``: the initializer's own exception (with the worker's
    traceback) where the initializer raised, else the start-up death or start error."""
    cause = broken.__cause__
    if isinstance(cause, BrokenWorkerError) and cause.__cause__ is not None:
        cause = cause.__cause__  # the initializer raised it, in the worker
    err = BrokenPoolError(str(broken))
    err.__cause__ = cause
    return err
