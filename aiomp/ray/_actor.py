"""The worker of :class:`aiomp.ray.Pool`: an async Ray actor that runs the pool's tasks.

The pool makes it with ``ray.remote(TaskActor).options(max_concurrency=concurrency, ...)``
and two concurrency groups: the default one runs the tasks (``init``, ``run``), a ``ctl``
group (its own thread and event loop in Ray) answers ``cancel`` and ``alive`` even while
a sync task blocks the tasks' loop.

A task arrives as ``run(blob, *arrays)``: ``blob`` is a pickle of
``(tid, flags, fn_key, items, kwds)`` made in the caller, in which each large numpy array is a
persistent id ``i`` naming ``arrays[i]``. The arrays are top-level ``ObjectRef``
arguments, so Ray resolves them from its object store before the call (zero-copy,
read-only). ``fn_key`` is the function pickled once by the caller; the actor unpickles each
distinct one once. The answer is the value itself, or an ``ErrorPayload`` (no task returns
one of those): the error payload a process worker sends, so that the exception is raised
in the caller as its own type with this traceback as its cause. Ray serializes the value
(large arrays go through the object store).

This module imports ray only inside methods (the actor process has it anyway): the pool
turns :class:`TaskActor` into an actor class, the module stays importable without Ray.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import pickle
import types
from typing import Any

from .._child.info import set_worker_info
from .._pool import protocol as P

#: Flags in a task's blob (the wire format's own, for the same meanings).
F_ASYNC, F_STAR, F_APPLY = P.F_ASYNC, P.F_STAR, P.F_APPLY


_Coroutine = types.CoroutineType
#: Distinct pickled functions an actor keeps unpickled (a bound on its memory).
_MAX_FNS = 256


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, arrays: tuple[Any, ...]) -> None:
        super().__init__(io.BytesIO(data))
        self._arrays = arrays

    def persistent_load(self, pid: Any) -> Any:
        return self._arrays[pid]


def loads(data: bytes, arrays: tuple[Any, ...]) -> Any:
    """Unpickle a blob whose large arrays came as ``arrays`` (see the module docstring)."""
    if not arrays:
        return pickle.loads(data)
    return _Unpickler(data, arrays).load()


class TaskActor:
    """One pool worker. See the module docstring."""

    def __init__(self) -> None:
        self._fns: dict[bytes, Any] = {}
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        # Cancelled before they started: Ray may deliver a cancel before its task.
        self._cancelled: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def init(self, blob: bytes, who: tuple[int, int]) -> tuple[Any, ...]:
        """Record ``who`` (slot, pool size) as this actor's ``aiomp.get_worker_info()``,
        then run the pool's initializer; ``(True, pid, node id)`` or
        ``(False, ErrorPayload)``."""
        import ray

        set_worker_info(*who)
        self._loop = asyncio.get_running_loop()
        try:
            initializer, initargs = pickle.loads(blob)
            if initializer is not None:
                result = initializer(*initargs)
                if asyncio.iscoroutine(result):
                    await result
        except BaseException as exc:  # noqa: BLE001 - reported to the pool, SystemExit too
            return False, P.ErrorPayload.of(exc)
        return True, os.getpid(), ray.get_runtime_context().get_node_id()

    async def run(self, blob: bytes, *arrays: Any) -> Any:
        """Run one task (an ``apply`` call or a chunk of a map): its result, or the
        ErrorPayload of its exception. Cancelled by :meth:`cancel`: the function sees
        ``CancelledError``, and the answer is that error."""
        tid = 0
        try:
            tid, flags, key, items, kwds = loads(blob, arrays)
            task = asyncio.current_task()
            assert task is not None
            self._tasks[tid] = task
            if tid in self._cancelled:
                self._cancelled.discard(tid)
                raise asyncio.CancelledError
            fn = self._fns.get(key)
            if fn is None:
                if len(self._fns) >= _MAX_FNS:  # partials or closures of varying state
                    self._fns.clear()
                fn = self._fns[key] = pickle.loads(key)
            if flags & F_APPLY:
                result = fn(*items, **kwds) if kwds else fn(*items)
                if asyncio.iscoroutine(result):
                    result = await result
            elif not flags & F_ASYNC:
                # A loop in C, as the process worker's: a chunk may hold thousands.
                result = list(itertools.starmap(fn, items) if flags & F_STAR else map(fn, items))
                if _Coroutine in set(map(type, result)):  # a sync fn made coroutines
                    result = [await r if asyncio.iscoroutine(r) else r for r in result]
            else:
                result = []
                for x in items:
                    r = fn(*x) if flags & F_STAR else fn(x)
                    result.append(await r if asyncio.iscoroutine(r) else r)
        except BaseException as exc:  # noqa: BLE001 - the task's outcome, whatever it is:
            # CancelledError (the pool asked), and SystemExit or KeyboardInterrupt, which
            # are raised in the caller alone, as a process worker's are (issue 25 item 9).
            return P.ErrorPayload.of(exc)
        finally:
            self._tasks.pop(tid, None)
        return result  # bare, as a plain actor method's (a tuple around it costs a pickle)

    async def cancel(self, tid: int) -> None:
        """(``ctl`` group) Cancel task ``tid`` if it is running: on the tasks' loop."""
        task = self._tasks.get(tid)
        if task is None:
            self._cancelled.add(tid)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    async def alive(self) -> None:
        """(``ctl`` group) Never returns: its ref fails when the actor dies."""
        await asyncio.get_running_loop().create_future()
