"""The Pool's calls: ``apply``, ``map`` / ``starmap`` and the ``imap`` iterators.

Each call pickles its tasks in the caller (an argument that cannot be pickled raises at
the call site, before anything is sent), checks for cancellation, then hands them to the
pool and waits. It uses a small part of :class:`aiomp.Pool`: ``_submit(task)``,
``_sched.drop(task)``, ``_abandon(tasks)`` (shielded here), ``_check_open()``, and the
settings ``_loop``, ``_grace``, ``_processes``, ``_concurrency``, ``_tg``, and two that
``aiomp.ray.Pool`` sets its own way: ``_encode`` (None: tasks use the process workers'
wire format) and ``_chunks_per_slot`` (map's default chunks per worker slot).

Cancellation: see docs/decisions/0028-apply-sends-first.md and
docs/decisions/0025-pool-failures.md.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import math
import pickle
import sys
import types
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._errors import BrokenPoolError
from .._loop.wakeup import Signal, Wakeup
from .._process import checks as _process
from .._process.checks import count
from .._wire import transport as _transport
from . import protocol as P
from .scheduler import DONE, QUEUED, Task, fresh

if TYPE_CHECKING:
    import asyncio

    from .pool import Pool
    from .process_handle import WorkerHandle

T = TypeVar("T")

_BUILTIN_FUNCTIONS = frozenset((types.BuiltinFunctionType,))


class _Fn:
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


#: A weak reference to fn -> its _Fn (a cached function must not be kept alive by the
#: cache). A plain dict read with ``get(ref(fn))`` rather than a WeakKeyDictionary: no
#: Python frame on the call's hot path. A dead reference removes its own entry.
_fn_cache: dict[weakref.ref[Any], _Fn] = {}
_fids = itertools.count(1)
_tids = itertools.count(1)
_ref = weakref.ref


def _forget(ref: weakref.ref[Any]) -> None:
    _fn_cache.pop(ref, None)


def _as_args(args: Iterable[Any]) -> tuple[Any, ...]:
    """``apply``'s ``args`` as a tuple; a single argument passed bare is a clear error."""
    if isinstance(args, dict):
        raise TypeError("apply(fn, args): args is a tuple; pass keyword arguments as kwds=")
    if isinstance(args, (str, bytes)) or not isinstance(args, Iterable):
        raise TypeError(
            f"apply(fn, args): args is the tuple of fn's arguments, not "
            f"{type(args).__name__}; for one argument write apply(fn, (x,))"
        )
    return tuple(args)


def fn_info(fn: object) -> _Fn:
    """``fn``'s :class:`_Fn` (cached: it is asked on every call)."""
    try:
        info = _fn_cache.get(_ref(fn))
    except TypeError:  # not weakly referenceable (a builtin function), or unhashable
        info = None
    if info is not None:
        return info
    if not callable(fn):
        _process.check_function(fn, "fork")  # raises the right TypeError
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__  # an object with an async __call__
    )
    info = _Fn(P.fn_name(fn), is_async)
    if type(fn) is types.FunctionType:
        try:
            pickled = pickle.dumps(fn, protocol=5)
        except Exception:  # noqa: BLE001 - not by reference: each task pickles it, and says why
            pickled = b""
        if 0 < len(pickled) <= _transport.MAX_INLINE - 64:
            fid = next(_fids)
            info = _Fn(info.name, is_async, fid, P.framed(P.OP_DEF, fid, 0, pickled))
    try:
        _fn_cache[_ref(fn, _forget)] = info
    except TypeError:
        pass
    return info


def make_task(
    pool: Pool,
    fn: Callable[..., object],
    info: _Fn,
    flags: int,
    items: Any,
    kwds: dict[str, object] | None,
    *,
    group: object = None,
    index: int = 0,
    on_done: Callable[[Task], None] | None = None,
) -> Task:
    """Pickle a task (see :func:`make_message`) and make its :class:`Task`."""
    tid = next(_tids)
    message = make_message(pool, fn, info, flags, items, kwds, tid, group)
    size = 1 if flags & P.F_APPLY else len(items)
    return _new_task(pool, info, tid, message, group, index, size, on_done)


def make_message(
    pool: Pool,
    fn: Callable[..., object],
    info: _Fn,
    flags: int,
    items: Any,
    kwds: dict[str, object] | None,
    tid: int,
    group: object = None,
) -> Any:
    """Task ``tid``'s message; raises here, in the caller, if it cannot be pickled or if
    the pool's workers could not import ``fn`` (a lambda, a function of an interactive
    ``__main__``): the same check as ``spawn``'s, once per function and start method."""
    method = pool._start_method
    if method not in info.checked and pool._encode is None:  # (Ray pickles by value)
        _process.check_function(fn, method)
        info.checked.add(method)
    fid = info.fid
    if pool._encode is not None:  # aiomp.ray: a message that Ray carries
        return pool._encode(tid, fn, info, flags, items, kwds, group)
    if fid and flags & P.F_APPLY and not items and not kwds:  # fn(): _encode's hot case
        return P.noargs_task(tid, flags | P.F_NOARGS, fid)
    try:
        return _encode(tid, fn, fid, flags, items, kwds)
    except Exception as exc:
        _process.check_function(fn, method)  # a clearer error when fn is the problem
        exc.add_note(f"(while pickling a task of {info.name} for a pool worker)")
        raise


def _encode(
    tid: int,
    fn: Callable[..., object],
    fid: int,
    flags: int,
    items: Any,
    kwds: dict[str, object] | None,
) -> Any:
    """A task's message: a small frame (bytes), or a :class:`_protocol.Message`."""
    if flags & P.F_APPLY and not kwds:
        # apply(f, (1, "a")): nothing in it can carry an fd or an array. (Not for a map's
        # chunk: looking at each of thousands of items costs more than the pickler does.)
        if fid and not items:
            return P.noargs_task(tid, flags | P.F_NOARGS, fid)
        if (fid or type(fn) in _BUILTIN_FUNCTIONS) and all(type(x) in P.PLAIN for x in items):
            body = pickle.dumps((items, None) if fid else (fn, items, None), protocol=5)
            if P.fits_inline(body):
                return P.task_frame(tid, flags, fid, body)
    elif fid and type(items) is range and not kwds:
        # A chunk of map(f, range(n)): a few bytes, and no fd or array can be in it.
        return P.task_frame(tid, flags, fid, pickle.dumps((items, None), protocol=5))
    return P.Message(
        P.OP_TASK, tid, flags, P.task_body(fid, b""), (items, kwds) if fid else (fn, items, kwds)
    )


async def wait_done(task: Task, loop: asyncio.AbstractEventLoop | None) -> None:
    """Wait until ``task`` is done (for :meth:`Pool._abandon`)."""
    if task.state < DONE:
        signal = Signal(loop)
        previous = task.on_done

        def done(t: Task) -> None:
            if previous is not None:
                previous(t)
            signal.set()

        task.on_done = done
        await signal.wait()


async def _wait(
    pool: Pool, tasks: list[Task], signal: Signal, timeout: float | None = None
) -> None:
    """Wait for ``signal``; abandon ``tasks`` on cancellation or timeout."""
    try:
        if timeout is None:
            await signal.wait()
            return
        with anyio.move_on_after(timeout) as scope:
            await signal.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await pool._abandon(tasks)
        raise
    if scope.cancelled_caught and not signal.is_set():
        with anyio.CancelScope(shield=True):
            await pool._abandon(tasks)
        raise TimeoutError(f"{tasks[0].name} did not finish within {timeout} s")


async def apply(
    pool: Pool,
    fn: Callable[..., Any],
    args: Any = (),
    kwds: dict[str, object] | None = None,
    *,
    timeout: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwds)`` in a worker and return its result.

    ``fn`` may be sync or ``async def``. Its exception is raised here, as the same
    type, with the worker's traceback as ``__cause__`` (``SystemExit`` and
    ``KeyboardInterrupt`` too, as ``concurrent.futures`` raises them; the worker lives
    on). An argument that cannot be
    pickled raises here before anything is sent. If the worker dies while it runs the
    task: :class:`aiomp.BrokenWorkerError`.

    ``timeout`` (seconds, counted from this call, queueing included) raises
    ``TimeoutError``. A call made in a cancelled scope sends nothing. On timeout or
    cancellation a task that has not started never starts; a running one is stopped
    as :class:`aiomp.Pool` describes (its worker terminated and replaced if need be)
    before the cancellation goes on.
    """
    sched = pool._sched
    if pool._state != 1 or sched.broken is not None:  # not _OPEN
        pool._check_open()
    try:
        info = _fn_cache.get(_ref(fn))  # fn_info's cache, read here: a frame less
    except TypeError:
        info = None
    if info is None:
        info = fn_info(fn)
    flags = P.F_APPLY | P.F_ASYNC if info.is_async else P.F_APPLY
    loop = pool._loop
    tid = next(_tids)
    fid = info.fid
    encode = pool._encode  # (None but for aiomp.ray's pool: tasks in the workers' format)
    if (
        fid
        and not args
        and type(args) is tuple
        and not kwds
        and encode is None
        and pool._start_method in info.checked  # (else make_message checks fn first)
    ):
        message: Any = P.noargs_task(tid, flags | P.F_NOARGS, fid)  # fn(): one C call
    else:
        message = make_message(
            pool,
            fn,
            info,
            flags,
            args if type(args) is tuple else _as_args(args),
            dict(kwds) if kwds else None,
            tid,
        )
    if loop is not None and timeout is None:
        # The round trip's hot path: the task is sent before this task yields, so the
        # worker runs it while the loop is still on its way to waiting (measured: sending
        # after the yield costs 11 to 17 % of the round trip), and the reader callback
        # resolves the future awaited here directly. Sent first, as soon as the message
        # is made: the Task, its future and the scheduler's record come after the send,
        # while the worker wakes (see docs/decisions/0028-apply-sends-first.md).
        # Unless a cancellation may be pending: then the task goes to the pool from a
        # callback that runs once this task has yielded, and is dropped unsent if the
        # wait was cancelled by then.
        current = _current_task(loop)  # (_cancel_pending's test, a frame less)
        if current is None or current.cancelling() or _anyio_scope_cancelled(current, loop):
            task = _new_task(pool, info, tid, message)
            task.waiter = waiter = loop.create_future()
            loop.call_soon(_submit_unless_cancelled, pool, task, waiter)
        else:
            worker = None
            idle = sched.idle
            if idle and not sched.queued and type(message) is bytes and encode is None:
                # The most recently idle worker (the one submit would pick), if it can
                # take the frame at once. (A process pool's handles are WorkerHandles.)
                worker = idle.popitem()[0]
                handle: WorkerHandle = worker.handle  # type: ignore[assignment]
                if not handle.send_first(message, fid):
                    idle[worker] = None  # back where it was: the last, the next picked
                    worker = None
            task = _new_task(pool, info, tid, message)
            if worker is not None:
                sched.started(worker, task)
            else:
                sched.submit(task)
                if task.state == DONE:  # failed at once (a broken pool): nothing to wait for
                    if task.ok:
                        return task.value
                    raise task.value
            task.waiter = waiter = loop.create_future()
        try:
            await waiter
        except BaseException:
            with anyio.CancelScope(shield=True):
                await pool._abandon([task])
            raise
    else:
        task = _new_task(pool, info, tid, message)
        signal = Signal(loop)
        task.on_done = lambda _: signal.set()
        await anyio.lowlevel.checkpoint()
        try:
            pool._check_open()
        except BaseException:
            task.drop()
            raise
        pool._submit(task)
        await _wait(pool, [task], signal, timeout)
    if task.ok:
        return task.value
    raise task.value


def _new_task(
    pool: Pool,
    info: _Fn,
    tid: int,
    message: Any,
    group: object = None,
    index: int = 0,
    size: int = 1,
    on_done: Callable[[Task], None] | None = None,
) -> Task:
    """Task ``tid`` of ``info``'s function (an ``apply`` call's with the defaults)."""
    return Task(  # (positional: keywords cost a third of the call)
        tid,
        info.name,
        1 if info.is_async else pool._concurrency,
        info.is_async,
        message,
        info.fid,
        info.define,
        group,
        index,
        size,
        on_done,
    )


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a cancellation may be pending for the current asyncio task (or there is
    no task): then a call must yield before it sends anything."""
    current = _current_task(loop)
    return current is None or bool(current.cancelling()) or _anyio_scope_cancelled(current, loop)


def _current_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    """``asyncio.current_task(loop)``. Python 3.11's is a Python function reading a dict;
    the dict is read directly instead, without that frame on ``apply``'s hot path."""
    global _current_task
    asyncio = sys.modules["asyncio"]
    tasks = getattr(asyncio.tasks, "_current_tasks", None)
    if isinstance(asyncio.current_task, types.FunctionType) and type(tasks) is dict:
        _current_task = tasks.get  # type: ignore[assignment]
    else:  # a C current_task (3.12+), or asyncio changed
        _current_task = asyncio.current_task
    return _current_task(loop)


def _anyio_scope_cancelled(task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> bool:
    """Whether an anyio cancel scope around ``task`` is cancelled or past its deadline:
    with ``Task.cancelling()``, what tells apply a cancellation may be pending. (An
    ``asyncio.timeout`` whose deadline has passed but whose callback has not run yet
    cannot be seen: it cancels the call once sent, as a running one.)

    ``anyio.current_effective_deadline()`` says so publicly, at 3.7 us of a 70 us round
    trip, mostly detecting the library; anyio's record of the task's scopes says it in a
    fraction of that, and the public call stands in if anyio ever moves it."""
    global _anyio_scope_cancelled
    try:
        from anyio._backends._asyncio import CancelScope, TaskState, _task_states

        read = {"_cancel_called", "_deadline", "_parent_scope", "_shield"}
        if not read <= set(CancelScope.__slots__) or "cancel_scope" not in TaskState.__slots__:
            raise LookupError("anyio's record of a task's scopes has changed")
        # The WeakKeyDictionary's own dict, read with get(ref(task)): no Python frame.
        states: dict[Any, Any] = vars(_task_states)["data"]
        ref = weakref.ref
        inf = math.inf

        def fast(task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> bool:
            state = states.get(ref(task))
            if state is None:
                return False  # no anyio scope around it
            scope = state.cancel_scope
            while scope is not None:
                # Its attributes, not its properties: no Python frame per scope.
                if scope._cancel_called:
                    return True
                deadline = scope._deadline
                if deadline != inf and deadline <= loop.time():
                    return True
                if scope._shield:
                    return False
                scope = scope._parent_scope
            return False

        fast(task, loop)
    except Exception:  # noqa: BLE001 - anyio changed: its public call

        def fast(task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop) -> bool:
            return bool(anyio.current_effective_deadline() <= loop.time())

    _anyio_scope_cancelled = fast
    return fast(task, loop)


def _submit_unless_cancelled(pool: Pool, task: Task, waiter: asyncio.Future[None]) -> None:
    if waiter.done():  # cancelled before the task could start: it never does
        task.drop()
        return
    try:
        pool._check_open()
    except BaseException as exc:  # noqa: BLE001 - closed or broken meanwhile
        task.drop()
        task.state = DONE
        task.value = exc
        waiter.set_result(None)
        return
    pool._submit(task)


async def map_(
    pool: Pool,
    fn: Callable[..., Any],
    iterable: Any,
    chunksize: int | None,
    star: bool,
    on_progress: Callable[[int, int], object] | None = None,
) -> list[Any]:
    """:meth:`Pool.map` and :meth:`Pool.starmap`."""
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress must be callable, not {type(on_progress).__name__}")
    pool._check_open()
    info = fn_info(fn)
    if isinstance(iterable, (list, tuple, range)):
        # Sliced chunk by chunk, never copied whole; a range's chunks stay ranges (a few
        # bytes to pickle, and no int objects made in the parent at all).
        items: Sequence[Any] = iterable
    elif hasattr(iterable, "__aiter__"):
        items = [x async for x in iterable]
    else:
        items = list(iterable)
    n = len(items)
    if chunksize is None:
        slots = pool._processes * (pool._concurrency if info.is_async else 1)
        chunksize = max(1, math.ceil(n / (pool._chunks_per_slot * slots)))
    else:
        chunksize = count("chunksize", chunksize)
    loop = pool._loop
    if loop is None or not n or _cancel_pending(loop):
        await anyio.lowlevel.checkpoint()
        pool._check_open()
        if not n:
            return []
    # else the chunks go out before this task first yields, as apply's task does: the
    # wait below is the checkpoint (see docs/decisions/0029-map-chunks.md).
    flags = (P.F_ASYNC if info.is_async else 0) | (P.F_STAR if star else 0)
    gather = _Gather(pool, n, chunksize)
    tasks = gather.tasks
    try:
        for i, start in enumerate(range(0, n, chunksize)):
            tasks.append(
                make_task(
                    pool,
                    fn,
                    info,
                    flags,
                    items[start : start + chunksize],
                    None,
                    group=gather,
                    index=i,
                    on_done=gather,
                )
            )
    except BaseException:
        for task in tasks:
            task.drop()
        raise
    for task in tasks:
        pool._submit(task)
    if on_progress is None:
        await _wait(pool, tasks, gather.signal)
    else:
        await _wait_reporting(pool, gather, n, on_progress)
    if gather.error is not None:
        raise gather.error
    assert gather.results is not None  # n > 0 chunks, all done
    return gather.results


async def _wait_reporting(
    pool: Pool, gather: _Gather, total: int, on_progress: Callable[[int, int], object]
) -> None:
    """Wait for a map, calling ``on_progress(done, total)`` from this task (never from a
    loop callback) each time chunks have finished; abandon the map on cancellation."""
    progress = gather.progress = Wakeup(pool._loop)
    reported = 0
    try:
        while True:
            if gather.done != reported:
                reported = gather.done
                on_progress(reported, total)
            if gather.signal.is_set():
                return
            await progress.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await pool._abandon(gather.tasks)
        raise


class _Gather:
    """Collects a map's chunks; its signal fires when all are done or one has failed.

    Each chunk's results are copied into their place in the map's result list as they
    come (in the reader callback, while the workers compute the next chunks), so nothing
    is left to assemble after the last one. The list itself is made when the first chunk
    comes, not before the first send (see docs/decisions/0029-map-chunks.md).
    """

    __slots__ = (
        "chunksize",
        "done",
        "error",
        "n",
        "pool",
        "progress",
        "remaining",
        "results",
        "signal",
        "tasks",
    )

    def __init__(self, pool: Pool, n: int, chunksize: int) -> None:
        self.pool = pool
        self.tasks: list[Task] = []
        self.n = n
        self.results: list[Any] | None = None  # made by the first chunk to come
        self.chunksize = chunksize
        self.remaining = math.ceil(n / chunksize)
        self.error: BaseException | None = None
        self.signal = Signal(pool._loop)
        self.done = 0  # inputs whose results have come
        self.progress: Wakeup | None = None

    def __call__(self, task: Task) -> None:
        if self.progress is not None:
            self.progress.set()
        if task.ok and len(task.value) == task.size:
            self.done += task.size
            start = task.index * self.chunksize
            results = self.results
            if results is None:
                results = self.results = [None] * self.n
            results[start : start + task.size] = task.value
        elif self.error is None:
            if task.ok:  # cannot happen unless a worker is broken; never a shifted list
                task.ok = False
                task.value = RuntimeError(
                    f"a chunk of {task.name} came back with {len(task.value)} results "
                    f"for {task.size} inputs"
                )
            self.error = task.value
            self.signal.set()
            for other in self.tasks:  # now, before the freed worker takes the next one
                self.pool._sched.drop(other)
        self.remaining -= 1
        if not self.remaining:
            self.signal.set()


class ResultIterator(Generic[T]):
    """What :meth:`Pool.imap` and :meth:`Pool.imap_unordered` return."""

    def __init__(
        self,
        pool: Pool,
        fn: Callable[..., T],
        iterable: Any,
        chunksize: int,
        star: bool,
        ordered: bool,
        buffersize: int | None,
    ) -> None:
        pool._check_open()
        self._fn_info = info = fn_info(fn)
        chunksize = count("chunksize", chunksize)
        if buffersize is None:
            buffersize = 2 * pool._processes * (pool._concurrency if info.is_async else 1)
        else:
            buffersize = count("buffersize", buffersize)
        self._pool = pool
        self._fn = fn
        self._flags = (P.F_ASYNC if info.is_async else 0) | (P.F_STAR if star else 0)
        self._chunksize = chunksize
        self._buffersize = buffersize
        self._ordered = ordered
        self._ait: AsyncIterator[Any] | None = None
        self._it: Iterator[Any] | None = None
        if hasattr(iterable, "__aiter__"):
            self._ait = iterable.__aiter__()
        else:
            self._it = iter(iterable)
        self._tasks: dict[int, Task] = {}  # submitted and not yet consumed, by index
        self._done: collections.deque[Task] = collections.deque()  # unordered: completed
        self._next = 0  # ordered: the index to consume next
        self._count = 0  # chunks submitted
        self._items: collections.deque[T] = collections.deque()
        self._exhausted = False
        self._error: BaseException | None = None  # raised once the in-flight are consumed
        self._wake: anyio.Event | None = None
        self._space: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._started = False
        self._closed: BaseException | None = None
        self._broken: BrokenPoolError | None = None  # raised on every step from then on
        pool._iterators[self] = None

    def __aiter__(self) -> ResultIterator[T]:
        return self

    async def __aenter__(self) -> ResultIterator[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: drop queued chunks, stop reading the input. Never blocks."""
        self._close(None)
        await anyio.lowlevel.checkpoint()

    async def __anext__(self) -> T:
        """The next result. Cancelling it leaves the iterator as it was."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._items:
                return self._items.popleft()
            if self._broken is not None:
                raise fresh(self._broken)
            if self._closed is not None:
                err = self._closed
                if isinstance(err, StopAsyncIteration):
                    raise StopAsyncIteration
                self._closed = StopAsyncIteration()  # raised once, then the end
                raise err
            if not self._started:
                await anyio.lowlevel.checkpoint()
                self._start()
                continue
            task = self._take()
            if task is not None:
                if task.ok:
                    self._items.extend(task.value)
                    continue
                if isinstance(task.value, BrokenPoolError):
                    self._break(task)
                    continue
                raise task.value
            if self._exhausted and not self._tasks:
                input_error, self._error = self._error, None
                self._close(None)
                if input_error is not None:
                    raise input_error
                raise StopAsyncIteration
            self._wake = event = anyio.Event()
            try:
                await event.wait()
            finally:
                self._wake = None

    def _break(self, task: Task) -> None:
        """The pool broke: no more results will come. Count what was not run."""
        lost = task.size + sum(t.size for t in self._tasks.values() if not t.ok)
        more = "" if self._exhausted else " (the rest of the input was not read)"
        err = BrokenPoolError(
            f"the pool broke with {lost} input(s) of this iterator not run{more}: {task.value}",
            lost,
        )
        err.__cause__ = task.value.__cause__
        self._close(None)
        self._broken = err

    def _start(self) -> None:
        self._started = True
        self._pool._check_open()
        if self._it is not None:
            self._fill()
        else:
            self._scope = anyio.CancelScope()
            assert self._pool._tg is not None
            self._pool._tg.start_soon(self._feed)

    def _take(self) -> Task | None:
        if self._ordered:
            task = self._tasks.get(self._next)
            if task is None or task.state != DONE:
                return None
            self._next += 1
        else:
            if not self._done:
                return None
            task = self._done.popleft()
        del self._tasks[task.index]
        if self._it is not None:
            self._fill()
        elif self._space is not None:
            self._space.set()
        return task

    def _submit(self, chunk: list[Any]) -> None:
        pool = self._pool
        task = make_task(
            pool,
            self._fn,
            self._fn_info,
            self._flags,
            chunk,
            None,
            group=self,
            index=self._count,
            on_done=self._on_done,
        )
        self._tasks[self._count] = task
        self._count += 1
        pool._submit(task)

    def _fill(self) -> None:
        """Pull from a sync input until ``buffersize`` chunks are in flight."""
        assert self._it is not None
        while not self._exhausted and len(self._tasks) < self._buffersize:
            try:
                chunk = list(itertools.islice(self._it, self._chunksize))
            except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
                self._error = exc
                self._exhausted = True
                return
            if chunk:
                self._submit(chunk)
            if len(chunk) < self._chunksize:
                self._exhausted = True

    async def _feed(self) -> None:
        """Pull from an async input while there is room (a task in the pool's group)."""
        ait = self._ait
        assert ait is not None and self._scope is not None
        finished = False  # the input said StopAsyncIteration
        try:
            with self._scope:
                while not finished:
                    while len(self._tasks) >= self._buffersize:
                        self._space = anyio.Event()
                        await self._space.wait()
                    self._space = None
                    chunk: list[Any] = []
                    try:
                        while len(chunk) < self._chunksize:
                            chunk.append(await ait.__anext__())
                    except StopAsyncIteration:
                        finished = True
                    if self._closed is not None:
                        break  # closed while the input was read (an event wins over a cancel)
                    if chunk:
                        self._submit(chunk)
        except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
            self._error = exc
        finally:
            self._exhausted = True
            self._space = None
            if self._wake is not None:
                self._wake.set()
            # An async generator we stopped reading gets its finally blocks run now. Other
            # async iterables (a memory stream, say) are the caller's to close.
            if not finished and inspect.isasyncgen(ait):
                with anyio.CancelScope(shield=True), anyio.move_on_after(self._pool._grace):
                    await ait.aclose()

    def _on_done(self, task: Task) -> None:
        if not self._ordered:
            self._done.append(task)
        if self._wake is not None:
            self._wake.set()

    def _close(self, error: BaseException | None) -> None:
        if self._closed is not None:
            return
        self._closed = error if error is not None else StopAsyncIteration()
        if self._scope is not None:
            self._scope.cancel()
        for task in self._tasks.values():
            if task.state == QUEUED:
                self._pool._sched.drop(task)
        self._tasks.clear()
        self._done.clear()
        self._items.clear()
        self._exhausted = True
        self._pool._iterators.pop(self, None)
        if self._wake is not None:
            self._wake.set()
