"""A Pool's task and what the pool knows of the functions it runs.

Owns nothing: :class:`Task` is one message's worth of work (an ``apply`` call or a chunk
of a map) and its outcome; :class:`FnInfo` and :func:`fn_info` cache, per function object,
its name, whether it is async and, for a plain function, its id and ``DEF`` frame (see
:mod:`aiomp._pool.protocol`).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._process import checks as _process
from .._wire import byvalue as _byvalue
from .._wire import datagram as _transport
from . import protocol as P

if TYPE_CHECKING:
    import asyncio

    from .workers import WorkerSlot

QUEUED, RUNNING, DONE, DROPPED = range(4)


def fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise in one more place (raising one object again and again
    would grow its traceback)."""
    try:
        new = copy.copy(exc)
    except Exception:  # noqa: BLE001
        return exc
    new.__cause__ = exc.__cause__
    new.__traceback__ = None
    return new


class Task:
    """One message's worth of work: an ``apply`` call or a chunk of a map.

    ``message`` is whatever the worker handle sends (the scheduler never looks inside):
    a small frame (``bytes``), or an object whose ``close()`` is called once the task is
    done (it is kept until then: a task that its dead worker never started is sent again
    to another), and ``discard()`` instead when no worker will ever run it.
    """

    __slots__ = (
        "abandoned",
        "define",
        "fn_id",
        "group",
        "index",
        "is_async",
        "message",
        "name",
        "ok",
        "on_done",
        "size",
        "state",
        "tid",
        "value",
        "waiter",
        "weight",
        "worker",
    )

    def __init__(
        self,
        tid: int,
        name: str,
        weight: int,
        is_async: bool,
        message: Any,
        fn_id: int = 0,
        define: bytes = b"",
        group: object = None,
        index: int = 0,
        size: int = 1,
        on_done: Callable[[Task], None] | None = None,
    ) -> None:
        self.tid = tid
        self.name = name  # of the function, for error messages
        self.weight = weight
        self.is_async = is_async
        self.message = message
        self.fn_id = fn_id  # nonzero: the worker must know DEF ``define`` first
        self.define = define
        self.group = group  # the map / imap call it is a chunk of; None for apply
        self.index = index
        self.size = size  # inputs it carries
        self.on_done = on_done
        # An asyncio future the caller awaits (apply's hot path: resolved here, with no
        # callback in between), or None.
        self.waiter: asyncio.Future[None] | None = None
        self.state = QUEUED
        self.worker: WorkerSlot | None = None
        self.ok = False
        self.value: Any = None
        # Its caller has gone while it was running: if it turns out never to have
        # started, it never does.
        self.abandoned = False

    def finish(self, ok: bool, value: object) -> None:
        message = self.message
        if type(message) is not bytes:  # (a small frame needs nothing: the hot path)
            message.close()
        self.state = DONE
        self.ok = ok
        self.value = value
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_done is not None:
            self.on_done(self)

    def drop(self) -> None:
        message = self.message
        if type(message) is not bytes:
            message.discard()
        self.state = DROPPED


class FnInfo:
    """What the pool knows of a function it runs (cached per function object).

    ``fid`` is nonzero for a plain function, which pickles by reference: each worker is
    sent ``define`` (a ``DEF`` message) once, and tasks then name it by ``fid``. Other
    callables (bound methods, partials, objects with ``__call__``) travel by value in
    every task: their state may change between calls.
    """

    __slots__ = ("checked", "define", "fid", "is_async", "name")

    def __init__(self, name: str, is_async: bool, fid: int = 0, define: bytes = b"") -> None:
        self.name = name
        self.is_async = is_async
        self.fid = fid
        self.define = define
        self.checked: set[str] = set()  # start methods whose children can import it


#: A weak reference to fn -> its FnInfo (a cached function must not be kept alive by the
#: cache). A plain dict read with ``get(ref(fn))`` rather than a WeakKeyDictionary: no
#: Python frame on the call's hot path. A dead reference removes its own entry.
fn_cache: dict[weakref.ref[Any], FnInfo] = {}
_fids = itertools.count(1)
#: Task ids, unique in this process.
tids = itertools.count(1)
_ref = weakref.ref


def _forget(ref: weakref.ref[Any]) -> None:
    fn_cache.pop(ref, None)


def as_args(args: Iterable[Any]) -> tuple[Any, ...]:
    """``apply``'s ``args`` as a tuple; a single argument passed bare is a clear error."""
    if isinstance(args, dict):
        raise TypeError("apply(fn, args): args is a tuple; pass keyword arguments as kwds=")
    if isinstance(args, (str, bytes)) or not isinstance(args, Iterable):
        raise TypeError(
            f"apply(fn, args): args is the tuple of fn's arguments, not "
            f"{type(args).__name__}; for one argument write apply(fn, (x,))"
        )
    return tuple(args)


def fn_info(fn: object) -> FnInfo:
    """``fn``'s :class:`FnInfo` (cached: it is asked on every call)."""
    try:
        info = fn_cache.get(_ref(fn))
    except TypeError:  # not weakly referenceable (a builtin function), or unhashable
        info = None
    if info is not None:
        return info
    if not callable(fn):
        _process.check_function(fn, "fork")  # raises the right TypeError
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__  # an object with an async __call__
    )
    info = FnInfo(P.fn_name(fn), is_async)
    if type(fn) is types.FunctionType:
        pickled = _define(fn)
        if 0 < len(pickled) <= _transport.MAX_INLINE - 64:
            fid = next(_fids)
            info = FnInfo(info.name, is_async, fid, P.framed(P.OP_DEF, fid, 0, pickled))
    try:
        fn_cache[_ref(fn, _forget)] = info
    except TypeError:
        pass
    return info


def _define(fn: object) -> bytes:
    """``fn`` pickled for its ``DEF``: by reference, or by value where a worker cannot
    import it by name (a lambda, a closure, a notebook's function: sent once per worker
    all the same); b"" when it cannot be sent that way (it holds an fd or cannot be
    pickled): each task then carries it, and says why it cannot."""
    try:
        msg = _byvalue.dumps(fn)
    except Exception:  # noqa: BLE001 - each task pickles it, and says why
        return b""
    with msg:
        return msg.body if msg.is_plain() else b""


def when_done(task: Task, fn: Callable[[Task], None]) -> None:
    """Have ``fn(task)`` called once ``task`` is done, after what was to be called then."""
    previous = task.on_done
    if previous is None:
        task.on_done = fn
        return

    def both(t: Task) -> None:
        previous(t)
        fn(t)

    task.on_done = both


def new_task(
    concurrency: int,
    info: FnInfo,
    tid: int,
    message: Any,
    group: object = None,
    index: int = 0,
    size: int = 1,
    on_done: Callable[[Task], None] | None = None,
) -> Task:
    """Task ``tid`` of ``info``'s function (an ``apply`` call's with the defaults) in a pool
    of ``concurrency`` slots per worker (a sync task takes them all)."""
    return Task(  # (positional: keywords cost a third of the call)
        tid,
        info.name,
        1 if info.is_async else concurrency,
        info.is_async,
        message,
        info.fid,
        info.define,
        group,
        index,
        size,
        on_done,
    )
