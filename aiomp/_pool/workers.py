"""The scheduler's record of one worker, and the rules that read the records alone.

Owns nothing: :class:`WorkerSlot` is what :class:`~aiomp._pool.scheduler.Scheduler` knows
of one worker; :func:`pick_busy` and :func:`not_started` are its rules over them (the why
is in the scheduler's module docstring).
"""

from __future__ import annotations

from collections.abc import Iterable
from time import monotonic

from .kinds import Handle
from .tasks import Task

#: Sync chunks of one map that may wait in a worker behind the one it runs.
CHUNKS_AHEAD = 2
#: Sync tasks of any call that may wait, queued ahead, in a worker that ``looks_ahead``
#: behind the one it runs (docs/decisions/0065-tasks-queued-ahead.md).
AHEAD = 1
#: Seconds: a task is queued ahead only behind a task that has run less than this so far,
#: of a function whose last run in this pool took less than this: one that ends soon.
#: Tasks that wait on one another (a consumer waiting for a producer still to be sent)
#: must not wait behind each other in one worker while another is idle: such a task runs
#: long, or has never run before (decision 0065).
AHEAD_WITHIN = 0.1
#: Ids of the functions (``Task.fn_id``) behind whose tasks no task is queued ahead: tasks
#: that run as long as something else needs (a DataLoader's per-epoch feed). See
#: :func:`never_ahead`.
NEVER_AHEAD: set[int] = set()

#: A worker's state (:attr:`WorkerSlot.state`): started, not ready yet; takes tasks;
#: takes none and exits once it holds none (``maxtasksperchild``, ``max_memory``); told
#: to exit; a send found it dead (its exit is on its way); being terminated by the pool.
STARTING, READY, RETIRING, EXITING, GONE, KILLED = range(6)


class WorkerSlot:
    """The scheduler's record of one worker."""

    __slots__ = (
        "dispatched",
        "handle",
        "load",
        "lookahead",
        "reason",
        "replaced",
        "running",
        "since",
        "slot",
        "state",
    )

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.slot = handle.slot
        self.state = STARTING
        self.since = 0.0  # monotonic() when its first task started (lookahead workers)
        self.load = 0  # slots in use: 1 per async task, `concurrency` for a sync one
        self.running: dict[int, Task] = {}
        self.dispatched = 0
        self.replaced = False  # a worker has been asked for in its place
        self.reason = ""
        # Tasks may be queued ahead in it: its kind can, and it serves in sync mode (no
        # async task was sent to it). Then every task it holds but the first is ahead.
        self.lookahead = handle.looks_ahead and handle.in_order

    @property
    def usable(self) -> bool:
        return self.state == READY


def cancel_ahead(task: Task) -> bool:
    """A running task's caller has gone: if it is queued ahead (not started), tell its
    worker to skip it (the scheduler's ``skipped`` follows). False: it may have started."""
    w = task.worker
    if w is None or not w.lookahead or w.state == KILLED or next(iter(w.running)) == task.tid:
        return False
    task.abandoned = True
    w.handle.cancel(task.tid)
    return True


def take_back(w: WorkerSlot, task: Task) -> int:
    """Forget ``task``, which ``w`` held and never started; 1 if it was queued ahead."""
    del w.running[task.tid]
    w.load -= task.weight
    w.dispatched -= 1
    return 1 if w.lookahead and w.running else 0


def never_ahead(fid: int) -> None:
    """No task is ever queued ahead behind a task of function ``fid`` (see
    :data:`NEVER_AHEAD`)."""
    NEVER_AHEAD.add(fid)


#: Functions whose last run's time the scheduler keeps (``took``) before it forgets all.
MAX_TOOK = 1024


def record_took(took: dict[int, float], fn_id: int, since: float) -> None:
    """A task of function ``fn_id`` (0: none to record) that started at ``since`` is done:
    keep how long it ran, for :func:`ends_soon`."""
    if fn_id:
        if len(took) > MAX_TOOK:
            took.clear()
        took[fn_id] = monotonic() - since


def ends_soon(w: WorkerSlot, took: dict[int, float], now: float) -> bool:
    """Whether ``w``'s running task is one a task may be queued ahead behind (see
    :data:`AHEAD_WITHIN`)."""
    fid = next(iter(w.running.values())).fn_id
    last = took.get(fid)
    return (
        last is not None
        and last < AHEAD_WITHIN
        and now - w.since < AHEAD_WITHIN
        and fid not in NEVER_AHEAD
    )


def pick_busy(
    workers: Iterable[WorkerSlot],
    task: Task,
    concurrency: int,
    ahead: bool,
    took: dict[int, float],
) -> WorkerSlot | None:
    """The busy worker that takes ``task`` now (no worker is idle), or None: it waits.

    An async task (weight 1) goes to the least loaded worker with a free slot. A sync
    task needs a whole worker, except that it may be queued ahead (:data:`AHEAD`) behind
    the task of a worker whose ``lookahead`` is set (if ``ahead``: no worker is on its
    way to be idle, starting), and a map's sync chunk may wait (:data:`CHUNKS_AHEAD`)
    behind chunks of its own call only; to the worker holding fewest. ``took``: the
    last run's seconds of each function (:func:`ends_soon`).
    """
    if task.weight < concurrency:  # async: the least loaded with a free slot
        best: WorkerSlot | None = None
        for w in workers:
            if (
                w.usable
                and w.load + task.weight <= concurrency
                and (best is None or w.load < best.load)
            ):
                best = w
        return best
    if task.is_async:
        return None
    # A sync task, queued ahead (AHEAD), or a map's chunk behind chunks of its own
    # call only (CHUNKS_AHEAD): to the worker holding fewest.
    group = task.group
    best = None
    fewest = max(AHEAD, CHUNKS_AHEAD) + 1
    now = monotonic()
    for w in workers:
        n = len(w.running)
        if not 0 < n < fewest or not w.usable:
            continue
        if ahead and w.lookahead and n <= AHEAD and ends_soon(w, took, now):
            best, fewest = w, n
        elif group is not None and n <= CHUNKS_AHEAD:
            for other in w.running.values():
                if other.group is not group or other.is_async:
                    break
            else:
                best, fewest = w, n
    return best


def not_started(in_order: bool, tasks: dict[int, Task], unsent: Iterable[int]) -> list[int]:
    """Ids of the tasks that a dead worker held and never started, in the order sent.

    ``tasks`` is in the order sent. The ``unsent`` ones never left the pool. An
    ``in_order`` worker runs its sync tasks one at a time in that order, so of those it was
    sent only the first can have started; an async task starts as it arrives.
    """
    unsent = set(unsent)
    out: list[int] = []
    behind = False  # past the sync task it may have been running
    for tid, task in tasks.items():
        if tid in unsent:
            out.append(tid)
        elif in_order and not task.is_async:
            if behind:
                out.append(tid)
            behind = True
    return out
