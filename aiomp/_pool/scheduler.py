"""The Pool's scheduler: which task runs on which worker, and when workers come and go.

Synchronous and pure: no sockets, no processes, no anyio, no awaits. Every method runs to
completion and may be called from a task or from an event loop's reader callback. It
talks to workers through :class:`~aiomp._pool.kinds.Handle` (a fake in the unit tests)
and hands back the one decision it cannot carry out itself, starting a worker, as a slot
in :attr:`Scheduler.to_spawn` plus a call of ``on_spawn``; the engine starts it.

The rules (the why is in ``aiomp.Pool``'s docstring):

* A task is *queued* (waiting in the pool, FIFO), *running* (sent to a worker, or in that
  worker's outbox), *done* or *dropped* (its caller left before it started: it never
  starts).
* A worker is in one state (:attr:`WorkerSlot.state`): *starting* (not ready yet),
  *ready* (takes tasks), *retiring* (takes none, exits once it holds none), *exiting*
  (told to), *gone* (a send found it dead) or *killed* (being terminated by the pool).
* Idle workers first, most recently idle first (LIFO). An async task (weight 1) otherwise
  goes to the least loaded worker with a free slot; a sync task needs a whole worker
  (weight ``concurrency``), except that up to :data:`CHUNKS_AHEAD` sync chunks of a map may
  wait behind a running sync chunk of the same call.
* *Queued ahead* (docs/decisions/0065-tasks-queued-ahead.md): with no worker idle or
  starting, a sync task may wait in a sync-mode worker whose handle ``looks_ahead``,
  behind a task that ends soon (``workers.ends_soon``). The first task a worker holds has
  started; each behind it starts as the outcome before it comes, unless the worker said
  ``skipped`` first. One whose caller leaves is skipped (:meth:`cancel_ahead`), or its
  worker killed if it started before it learnt.
* The head of the queue is never overtaken.
* A send that fails because the worker has gone did not start the task: it goes back to
  the head of the queue. Tasks still in a dead worker's outbox go back the same way, and
  so do the sync tasks that waited in it behind another (a worker whose handle is
  ``in_order`` runs its sync tasks one at a time in the order sent, so those had not
  started), unless their caller has gone: then they are dropped.
* A worker that dies fails the tasks it held (those it may have started) with
  :class:`BrokenWorkerError` and is replaced. One that dies before it is ready is
  replaced too, unless that slot's workers died during start-up
  :data:`MAX_START_FAILURES` times in a row: then, as when the initializer raises, the
  pool is *broken* and every pending and later task fails with :class:`BrokenPoolError`.
* A worker that could not be started at all (fork's EAGAIN under a pids limit, ENOMEM,
  EMFILE: an ``OSError``) is tried again after each delay of :data:`START_RETRY_DELAYS`
  in turn; only when every retry has failed too does the pool break.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from time import monotonic

from .._child.bootstrap import UNGUARDED_EXIT, UNGUARDED_MAIN
from .._errors import BrokenPoolError
from .health import death_error
from .kinds import Handle
from .tasks import DONE, DROPPED, QUEUED, RUNNING, Task, fresh  # noqa: F401 - its states
from .workers import (
    EXITING,
    GONE,
    KILLED,
    READY,
    RETIRING,
    STARTING,
    WorkerSlot,
    cancel_ahead,
    not_started,
    pick_busy,
    record_took,
    take_back,
)

#: Start-up deaths in a row of one slot's workers that break the pool.
MAX_START_FAILURES = 3
#: Seconds to wait before each retry of a slot's worker start that failed with an OSError
#: (a transient shortage: pids, memory, fds); one more failure after the last breaks the
#: pool. About 6 s in all, so that a shortage of a few seconds does not.
START_RETRY_DELAYS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


_OPEN, _CLOSING, _CLOSED = range(3)


class Scheduler:
    """Tasks, workers and the decisions between them. See the module docstring."""

    def __init__(
        self,
        concurrency: int,
        maxtasks: int | None,
        on_spawn: Callable[[], None] = lambda: None,
        on_drained: Callable[[], None] | None = None,
        on_demand: bool = False,
    ) -> None:
        self.concurrency = concurrency
        #: A worker starts when a task finds none for it (decision 0091): ``spare`` slots,
        #: the last first, up to the pool's size.
        self.on_demand, self.spare = on_demand, list[int]()
        self.maxtasks = maxtasks
        self.on_spawn = on_spawn  # to_spawn grew
        # No task is queued or running any more (None: nobody is waiting for that).
        self.on_drained = on_drained
        self.to_spawn: collections.deque[int] = collections.deque()
        self.workers: dict[Handle, WorkerSlot] = {}
        self.idle: dict[WorkerSlot, None] = {}  # insertion order: popitem() is LIFO
        #: ``take_idle()``: the worker :meth:`submit` would pick while no task is queued
        #: (the most recently idle), for a send made before its task is submitted; then
        #: :meth:`started` or :meth:`untake`. A C method: hot path: tests/budgets.
        self.take_idle = self.idle.popitem
        self.queue: collections.deque[Task] = collections.deque()
        self.queued = 0  # tasks in `queue` still QUEUED (dropped ones leave lazily)
        self.ahead = 0  # tasks queued ahead in workers, sent and not started
        self.starting = 0  # workers started, not ready yet, not exited
        #: Seconds the last run of each function took (``Task.fn_id``; lookahead workers).
        self.took: dict[int, float] = {}
        self.unfinished = 0  # tasks queued or running
        self.completed = 0
        self.replaced = 0
        self.start_failures: dict[int, int] = {}
        self.start_errors: dict[int, int] = {}  # failed starts in a row, by slot
        self.broken: BrokenPoolError | None = None
        self.on_room: Callable[[], None] | None = None  # a worker has room, or broken: admission
        self._state = _OPEN

    # -- workers ---------------------------------------------------------------------
    def open(self, processes: int) -> range:  # the slots to start now: all, or none on demand
        self.spare = list(range(processes - 1, -1, -1)) if self.on_demand else []
        return range(0 if self.on_demand else processes)

    def add(self, handle: Handle) -> None:
        """A worker process has been started for ``handle.slot``; it is not ready yet."""
        self.workers[handle] = WorkerSlot(handle)
        self.starting += 1
        self.start_errors.pop(handle.slot, None)

    def retire(self, handle: Handle) -> None:
        """Send ``handle``'s worker no new task, ask for its replacement now, and let it
        exit once it holds none (``maxtasksperchild``, ``max_memory``)."""
        w = self.workers.get(handle)
        if w is not None and w.state == READY:
            w.state = RETIRING
            self.idle.pop(w, None)
            self._replace(w)
            self._make_available(w)

    def ready(self, handle: Handle) -> None:
        w = self.workers.get(handle)
        if w is None or w.state != STARTING:
            return
        w.state = READY
        self.starting -= 1
        self.start_failures[w.slot] = 0
        self._make_available(w)

    def kill(self, handle: Handle, reason: str) -> None:
        """Terminate ``handle``'s worker (its tasks fail once it has exited); replace it."""
        w = self.workers.get(handle)
        if w is None:
            return
        if w.state != KILLED:
            if w.state == STARTING:
                self.starting -= 1
            w.state = KILLED
            w.reason = w.reason or reason
            self.idle.pop(w, None)
            self._replace(w)
        handle.kill()

    def exited(
        self, handle: Handle, exitcode: int | None, unsent: Iterable[int] = (), why: str = ""
    ) -> None:
        """``handle``'s worker has exited (``exitcode`` None: it survived SIGKILL; ``why``:
        its kind's reason, when it died on its own). The tasks it never started
        (:func:`not_started`; ``unsent``: those still in its outbox) go back to the head of
        the queue in order (dropped if their caller has gone); the rest fail with
        :class:`BrokenWorkerError`."""
        w = self.workers.pop(handle, None)
        if w is None:
            return
        if why and not w.reason:
            w.reason = f" ({why})"
        starting = w.state == STARTING
        if starting:
            self.starting -= 1
        self.idle.pop(w, None)
        tasks = w.running
        if w.lookahead and tasks:
            self.ahead -= len(tasks) - 1
        w.running = {}
        w.load = 0
        back = [tasks.pop(tid) for tid in not_started(w.handle.in_order, tasks, unsent)]
        for task in reversed(back):
            self._back(task)
        for task in tasks.values():
            err = death_error(handle, exitcode, f"while it ran {task.name}", w.reason)
            self._finish(task, False, err)
        if exitcode is not None and starting and self.broken is None:
            failures = self.start_failures[w.slot] = self.start_failures.get(w.slot, 0) + 1
            if failures >= MAX_START_FAILURES:
                err = death_error(handle, exitcode, "during start-up")
                self.break_pool(start_failures_error(w.slot, failures, err, exitcode), err)
        self._replace(w)
        self._dispatch()
        self._check_drained()

    # -- tasks -------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Start ``task`` on a worker, or queue it. On a broken pool it fails at once."""
        if self.broken is not None:
            task.finish(False, fresh(self.broken))
            return
        self.unfinished += 1
        if not self.queued:
            idle = self.idle
            w = idle.popitem()[0] if idle else self._pick(task)
            while w is not None:
                if self._start(w, task):
                    return
                w = self._pick(task)  # that one had gone: the next
        self.queue.append(task)
        self.queued += 1
        if self.spare and self.queued > self.starting and self._state == _OPEN:
            self.to_spawn.append(self.spare.pop())  # no worker for it: one more
            self.on_spawn()

    def untake(self, w: WorkerSlot) -> None:
        self.idle[w] = None  # taken with take_idle, it was sent nothing

    def started(self, w: WorkerSlot, task: Task) -> None:
        """``task`` was sent to ``w`` (from :attr:`take_idle`): apply's hot path."""
        self.unfinished += 1
        self._running(w, task)

    def drop(self, task: Task) -> None:
        """A queued task's caller has gone: it never starts."""
        if task.state == QUEUED:
            task.drop()
            self.queued -= 1
            self.unfinished -= 1
            self._check_drained()

    def recall(self, task: Task) -> bool:
        """A running task's caller has gone: if it waits in its worker's outbox, drop it as
        if queued. False: it has left (should its worker die before starting it, it is
        dropped then rather than sent to another)."""
        w = task.worker
        if task.state != RUNNING or w is None or not w.handle.unsend(task):
            task.abandoned = True
            return False
        self.ahead -= take_back(w, task)
        task.abandoned = True
        self._back(task)
        self._check_drained()
        self._make_available(w)
        return True

    cancel_ahead = staticmethod(cancel_ahead)

    def skipped(self, handle: Handle, tid: int) -> None:
        """``handle``'s worker never starts task ``tid``, held behind another: dropped if
        its caller has gone, else back to the head of the queue (its worker retires)."""
        w = self.workers.get(handle)
        task = None if w is None else w.running.get(tid)
        if task is None:
            return
        assert w is not None
        self.ahead -= take_back(w, task)
        self._back(task)
        self._make_available(w)
        self._dispatch()
        self._check_drained()

    def _back(self, task: Task) -> None:
        """``task`` was never started: to the head of the queue, or dropped if its caller
        has gone."""
        task.worker = None
        if task.abandoned:
            self.unfinished -= 1
            task.drop()
        else:
            task.state = QUEUED
            self.queue.appendleft(task)
            self.queued += 1

    def _ran(self, w: WorkerSlot, task: Task) -> None:
        """``task``, the first ``w`` held, is done in a busy pool: how long it ran
        (``workers.ends_soon``), and the one queued ahead behind it has started."""
        record_took(self.took, task.fn_id, w.since)
        if w.running:
            self._next_started(w)

    def _next_started(self, w: WorkerSlot) -> None:
        """The outcome before the task queued ahead in ``w`` came with no ``skipped``: it
        has started. If its caller has gone, it is stopped as a running sync task is."""
        self.ahead -= 1
        w.since = monotonic()
        first = next(iter(w.running.values()))
        if first.abandoned and w.state != KILLED:
            self.kill(
                w.handle,
                f" (it started {first.name}, queued ahead, before it learnt that the "
                "task's caller had gone)",
            )

    @property
    def unstarted(self) -> int:  # tasks submitted, not started: queued, or queued ahead
        return self.queued + self.ahead

    def complete(self, handle: Handle, tid: int, ok: bool, value: object) -> bool:
        """A result (or an error) for task ``tid`` came from ``handle``'s worker; False if
        no such task is running there (it failed or was given up already)."""
        w = self.workers.get(handle)
        task = None if w is None else w.running.pop(tid, None)
        if task is None:
            return False
        assert w is not None
        w.load -= task.weight
        self.unfinished -= 1
        self.completed += 1
        task.finish(ok, value)
        if w.load or self.queue or w.state != READY or self._state == _CLOSED:
            if w.lookahead:
                self._ran(w, task)
            self._make_available(w)
        else:  # idle again, nothing waits. hot path: tests/budgets
            self.idle[w] = None
            if self.on_room is not None:
                self.on_room()
        if not self.unfinished and self.on_drained is not None:
            self.on_drained()
        return True

    def close(self) -> None:  # no new calls; queued tasks still run (workers replaced)
        self._state = max(self._state, _CLOSING)

    def terminate(self, error: BaseException) -> None:  # queued tasks fail; no worker starts
        self._state = _CLOSED
        self._fail_queued(error)

    # -- internals ---------------------------------------------------------------------
    def _finish(self, task: Task, ok: bool, value: object) -> None:
        self.unfinished -= 1
        self.completed += 1
        task.finish(ok, value)

    def _check_drained(self) -> None:
        if self.unfinished == 0 and self.on_drained is not None:
            self.on_drained()

    def _replace(self, w: WorkerSlot) -> None:
        """Start a worker in ``w``'s place, if the pool still wants one (once per worker)."""
        if w.replaced or self.broken is not None or not self._wants_workers():
            return
        w.replaced = True
        self.to_spawn.append(w.slot)
        self.replaced += 1
        self.on_spawn()

    def spawn_failed(self, slot: int, error: BaseException) -> float | None:
        """The pool could not start a process for ``slot`` (``error``: EAGAIN, ENOMEM...).
        The seconds to wait before :meth:`respawn`, or None: the pool is broken (not an
        OSError, or the :data:`START_RETRY_DELAYS` are spent)."""
        failures = self.start_errors[slot] = self.start_errors.get(slot, 0) + 1
        if isinstance(error, OSError) and failures <= len(START_RETRY_DELAYS):
            return START_RETRY_DELAYS[failures - 1]
        more = f" ({failures} times in a row)" if failures > 1 else ""
        err = BrokenPoolError(f"the pool could not start a worker for slot {slot}{more}: {error}")
        self.break_pool(err, cause=error)
        return None

    def respawn(self, slot: int) -> None:  # ask again for slot's worker whose start failed
        if self.broken is None and self._wants_workers():
            self.to_spawn.appendleft(slot)
            self.on_spawn()

    def _wants_workers(self) -> bool:  # open, or closing with tasks still queued
        return self._state == _OPEN or (self._state == _CLOSING and self.queued > 0)

    def break_pool(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Break the pool: queued and later tasks fail with BrokenPoolError from ``error``
        (the initializer raised, workers cannot start, its Ray session ended)."""
        if self.broken is None:
            if isinstance(error, BrokenPoolError):
                self.broken = error
            else:
                self.broken = BrokenPoolError(f"the pool is broken: {error}")
                cause = error
            if cause is not None:
                self.broken.__cause__ = cause
        self._fail_queued(self.broken)

    def _fail_queued(self, error: BaseException) -> None:
        queue = self.queue
        while queue:
            task = queue.popleft()
            if task.state == QUEUED:
                self.queued -= 1
                self._finish(task, False, fresh(error))
        self._check_drained()
        if self.on_room is not None:
            self.on_room()

    def _make_available(self, w: WorkerSlot) -> None:
        """``w`` has room again: let it exit if it is retiring, else mark it idle, dispatch."""
        if w.state != READY:
            if w.state == RETIRING and not w.running:
                w.state = EXITING
                w.handle.send_exit()
            return
        if w.load == 0 and self._state != _CLOSED:
            self.idle[w] = None
        if self.queue:
            self._dispatch()
        if self.on_room is not None:
            self.on_room()

    def _pick(self, task: Task) -> WorkerSlot | None:
        if self.idle:
            return self.idle.popitem()[0]
        return pick_busy(
            self.workers.values(), task, self.concurrency, self.may_look_ahead(), self.took
        )

    def may_look_ahead(self) -> bool:  # not while a worker starts (or may): it takes it
        return not self.starting and not self.spare

    def _dispatch(self) -> None:
        if self._state == _CLOSED:
            return
        queue = self.queue
        while queue:
            task = queue[0]
            if task.state != QUEUED:
                queue.popleft()
                continue
            w = self._pick(task)
            if w is None:
                return
            queue.popleft()
            self.queued -= 1
            if not self._start(w, task):
                queue.appendleft(task)
                self.queued += 1

    def _start(self, w: WorkerSlot, task: Task) -> bool:
        """Send ``task`` to ``w``. False: ``w`` has gone, the task is still queued.

        The send comes first and the bookkeeping after it, while the worker wakes; nothing
        can complete the task in between: a result is read by a later loop callback.
        """
        try:
            sent = w.handle.send(task)
        except OSError as exc:  # its fds cannot travel (fd limit): that task's failure
            self._finish(task, False, exc)
            if w.load == 0 and w.usable:
                self.idle[w] = None
            return True
        if not sent:
            w.state = GONE
            self.idle.pop(w, None)
            return False
        if not w.running:
            w.since = monotonic()  # (apply's hot path, ``started``, leaves it: see _ran)
        self._running(w, task)
        return True

    def _running(self, w: WorkerSlot, task: Task) -> None:
        """``task`` has been sent to ``w`` (or waits in its outbox)."""
        task.state = RUNNING
        task.worker = w
        if w.lookahead:
            if task.is_async:
                w.lookahead = False  # it serves from its event loop from now on
            elif w.running:
                self.ahead += 1
        w.running[task.tid] = task
        w.load += task.weight
        w.dispatched += 1
        if self.maxtasks is not None and w.dispatched >= self.maxtasks:
            self.retire(w.handle)

    def live_workers(self) -> list[WorkerSlot]:
        return [w for w in self.workers.values() if w.state <= READY]


def start_failures_error(
    slot: int, failures: int, err: BaseException, exitcode: int
) -> BrokenPoolError:
    """Why the pool breaks when ``slot``'s workers died during start-up ``failures`` times
    in a row, the last one with ``err``."""
    # The guard's hint is in the workers' stderr; the error must say it too.
    why = f": {UNGUARDED_MAIN}" if exitcode == UNGUARDED_EXIT else ""
    return BrokenPoolError(
        f"the pool's worker {slot} died during start-up {failures} times in a row, the last "
        f"time: {err}{why}"
    )
