"""The running pool: its task host, supervisor, scheduler and workers, behind one object.

An :class:`Engine` knows workers only through a :class:`~aiomp._pool.kinds.WorkerKind`
and its :class:`~aiomp._pool.kinds.Handle`\\ s, and is their
:class:`~aiomp._pool.kinds.Events`. It owns the pool's task group (hosted: see
:class:`~aiomp._loop.taskhost.TaskHost`), the *supervisor* task that starts the workers the
scheduler asks for (the one thing the scheduler cannot do from a loop callback), and the
lifetime: open, join, shutdown, reap. The calls (:mod:`aiomp._pool.calls`) use its public
names; :class:`aiomp.Pool` is the façade over it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from .._errors import BrokenWorkerError
from .._loop import running_asyncio_loop
from .._loop.cancel import CancelProbe
from .._loop.taskhost import Started, TaskHost
from .._loop.wakeup import Signal, Wakeup
from .admission import Room
from .deaths import died_on_its_own, log_death
from .kinds import Handle, WorkerKind
from .options import PoolStatistics
from .scheduler import Scheduler
from .tasks import DONE, QUEUED, RUNNING, Task, fresh, when_done
from .workers import KILLED

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger("aiomp")

NEW, OPEN, CLOSING, CLOSED = range(4)


class Closable(Protocol):
    """An iterator of the pool's that its shutdown closes (``ResultIterator``)."""

    def close(self, error: BaseException | None) -> None: ...


async def reap(
    handles: list[Handle], interrupted: BaseException | None = None
) -> BaseException | None:
    """Wait until every watcher of ``handles`` has finished (bounded: each one's
    termination is). A cancellation or KeyboardInterrupt meanwhile cannot cut this short,
    as native asyncio cancellations pass anyio's shields: it means "now", SIGKILL for all,
    and is returned, with ``interrupted``, once they are reaped."""
    for h in handles:
        while not h.dead.is_set():
            try:
                if not h.watching:
                    await anyio.lowlevel.checkpoint()  # a watcher just started begins
                    await h.finish_unwatched()  # (or its task was cancelled before it)
                await h.dead.wait()
            except BaseException as exc:  # noqa: BLE001 - returned once all are reaped
                interrupted = interrupted or exc
                for other in handles:
                    other.kill(now=True)
    return interrupted


async def wait_done(task: Task, loop: asyncio.AbstractEventLoop | None) -> None:
    """Wait until ``task`` is done."""
    if task.state < DONE:
        signal = Signal(loop)
        when_done(task, lambda _: signal.set())
        await signal.wait()


class Engine:
    """See the module docstring. Every method but the ``async`` ones runs to completion
    and may be called from a loop callback."""

    def __init__(
        self,
        kind: WorkerKind,
        processes: int,
        concurrency: int,
        maxtasksperchild: int | None,
        grace: float,
        on_demand: bool = False,
    ) -> None:
        """``on_demand``: start a worker when a task finds none for it, up to
        ``processes``, rather than all as the pool opens (``run_sync``'s default pool;
        :class:`~aiomp._pool.scheduler.Scheduler`)."""
        self.kind = kind
        #: ``kind.start_method``: where a function was checked for it (``FnInfo.checked``),
        #: ``apply`` builds the frame of its ``fn()`` itself.
        self.start_method = kind.start_method
        self.processes = processes
        self.concurrency = concurrency
        self.grace = grace
        self.state = NEW
        self.sched = Scheduler(concurrency, maxtasksperchild, self._spawn_soon, None, on_demand)
        # The calls talk to the engine only; what they ask of the scheduler is its own
        # methods, bound here (no frame of the engine's on the hot path: tests/budgets).
        # apply's hot path alone reads the scheduler's state (``sched``) itself.
        #: The scheduler's ``complete``: what a handle reports a task's outcome to.
        self.on_result = self.sched.complete
        #: Start a task on a worker, or queue it (``Scheduler.submit``).
        self.submit = self.sched.submit
        #: A queued task's caller has gone: it never starts (``Scheduler.drop``).
        self.drop = self.sched.drop
        #: ``Pool(max_pending=)`` and who waits for a worker to have room: ``admission``.
        self.max_pending: int | None = None
        self.room = Room(self.sched)
        self.handles: dict[Handle, None] = {}
        self.iterators: dict[Closable, None] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # None: not an asyncio loop
        #: Whether a cancellation may be pending for the caller (asyncio; bound on open).
        self.probe: CancelProbe | None = None
        self._host: TaskHost | None = None
        self._wake: Wakeup | None = None  # the supervisor's: workers to start
        self._supervisor: anyio.CancelScope | None = None
        self._watch: anyio.CancelScope | None = None  # the kind's own task
        #: The watchers' coroutines, closed with the group if never started (see there).
        self._started = Started()

    @property
    def tg(self) -> anyio.abc.TaskGroup | None:
        """The pool's task group, once open."""
        return None if self._host is None else self._host.tg

    # -- lifetime ----------------------------------------------------------------------
    async def open(self) -> None:
        """Start the workers (concurrently; returns before they are ready). On
        cancellation or failure, the workers started so far are killed and reaped."""
        if self.state != NEW:
            raise RuntimeError("a Pool can be used in `async with` only once")
        host = TaskHost(self._on_host_failed)
        try:
            # (In here: a kind may own a worker already, launched ahead, to close.)
            await anyio.lowlevel.checkpoint_if_cancelled()
            self.processes = await self.kind.prepare(self.processes)
            tg = await host.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.kind.close(False)
            raise
        self._host = host
        self.loop = running_asyncio_loop()
        if self.loop is not None:
            self.probe = CancelProbe()
        self._wake = Wakeup(self.loop)
        self.state = OPEN
        try:
            for slot in self.sched.open(self.processes):
                if slot:
                    # A spawn start forks and execs (a few ms): let the loop breathe
                    # between starts rather than block it for all of them at once.
                    await anyio.lowlevel.checkpoint()
                self._start(slot)
            self._supervisor = anyio.CancelScope()
            # (Kept by _started, as the watchers are: a loop that ends now, as the first
            # run_sync call starts the pool, would otherwise never start their coroutines.)
            self._started.start_soon(tg, self._supervise)
            watch = self.kind.watch()
            if watch is not None:
                self._watch = anyio.CancelScope()
                self._started.start_soon(tg, functools.partial(self._run_watch, watch))
        except BaseException as exc:
            await self.shutdown(graceful=False)
            await self._stop_host(host, exc)
            raise

    async def _run_watch(self, watch: Any) -> None:
        assert self._watch is not None
        with self._watch:
            await watch()

    async def close(self, error: BaseException | None) -> bool | None:
        """Leave the pool: with no ``error``, wait for every submitted task, then let the
        workers exit; else (or cancelled while waiting) terminate them. Returns what
        ``__aexit__`` returns for ``error``; raises a new error (a cancellation meanwhile)."""
        host = self._host
        assert host is not None
        exc = error
        if error is None:
            try:
                await self._join()
            except BaseException as join_exc:  # noqa: BLE001 - cancelled while waiting
                error = join_exc
        interrupted = await self.shutdown(graceful=error is None)
        error = error or interrupted
        if error is None:
            return await self._stop_host(host, None)
        if await self._stop_host(host, error) and error is exc:
            return True
        if error is exc:
            return False  # the body's exception goes on as it was
        raise error

    async def _stop_host(self, host: TaskHost, error: BaseException | None) -> bool:
        """``host.stop(error)``, then (the group has ended) close the watchers that never
        ran."""
        stopped = await host.stop(error)
        self._started.close()
        return stopped

    async def _join(self) -> None:
        self.state = CLOSING
        self.sched.close()
        for it in list(self.iterators):
            it.close(RuntimeError("the pool was closed before this iterator was consumed"))
        while self.sched.unfinished:
            done = anyio.Event()
            self.sched.on_drained = done.set  # made here, in a task; set from anywhere
            await done.wait()

    async def shutdown(self, graceful: bool) -> BaseException | None:
        """Stop every worker: politely first if ``graceful``, then let the kind release
        what it holds (output may linger a moment). Shielded and bounded.

        A cancellation or KeyboardInterrupt that arrives meanwhile (a second Ctrl-C: native
        asyncio cancellations pass anyio's shield) does not stop it: it SIGKILLs the
        workers at once, the shutdown still reaps them all, and it is returned.
        """
        interrupted: BaseException | None = None
        with anyio.CancelScope(shield=True):
            if self._watch is not None:
                self._watch.cancel()
            for it in list(self.iterators):
                it.close(RuntimeError("the pool was terminated"))
            if graceful:
                for h in list(self.handles):
                    h.send_exit()
                try:
                    with anyio.move_on_after(self.grace):
                        for h in list(self.handles):
                            await h.dead.wait()
                except BaseException as exc:  # noqa: BLE001 - returned once all are reaped
                    interrupted = exc
                # Every task is done: one still exiting is slow (a loaded machine, a heavy
                # interpreter's teardown), not a survivor of a failure. It is terminated
                # quietly, as torch's DataLoader terminates its workers after its 5 s join
                # (issue 39 bug 9: a normal exit under load printed a SIGTERM warning).
                for h in list(self.handles):
                    h.expect_kill()
            self.state = CLOSED
            self.sched.terminate(RuntimeError("the pool was terminated before the task started"))
            if self._supervisor is not None:
                self._supervisor.cancel()
            handles = self._kill_workers(" (the pool was shutting down)", interrupted is not None)
            interrupted = await reap(handles, interrupted)
            try:
                await self.kind.close(interrupted is None)
            except BaseException as exc:  # noqa: BLE001 - returned, as the others are
                interrupted = interrupted or exc
        return interrupted

    def _on_host_failed(self) -> None:
        """One of the pool's own tasks raised (a bug) while the pool is open, on asyncio,
        where that cancels no caller: break the pool and stop its workers, so that no call
        waits forever; leaving the pool raises the error."""
        if self.state == CLOSED:
            return
        self.sched.break_pool(RuntimeError("one of the pool's own tasks failed"))
        self._kill_workers(" (one of the pool's own tasks failed)", now=True)

    def _kill_workers(self, reason: str, now: bool) -> list[Handle]:
        """Fail each worker's tasks (BrokenWorkerError, ``reason``) and kill it: SIGTERM
        and the grace period, or SIGKILL ``now``. Those the scheduler forgot too. Returns
        them, to reap."""
        handles = list(self.handles)
        for h in handles:
            self.sched.kill(h, reason)
            h.kill(now=now)
        return handles

    def check_open(self) -> None:
        """Raise unless calls may be made: not open yet, closed, or broken."""
        if self.state != OPEN:
            if self.state == NEW:
                raise RuntimeError("the pool is not started: use `async with aiomp.Pool(...)`")
            raise RuntimeError("the pool is closed")
        broken = self.sched.broken
        if broken is not None:
            raise fresh(broken)

    def live_handles(self) -> list[Handle]:
        return [w.handle for w in self.sched.live_workers()]

    @property
    def broken(self) -> BaseException | None:
        return self.sched.broken

    def break_pool(self, error: BaseException) -> None:
        """Queued and later tasks fail with BrokenPoolError from ``error``."""
        self.sched.break_pool(error)

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
                while self.sched.to_spawn and self.state != CLOSED:
                    slot = self.sched.to_spawn.popleft()
                    try:
                        self._start(slot)
                    except Exception as exc:  # noqa: BLE001 - fork/exec failed: EAGAIN, EMFILE
                        delay = self.sched.spawn_failed(slot, exc)
                        if delay is None:
                            log.error("aiomp: %s", self.sched.broken)
                            continue
                        log.warning(
                            "aiomp: could not start worker %d (%s: %s); trying again in %.2f s",
                            slot,
                            type(exc).__name__,
                            exc,
                            delay,
                        )
                        await anyio.sleep(delay)
                        self.sched.respawn(slot)

    def _start(self, slot: int) -> None:
        """Start a worker for ``slot`` and its watcher (from a task, never a callback)."""
        tg = self.tg
        assert tg is not None
        h = self.kind.start(slot, self, self)
        if h is None:
            return
        self.handles[h] = None
        self.sched.add(h)
        self._started.start_soon(tg, h.run)

    # -- what handles report (Events) --------------------------------------------------
    def on_ready(self, handle: Handle) -> None:
        self.sched.ready(handle)

    def on_init_failed(self, handle: Handle, cause: BaseException) -> None:
        """``handle``'s initializer raised ``cause``: deterministic, so the pool breaks."""
        init_err = BrokenWorkerError(
            f"{handle.name}: the pool's initializer raised {type(cause).__name__}: {cause}",
            handle.slot,
            handle.pid,
            1,
            None,
        )
        init_err.__cause__ = cause
        self.sched.break_pool(init_err)
        log.error("aiomp: the pool is broken: %s", init_err)

    def on_retire(self, handle: Handle, tid: int, grown: int, limit: int) -> None:
        """Its private memory grew past ``max_memory``: retire it after its tasks."""
        log.info(
            "aiomp: retiring %s after %s: its private memory grew by %.1f MiB over its "
            "level after the initializer, past max_memory (%.1f MiB)",
            handle.name,
            self.task_name(handle, tid) or f"task {tid}",
            grown / (1 << 20),
            limit / (1 << 20),
        )
        self.sched.retire(handle)

    def on_skipped(self, handle: Handle, tid: int) -> None:
        self.sched.skipped(handle, tid)

    def on_lost(self, handle: Handle, exc: BaseException) -> None:
        log.error(
            "aiomp: a message from %s was lost (%s: %s); terminating it",
            handle.name,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, OSError),
        )
        self.sched.kill(handle, f" (a message from it was lost: {type(exc).__name__}: {exc})")

    def on_exit(self, handle: Handle, exitcode: int | None, unsent: list[int]) -> None:
        del self.handles[handle]
        w = self.sched.workers.get(handle)
        asked = self.state != OPEN or self.sched.broken is not None
        if w is not None and exitcode is not None and died_on_its_own(w, exitcode, asked):
            log_death(w, exitcode, unsent)  # (a WARNING: see _pool.deaths)
        self.sched.exited(handle, exitcode, unsent, handle.why)

    def kill(self, handle: Handle, reason: str) -> None:
        self.sched.kill(handle, reason)

    def task_name(self, handle: Handle, tid: int) -> str | None:
        w = self.sched.workers.get(handle)
        task = None if w is None else w.running.get(tid)
        return None if task is None else task.name

    # -- what the calls use ------------------------------------------------------------
    async def abandon(
        self, tasks: Iterable[Task], timeout: float | None = None
    ) -> dict[Handle, str | None]:
        """The caller waiting for ``tasks`` is leaving early: cancelled, or its
        ``timeout`` has passed (the caller shields this).

        Queued tasks are dropped, and so are tasks queued ahead in a worker: it is told
        to skip them, and should it have started one before it learnt, the pool
        terminates it once it knows (the caller does not wait for that). Running async
        tasks are cancelled in their worker and given the grace period to finish; the
        workers of running sync tasks, and of async ones that did not finish in time, are
        terminated and replaced, each logged at INFO with the task and why. Returns those
        workers with the stack each printed as it was terminated (None: it could not
        print; see ``_pool.health``), which the line of a cancellation carries.
        """
        coop: list[Task] = []
        kill: dict[Handle, Task] = {}
        for task in tasks:
            if task.state == QUEUED:
                self.sched.drop(task)
            elif task.state == RUNNING and not self.sched.recall(task):
                assert task.worker is not None
                w = task.worker
                if self.sched.cancel_ahead(task):
                    continue  # queued ahead: the worker skips it, or is killed if it starts it
                if task.is_async and w.state != KILLED:
                    coop.append(task)
                    w.handle.cancel(task.tid)
                else:
                    kill[w.handle] = task
        interrupted: BaseException | None = None
        if coop:
            try:
                with anyio.move_on_after(self.grace):
                    for task in coop:
                        await wait_done(task, self.loop)
            except BaseException as exc:  # noqa: BLE001 - raised once the workers are reaped
                interrupted = exc
            for task in coop:
                if task.state == RUNNING:
                    assert task.worker is not None
                    kill[task.worker.handle] = task
        for h in kill:
            h.expect_kill()
            self.sched.kill(h, " (the pool terminated it to cancel a task)")
            if interrupted is not None:
                h.kill(now=True)
        interrupted = await reap(list(kill), interrupted)
        for h, task in kill.items():
            self._log_kill(h, task, timeout)
        if interrupted is not None:
            raise interrupted
        return {h: h.stack for h in kill}

    def _log_kill(self, handle: Handle, task: Task, timeout: float | None) -> None:
        """One INFO line per worker the pool terminated to stop a task: which, why, and
        for a cancellation its stack (a timeout's goes in the TimeoutError's notes)."""
        if timeout is not None:
            log.info(
                "aiomp: terminated %s: %s did not finish within %s s",
                handle.name,
                task.name,
                timeout,
            )
        else:
            log.info(
                "aiomp: terminated %s: the caller of %s was cancelled. %s",
                handle.name,
                task.name,
                stack_note(handle),
            )


def pool_statistics(engine: Engine) -> PoolStatistics:
    """:meth:`aiomp.Pool.statistics`: the counts of ``engine``'s scheduler, now."""
    s = engine.sched
    return PoolStatistics(
        workers=len(s.live_workers()),
        idle=len(s.idle),
        busy=sum(1 for w in s.workers.values() if w.running),
        running=sum(len(w.running) for w in s.workers.values()),
        queued=s.queued,
        completed=s.completed,
        replaced=s.replaced,
    )


def stack_note(handle: Handle) -> str:
    """``handle``'s stack as its worker was terminated, introduced, for a note or a log
    ("" where its kind keeps none)."""
    if not handle.prints_stack:
        return ""
    if handle.stack is None:
        return f"The stack of {handle.name} could not be read (it did not print it)."
    return f"The stack of {handle.name} as it was terminated:\n{handle.stack}"
