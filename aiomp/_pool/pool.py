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

    caller --- apply / map / imap (_calls: pickle in the caller, wait, abandon)
                  |  submit / drop
                  v
    Pool (here) - Scheduler (_scheduler: pure, synchronous; which task runs where)
       |             |  send / send_exit / kill          ^ ready / complete / exited
       |             v                                   |
       +-- spawns - WorkerHandle (_handle: process, channel, outbox, watcher task)
                     |  _protocol frames over a _transport.Stream
                     v
                   worker process (_worker.main)

Each worker is a process started by ``_process.launch``. The pool owns the task group,
the *supervisor* task that starts workers (the one thing the scheduler cannot do from a
loop callback) and the message handler. How a task
travels: "From apply to its result" in docs/architecture.md; why it is built so:
docs/decisions/ (0024 dispatch, 0025 pool failures, 0029 map chunks, 0002 stream channels,
0021 termination) and *Nothing anyio in loop callbacks* in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar, cast, overload

import anyio
import anyio.abc
import anyio.lowlevel

from .._errors import BrokenWorkerError, ProcessRaisedException
from .._loop import running_asyncio_loop
from .._loop.taskhost import TaskHost
from .._loop.wakeup import Wakeup
from .._output import forwarder as _output
from .._process import checks as _checks
from .._process import launch as _launch
from .._process.child import Child
from .._wire import pickling as _reduction
from .._wire import transport as _transport
from . import calls as _calls
from . import protocol as P
from . import worker_main as _worker
from .process_handle import WorkerHandle
from .scheduler import QUEUED, RUNNING, Handle, Scheduler, Task, fresh

if TYPE_CHECKING:
    import asyncio

__all__ = ("Pool", "PoolStatistics")

log = logging.getLogger("aiomp")

S = TypeVar("S")
T = TypeVar("T")

_NEW, _OPEN, _CLOSING, _CLOSED = range(4)
_KIND_DATA = _transport.KIND_DATA
_HEAD = P.HEAD.unpack_from
_SMALL = P.COPY_BELOW


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


class _Handle(Handle, Protocol):
    """What the pool needs of a worker's handle, beyond what its scheduler needs: a
    :class:`~aiomp._pool.process_handle.WorkerHandle`, or ``aiomp.ray``'s ``ActorHandle``."""

    #: Set once the worker has exited and its handle is closed.
    dead: anyio.Event

    def cancel(self, tid: int) -> None:
        """Ask the worker to cancel async task ``tid``."""


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


async def _reap(
    handles: list[_Handle], interrupted: BaseException | None = None
) -> BaseException | None:
    """Wait until every watcher of ``handles`` has finished (bounded: each one's
    termination is). A cancellation or KeyboardInterrupt meanwhile cannot cut this short,
    as native asyncio cancellations pass anyio's shields: it means "now", SIGKILL for all,
    and is returned, with ``interrupted``, once they are reaped."""
    for h in handles:
        while not h.dead.is_set():
            try:
                await h.dead.wait()
            except BaseException as exc:  # noqa: BLE001 - returned once all are reaped
                interrupted = interrupted or exc
                for other in handles:
                    other.kill(now=True)
    return interrupted


class Pool:
    """A pool of worker processes serving sync and async functions to async code.

    ``async with aiomp.Pool(4) as pool:`` starts ``processes`` workers (default: the CPUs
    this process may run on) concurrently, without blocking the event loop, and returns
    at once; tasks wait for the first worker to be ready.

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
    - ``output``: ``"prefix"`` (each line a worker writes to fd 1 or 2 appears on the
      parent's ``sys.stdout`` / ``sys.stderr`` as ``[worker N] line``, and its logging
      records go through the parent's logging with ``record.worker`` set to N), ``"inherit"``
      (the raw fds), or a callable ``(slot, stream, line)``; see ``aiomp.spawn``.

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

    #: Turns a call into a task's message (see ``_calls.make_task``); None: the process
    #: workers' wire format. ``aiomp.ray.Pool`` sets its own.
    _encode: Callable[..., Any] | None = None
    #: ``map``'s default chunk size makes this many chunks per worker slot.
    _chunks_per_slot = 4

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
    ) -> None:
        # (A wrong type is a TypeError, a number below 1 a ValueError, as Python's pools.)
        processes = _cpu_count() if processes is None else _checks.count("processes", processes)
        concurrency = _checks.count("concurrency", concurrency)
        if maxtasksperchild is not None:
            maxtasksperchild = _checks.count("maxtasksperchild", maxtasksperchild)
        if grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, not {grace_period!r}")
        _checks.check_start_method(start_method)
        _output.check_output(output)
        if initializer is not None:
            _checks.check_function(initializer, start_method, "initializer")
        self._processes = processes
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._start_method = start_method
        self._concurrency = concurrency
        self._grace = float(grace_period)
        self._output = output
        #: Workers' forwarders that have not ended yet: a worker's own children may hold
        #: its output after it exits; closed with the pool.
        self._forwarders: list[_output.Forwarder] = []

        self._state = _NEW
        self._host: TaskHost | None = None  # where the pool's own tasks run, once open
        self._loop: asyncio.AbstractEventLoop | None = None  # None on trio
        self._init: _reduction.Message | None = None
        self._init_sends = 0
        self._sched = Scheduler(concurrency, maxtasksperchild, self._spawn_soon)
        self._handles: dict[_Handle, None] = {}
        self._wake: Wakeup | None = None  # the supervisor's: workers to start
        self._supervisor: anyio.CancelScope | None = None
        self._iterators: dict[_calls.ResultIterator[Any], None] = {}

    def __repr__(self) -> str:
        state = ("new", "open", "closing", "closed")[self._state]
        return (
            f"<aiomp.Pool {state} processes={self._processes} "
            f"concurrency={self._concurrency} start_method={self._start_method!r}>"
        )

    @property
    def processes(self) -> int:
        """The number of worker processes the pool keeps."""
        return self._processes

    def pids(self) -> list[int]:
        """Process ids of the live workers that take tasks."""
        return [pid for w in self._sched.live_workers() if (pid := w.handle.pid) is not None]

    def statistics(self) -> PoolStatistics:
        """A :class:`PoolStatistics` snapshot (never blocks)."""
        s = self._sched
        return PoolStatistics(
            workers=len(s.live_workers()),
            idle=len(s.idle),
            busy=sum(1 for w in s.workers.values() if w.running),
            running=sum(len(w.running) for w in s.workers.values()),
            queued=s.queued,
            completed=s.completed,
            replaced=s.replaced,
        )

    # -- lifetime ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Start the workers (concurrently; returns before they are ready).

        On cancellation or failure, the workers started so far are killed and reaped.
        """
        if self._state != _NEW:
            raise RuntimeError("a Pool can be used in `async with` only once")
        await anyio.lowlevel.checkpoint_if_cancelled()
        host = TaskHost(self._on_host_failed)
        try:
            await self._prepare()
            tg = await host.start()
        except BaseException:
            self._release_init()
            raise
        self._host = host
        self._loop = running_asyncio_loop()
        self._wake = Wakeup(self._loop)
        self._state = _OPEN
        try:
            for slot in range(self._processes):
                if slot:
                    # A spawn start forks and execs (a few ms): let the loop breathe
                    # between starts rather than block it for all of them at once.
                    await anyio.lowlevel.checkpoint()
                self._spawn(slot)
            self._supervisor = anyio.CancelScope()
            tg.start_soon(self._supervise)
        except BaseException as exc:
            await self._shutdown(graceful=False)
            await host.stop(exc)
            raise
        return self

    async def _prepare(self) -> None:
        """What must be done before the first worker starts (``aiomp.ray.Pool`` has its own)."""
        self._init = _reduction.dumps(
            (self._initializer, self._initargs), P.header(P.OP_INIT, 0, 0)
        )
        if self._start_method == "fork":
            _checks.check_fork_safe()
        elif self._start_method == "forkserver":
            await _launch.prepare_forkserver()

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
        host = self._host
        assert host is not None
        error = exc
        if error is None:
            try:
                await self._join()
            except BaseException as join_exc:  # noqa: BLE001 - cancelled while waiting
                error = join_exc
        interrupted = await self._shutdown(graceful=error is None)
        error = error or interrupted
        if error is None:
            return await host.stop(None)
        if await host.stop(error) and error is exc:
            return True
        if error is exc:
            return False  # the body's exception goes on as it was
        raise error

    async def _join(self) -> None:
        self._state = _CLOSING
        self._sched.close()
        for it in list(self._iterators):
            it._close(RuntimeError("the pool was closed before this iterator was consumed"))
        while self._sched.unfinished:
            done = anyio.Event()
            self._sched.on_drained = done.set  # made here, in a task; set from anywhere
            await done.wait()

    async def _shutdown(self, graceful: bool) -> BaseException | None:
        """Stop every worker: politely first if ``graceful``, then forward their output to
        its end (at most ``_output.LINGER`` seconds for what their own children still
        hold). Shielded and bounded.

        A cancellation or KeyboardInterrupt that arrives meanwhile (a second Ctrl-C: native
        asyncio cancellations pass anyio's shield) does not stop it: it SIGKILLs the
        workers at once, the shutdown still reaps them all, and it is returned.
        """
        interrupted: BaseException | None = None
        with anyio.CancelScope(shield=True):
            for it in list(self._iterators):
                it._close(RuntimeError("the pool was terminated"))
            if graceful:
                for h in list(self._handles):
                    h.send_exit()
                try:
                    with anyio.move_on_after(self._grace):
                        for h in list(self._handles):
                            await h.dead.wait()
                except BaseException as exc:  # noqa: BLE001 - returned once all are reaped
                    interrupted = exc
            self._state = _CLOSED
            self._sched.terminate(RuntimeError("the pool was terminated before the task started"))
            if self._supervisor is not None:
                self._supervisor.cancel()
            handles = self._kill_workers(" (the pool was shutting down)", interrupted is not None)
            interrupted = await _reap(handles, interrupted)
            self._release_init()
            try:
                linger = 0 if interrupted is not None else _output.LINGER
                await _output.close_all(self._forwarders, linger)
            except BaseException as exc:  # noqa: BLE001 - returned, as the others are
                interrupted = interrupted or exc
            self._forwarders = []
        return interrupted

    def _on_host_failed(self) -> None:
        """One of the pool's own tasks raised (a bug) while the pool is open, on asyncio,
        where that cancels no caller (see *Hosted task group*): break the pool and stop
        its workers, so that no call waits forever; ``__aexit__`` raises the error."""
        if self._state == _CLOSED:
            return
        self._sched.fail(RuntimeError("one of the pool's own tasks failed"))
        self._kill_workers(" (one of the pool's own tasks failed)", now=True)

    def _kill_workers(self, reason: str, now: bool) -> list[_Handle]:
        """Fail each worker's tasks (BrokenWorkerError, ``reason``) and kill it: SIGTERM
        and the grace period, or SIGKILL ``now``. Those the scheduler forgot too. Returns
        them, to reap."""
        handles = list(self._handles)
        for h in handles:
            self._sched.kill(h, reason)
            h.kill(now=now)
        return handles

    @property
    def _tg(self) -> anyio.abc.TaskGroup | None:
        """The pool's task group (see *Hosted task group*), once open."""
        return None if self._host is None else self._host.tg

    def _release_init(self) -> None:
        init, self._init = self._init, None
        if init is not None:
            init.close()

    def _check_open(self) -> None:
        if self._state != _OPEN:
            if self._state == _NEW:
                raise RuntimeError("the pool is not started: use `async with aiomp.Pool(...)`")
            raise RuntimeError("the pool is closed")
        broken = self._sched.broken
        if broken is not None:
            raise fresh(broken)

    # -- workers -----------------------------------------------------------------------
    def _spawn_soon(self) -> None:
        """From the scheduler (maybe in a loop callback): workers to start."""
        if self._wake is not None:
            self._wake.set()

    async def _supervise(self) -> None:
        """Start the workers the scheduler asks for: a task, so anyio may be used.

        A start that fails with an OSError (fork's EAGAIN under a pids limit, ENOMEM,
        EMFILE) is tried again after the scheduler's delay, during which no other start is
        tried (they would fail alike); only a failure that persists breaks the pool.
        """
        assert self._supervisor is not None and self._wake is not None
        with self._supervisor:
            while True:
                await self._wake.wait()
                while self._sched.to_spawn and self._state != _CLOSED:
                    slot = self._sched.to_spawn.popleft()
                    try:
                        self._spawn(slot)
                    except Exception as exc:  # noqa: BLE001 - fork/exec failed: EAGAIN, EMFILE
                        delay = self._sched.spawn_failed(slot, exc)
                        if delay is None:
                            log.error("aiomp: %s", self._sched.broken)
                            continue
                        log.warning(
                            "aiomp: could not start worker %d (%s: %s); trying again in %.2f s",
                            slot,
                            type(exc).__name__,
                            exc,
                            delay,
                        )
                        await anyio.sleep(delay)
                        self._sched.respawn(slot)

    def _spawn(self, slot: int) -> None:
        """Start a worker for ``slot`` and its watcher (from a task, never a callback)."""
        assert self._tg is not None and self._init is not None
        fw = None
        if self._output != "inherit":
            fw = _output.Forwarder(slot, self._output, label="worker")
            self._forwarders = [f for f in self._forwarders if not f.closed]
            self._forwarders.append(fw)
        # Two channels: tasks to the worker, results from it (see
        # docs/decisions/0026-two-channels.md). A start that fails (EMFILE here, EAGAIN in
        # launch) is tried again: whatever it made is closed.
        try:
            sock, theirs = _transport.stream_socketpair()
        except BaseException:
            if fw is not None:
                fw.close()
            raise
        try:
            results, their_results = _transport.stream_socketpair()
        except BaseException:
            sock.close()
            theirs.close()
            if fw is not None:
                fw.close()
            raise
        try:
            child = _launch.launch(
                Child,
                _worker.main,
                slot,
                self._start_method,
                True,
                theirs,
                extra=(their_results,),
                name=f"aiomp-pool-{slot}",
                output=fw,
            )
        except BaseException:
            sock.close()
            results.close()
            raise
        finally:
            their_results.close()
        h = WorkerHandle(
            slot,
            child,
            sock,
            results,
            self._loop,
            self._grace,
            self._on_message,
            self._on_lost,
            self._on_failed,
            self._on_exit,
        )
        self._handles[h] = None
        self._sched.add(h)
        if self._init_sends:
            self._init.sent_again()
        self._init_sends += 1
        h.send_frame(*self._init.framed())
        self._tg.start_soon(h.run)

    def _on_exit(self, h: WorkerHandle, exitcode: int | None, unsent: list[int]) -> None:
        del self._handles[h]
        self._sched.exited(h, exitcode, unsent)

    def _on_lost(self, h: WorkerHandle, exc: BaseException) -> None:
        """A message from ``h`` could not be received or handled: its task would wait
        forever, so terminate the worker instead (its tasks fail with BrokenWorkerError)."""
        log.error(
            "aiomp: a message from %s was lost (%s: %s); terminating it",
            h.name,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, OSError),
        )
        self._sched.kill(h, f" (a message from it was lost: {type(exc).__name__}: {exc})")

    def _on_failed(self, h: WorkerHandle, tid: int, exc: BaseException) -> None:
        self._sched.complete(h, tid, False, exc)

    def _on_message(self, h: WorkerHandle, got: tuple[bytes, list[int]]) -> None:
        """One message from a worker (in the reader callback on asyncio)."""
        data, fds = got
        if data[0] == _KIND_DATA and len(data) < _SMALL:  # P.unpack's common case, inline
            _, op, tid, _ = _HEAD(data)
            payload: bytes | memoryview = data[11:]
        else:
            op, tid, _, payload, fds = P.unpack(data, fds)
        if op == P.OP_OK:
            try:
                value: Any = _reduction.loads(payload, fds) if fds else pickle.loads(payload)
            except BaseException as exc:  # noqa: BLE001 - the caller's, never the loop's
                # (A SystemExit raised here would leave the reader callback and stop the
                # loop: issue 25 item 9.)
                task = self._sched.task(h, tid)
                what = f"the result of {task.name if task else tid} from {h.name}"
                self._sched.complete(h, tid, False, P.unpickling_failed(exc, what))
                return
            self._sched.complete(h, tid, True, value)
        elif op == P.OP_ERR:
            if self._sched.task(h, tid) is None:
                _transport.close_fds(fds)
                return
            self._sched.complete(h, tid, False, self._remote_error(h, payload, fds))
        elif op == P.OP_READY:
            _transport.close_fds(fds)
            self._sched.ready(h)
        elif op == P.OP_INIT_ERR:
            self._initializer_failed(h, self._remote_error(h, payload, fds))
        else:
            _transport.close_fds(fds)
            log.error("aiomp: %s sent an unknown message (op %d)", h.name, op)

    def _remote_error(
        self, h: WorkerHandle, payload: bytes | memoryview, fds: list[int]
    ) -> BaseException:
        try:
            error = _reduction.loads(payload, fds)
            if not isinstance(error, P.ErrorPayload):
                raise TypeError(f"an ErrorPayload was expected, not {type(error).__name__}")
        except Exception as err:  # noqa: BLE001
            return ProcessRaisedException(
                f"{h.name} raised an exception that could not be unpickled: {err!r}", h.slot, h.pid
            )
        return error.exception(h.name, h.slot, h.pid)

    def _initializer_failed(self, h: Any, cause: BaseException) -> None:
        """``h``'s initializer raised ``cause``: deterministic, so the pool breaks."""
        init_err = BrokenWorkerError(
            f"{h.name}: the pool's initializer raised {type(cause).__name__}: {cause}",
            h.slot,
            h.pid,
            1,
            None,
        )
        init_err.__cause__ = cause
        self._sched.init_failed(h, init_err)
        log.error("aiomp: the pool is broken: %s", init_err)

    # -- what the calls use (see _calls) -----------------------------------------------
    def _submit(self, task: Task) -> None:
        self._sched.submit(task)

    async def _abandon(self, tasks: Iterable[Task]) -> None:
        """The caller waiting for ``tasks`` is leaving early (the caller shields this).

        Queued tasks are dropped. Running async tasks are cancelled in their worker and
        given ``grace_period`` to finish; the workers of running sync tasks, and of async
        ones that did not finish in time, are terminated and replaced.
        """
        coop: list[Task] = []
        kill: dict[_Handle, None] = {}
        for task in tasks:
            if task.state == QUEUED:
                self._sched.drop(task)
            elif task.state == RUNNING and not self._sched.recall(task):
                assert task.worker is not None
                w = task.worker
                # (The pool's scheduler holds only the handles this pool made.)
                h = cast(_Handle, w.handle)
                if task.is_async and not w.killed:
                    coop.append(task)
                    h.cancel(task.tid)
                else:
                    kill[h] = None
        interrupted: BaseException | None = None
        if coop:
            try:
                with anyio.move_on_after(self._grace):
                    for task in coop:
                        await _calls.wait_done(task, self._loop)
            except BaseException as exc:  # noqa: BLE001 - raised once the workers are reaped
                interrupted = exc
            for task in coop:
                if task.state == RUNNING:
                    assert task.worker is not None
                    kill[cast(_Handle, task.worker.handle)] = None  # (as above)
        for h in kill:
            self._sched.kill(h, " (the pool terminated it to cancel a task)")
            if interrupted is not None:
                h.kill(now=True)
        interrupted = await _reap(list(kill), interrupted)
        if interrupted is not None:
            raise interrupted

    # -- public calls ------------------------------------------------------------------
    if TYPE_CHECKING:

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
        ) -> Any: ...
    else:
        # The implementation itself, not a wrapper around it: a coroutine frame less on
        # the round trip's hot path. Its docstring is the one help(Pool.apply) shows.
        apply = _calls.apply

    @overload
    async def map(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[T]: ...

    @overload
    async def map(
        self,
        fn: Callable[[S], T],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[T]: ...

    async def map(
        self,
        fn: Callable[[Any], Any],
        iterable: Iterable[Any] | AsyncIterable[Any],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
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
        return await _calls.map_(self, fn, iterable, chunksize, False, on_progress)

    @overload
    async def starmap(
        self,
        fn: Callable[..., Awaitable[T]],
        iterable: Iterable[Iterable[Any]] | AsyncIterable[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[T]: ...

    @overload
    async def starmap(
        self,
        fn: Callable[..., T],
        iterable: Iterable[Iterable[Any]] | AsyncIterable[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[T]: ...

    async def starmap(
        self,
        fn: Callable[..., Any],
        iterable: Iterable[Iterable[Any]] | AsyncIterable[Iterable[Any]],
        chunksize: int | None = None,
        *,
        on_progress: Callable[[int, int], object] | None = None,
    ) -> list[Any]:
        """``[fn(*args) for args in iterable]``; otherwise as :meth:`map`."""
        return await _calls.map_(self, fn, iterable, chunksize, True, on_progress)

    @overload
    def imap(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[T]: ...

    @overload
    def imap(
        self,
        fn: Callable[[S], T],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[T]: ...

    def imap(
        self,
        fn: Callable[[Any], Any],
        iterable: Iterable[Any] | AsyncIterable[Any],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[Any]:
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
        return _calls.ResultIterator(self, fn, iterable, chunksize, False, True, buffersize)

    @overload
    def imap_unordered(
        self,
        fn: Callable[[S], Awaitable[T]],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[T]: ...

    @overload
    def imap_unordered(
        self,
        fn: Callable[[S], T],
        iterable: Iterable[S] | AsyncIterable[S],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[T]: ...

    def imap_unordered(
        self,
        fn: Callable[[Any], Any],
        iterable: Iterable[Any] | AsyncIterable[Any],
        chunksize: int = 1,
        *,
        buffersize: int | None = None,
    ) -> _calls.ResultIterator[Any]:
        """As :meth:`imap`, but each chunk's results come as soon as the chunk is done."""
        return _calls.ResultIterator(self, fn, iterable, chunksize, False, False, buffersize)


for _cls in (Pool, PoolStatistics):
    _cls.__module__ = "aiomp"
_calls.apply.__module__, _calls.apply.__qualname__ = "aiomp", "Pool.apply"
