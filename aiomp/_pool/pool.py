"""``aiomp.Pool``: a process pool for asyncio, uvloop and trio.

::

    async with aiomp.Pool(4) as pool:
        y = await pool.apply(f, (x,))
        ys = await pool.map(f, xs)
        async for y in pool.imap(f, endless_source()):
            ...

The parts, and who owns what
----------------------------
::

    Pool (here: options, async with, the typed calls, statistics)
      |  apply / map (calls), imap (iterators): pickle in the caller, wait, abandon
      v
    Engine (engine: task group, supervisor, lifetime) -- Scheduler (pure: which task where)
      |  start / encode                                  |  send / send_exit / cancel / kill
      v                                                  v
    WorkerKind (kinds) ------------- starts -----------> Handle: decodes, reports on_result
      ProcessKind (process_kind)                          ProcessHandle (process_handle)
      RayKind (aiomp.ray)                                 ActorHandle (aiomp.ray)

A process worker (``worker_main``) speaks the frames of ``protocol`` over two stream
sockets. Nothing reached from a loop callback (a handle's reader) creates an anyio object
or awaits: the scheduler is synchronous, and wake-ups are ``aiomp._loop.wakeup``'s.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Self, TypeVar, overload

from .._output import forwarder as _output
from .._process import checks as _process
from .._process import placement as _placement
from .._process.cpus import cpu_count
from .._spawn.unawaited import call_site, warn_never_used
from . import admission as _admission
from . import calls as _calls
from .batching import Batched
from .engine import Engine, pool_statistics
from .iterators import ResultIterator
from .options import Inputs, PoolStatistics, Progress, check_options
from .process_kind import ProcessKind

__all__ = ("Pool", "PoolStatistics", "check_options")

S = TypeVar("S")
T = TypeVar("T")


class Pool:
    """A pool of worker processes serving sync and async functions to async code.

    ``async with aiomp.Pool(4) as pool:`` starts ``processes`` workers (default: the CPUs
    this process may use, its affinity capped by its cgroup's CPU quota) concurrently,
    without blocking the event loop, and returns at once; tasks wait for the first worker
    to be ready. A pool never entered warns (``RuntimeWarning``) when collected. Workers
    that a fork starts get fresh seeds for ``random``, numpy and torch
    (``aiomp._child.seeds``).

    - ``initializer(*initargs)`` runs once in each worker before its first task (an
      ``async def`` initializer runs on the worker's event loop, which its async tasks
      then share). If it raises, the pool is broken: pending and later tasks raise
      :class:`aiomp.BrokenPoolError` with the cause.
    - ``maxtasksperchild``: a worker retires after that many tasks (a ``map`` chunk counts
      as one); its replacement starts at once.
    - ``start_method``: ``"spawn"``, ``"forkserver"`` or ``"fork"``.
    - ``concurrency``: how many async tasks run at once in each worker. A sync task always
      has its worker to itself.
    - ``grace_period``: seconds between SIGTERM and SIGKILL whenever a worker is
      terminated, and the longest a cancelled async task may take to finish.
    - ``max_memory`` (bytes): a worker whose private memory (``Private_Dirty``: shared
      arrays and weights do not count) grows more than that over its level after the
      initializer is retired after its current task, its replacement started first, and
      an INFO line on the ``aiomp`` logger says why.
    - ``output``: ``"prefix"`` (each line a worker writes to fd 1 or 2 appears on the
      parent's ``sys.stdout`` / ``sys.stderr`` as ``[worker N] line``, and its logging
      records go through the parent's logging with ``record.worker`` set to N), ``"inherit"``
      (the raw fds), or a callable ``(slot, stream, line)``; see ``aiomp.spawn``.
    - ``env``: a dict of str to str merged over each worker's environment, or a callable
      ``env(slot)`` giving one (called here, once per slot), e.g. ``lambda i:
      {"CUDA_VISIBLE_DEVICES": str(i)}``: in place before the worker's interpreter
      starts (``spawn``) or before any code runs in it (``forkserver``, ``fork``); a
      replacement gets its slot's again. A worker's ``aiomp.get_worker_info().id`` is its
      slot. A key or value that is not a str: ``TypeError`` here.
    - ``max_pending``: load shedding. A call that would be the (N+1)-th task not started
      yet (queued in the pool, or waiting in a worker behind the one it runs) raises
      :class:`aiomp.PoolOverloadedError` at once and never runs; calls are accepted again
      as the queue drains. A ``map`` is one call (refused when its first chunk would be);
      for ``batched`` see there. Default: no limit.

    Dispatch: a task goes to the most recently idle worker, else waits in one FIFO queue
    (never overtaken); a sync task has a worker to itself, ``concurrency`` async tasks
    share one. A task's exception is raised in its caller alone, ``SystemExit`` and
    ``KeyboardInterrupt`` too (as ``concurrent.futures`` raises them; the worker serves
    on). A worker that dies fails only the tasks it had started
    (:class:`aiomp.BrokenWorkerError`) and is replaced; tasks it had not started go to
    another. A worker that cannot be started (fork's EAGAIN) is tried again with growing
    delays; only a start that keeps failing breaks the pool. Cancelling a call (or its
    ``timeout``) drops a task that has not started and stops a running one, terminating
    its worker if need be. Leaving ``async with`` normally waits for the submitted tasks;
    leaving by an exception or cancellation terminates the workers (a second
    cancellation: SIGKILL at once), and they are always reaped first. The design:
    ``docs/architecture.md`` in the source repository.
    """

    #: What serves the calls (set by :func:`attach`).
    _engine: Engine
    #: Where the pool was made, until it is entered (see __del__).
    _site: tuple[str, int, str] | None = None

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
        output: _output.Output = "prefix",
        env: _placement.Env = None,
        max_memory: int | None = None,
        max_pending: int | None = None,
    ) -> None:
        n, concurrency, maxtasksperchild, grace = check_options(
            processes, concurrency, maxtasksperchild, grace_period
        )
        if max_memory is not None:
            max_memory = _process.count("max_memory", max_memory)
        _process.check_start_method(start_method)
        _output.check_output(output)
        if initializer is not None:
            _process.check_function(initializer, start_method, "initializer")
        n = cpu_count() if n is None else n
        init = (initializer, tuple(initargs))
        envs = _placement.slot_envs(env, n)
        kind = ProcessKind(start_method, init, output, envs=envs, max_memory=max_memory)
        attach(self, Engine(kind, n, concurrency, maxtasksperchild, grace), max_pending)

    def __repr__(self) -> str:
        e = self._engine
        state = ("new", "open", "closing", "closed")[e.state]
        cls = type(self)
        return (
            f"<{cls.__module__}.{cls.__qualname__} {state} processes={e.processes} "
            f"concurrency={e.concurrency} {e.kind.describe()}>"
        )

    @property
    def processes(self) -> int:
        """The number of worker processes the pool keeps."""
        return self._engine.processes

    def pids(self) -> list[int]:
        """Process ids of the live workers that take tasks (known once they are ready)."""
        return [pid for h in self._engine.live_handles() if (pid := h.pid) is not None]

    def statistics(self) -> PoolStatistics:
        """A :class:`PoolStatistics` snapshot (never blocks)."""
        return pool_statistics(self._engine)

    async def wait_ready(self) -> None:
        """Return once every worker has run the initializer (at once if none is set).

        Raises :class:`aiomp.BrokenPoolError` if the pool is broken (its ``__cause__``:
        the initializer's own exception, with the worker's traceback, where it raised),
        ``RuntimeError`` outside ``async with``. Call it before taking traffic (a
        service's lifespan). Cancellation leaves the pool as it was.
        """
        await _admission.wait_ready(self._engine)

    # -- lifetime ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (concurrently; returns before they are ready).

        On cancellation or failure, the workers started so far are killed and reaped.
        """
        self._site = None
        await self._engine.open()
        return self

    def __del__(self) -> None:
        # A pool made and dropped unentered ran nothing: say so, as a coroutine would.
        if self._site is not None:
            name = type(self).__module__ + "." + type(self).__qualname__
            warn_never_used(f"{name}(...)", f"`async with {name}(...) as pool:`", self._site)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Leaving normally waits for every submitted task, then lets the workers exit.

        Leaving by an exception, or being cancelled while waiting, terminates the
        workers (SIGTERM, ``grace_period``, SIGKILL; shielded and bounded), fails the tasks
        still pending, and re-raises what the body raised, as it was.
        """
        return await self._engine.close(exc)

    # -- public calls ------------------------------------------------------------------
    # Each call is typed by two overloads: an ``async def`` fn's result is awaited in the
    # worker, so both give T.
    @overload
    async def apply(
        self,
        fn: Callable[..., Awaitable[T]],
        args: Iterable[object] = (),
        kwds: dict[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> T: ...
    @overload
    async def apply(
        self,
        fn: Callable[..., T],
        args: Iterable[object] = (),
        kwds: dict[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> T: ...
    async def apply(
        self,
        fn: Callable[..., Any],
        args: Iterable[object] = (),
        kwds: dict[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        # Each pool shadows this with calls.apply bound to its engine (see attach): the
        # docstring is calls.apply's.
        return await _calls.apply(self._engine, fn, args, kwds, timeout=timeout)

    apply.__doc__ = _calls.apply.__doc__

    @overload
    async def map(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Inputs[S],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...
    @overload
    async def map(
        self,
        fn: Callable[[S], T],
        iterable: Inputs[S],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...
    async def map(
        self,
        fn: Callable[[Any], Any],
        iterable: Inputs[Any],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[Any]:
        """``[fn(x) for x in iterable]``, computed by the workers in chunks.

        ``iterable`` may be sync or async; it is read whole first (use :meth:`imap` for
        streams). ``chunksize`` defaults to ``ceil(n / (4 * processes))`` (times
        ``concurrency`` for an async ``fn``). The first task to fail makes this raise its
        exception (never an exception group); the chunks not started yet are dropped.

        ``on_progress(done, total)``, if given, is called from this task (not from the
        event loop's internals) as chunks finish, with the number of inputs done so far:
        ``tqdm``'s ``update`` or a log line fit there.

        On cancellation chunks not started never start, and running ones are stopped as
        for :meth:`apply`.
        """
        return await _calls.map_(self._engine, fn, iterable, chunksize, False, on_progress)

    @overload
    async def starmap(
        self,
        fn: Callable[..., Awaitable[T]],
        iterable: Inputs[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...
    @overload
    async def starmap(
        self,
        fn: Callable[..., T],
        iterable: Inputs[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[T]: ...
    async def starmap(
        self,
        fn: Callable[..., Any],
        iterable: Inputs[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Progress = None,
    ) -> list[Any]:
        """``[fn(*args) for args in iterable]``; otherwise as :meth:`map`."""
        return await _calls.map_(self._engine, fn, iterable, chunksize, True, on_progress)

    @overload
    def imap(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...
    @overload
    def imap(
        self,
        fn: Callable[[S], T],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...
    def imap(
        self,
        fn: Callable[[Any], Any],
        iterable: Inputs[Any],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[Any]:
        """An async iterator of ``fn(x)`` for each ``x`` of ``iterable``, in order.

        ``iterable`` may be sync or async, and endless: at most ``buffersize`` chunks
        (default: twice the pool's slots) are submitted and not yet consumed, so the input
        is read only as fast as results are consumed. Results come as soon as each is
        ready and all before it have come. A failed chunk raises its exception when
        reached; iteration may go on after it. An error reading the input is raised after
        the results of the items read before it. If the pool breaks, the iterator raises
        :class:`aiomp.BrokenPoolError` (saying how many inputs were not run) on this and
        every later step: it never ends with inputs unaccounted for.

        Use it with ``async with pool.imap(...) as it:`` or call ``await it.aclose()`` to
        stop early: queued chunks are dropped (running ones finish; their results are
        discarded) and an async input is closed. Cancelling a task waiting for the next
        item leaves the iterator as it was. Leaving the pool's ``async with`` closes it.
        """
        return ResultIterator(self._engine, fn, iterable, chunksize, False, True, buffersize)

    @overload
    def imap_unordered(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...
    @overload
    def imap_unordered(
        self,
        fn: Callable[[S], T],
        iterable: Inputs[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[T]: ...
    def imap_unordered(
        self,
        fn: Callable[[Any], Any],
        iterable: Inputs[Any],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> ResultIterator[Any]:
        """As :meth:`imap`, but each chunk's results come as soon as the chunk is done."""
        return ResultIterator(self._engine, fn, iterable, chunksize, False, False, buffersize)

    def batched(
        self,
        fn: Callable[[Any], Any],
        *,
        max_batch_size: int = 32,
        max_delay: float = 0.005,
        stack: bool = False,
        split_on_error: bool = True,
    ) -> Batched[Any, Any]:
        """An async callable ``b``: ``await b(x)`` from many tasks at once runs ``fn``
        once per batch of calls. Make it once (a service: in its lifespan) and share it:
        each ``b`` batches only its own calls (a second one for the same ``fn`` warns).

        Calls collect in an open batch; it goes to a worker as soon as one is free to
        take it (a call on an idle pool costs about an ``apply``: it waits for company
        only while calls keep arriving, at most ``max_delay`` seconds), and while every
        worker is busy it keeps filling; a full batch (``max_batch_size`` calls) is
        queued like any task. The worker runs ``fn(xs)`` (sync or async), ``xs`` the
        batch's arguments in arrival order; it returns a sequence of the same length,
        and each caller gets its own element. ``stack=True``: every argument is a numpy
        array of the batch's first shape and dtype (otherwise that call raises
        ``ValueError`` at once), stacked along a new axis 0 straight into shared memory
        (under 64 KiB: into the task's message); ``fn`` gets that one array and returns
        an array whose axis 0 is the batch size, given back as views.

        Errors: a batch whose ``fn`` raises is split in halves that run again, down to
        single rows, so only a row that raises on its own fails, in its own caller, as
        :meth:`apply` raises it: ``fn`` must be safe to run again on rows
        (``split_on_error=False``: every caller of the batch gets the exception). A
        worker that dies: :class:`aiomp.BrokenWorkerError` in each; a result of the
        wrong length: ``ValueError`` in each. With the pool's ``max_pending``, a full
        batch is one task: one that cannot be queued waits for room, and a call that
        finds no batch to join raises :class:`aiomp.PoolOverloadedError` at once.
        Cancellation: a call cancelled before its batch goes to a worker is taken out of
        it (a batch left empty is dropped); one cancelled after returns at once and its
        element is discarded. A running batch is never stopped for its callers.
        """
        return Batched(self._engine, fn, max_batch_size, max_delay, stack, split_on_error)


def on_demand(kind: ProcessKind, processes: int) -> tuple[Pool, Engine]:
    """A Pool of up to ``processes`` workers of ``kind``, each started when a task finds
    no worker for it (``run_sync``'s default pool, decision 0091); and its engine."""
    pool = Pool.__new__(Pool)
    engine = Engine(kind, processes, 1, None, 5.0, on_demand=True)
    attach(pool, engine)
    pool._site = None  # aiomp's own pool: its loop may end before it is entered
    return pool, engine


def attach(pool: Pool, engine: Engine, max_pending: int | None = None) -> None:
    """Make ``engine`` serve ``pool``'s calls: every Pool constructor's last step, the
    engine built over the constructor's own kind of worker (``aiomp.ray.Pool``: Ray's)."""
    if max_pending is not None:
        engine.max_pending = _admission.check_max_pending(max_pending)
    pool._engine = engine
    pool._site = call_site(2)  # the caller of the pool's constructor
    # ``apply`` is calls.apply bound to the engine: no frame of the Pool's on the round
    # trip (hot path: tests/budgets).
    pool.__dict__["apply"] = functools.partial(_calls.apply, engine)


for _cls in (Pool, PoolStatistics):
    _cls.__module__ = "aiomp"
_calls.apply.__module__, _calls.apply.__qualname__ = "aiomp", "Pool.apply"
