"""Unit tests of the scheduler's tasks queued ahead (issue 41; see
docs/decisions/0065-tasks-queued-ahead.md), with fake worker handles that look ahead.

No processes, no event loop: each contract is checked on the scheduler's decisions.
"""

from __future__ import annotations

import pytest

from aiomp._pool import workers as _workers
from aiomp._pool.scheduler import DONE, DROPPED, QUEUED, RUNNING
from aiomp._pool.tasks import Task
from tests.pool._scheduler import Rig


@pytest.fixture
def soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every running task ends soon (``ends_soon``'s own rule is tested below)."""
    monkeypatch.setattr(_workers, "ends_soon", lambda w, took, now: True)


pytestmark = pytest.mark.usefixtures("soon")


def test_a_sync_task_is_queued_ahead_only_when_no_worker_is_idle() -> None:
    r = Rig(2, looks_ahead=True)
    a, b = r.handles
    t1, t2, t3, t4, t5 = (r.task() for _ in range(5))
    r.submit(t1, t2)
    assert len(a.sent) == len(b.sent) == 1  # the idle one first
    r.submit(t3, t4, t5)
    assert len(a.sent) == len(b.sent) == 2  # one ahead in each busy worker
    assert t5.state == QUEUED
    assert (r.sched.ahead, r.sched.queued, r.sched.unstarted) == (2, 1, 3)


def test_no_task_is_queued_ahead_while_a_worker_is_starting() -> None:
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    later = r.start(1, ready=False)
    t1, t2 = r.task(), r.task()
    r.submit(t1, t2)
    assert a.sent == [t1.tid] and t2.state == QUEUED  # the starting worker takes it
    r.sched.ready(later)
    assert later.sent == [t2.tid]


def test_kinds_that_do_not_look_ahead_and_async_workers_are_never_sent_one() -> None:
    r = Rig(1)
    (a,) = r.handles
    t1, t2 = r.task(), r.task()
    r.submit(t1, t2)
    assert a.sent == [t1.tid] and t2.state == QUEUED
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    first = r.task(is_async=True)
    r.submit(first)
    r.sched.complete(a, first.tid, True, None)
    t1, t2 = r.task(), r.task()
    r.submit(t1, t2)  # it serves from its event loop now
    assert a.sent == [first.tid, t1.tid] and t2.state == QUEUED


def test_the_task_ahead_starts_as_the_outcome_before_it_comes() -> None:
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    t1, t2, t3 = r.task(), r.task(), r.task()
    r.submit(t1, t2, t3)
    assert r.sched.ahead == 1
    r.sched.complete(a, t1.tid, True, 1)
    assert a.sent == [t1.tid, t2.tid, t3.tid]  # t2 started, t3 ahead now
    assert r.sched.ahead == 1 and r.sched.queued == 0
    r.sched.complete(a, t2.tid, True, 2)
    r.sched.complete(a, t3.tid, True, 3)
    assert r.sched.ahead == 0 and r.sched.unfinished == 0
    assert [t.value for t in r.done] == [1, 2, 3]


def test_a_cancelled_task_ahead_is_skipped_never_started() -> None:
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    t1, t2, t3 = r.task(), r.task(), r.task()
    r.submit(t1, t2, t3)
    assert not r.sched.cancel_ahead(t1)  # running: the caller stops it as such
    assert r.sched.cancel_ahead(t2)
    assert a.cancelled == [t2.tid] and t2.state == RUNNING
    r.sched.skipped(a, t2.tid)  # the worker's answer
    assert t2.state == DROPPED and r.sched.ahead == 1  # t3 took its place
    assert a.sent == [t1.tid, t2.tid, t3.tid]  # its place went to the head of the queue
    r.sched.complete(a, t1.tid, True, None)
    assert not a.killed and r.sched.unfinished == 1


def test_a_task_ahead_started_before_its_cancel_arrived_is_stopped() -> None:
    """The worker started it before it read the CANCEL: the outcome before it came with
    no SKIPPED, so the worker is killed, as for a running sync task."""
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    t1, t2 = r.task(), r.task()
    r.submit(t1, t2)
    assert r.sched.cancel_ahead(t2)
    r.sched.complete(a, t1.tid, True, None)
    assert a.killed and t1.ok
    r.sched.exited(a, -9)
    assert t2.state == DONE and not t2.ok  # nobody waits for it
    assert r.sched.ahead == 0


def test_a_dead_workers_tasks_ahead_go_back_to_the_head_of_the_queue() -> None:
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    t1, t2, t3 = r.task(), r.task(), r.task()
    r.submit(t1, t2, t3)
    r.sched.exited(a, -9)
    assert t1.state == DONE and isinstance(t1.value, Exception)
    assert [t.tid for t in r.sched.queue] == [t2.tid, t3.tid]  # t2 first, in order
    assert t2.state == t3.state == QUEUED and r.sched.ahead == 0
    (b,) = r.spawn_requested()
    r.sched.ready(b)
    assert b.sent == [t2.tid, t3.tid]


def test_a_retiring_workers_skipped_task_goes_back_to_the_head_of_the_queue() -> None:
    """``max_memory``: the worker skips what it holds ahead; those tasks run elsewhere."""
    r = Rig(2, looks_ahead=True)
    a, b = r.handles
    t1, t2, t3, t4, t5 = (r.task() for _ in range(5))
    r.submit(t1, t2, t3, t4, t5)
    holder = a if t3.tid in a.sent else b
    r.sched.retire(holder)
    r.sched.skipped(holder, t3.tid)
    assert r.sched.queue[0] is t3 and t3.state == QUEUED
    assert not holder.exit_requested  # it still runs its first task


def test_maxtasks_counts_the_tasks_sent_ahead() -> None:
    r = Rig(1, maxtasks=2, looks_ahead=True)
    (a,) = r.handles
    t1, t2, t3 = r.task(), r.task(), r.task()
    r.submit(t1, t2, t3)
    assert a.sent == [t1.tid, t2.tid] and t3.state == QUEUED  # retiring after two
    r.sched.complete(a, t1.tid, True, None)
    assert not a.exit_requested
    r.sched.complete(a, t2.tid, True, None)
    assert a.exit_requested


def test_a_maps_chunks_still_wait_two_deep_behind_its_own() -> None:
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles
    group = object()
    chunks = [r.task(group=group) for _ in range(4)]
    r.submit(*chunks)
    assert a.sent == [c.tid for c in chunks[:3]] and r.sched.ahead == 2


# -- behind which tasks (ends_soon) ----------------------------------------------------------


def test_only_behind_a_function_that_ran_quickly_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks that wait on one another must never wait behind each other in one worker:
    a task is queued ahead only behind one whose function's last run was quick, and that
    has not run long yet (a DataLoader's feeds deadlocked without this)."""
    monkeypatch.undo()  # the real rule
    r = Rig(1, looks_ahead=True)
    (a,) = r.handles

    def task(fid: int) -> Task:
        t = r.task()
        t.fn_id = fid
        return t

    first, second = task(7), task(7)
    r.submit(first, second)
    assert second.state == QUEUED  # never ran: nothing known of it
    r.sched.complete(a, first.tid, True, None)  # ran at once: quick
    third = task(7)
    r.submit(third)
    assert a.sent == [first.tid, second.tid, third.tid] and r.sched.ahead == 1
    r.sched.complete(a, second.tid, True, None)
    r.sched.complete(a, third.tid, True, None)
    hold, behind = task(7), task(7)
    r.submit(hold)
    r.sched.workers[a].since -= 2 * _workers.AHEAD_WITHIN  # it has run long now
    r.submit(behind)
    assert behind.state == QUEUED
    r.sched.complete(a, hold.tid, True, None)
    r.sched.complete(a, behind.tid, True, None)
    _workers.never_ahead(7)
    try:
        x, y = task(7), task(7)
        r.submit(x, y)
        assert y.state == QUEUED  # never behind a function marked so
    finally:
        _workers.NEVER_AHEAD.discard(7)
