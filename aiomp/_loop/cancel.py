"""Whether a cancellation may be pending for the current asyncio task: the only reader of
asyncio's and anyio's private records of tasks and cancel scopes.

A call that sends before it first yields (``Pool.apply``'s hot path) must not send when
its caller is about to be cancelled. Two questions answer that: which task runs
(:func:`current_task_reader`), and whether an anyio cancel scope around it is cancelled or
past its deadline (:func:`scope_cancelled_reader`). The public answers cost a Python frame
each (``asyncio.current_task`` on 3.11) or several microseconds
(``anyio.current_effective_deadline``, mostly detecting the library) on a round trip of
tens; the private records answer in a C call and a short loop.

Each reader is resolved once, when asked, and bound by its user: nothing here dispatches
per call. If asyncio or anyio has moved what is read here, the reader falls back to the
public call and logs a warning once; ``tests/loop/test_cancel_probe.py`` calls the strict
resolvers (:func:`private_current_task`, :func:`private_scope_cancelled`), which raise, so
that the change fails the suite instead of slowing ``apply`` in silence.
"""

from __future__ import annotations

import logging
import math
import sys
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("aiomp")

CurrentTask = Callable[["asyncio.AbstractEventLoop"], "asyncio.Task[Any] | None"]
ScopeCancelled = Callable[["asyncio.Task[Any]", "asyncio.AbstractEventLoop"], bool]

#: The fields of anyio's asyncio ``CancelScope`` that :func:`private_scope_cancelled` reads.
SCOPE_FIELDS = frozenset({"_cancel_called", "_deadline", "_parent_scope", "_shield"})


def private_current_task() -> CurrentTask:
    """``asyncio.current_task(loop)`` without a Python frame: the C function where asyncio
    has one (3.12+), else the ``get`` of asyncio's private dict of current tasks. Raises
    LookupError if neither is there."""
    asyncio = sys.modules["asyncio"]
    if not isinstance(asyncio.current_task, types.FunctionType):
        current: CurrentTask = asyncio.current_task
        return current
    tasks = getattr(asyncio.tasks, "_current_tasks", None)
    if type(tasks) is not dict:
        raise LookupError("asyncio.tasks._current_tasks is no longer a dict")
    getter: CurrentTask = tasks.get
    return getter


def private_scope_cancelled() -> ScopeCancelled:
    """A check of anyio's record of a task's cancel scopes (its asyncio backend's
    ``_task_states``, a WeakKeyDictionary read through its own dict). Raises LookupError
    if anyio has changed that record or its scopes' fields."""
    try:
        from anyio._backends._asyncio import CancelScope, TaskState, _task_states
    except ImportError as exc:
        raise LookupError(f"anyio's asyncio backend has moved: {exc}") from exc
    if not set(getattr(CancelScope, "__slots__", ())) >= SCOPE_FIELDS:
        raise LookupError("anyio's CancelScope no longer has the fields read here")
    if "cancel_scope" not in getattr(TaskState, "__slots__", ()):
        raise LookupError("anyio's TaskState no longer has cancel_scope")
    states = vars(_task_states).get("data")
    if type(states) is not dict:
        raise LookupError("anyio's _task_states is no longer a WeakKeyDictionary")
    ref = weakref.ref
    inf = math.inf

    def scope_cancelled(task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> bool:
        state = states.get(ref(task))
        if state is None:
            return False  # no anyio scope around it
        scope = state.cancel_scope
        while scope is not None:
            # Its fields, not its properties: no Python frame per scope.
            if scope._cancel_called:
                return True
            deadline = scope._deadline
            if deadline != inf and deadline <= loop.time():
                return True
            if scope._shield:
                return False
            scope = scope._parent_scope
        return False

    return scope_cancelled


def _public_scope_cancelled(task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> bool:
    import anyio

    return bool(anyio.current_effective_deadline() <= loop.time())


def current_task_reader() -> CurrentTask:
    """The fastest ``current_task(loop)`` there is (see the module docstring)."""
    try:
        return private_current_task()
    except LookupError as exc:
        log.warning("aiomp: %s; apply uses asyncio.current_task", exc)
        current: CurrentTask = sys.modules["asyncio"].current_task
        return current


def scope_cancelled_reader() -> ScopeCancelled:
    """The fastest check that an anyio scope around a task is cancelled or past its
    deadline. (An ``asyncio.timeout`` whose deadline has passed but whose callback has not
    run yet cannot be seen: it cancels the call once sent, as a running one.)"""
    try:
        return private_scope_cancelled()
    except LookupError as exc:
        log.warning("aiomp: %s; apply uses anyio.current_effective_deadline", exc)
        return _public_scope_cancelled


class CancelProbe:
    """Both readers, bound once (an object's attributes: no dispatch per call)."""

    __slots__ = ("current_task", "scope_cancelled")

    def __init__(self) -> None:
        self.current_task = current_task_reader()
        self.scope_cancelled = scope_cancelled_reader()

    def pending(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a cancellation may be pending for the current task (or there is no
        task): then a call must yield before it sends anything."""
        current = self.current_task(loop)
        return current is None or bool(current.cancelling()) or self.scope_cancelled(current, loop)
