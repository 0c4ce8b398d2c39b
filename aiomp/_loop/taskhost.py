"""The Pool's task group, hosted so that the pool may be left by another task than the one
that entered it (see *Hosted task group* in docs/architecture.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import anyio
import anyio.abc

from . import running_asyncio_loop


class TaskHost:
    """Where a pool's own tasks (worker watchers, the supervisor, map feeders) run.

    On asyncio (uvloop included) the task group lives in a task of its own, so that
    :meth:`stop` may be called from any task: pytest-asyncio, for one, runs a yield
    fixture's setup and teardown in different tasks. On trio it is a nursery entered in
    the caller's task, as usual.

    Hosted, a failing task of the group cancels no caller's scope; ``on_failed`` is called
    instead (in the host task, as the group starts to cancel its tasks), and the error is
    raised again by :meth:`stop`. ``on_failed`` is also what a native cancellation of the
    host (``asyncio.run`` cancelling the tasks left at its end) calls.
    """

    def __init__(self, on_failed: Callable[[], None]) -> None:
        self._on_failed = on_failed
        self.tg: anyio.abc.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Future[bool] | None = None

    async def start(self) -> anyio.abc.TaskGroup:
        """Open the group. On cancellation or failure nothing of it is left running."""
        loop = running_asyncio_loop()
        if loop is None:
            tg = anyio.create_task_group()
            await tg.__aenter__()
            self.tg = tg
            return tg
        ready: asyncio.Future[anyio.abc.TaskGroup] = loop.create_future()
        self._stop = loop.create_future()
        self._task = loop.create_task(self._host(ready), name="aiomp pool tasks")
        try:
            self.tg = await ready
        except BaseException:
            self._task.cancel()  # the group has no task yet: it ends at once
            with anyio.CancelScope(shield=True):
                await asyncio.wait({self._task})
            raise
        return self.tg

    async def _host(self, ready: asyncio.Future[anyio.abc.TaskGroup]) -> None:
        assert self._stop is not None
        try:
            async with anyio.create_task_group() as tg:
                ready.set_result(tg)
                try:
                    cancel = await self._stop
                except anyio.get_cancelled_exc_class():
                    self._on_failed()  # a task of the group raised, or the host was cancelled
                    raise
                if cancel:
                    tg.cancel_scope.cancel()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    async def stop(self, error: BaseException | None) -> bool:
        """Close the group, from any task; ``error`` is what the pool's block raised (or
        None): if there is one, the group's tasks are cancelled, else they are awaited.

        Returns or raises as :func:`exit_task_group` does: an error of the
        group's own tasks (a bug) is raised. Shielded: it waits until the group has ended.
        """
        if self._task is None:
            assert self.tg is not None
            return await exit_task_group(self.tg, error)
        assert self._stop is not None
        if not self._stop.done():
            self._stop.set_result(error is not None)
        with anyio.CancelScope(shield=True):
            await asyncio.wait({self._task})
        if not self._task.cancelled() and (failed := self._task.exception()) is not None:
            raise failed
        return False


class Started:
    """The coroutines of tasks started in anyio task groups, each closed if its task was
    cancelled before its first step.

    anyio (4.14 and later) runs a task's coroutine inside a wrapper coroutine of its own:
    a task cancelled before its first step (``asyncio.run`` cancels the tasks left at its
    end, and a worker may just have been started) never awaits the coroutine, which
    Python reports at collection as "coroutine ... was never awaited". Call :meth:`close`
    once the group has exited (or its owner is done with it, however it ends): only
    coroutines never started are closed, so nothing running is touched.
    """

    __slots__ = ("_coros",)

    def __init__(self) -> None:
        self._coros: list[Coroutine[Any, Any, Any]] = []

    def start_soon(
        self, tg: anyio.abc.TaskGroup, fn: Callable[[], Coroutine[Any, Any, Any]]
    ) -> None:
        """``tg.start_soon(fn)``, its coroutine kept until :meth:`close`."""
        coro = fn()
        # (Those that have finished are let go: a pool starts many workers in its life.)
        self._coros = [c for c in self._coros if _unfinished(c)]
        self._coros.append(coro)
        tg.start_soon(_given, coro, name=getattr(fn, "__qualname__", None))

    def close(self) -> None:
        """Close the coroutines whose task never started them."""
        coros, self._coros = [c for c in self._coros if _unfinished(c)], []
        if coros:
            import inspect  # (only here: costly to import, and rarely needed)

            for c in coros:
                if inspect.getcoroutinestate(c) == inspect.CORO_CREATED:
                    c.close()


def _unfinished(coro: Coroutine[Any, Any, Any]) -> bool:
    """Whether ``coro`` has not finished (nor been closed): it still has its frame."""
    return getattr(coro, "cr_frame", None) is not None


def _given(coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
    return coro


async def exit_task_group(tg: anyio.abc.TaskGroup, exc: BaseException | None) -> bool:
    """Leave ``tg`` with ``exc``, what the body of an ``async with`` raised (or None).

    trio's nursery wraps what the body raised in a group of its own (another layer when
    the body raised a group itself, e.g. a KeyboardInterrupt in the user's nursery): when
    it holds nothing else, the body's exception leaves the block as it was raised, and
    this returns False. A group that adds other errors (our own tasks': bugs) is raised.
    """
    try:
        return bool(
            await tg.__aexit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        )
    except BaseExceptionGroup as group:
        if exc is None or list(_leaves(group)) != list(_leaves(exc)):
            raise
        return False


def _leaves(exc: BaseException) -> Generator[BaseException, None, None]:
    """The exceptions inside ``exc``, however deeply grouped; ``exc`` itself if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc
