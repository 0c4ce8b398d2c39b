"""``aiomp.Pool``: a process pool for asyncio, uvloop and trio.

::

    async with aiomp.Pool(4) as pool:
        y = await pool.apply(f, (x,))
        ys = await pool.map(f, xs)
        async for y in pool.imap(f, endless_source()):
            ...

Processes and who owns what
---------------------------
Each worker is a process started by ``_context.launch`` (concurrently: the call returns
while the interpreter boots) running :func:`aiomp._worker.main`. The pool owns, per
worker, one *watcher* task in the pool's task group. The watcher is the only task that
waits for the process's exit (``_Child.wait_exit``, the pidfd), and it runs the worker's
only *reader* (the one task that receives on its channel) and, when the socket buffer is
full, its *flusher*. Nothing polls and no thread is used: a result is a message becoming
readable, a crash is the pidfd becoming readable.

The channel is a ``_transport.Stream`` over the unix *stream* socket pair that ``launch``
makes for a pool worker (``stream=True``): a worker blocked in ``recvmsg`` on a stream
socket wakes 15 to 20 us sooner than on a datagram socket, a third of a round trip (see
``_transport``). The watcher closes the pool's end once nothing waits on it any more.

How dispatch works, and why
---------------------------
A task is pickled in the caller (so an unpicklable argument raises at the call site) into
one ready-to-send message, then placed by a synchronous scheduler that never awaits:

* **Idle workers first.** Ready workers holding no task sit in a LIFO set; a new task
  goes straight to the most recently idle one, with one non-blocking ``sendmsg``. LIFO
  keeps the hot worker hot (its caches warm, its CPU awake), which is what latency wants.
* **Only to workers that have room; a sent task is a running task.** A worker holds at
  most ``concurrency`` async tasks, or one sync task alone (a sync function blocks its
  worker, so it counts as all ``concurrency`` slots). Nothing waits inside a worker, so
  "sent" means "started", and cancelling a task that is still in the pool's queue simply
  drops it: it never starts. With no idle worker, an async task goes to the least loaded
  worker that has a free slot.
* **One exception, for throughput: a map's next chunk may wait in a busy worker.** A sync
  chunk of a ``map`` / ``imap`` may be sent to a worker that is running a sync chunk of
  the *same* call (one such chunk per worker at most). The worker starts it the moment
  the first ends, so it computes while the parent is still unpickling the previous
  result, as multiprocessing's workers do. Only the call's own chunks share a worker
  that way, so cancelling or failing that call can never hurt another caller's task.
* **FIFO otherwise.** Tasks that find no room wait in one queue, in submission order;
  each freed slot (a result, a new or replacement worker saying READY) dispatches from its
  head. The head is never overtaken, so a sync task waiting for a whole worker is not
  starved by async tasks behind it.
* **One message each way.** ``apply`` costs one ``send`` in the caller, one ``recvmsg`` in
  the pool's reader callback, which resolves the caller's future directly, and one
  ``recvmsg`` and one ``send`` in the worker. There is no feeder thread, no result-handler
  thread and no task-queue process in between. A plain function is pickled (by
  reference) and sent to each worker once; its tasks then name it by a number.
* **Batches for throughput.** ``map`` and ``imap`` send items in chunks (one message,
  one result message per chunk). ``map``'s default chunk size is multiprocessing's,
  ``ceil(n / (4 * processes))`` (times ``concurrency`` for async functions, so that each
  worker gets enough chunks to overlap them); ``imap`` defaults to 1.
* **Back-pressure.** ``imap`` and ``imap_unordered`` keep at most ``buffersize`` chunks
  submitted and not yet consumed (default: twice the slots of the pool). A sync input is
  pulled as the consumer consumes; an async input is pulled by a feeder task that waits
  for room. So an endless input is fine, and a slow consumer throttles the producer.

Failure handling
----------------
* A task's exception is raised in the caller as the same type, its ``__cause__`` a
  ``_RemoteTraceback`` carrying the worker's formatted traceback (as concurrent.futures
  does). An exception that cannot travel arrives as :class:`aiomp.ProcessRaisedException`
  naming its type and text; so does a ``BaseException`` that is not an ``Exception``
  (a task that cancelled itself must not look like a cancellation of the caller).
* A worker that dies fails exactly the tasks it held with :class:`aiomp.BrokenWorkerError`
  and is replaced. A worker that dies before it is ready, or whose initializer raises,
  *breaks* the pool: queued and later tasks fail with that error, and no more workers are
  started (retrying a deterministic start-up failure forever helps nobody).
* Cancelling a caller, or its ``timeout`` passing: a queued task is dropped; a running
  sync task's worker is terminated (SIGTERM, ``grace_period``, SIGKILL) and replaced; a
  running async task is first cancelled inside the worker (its coroutine sees
  ``CancelledError`` and may clean up) and its worker is terminated only if it has not
  finished within ``grace_period``, so that the other tasks in that worker live on.
* Leaving ``async with`` normally waits for every submitted task (an unconsumed
  ``imap``'s queued chunks are dropped), then asks the workers to exit and terminates any
  that do not within ``grace_period``. Leaving by an exception or cancellation terminates
  every worker at once. Both are shielded and bounded.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import itertools
import logging
import math
import os
import pickle
import sys
import types
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from . import _context, _reduction, _transport, _worker
from ._errors import BrokenWorkerError, ProcessRaisedException, exit_description

__all__ = ("Pool", "PoolStatistics")

log = logging.getLogger("aiomp")

T = TypeVar("T")

# task states
_QUEUED, _RUNNING, _DONE, _DROPPED = range(4)
# pool states
_NEW, _OPEN, _CLOSING, _TERMINATING, _CLOSED = range(5)

_EXIT_FRAME = _transport.frame(_worker.frame(_worker.OP_EXIT))


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a :class:`Pool`, from :meth:`Pool.statistics`.

    A "task" is one ``apply`` call or one chunk of a ``map`` / ``imap``.
    """

    #: Worker processes that take tasks (starting ones included; retiring ones not).
    workers: int
    #: Workers that are ready and hold no task.
    idle: int
    #: Workers that hold at least one task.
    busy: int
    #: Tasks held by workers.
    running: int
    #: Tasks waiting in the pool for a worker.
    queued: int
    #: Tasks finished, successfully or not.
    completed: int
    #: Workers started to replace one that died, was killed or retired.
    replaced: int


class _RemoteTraceback(Exception):
    """The ``__cause__`` of an exception re-raised from a worker: its traceback there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class _Signal:
    """A one-shot wake-up for one waiting task at a time.

    On asyncio (uvloop included) it is a bare future: the cheapest wake-up there is, which
    matters on the ``apply`` round trip. Elsewhere (trio) it is an ``anyio.Event``.
    """

    __slots__ = ("_loop", "_set", "_waiter")

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._waiter: Any = None
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            waiter = self._waiter
            if waiter is not None:
                if self._loop is None:
                    waiter.set()
                elif not waiter.done():
                    waiter.set_result(None)

    async def wait(self) -> None:
        if self._set:
            return
        if self._loop is None:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()
            return
        waiter = self._waiter
        if waiter is None or waiter.done():  # done: a cancelled earlier wait
            waiter = self._waiter = self._loop.create_future()
        await waiter


class _Task:
    """One message to a worker: an ``apply`` call or a chunk of a map."""

    __slots__ = (
        "callback",
        "extra",
        "fds",
        "fn",
        "fn_info",
        "frame",
        "group",
        "index",
        "is_async",
        "ok",
        "out",
        "signal",
        "state",
        "tid",
        "value",
        "weight",
        "worker",
    )

    def __init__(self, tid: int, fn: object, fn_info: _Fn, weight: int, frame: bytes,
                 fds: list[int], extra: int, out: _reduction.Outgoing | None,
                 callback: Callable[[_Task], None] | None, index: int,
                 signal: _Signal | None) -> None:
        self.tid = tid
        # The map / imap call it is a chunk of (its callback's owner); None for apply.
        self.group = getattr(callback, "__self__", callback) if callback is not None else None
        self.fn = fn
        self.fn_info = fn_info
        self.is_async = fn_info.is_async
        self.weight = weight
        self.frame = frame  # ready for Stream.try_send, with fds
        self.fds = fds
        self.extra = extra
        self.out: _reduction.Outgoing | None = out
        self.state = _QUEUED
        self.worker: _Worker | None = None
        self.ok = False
        self.value: Any = None
        self.signal = signal
        self.callback = callback
        self.index = index

    @property
    def name(self) -> str:
        return _worker._fn_name(self.fn)

    def release(self) -> None:
        """Drop the pickled message (sent, or never to be sent)."""
        out, self.out = self.out, None
        if out is not None:
            if self.extra >= 0:
                os.close(self.extra)
                self.extra = -1
            out.close()
            self.frame = b""
            self.fds = []

    def finish(self, ok: bool, value: object) -> None:
        if self.out is not None:
            self.release()
        self.state = _DONE
        self.ok = ok
        self.value = value
        if self.callback is not None:
            self.callback(self)
        if self.signal is not None:
            self.signal.set()

    async def wait(self, loop: Any) -> None:
        if self.state < _DONE:
            if self.signal is None:
                self.signal = _Signal(loop)
            await self.signal.wait()


class _Worker:
    """The pool's view of one worker process. Owned by its watcher task."""

    __slots__ = (
        "chan",
        "child",
        "closed",
        "dead",
        "dispatched",
        "fids",
        "flushing",
        "init_error",
        "killed",
        "load",
        "outbox",
        "partial",
        "ready",
        "reason",
        "replaced",
        "retiring",
        "running",
        "scope",
        "slot",
        "tg",
        "wait_scope",
    )

    def __init__(self, slot: int, child: _context._Child, chan: _transport.Stream) -> None:
        self.slot = slot
        self.child = child
        self.chan = chan
        self.ready = False
        self.load = 0  # slots in use: 1 per async task, `concurrency` for a sync one
        self.running: dict[int, _Task] = {}
        self.dispatched = 0
        self.fids: set[int] = set()  # functions DEF'd to it
        self.retiring = False
        self.replaced = False
        self.killed = False
        self.reason = ""
        self.outbox: collections.deque[_Task | bytes] = collections.deque()
        # The unsent rest of a frame that went out in part: it goes before anything else.
        self.partial: memoryview | None = None
        self.flushing = False
        self.tg: anyio.abc.TaskGroup | None = None
        # Shielded: a cancellation around the pool must not blind it to its workers while
        # it shuts them down. The watcher always ends: terminate_all is bounded.
        self.scope = anyio.CancelScope(shield=True)
        # Cancelled to make the watcher stop waiting for the exit and terminate the process.
        self.wait_scope = anyio.CancelScope()
        self.dead = anyio.Event()  # the watcher has finished
        self.init_error: BaseException | None = None
        self.closed = False  # the pool's socket to it is closed

    @property
    def name(self) -> str:
        return f"worker {self.slot} (pid {self.child.pid})"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_BUILTIN_FUNCTIONS = frozenset((types.BuiltinFunctionType,))


class _Fn:
    """What the pool knows of a function it runs (cached per function object).

    ``fid`` is nonzero for a plain function, which pickles by reference: each worker is
    sent ``define`` (a ``DEF`` message) once, and tasks then name it by ``fid``, so
    neither side pickles or looks up the function again. Other callables (bound
    methods, partials, objects with ``__call__``) travel by value in every task: their
    state may change between calls.
    """

    __slots__ = ("define", "fid", "is_async")

    def __init__(self, is_async: bool, fid: int = 0, define: bytes = b"") -> None:
        self.is_async = is_async
        self.fid = fid
        self.define = define


#: fn -> _Fn. Weak: a cached function must not be kept alive by the cache.
_fn_cache: weakref.WeakKeyDictionary[object, _Fn] = weakref.WeakKeyDictionary()
_fids = itertools.count(1)


def _fn_info(fn: object) -> _Fn:
    """``fn``'s :class:`_Fn` (cached: it is asked on every call)."""
    try:
        return _fn_cache[fn]
    except (KeyError, TypeError):  # TypeError: unhashable or not weakly referenceable
        pass
    if not callable(fn):
        _context.check_function(fn, "fork")  # raises the right TypeError
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__  # an object with an async __call__
    )
    info = _Fn(is_async)
    if type(fn) is types.FunctionType:
        try:
            pickled = pickle.dumps(fn, protocol=5)
        except Exception:  # noqa: BLE001 - not by reference: each task pickles it, and says why
            pickled = b""
        if 0 < len(pickled) <= _transport.MAX_INLINE - 64:
            fid = next(_fids)
            info = _Fn(is_async, fid,
                       _transport.frame(_worker.frame(_worker.OP_DEF, fid) + pickled))
    try:
        _fn_cache[fn] = info
    except TypeError:
        pass
    return info


def _asyncio_loop() -> Any:
    """The running asyncio loop, or None on another backend (trio)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _exit_task_group(tg: anyio.abc.TaskGroup, exc: BaseException | None) -> bool:
    """Leave the pool's task group with ``exc`` (the body's exception, if any).

    The body's own exception comes out as itself, not wrapped in an exception group: the
    group may only add errors of the pool's tasks, which would be bugs.
    """
    try:
        return bool(await tg.__aexit__(type(exc) if exc else None, exc,
                                       exc.__traceback__ if exc else None))
    except BaseExceptionGroup as group:
        if exc is None or _leaves(group) != [exc]:
            raise
        return False


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise in one more place (raising one object again and again
    would grow its traceback)."""
    try:
        new = copy.copy(exc)
    except Exception:  # noqa: BLE001
        return exc
    new.__cause__ = exc.__cause__
    new.__traceback__ = None
    return new


class Pool:
    """A pool of worker processes serving sync and async functions to async code.

    ``async with aiomp.Pool(4) as pool:`` starts ``processes`` workers (default: the CPUs
    this process may run on) concurrently, without blocking the event loop, and returns
    at once; tasks wait for the first worker to be ready.

    - ``initializer(*initargs)`` runs once in each worker before its first task (an
      ``async def`` initializer runs on the worker's event loop, which its async tasks
      then share). If it raises, or a worker dies before it is ready, the pool is broken:
      pending and later tasks raise :class:`aiomp.BrokenWorkerError` with the cause.
    - ``maxtasksperchild``: a worker retires after that many tasks (a ``map`` chunk counts
      as one); its replacement starts at once.
    - ``start_method``: ``"spawn"``, ``"forkserver"`` or ``"fork"``.
    - ``concurrency``: how many async tasks run at once in each worker. A sync task always
      has its worker to itself.
    - ``grace_period``: seconds between SIGTERM and SIGKILL whenever a worker is
      terminated, and the longest a cancelled async task may take to finish.

    See the module docstring of ``aiomp._pool`` for how tasks are dispatched.
    """

    def __init__(
        self,
        processes: int | None = None,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        maxtasksperchild: int | None = None,
        start_method: str = "spawn",
        concurrency: int = 1,
        grace_period: float = 5.0,
    ) -> None:
        if processes is None:
            processes = _cpu_count()
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be an int >= 1, not {processes!r}")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, not {concurrency!r}")
        if maxtasksperchild is not None and (
            not isinstance(maxtasksperchild, int) or maxtasksperchild < 1
        ):
            raise ValueError(f"maxtasksperchild must be None or an int >= 1, "
                             f"not {maxtasksperchild!r}")
        if grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, not {grace_period!r}")
        _context.check_start_method(start_method)
        if initializer is not None:
            _context.check_function(initializer, start_method, "initializer")
        self._processes = processes
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasks = maxtasksperchild
        self._start_method = start_method
        self._concurrency = concurrency
        self._grace = float(grace_period)

        self._state = _NEW
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: Any = None  # the asyncio loop we run on; None on trio
        self._init: tuple[bytes, list[int], int, _reduction.Outgoing] | None = None
        self._init_sends = 0
        self._workers: dict[_Worker, None] = {}
        self._idle: dict[_Worker, None] = {}  # insertion order: popitem() is LIFO
        self._queue: collections.deque[_Task] = collections.deque()
        self._queued = 0  # tasks in _queue still _QUEUED (dropped ones leave lazily)
        self._unfinished = 0  # tasks queued or running
        self._completed = 0
        self._replaced = 0
        self._tids = itertools.count(1)
        self._broken: BaseException | None = None
        self._all_done: anyio.Event | None = None
        self._iterators: dict[_ResultIterator[Any], None] = {}

    def __repr__(self) -> str:
        state = ("new", "open", "closing", "terminating", "closed")[self._state]
        return (f"<aiomp.Pool {state} processes={self._processes} "
                f"concurrency={self._concurrency} start_method={self._start_method!r}>")

    @property
    def processes(self) -> int:
        """The number of worker processes the pool keeps."""
        return self._processes

    def pids(self) -> list[int]:
        """Process ids of the live workers that take tasks."""
        return [w.child.pid for w in self._workers if not (w.retiring or w.killed)]

    def statistics(self) -> PoolStatistics:
        """A :class:`PoolStatistics` snapshot (never blocks)."""
        live = [w for w in self._workers if not (w.retiring or w.killed)]
        return PoolStatistics(
            workers=len(live),
            idle=len(self._idle),
            busy=sum(1 for w in self._workers if w.running),
            running=sum(len(w.running) for w in self._workers),
            queued=self._queued,
            completed=self._completed,
            replaced=self._replaced,
        )

    # -- lifetime ------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (concurrently; returns before they are ready).

        On cancellation or failure, the workers started so far are killed and reaped.
        """
        if self._state != _NEW:
            raise RuntimeError("a Pool can be used in `async with` only once")
        out = _reduction.dumps((self._initializer, self._initargs))
        try:
            datagram, fds, extra = _transport.encode(
                _worker.header(_worker.OP_INIT) + out.body, out.fds)
        except BaseException:
            out.close()
            raise
        self._init = (_transport.frame(datagram, len(fds)), fds, extra, out)
        try:
            if self._start_method == "fork":
                _context.check_fork_safe()
            elif self._start_method == "forkserver":
                await _context.prepare_forkserver()
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            self._release_init()
            raise
        self._tg = tg
        self._loop = _asyncio_loop()
        self._state = _OPEN
        try:
            for slot in range(self._processes):
                if slot:
                    # A spawn start forks and execs (a few ms): let the loop breathe
                    # between starts rather than block it for all of them at once.
                    await anyio.lowlevel.checkpoint()
                self._spawn(slot)
        except BaseException as exc:
            await self._shutdown(graceful=False)
            self._release_init()
            await _exit_task_group(tg, exc)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        """Leaving normally waits for every submitted task, then lets the workers exit.

        Leaving by an exception, or being cancelled while waiting, terminates the
        workers (SIGTERM, ``grace_period``, SIGKILL; shielded and bounded), fails the tasks
        still pending, and re-raises.
        """
        tg = self._tg
        assert tg is not None
        if exc is None:
            try:
                await self._join()
            except BaseException as join_exc:
                await self._shutdown(graceful=False)
                self._release_init()
                if await _exit_task_group(tg, join_exc):
                    return None
                raise
            await self._shutdown(graceful=True)
        else:
            await self._shutdown(graceful=False)
        self._release_init()
        return await _exit_task_group(tg, exc)

    async def _join(self) -> None:
        self._state = _CLOSING
        for it in list(self._iterators):
            it._close(RuntimeError("the pool was closed before this iterator was consumed"))
        while self._unfinished:
            self._all_done = anyio.Event()
            await self._all_done.wait()

    async def _shutdown(self, graceful: bool) -> None:
        with anyio.CancelScope(shield=True):
            for it in list(self._iterators):
                it._close(RuntimeError("the pool was terminated"))
            if graceful:
                for w in list(self._workers):
                    self._send(w, _EXIT_FRAME)
                with anyio.move_on_after(self._grace):
                    for w in list(self._workers):
                        await w.dead.wait()
            self._state = _TERMINATING
            self._fail_queued(RuntimeError("the pool was terminated before the task started"))
            workers = list(self._workers)
            for w in workers:
                self._request_kill(w, " (the pool was shutting down)")
            for w in workers:
                await w.dead.wait()  # bounded: each watcher's terminate_all is
            self._state = _CLOSED

    def _release_init(self) -> None:
        init, self._init = self._init, None
        if init is not None:
            if init[2] >= 0:
                os.close(init[2])
            init[3].close()

    def _check_open(self) -> None:
        if self._state != _OPEN:
            if self._state == _NEW:
                raise RuntimeError("the pool is not started: use `async with aiomp.Pool(...)`")
            raise RuntimeError("the pool is closed")
        if self._broken is not None:
            raise _fresh(self._broken)

    # -- workers -------------------------------------------------------------------
    def _spawn(self, slot: int) -> None:
        assert self._tg is not None and self._init is not None
        child = _context.launch(_worker.main, slot, self._start_method, True,
                                name=f"aiomp-pool-{slot}", report=False, stream=True)
        ours, child.sock = child.sock, None  # the channel is ours to own from here
        assert ours is not None
        w = _Worker(slot, child, _transport.Stream(ours))
        self._workers[w] = None
        if self._init_sends:
            self._init[3].copies(2)  # the init message is sent once more
        self._init_sends += 1
        self._send(w, self._init[0], self._init[1])
        self._tg.start_soon(self._watch, w)

    def _replace(self, w: _Worker) -> None:
        """Start a worker to take ``w``'s place, if the pool still wants one."""
        if w.replaced or self._broken is not None:
            return
        if self._state != _OPEN and not (self._state == _CLOSING and self._queued):
            return
        w.replaced = True
        self._replaced += 1
        try:
            self._spawn(w.slot)
        except Exception as exc:  # noqa: BLE001 - fork/exec failed: EAGAIN, EMFILE, ...
            err = RuntimeError(f"the pool could not start a worker to replace {w.name}: {exc}")
            err.__cause__ = exc
            self._break(err)

    def _break(self, err: BaseException) -> None:
        if self._broken is None:
            self._broken = err
            log.error("aiomp: %s", err)
        self._fail_queued(err)

    def _fail_queued(self, err: BaseException) -> None:
        queue = self._queue
        while queue:
            task = queue.popleft()
            if task.state == _QUEUED:
                self._queued -= 1
                self._unfinished -= 1
                task.finish(False, _fresh(err))
        self._check_all_done()

    async def _watch(self, w: _Worker) -> None:
        # The watcher is the only task that waits for, polls, signals or reaps its process:
        # another task reaping it would close the pidfd under a waiter's feet. Others ask
        # for termination through _request_kill and wait for ``w.dead``.
        try:
            with w.scope:
                async with anyio.create_task_group() as tg:
                    w.tg = tg
                    tg.start_soon(self._read, w)
                    if (w.outbox or w.partial is not None) and not w.flushing:
                        w.flushing = True
                        tg.start_soon(self._flush, w)
                    with w.wait_scope:
                        await w.child.wait_exit()
                    if not w.child.exited:
                        await _context.terminate_all([w.child], self._grace)
                    tg.cancel_scope.cancel()
        finally:
            w.tg = None
            if w.child.exited:
                self._drain(w)  # results sent just before the exit
            for item in w.outbox:
                if isinstance(item, _Task):
                    item.release()  # it is in w.running: _on_exit fails it
            w.outbox.clear()
            w.partial = None
            w.chan.close()
            w.closed = True
            self._on_exit(w)
            w.dead.set()

    async def _read(self, w: _Worker) -> None:
        """The one reader of ``w``'s channel, until end of stream or cancellation."""
        chan = w.chan
        loop = self._loop
        if loop is None:
            while True:
                try:
                    got = await chan.recv_async()
                except _transport.Closed:
                    return  # the process is exiting: the watcher sees it next
                except OSError as exc:  # fds were lost (fd limit): the channel is unusable
                    self._lost(w, exc)
                    return
                self._handle(w, got)
        # asyncio: a reader callback that stays registered. It completes the task of the
        # message it reads straight away (resolving its caller's future), without waking a
        # task first and without re-registering the fd for every message (measured: two
        # epoll_ctl calls per round trip cost more than they save). One read per call: the
        # selector is level-triggered and calls again at once if there is more, and the
        # common case, one result, is spared a receive that fails.
        eof = loop.create_future()
        try_recv, take, on_message = chan.try_recv, chan.take, self._on_message

        def readable() -> None:
            try:
                got = try_recv()
            except _transport.Closed:
                loop.remove_reader(fd)
                if not eof.done():
                    eof.set_result(None)
                return
            except OSError as exc:
                loop.remove_reader(fd)  # fds were lost: the channel is unusable
                self._lost(w, exc)
                return
            while got is not None:
                try:
                    on_message(w, got)
                    got = take()  # more that came in the same read
                except Exception as exc:  # noqa: BLE001
                    self._lost(w, exc)
                    return

        fd = chan.fileno()
        loop.add_reader(fd, readable)
        try:
            await eof
        finally:
            loop.remove_reader(fd)

    def _drain(self, w: _Worker) -> None:
        while True:
            try:
                got = w.chan.try_recv()
            except (_transport.Closed, OSError):
                return
            if got is None:
                return
            self._handle(w, got)

    def _send(self, w: _Worker, item: _Task | bytes, fds: list[int] | None = None) -> None:
        """Send a task or a control frame to ``w`` without waiting.

        What does not fit in the socket buffer waits in the worker's outbox (a frame sent
        in part: its rest in ``w.partial``) for its flusher. A task that cannot be sent at
        all (fd limit) fails.
        """
        if w.closed:  # its watcher has finished (and failed its tasks)
            if isinstance(item, _Task):
                item.release()
            return
        if w.outbox or w.partial is not None or not self._try_send(w, item, fds):
            w.outbox.append(item if fds is None else (item, fds))  # type: ignore[arg-type]
        elif w.partial is None:
            return
        if not w.flushing and w.tg is not None:
            w.flushing = True
            w.tg.start_soon(self._flush, w)

    def _try_send(self, w: _Worker, item: Any, fds: list[int] | None = None) -> bool:
        """True when ``item`` is dealt with (sent, at least its start, failed or moot);
        False when it must wait. The rest of a frame sent in part goes to ``w.partial``."""
        if isinstance(item, tuple):  # a control frame with fds (INIT)
            item, fds = item
        task: _Task | None = None
        if isinstance(item, _Task):
            task = item
            data, fds = item.frame, item.fds
        else:
            data = item
        try:
            n = w.chan.try_send(data, fds or [])
        except _transport.Closed:
            n = len(data)  # dying: its watcher sees it, and fails its tasks
        except OSError as exc:  # TransportError: too many fds in flight
            if task is None:
                raise
            task.release()
            if task.state == _RUNNING:
                self._complete(w, task, False, exc)
            return True
        if n == 0:
            return False
        if n < len(data):
            w.partial = memoryview(data)[n:]
        if task is not None:
            task.release()  # its fds are in the socket now, and w.partial holds its rest
        return True

    async def _flush(self, w: _Worker) -> None:
        chan = w.chan
        try:
            while True:
                if w.partial is not None:
                    rest = w.partial
                    n = chan.try_send(rest, [])
                    if n < len(rest):
                        if n:
                            w.partial = rest[n:]
                        await anyio.wait_writable(chan.sock)
                        continue
                    w.partial = None
                if not w.outbox:
                    return
                if self._try_send(w, w.outbox[0]):
                    w.outbox.popleft()
                else:
                    await anyio.wait_writable(chan.sock)
        except _transport.Closed:
            pass  # dying: its watcher sees it, and fails its tasks
        finally:
            w.flushing = False

    def _handle(self, w: _Worker, got: tuple[bytes, list[int]]) -> None:
        try:
            self._on_message(w, got)
        except Exception as exc:  # noqa: BLE001
            self._lost(w, exc)

    def _lost(self, w: _Worker, exc: BaseException) -> None:
        """A message from ``w`` could not be received or handled.

        Its task would wait forever: terminate the worker instead, so that the tasks it
        holds fail with BrokenWorkerError, saying why.
        """
        log.error("aiomp: a message from %s was lost (%s: %s); terminating it",
                  w.name, type(exc).__name__, exc, exc_info=not isinstance(exc, OSError))
        self._request_kill(w, f" (a message from it was lost: {type(exc).__name__}: {exc})")

    def _on_message(self, w: _Worker, got: tuple[bytes, list[int]]) -> None:
        try:
            op, tid, _, payload, fds = _worker.unpack(*got)
        except BaseException:
            _transport.close_fds(got[1])
            raise
        if op == _worker.OP_OK or op == _worker.OP_ERR:
            task = w.running.get(tid)
            if task is None:
                _transport.close_fds(fds)
                return
            ok = op == _worker.OP_OK
            if ok:
                try:
                    value: Any = _reduction.loads(payload, fds)
                except Exception as exc:  # noqa: BLE001
                    ok = False
                    value = pickle.UnpicklingError(
                        f"the result of {task.name} from {w.name} could not be unpickled "
                        f"in the parent: {type(exc).__name__}: {exc}")
                    value.__cause__ = exc
            else:
                value = self._remote_error(w, payload, fds)
            self._complete(w, task, ok, value)
        elif op == _worker.OP_READY:
            _transport.close_fds(fds)
            w.ready = True
            self._make_available(w)
        elif op == _worker.OP_INIT_ERR:
            cause = self._remote_error(w, payload, fds)
            err = BrokenWorkerError(
                f"{w.name}: the pool's initializer raised {type(cause).__name__}: {cause}; "
                "the pool cannot start workers", w.slot, w.child.pid, 1, None)
            err.__cause__ = cause
            w.init_error = err
            if self._state in (_OPEN, _CLOSING):
                self._break(err)
        else:
            _transport.close_fds(fds)
            log.error("aiomp: %s sent an unknown message (op %d)", w.name, op)

    def _remote_error(self, w: _Worker, payload: bytes | memoryview,
                      fds: list[int]) -> BaseException:
        try:
            msg: Any = _reduction.loads(payload, fds)
            text, data, type_name, message, why = msg
        except Exception as exc:  # noqa: BLE001
            return ProcessRaisedException(
                f"{w.name} raised an exception that could not be unpickled: {exc!r}",
                w.slot, w.child.pid)
        exc_obj: BaseException | None = None
        if data is not None:
            try:
                exc_obj = pickle.loads(data)
            except Exception as err:  # noqa: BLE001
                why = f"{type(err).__name__}: {err}"
        if not isinstance(exc_obj, Exception):
            if isinstance(exc_obj, BaseException):
                why = f"it is a BaseException ({type_name}), not an Exception"
            exc_obj = ProcessRaisedException(
                f"{w.name} raised {type_name}: {message}\n"
                f"(the exception itself could not be sent to the parent: {why})",
                w.slot, w.child.pid)
        exc_obj.__cause__ = _RemoteTraceback(f'\n"""\n{w.name}:\n{text}"""')
        return exc_obj

    def _make_available(self, w: _Worker) -> None:
        """``w`` has room again: retire it, mark it idle, dispatch."""
        if w.killed or not w.ready:
            return
        if w.retiring:
            if not w.running:
                self._send(w, _EXIT_FRAME)
            return
        if w.load == 0 and self._state in (_OPEN, _CLOSING):
            self._idle[w] = None
        if self._queue:
            self._dispatch()

    def _retire(self, w: _Worker) -> None:
        w.retiring = True
        self._idle.pop(w, None)
        self._replace(w)
        if not w.running:
            self._send(w, _EXIT_FRAME)

    def _on_exit(self, w: _Worker) -> None:
        """The watcher has finished: the process has exited (or is beyond our reach)."""
        self._idle.pop(w, None)
        tasks = list(w.running.values())
        w.running.clear()
        w.load = 0
        code = w.child.exitcode
        if code is None:
            # It survived SIGKILL (uninterruptible sleep; terminate_all logged it): the pool
            # gives up on it.
            for task in tasks:
                self._unfinished -= 1
                self._completed += 1
                task.finish(False, RuntimeError(
                    f"{w.name} could not be terminated while it ran {task.name}"))
            del self._workers[w]
            self._dispatch()
            self._check_all_done()
            return
        del self._workers[w]
        what, sig = exit_description(code)
        for task in tasks:
            self._unfinished -= 1
            self._completed += 1
            task.finish(False, BrokenWorkerError(
                f"{w.name} {what} while it ran {task.name}{w.reason}",
                w.slot, w.child.pid, code, sig))
        if self._state in (_OPEN, _CLOSING) and self._broken is None and not w.replaced:
            if w.init_error is None and not w.ready and not (w.killed or w.retiring):
                self._break(BrokenWorkerError(
                    f"{w.name} {what} during start-up, before its initializer finished; "
                    "the pool cannot start workers", w.slot, w.child.pid, code, sig))
            elif w.init_error is None:
                self._replace(w)
        self._dispatch()
        self._check_all_done()

    # -- scheduling ------------------------------------------------------------------
    def _pick(self, task: _Task) -> _Worker | None:
        """The worker for ``task``, if one can take it now (see the module docstring)."""
        if self._idle:
            return self._idle.popitem()[0]
        if task.weight < self._concurrency:  # async: the least loaded with a free slot
            best: _Worker | None = None
            for w in self._workers:
                if (w.ready and not (w.retiring or w.killed)
                        and w.load + task.weight <= self._concurrency
                        and (best is None or w.load < best.load)):
                    best = w
            return best
        if task.group is None or task.is_async:
            return None
        for w in self._workers:  # a sync chunk: behind one of its own call's chunks
            if len(w.running) == 1 and not (w.retiring or w.killed):
                (other,) = w.running.values()
                if other.group is task.group and not other.is_async:
                    return w
        return None

    def _dispatch(self) -> None:
        if self._state not in (_OPEN, _CLOSING):
            return
        queue = self._queue
        while queue:
            task = queue[0]
            if task.state != _QUEUED:
                queue.popleft()
                continue
            w = self._pick(task)
            if w is None:
                return
            queue.popleft()
            self._queued -= 1
            self._start(w, task)

    def _start(self, w: _Worker, task: _Task) -> None:
        task.state = _RUNNING
        task.worker = w
        w.running[task.tid] = task
        w.load += task.weight
        w.dispatched += 1
        fid = task.fn_info.fid
        if fid and fid not in w.fids:
            w.fids.add(fid)
            self._send(w, task.fn_info.define)  # ahead of the task, on the same socket
        self._send(w, task)
        if self._maxtasks is not None and w.dispatched >= self._maxtasks:
            self._retire(w)

    def _complete(self, w: _Worker, task: _Task, ok: bool, value: object) -> None:
        del w.running[task.tid]
        w.load -= task.weight
        self._unfinished -= 1
        self._completed += 1
        task.finish(ok, value)
        self._make_available(w)
        if self._all_done is not None:
            self._check_all_done()

    def _check_all_done(self) -> None:
        if self._unfinished == 0 and self._all_done is not None:
            self._all_done.set()

    def _prepare(self, fn: Callable[..., object], info: _Fn, flags: int, items: object,
                 kwds: dict[str, object] | None,
                 callback: Callable[[_Task], None] | None = None, index: int = 0,
                 signal: _Signal | None = None) -> _Task:
        """Pickle a task; raises here, in the caller, if it cannot be pickled."""
        tid = next(self._tids)
        weight = 1 if info.is_async else self._concurrency
        fid = info.fid
        try:
            if not kwds and type(items) is tuple:
                # apply(f, (1, "a")): nothing in it can carry an fd or an array.
                if fid and not items:
                    return _Task(tid, fn, info, weight,
                                 _worker.task_frame(tid, flags | _worker.F_NOARGS, fid, b""),
                                 [], -1, None, callback, index, signal)
                if ((fid or type(fn) in _BUILTIN_FUNCTIONS)
                        and all(type(x) in _worker.PLAIN for x in items)):
                    body = pickle.dumps((items, None) if fid else (fn, items, None), protocol=5)
                    if len(body) < _transport.MAX_INLINE - 32:
                        return _Task(tid, fn, info, weight,
                                     _worker.task_frame(tid, flags, fid, body), [], -1, None,
                                     callback, index, signal)
            out = _reduction.dumps((items, kwds) if fid else (fn, items, kwds))
        except Exception as exc:
            _context.check_function(fn, "spawn")  # a clearer error when fn is the problem
            exc.add_note(f"(while pickling a task of {_worker._fn_name(fn)} for a pool worker)")
            raise
        try:
            datagram, fds, extra = _transport.encode(
                _worker.header(_worker.OP_TASK, tid, flags) + _worker.task_body(fid, out.body),
                out.fds)
        except BaseException:
            out.close()
            raise
        return _Task(tid, fn, info, weight, _transport.frame(datagram, len(fds)), fds, extra,
                     out, callback, index, signal)

    def _enqueue(self, task: _Task) -> None:
        self._unfinished += 1
        if not self._queued:
            w = self._pick(task)
            if w is not None:
                self._start(w, task)
                return
        self._queue.append(task)
        self._queued += 1

    def _drop(self, task: _Task) -> None:
        """A queued task's caller has gone: it never starts."""
        if task.state == _QUEUED:
            task.state = _DROPPED
            task.release()
            self._queued -= 1
            self._unfinished -= 1
            self._check_all_done()

    async def _abandon(self, tasks: Iterable[_Task]) -> None:
        """The caller waiting for ``tasks`` is leaving early (shielded by the caller).

        Queued tasks are dropped. Running async tasks are cancelled in their worker and
        given ``grace_period`` to finish; the workers of running sync tasks, and of async
        ones that did not finish in time, are terminated and replaced.
        """
        coop: list[_Task] = []
        kill: dict[_Worker, None] = {}
        for task in tasks:
            if task.state == _QUEUED:
                self._drop(task)
            elif task.state == _RUNNING:
                w = task.worker
                assert w is not None
                if task.is_async and not w.killed:
                    coop.append(task)
                    self._send(w, _transport.frame(_worker.frame(_worker.OP_CANCEL, task.tid)))
                else:
                    kill[w] = None
        if coop:
            with anyio.move_on_after(self._grace):
                for task in coop:
                    await task.wait(self._loop)
            for task in coop:
                if task.state == _RUNNING:
                    assert task.worker is not None
                    kill[task.worker] = None
        if kill:
            await self._kill(list(kill), " (the pool terminated it to cancel a task)")

    def _request_kill(self, w: _Worker, reason: str) -> None:
        """Have ``w``'s watcher terminate it (SIGTERM, grace period, SIGKILL); replace it."""
        if not w.killed:
            w.killed = True
            w.reason = w.reason or reason
            self._idle.pop(w, None)
            self._replace(w)
        w.wait_scope.cancel()

    async def _kill(self, workers: list[_Worker], reason: str) -> None:
        for w in workers:
            self._request_kill(w, reason)
        for w in workers:
            await w.dead.wait()

    async def _wait(self, tasks: list[_Task], event: _Signal,
                    timeout: float | None = None) -> None:
        """Wait for ``event``; abandon ``tasks`` on cancellation or timeout."""
        try:
            if timeout is None:
                await event.wait()
                return
            with anyio.move_on_after(timeout) as scope:
                await event.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abandon(tasks)
            raise
        if scope.cancelled_caught and not event.is_set():
            with anyio.CancelScope(shield=True):
                await self._abandon(tasks)
            raise TimeoutError(f"{tasks[0].name} did not finish within {timeout} s")

    # -- public calls ----------------------------------------------------------------
    async def apply(self, fn: Callable[..., Any], args: Iterable[object] = (),
                    kwds: dict[str, object] | None = None, *,
                    timeout: float | None = None) -> Any:
        """Run ``fn(*args, **kwds)`` in a worker and return its result.

        ``fn`` may be sync or ``async def``. Its exception is raised here, as the same
        type, with the worker's traceback as ``__cause__``. An argument that cannot be
        pickled raises here before anything is sent. If the worker dies while it runs the
        task: :class:`aiomp.BrokenWorkerError`.

        ``timeout`` (seconds, counted from this call, queueing included) raises
        ``TimeoutError``. On timeout or cancellation a task that has not started never
        starts; a running one is stopped as the module docstring describes (its worker
        terminated and replaced if need be) before the cancellation goes on.
        """
        if self._state != _OPEN or self._broken is not None:
            self._check_open()
        info = _fn_info(fn)
        flags = _worker.F_APPLY | _worker.F_ASYNC if info.is_async else _worker.F_APPLY
        loop = self._loop
        signal = _Signal(loop)
        task = self._prepare(fn, info, flags, args if type(args) is tuple else tuple(args),
                             dict(kwds) if kwds else None, signal=signal)
        self._enqueue(task)
        if loop is not None and timeout is None:
            # The round trip's hot path, _wait and _Signal.wait inlined: a future that the
            # reader callback resolves (_complete), awaited here directly.
            if not signal._set:
                signal._waiter = waiter = loop.create_future()
                try:
                    await waiter
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._abandon([task])
                    raise
        else:
            await self._wait([task], signal, timeout)
        if task.ok:
            return task.value
        raise task.value

    async def map(self, fn: Callable[[Any], Any], iterable: Iterable[Any] | AsyncIterable[Any],
                  chunksize: int | None = None) -> list[Any]:
        """``[fn(x) for x in iterable]``, computed by the workers in chunks.

        ``iterable`` may be sync or async; it is read whole first (use :meth:`imap` for
        streams). ``chunksize`` defaults to ``ceil(n / (4 * processes))`` (times
        ``concurrency`` for an async ``fn``). The first task to fail makes this raise its
        exception (never an exception group); the chunks not started yet are dropped.

        On cancellation chunks not started never start, and running ones are stopped as
        for :meth:`apply`.
        """
        return await self._map(fn, iterable, chunksize, star=False)

    async def starmap(self, fn: Callable[..., Any],
                      iterable: Iterable[Iterable[Any]] | AsyncIterable[Iterable[Any]],
                      chunksize: int | None = None) -> list[Any]:
        """``[fn(*args) for args in iterable]``; otherwise as :meth:`map`."""
        return await self._map(fn, iterable, chunksize, star=True)

    async def _map(self, fn: Callable[..., Any], iterable: Any, chunksize: int | None,
                   star: bool) -> list[Any]:
        self._check_open()
        info = _fn_info(fn)
        is_async = info.is_async
        if isinstance(iterable, (list, tuple)):
            items: list[Any] | tuple[Any, ...] = iterable
        elif hasattr(iterable, "__aiter__"):
            items = [x async for x in iterable]
            self._check_open()
        else:
            items = list(iterable)
        n = len(items)
        if chunksize is None:
            slots = self._processes * (self._concurrency if is_async else 1)
            chunksize = max(1, math.ceil(n / (4 * slots)))
        elif not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be an int >= 1, not {chunksize!r}")
        if n == 0:
            await anyio.lowlevel.checkpoint()
            return []
        flags = (_worker.F_ASYNC if is_async else 0) | (_worker.F_STAR if star else 0)
        gather = _Gather(self, math.ceil(n / chunksize))
        tasks = gather.tasks
        try:
            for i, start in enumerate(range(0, n, chunksize)):
                tasks.append(self._prepare(fn, info, flags, list(items[start:start + chunksize]),
                                           None, gather, i))
        except BaseException:
            for task in tasks:
                task.release()
            raise
        for task in tasks:
            self._enqueue(task)
        await self._wait(tasks, gather.signal)
        if gather.error is not None:
            raise gather.error
        return list(itertools.chain.from_iterable(gather.results))

    def imap(self, fn: Callable[[Any], Any], iterable: Iterable[Any] | AsyncIterable[Any],
             chunksize: int = 1, *, buffersize: int | None = None) -> _ResultIterator[Any]:
        """An async iterator of ``fn(x)`` for each ``x`` of ``iterable``, in order.

        ``iterable`` may be sync or async, and endless: at most ``buffersize`` chunks
        (default: twice the pool's slots) are submitted and not yet consumed, so the input
        is read only as fast as results are consumed. Results come as soon as each is
        ready and all before it have come. A failed chunk raises its exception when
        reached; iteration may go on after it. An error reading the input is raised after
        the results of the items read before it.

        Use it with ``async with pool.imap(...) as it:`` or call ``await it.aclose()`` to
        stop early: queued chunks are dropped (running ones finish; their results are
        discarded) and an async input is closed. Cancelling a task waiting for the next
        item leaves the iterator as it was. Leaving the pool's ``async with`` closes it.
        """
        return _ResultIterator(self, fn, iterable, chunksize, False, True, buffersize)

    def imap_unordered(self, fn: Callable[[Any], Any],
                       iterable: Iterable[Any] | AsyncIterable[Any], chunksize: int = 1, *,
                       buffersize: int | None = None) -> _ResultIterator[Any]:
        """As :meth:`imap`, but each chunk's results come as soon as the chunk is done."""
        return _ResultIterator(self, fn, iterable, chunksize, False, False, buffersize)


class _Gather:
    """Collects a map's chunks; its event fires when all are done or one has failed."""

    __slots__ = ("error", "pool", "remaining", "results", "signal", "tasks")

    def __init__(self, pool: Pool, n: int) -> None:
        self.pool = pool
        self.tasks: list[_Task] = []
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.error: BaseException | None = None
        self.signal = _Signal(pool._loop)

    def __call__(self, task: _Task) -> None:
        if task.ok:
            self.results[task.index] = task.value
        elif self.error is None:
            self.error = task.value
            self.signal.set()
            for other in self.tasks:  # now, before the freed worker takes the next one
                self.pool._drop(other)
        self.remaining -= 1
        if not self.remaining:
            self.signal.set()


class _ResultIterator(Generic[T]):
    """What :meth:`Pool.imap` and :meth:`Pool.imap_unordered` return."""

    def __init__(self, pool: Pool, fn: Callable[..., T], iterable: Any, chunksize: int,
                 star: bool, ordered: bool, buffersize: int | None) -> None:
        pool._check_open()
        self._fn_info = info = _fn_info(fn)
        is_async = info.is_async
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be an int >= 1, not {chunksize!r}")
        if buffersize is None:
            buffersize = 2 * pool._processes * (pool._concurrency if is_async else 1)
        elif not isinstance(buffersize, int) or buffersize < 1:
            raise ValueError(f"buffersize must be an int >= 1, not {buffersize!r}")
        self._pool = pool
        self._fn = fn
        self._flags = (_worker.F_ASYNC if is_async else 0) | (_worker.F_STAR if star else 0)
        self._chunksize = chunksize
        self._buffersize = buffersize
        self._ordered = ordered
        self._ait: AsyncIterator[Any] | None = None
        self._it: Iterator[Any] | None = None
        if hasattr(iterable, "__aiter__"):
            self._ait = iterable.__aiter__()
        else:
            self._it = iter(iterable)
        self._tasks: dict[int, _Task] = {}  # submitted and not yet consumed, by index
        self._done: collections.deque[_Task] = collections.deque()  # unordered: completed
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
        pool._iterators[self] = None

    def __aiter__(self) -> _ResultIterator[T]:
        return self

    async def __aenter__(self) -> _ResultIterator[T]:
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
            if self._closed is not None:
                err = self._closed
                if isinstance(err, StopAsyncIteration):
                    raise StopAsyncIteration
                self._closed = StopAsyncIteration()  # raised once, then the end
                raise err
            if not self._started:
                self._start()
                continue
            task = self._take()
            if task is not None:
                if task.ok:
                    self._items.extend(task.value)
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

    def _start(self) -> None:
        self._started = True
        if self._it is not None:
            self._fill()
        else:
            self._scope = anyio.CancelScope()
            assert self._pool._tg is not None
            self._pool._tg.start_soon(self._feed)

    def _take(self) -> _Task | None:
        if self._ordered:
            task = self._tasks.get(self._next)
            if task is None or task.state != _DONE:
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
        pool._check_open()
        task = pool._prepare(self._fn, self._fn_info, self._flags, chunk, None,
                             self._on_done, self._count)
        self._tasks[self._count] = task
        self._count += 1
        pool._enqueue(task)

    def _fill(self) -> None:
        """Pull from a sync input until ``buffersize`` chunks are in flight."""
        assert self._it is not None
        while not self._exhausted and len(self._tasks) < self._buffersize:
            try:
                chunk = list(itertools.islice(self._it, self._chunksize))
                if chunk:
                    self._submit(chunk)
            except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
                self._error = exc
                self._exhausted = True
                return
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

    def _on_done(self, task: _Task) -> None:
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
            self._pool._drop(task)
        self._tasks.clear()
        self._done.clear()
        self._items.clear()
        self._exhausted = True
        self._pool._iterators.pop(self, None)
        if self._wake is not None:
            self._wake.set()


for _cls in (Pool, PoolStatistics):
    _cls.__module__ = "aiomp"
