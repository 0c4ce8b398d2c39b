"""The scheduler's record of one worker, and the rules that read the records alone.

Owns nothing: :class:`WorkerSlot` is what :class:`~aiomp._pool.scheduler.Scheduler` knows
of one worker; :func:`pick_busy` and :func:`not_started` are its rules over them (the why
is in the scheduler's module docstring).
"""

from __future__ import annotations

from collections.abc import Iterable

from .kinds import Handle
from .tasks import Task

#: Sync chunks of one map that may wait in a worker behind the one it runs.
CHUNKS_AHEAD = 2
#: Sync tasks of any call that may wait, queued ahead, in a worker that ``looks_ahead``
#: behind the one it runs (docs/decisions/0065-tasks-queued-ahead.md).
AHEAD = 1

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
        "slot",
        "state",
    )

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.slot = handle.slot
        self.state = STARTING
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


def pick_busy(
    workers: Iterable[WorkerSlot], task: Task, concurrency: int, ahead: bool
) -> WorkerSlot | None:
    """The busy worker that takes ``task`` now (no worker is idle), or None: it waits.

    An async task (weight 1) goes to the least loaded worker with a free slot. A sync
    task needs a whole worker, except that it may be queued ahead (:data:`AHEAD`) behind
    the task of a worker whose ``lookahead`` is set (if ``ahead``: no worker is on its
    way to be idle, starting), and a map's sync chunk may wait (:data:`CHUNKS_AHEAD`)
    behind chunks of its own call only; to the worker holding fewest.
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
    for w in workers:
        n = len(w.running)
        if not 0 < n < fewest or not w.usable:
            continue
        if ahead and w.lookahead and n <= AHEAD:
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
