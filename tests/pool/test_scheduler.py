"""Unit tests of the Pool's scheduler (``aiomp._pool.scheduler``), with fake worker handles.

No processes, no sockets, no event loop: the scheduler is synchronous and pure, so every
rule of dispatch and every lifecycle decision is checked here directly, including issue
8's four bugs at the scheduler level.
"""

from __future__ import annotations

import pytest

import aiomp
from aiomp._pool.scheduler import (
    DONE,
    DROPPED,
    MAX_START_FAILURES,
    QUEUED,
    RUNNING,
    START_RETRY_DELAYS,
)
from aiomp._pool.tasks import Task
from tests.pool._scheduler import FakeHandle, Rig


def test_idle_workers_first_most_recently_idle_first() -> None:
    r = Rig(2)
    _a, b = r.handles
    t1 = r.task()
    r.submit(t1)
    assert b.sent == [t1.tid]  # the last to become ready (LIFO)
    r.sched.complete(b, t1.tid, True, 1)
    t2 = r.task()
    r.submit(t2)
    assert b.sent == [t1.tid, t2.tid]  # the hot worker again
    assert t1.state == DONE and t1.ok and t1.value == 1


def test_fifo_queue_and_the_head_is_never_overtaken() -> None:
    r = Rig(1, concurrency=2)
    (w,) = r.handles
    sync1, sync2, async1 = r.task(), r.task(), r.task(is_async=True)
    r.submit(sync1, sync2, async1)
    assert w.sent == [sync1.tid]
    assert r.sched.queued == 2
    r.sched.complete(w, sync1.tid, True, None)
    assert w.sent == [sync1.tid, sync2.tid]  # the sync head first, though async1 would fit
    r.sched.complete(w, sync2.tid, True, None)
    assert w.sent[-1] == async1.tid


def test_async_tasks_go_to_the_least_loaded_worker_with_room() -> None:
    r = Rig(2, concurrency=3)
    tasks = [r.task(is_async=True) for _ in range(6)]
    r.submit(*tasks)
    assert sorted(len(h.sent) for h in r.handles) == [3, 3]
    extra = r.task(is_async=True)
    r.submit(extra)
    assert extra.state == QUEUED


def test_a_maps_next_sync_chunks_may_wait_behind_its_own_chunk() -> None:
    r = Rig(1)
    (w,) = r.handles
    group, other = object(), object()
    c1, c2, c3, c4 = (r.task(group=group) for _ in range(4))
    r.submit(c1, c2, c3, c4)
    # CHUNKS_AHEAD (2) chunks of the same call wait in the worker; the rest in the pool.
    assert w.sent == [c1.tid, c2.tid, c3.tid]
    assert c4.state == QUEUED
    x = r.task(group=other)
    r.submit(x)
    assert x.state == QUEUED
    r.sched.complete(w, c1.tid, True, [None])
    assert w.sent[-1] == c4.tid  # the freed place goes to the head of the queue


def test_chunks_ahead_go_to_the_worker_holding_fewest_of_them() -> None:
    """Two workers: a map's chunks beyond the first two spread over both, never three
    deep in one while the other holds one."""
    r = Rig(2)
    group = object()
    chunks = [r.task(group=group) for _ in range(6)]
    r.submit(*chunks)
    assert sorted(len(h.sent) for h in r.handles) == [3, 3]


def test_chunks_never_wait_behind_another_calls_chunk() -> None:
    r = Rig(1)
    (w,) = r.handles
    a, b = object(), object()
    first, second = r.task(group=a), r.task(group=b)
    r.submit(first, second)
    assert w.sent == [first.tid] and second.state == QUEUED


def test_dropped_tasks_never_start() -> None:
    r = Rig(1)
    (w,) = r.handles
    busy, queued = r.task(), r.task()
    r.submit(busy, queued)
    r.sched.drop(queued)
    assert queued.state == DROPPED
    r.sched.complete(w, busy.tid, True, None)
    assert w.sent == [busy.tid]
    assert r.sched.unfinished == 0 and r.drained >= 1


def test_bug1_retire_and_replace_are_decisions_not_actions() -> None:
    """Issue 8 bug 1 at the scheduler level: retiring asks for a replacement through
    ``to_spawn`` (the pool starts it from a task), never by starting one itself."""
    r = Rig(1, maxtasks=1)
    (w,) = r.handles
    t1, t2 = r.task(), r.task()
    r.submit(t1, t2)
    assert list(r.sched.to_spawn) == [0] and r.spawns == 1
    assert t2.state == QUEUED  # not sent to a retiring worker
    r.sched.complete(w, t1.tid, True, None)
    assert w.exit_requested
    (new,) = r.spawn_requested()
    r.sched.ready(new)
    assert new.sent == [t2.tid]
    assert r.sched.replaced == 2  # the new one retires at once too (maxtasks=1)


def test_bug3_a_send_to_a_dead_worker_requeues_the_task() -> None:
    """Issue 8 bug 3: a send that fails because the worker has gone did not start the
    task: it goes to another worker (or waits), never fails with BrokenWorkerError."""
    r = Rig(2)
    a, b = r.handles
    b.alive = False  # died while idle; its exit has not been seen yet
    t = r.task()
    r.submit(t)
    assert a.sent == [t.tid] and t.state == RUNNING
    a.alive = False
    r.sched.complete(a, t.tid, True, None)
    t2 = r.task()
    r.submit(t2)
    assert t2.state == QUEUED  # nobody alive: it waits for a replacement
    r.sched.exited(b, -9)
    r.sched.exited(a, -9)
    assert t2.state == QUEUED and not r.done[1:]
    (_n1, n2) = r.spawn_requested()
    r.sched.ready(n2)
    assert n2.sent == [t2.tid]


def test_tasks_left_in_a_dead_workers_outbox_are_requeued_first() -> None:
    r = Rig(1, concurrency=4)
    (w,) = r.handles
    t1, t2, t3 = (r.task(is_async=True) for _ in range(3))
    r.submit(t1, t2, t3)
    r.sched.exited(w, -9, unsent=[t2.tid, t3.tid])
    assert t1.state == DONE and isinstance(t1.value, aiomp.BrokenWorkerError)
    assert "terminated with signal SIGKILL while it ran f" in str(t1.value)
    assert [t.tid for t in r.sched.queue] == [t2.tid, t3.tid]
    (new,) = r.spawn_requested()
    r.sched.ready(new)
    assert new.sent == [t2.tid, t3.tid]


def test_bug4_a_death_during_start_up_is_replaced() -> None:
    """Issue 8 bug 4: a worker killed before it was ready (the OOM killer) is replaced;
    the pool breaks only after MAX_START_FAILURES start-up deaths in a row of one slot."""
    r = Rig(2)
    _a, b = r.handles
    queued = [r.task() for _ in range(5)]
    r.submit(*queued)
    r.sched.exited(b, -9)  # a ready worker's death: not a start-up death
    for n in range(1, MAX_START_FAILURES + 1):
        (victim,) = r.spawn_requested()  # not ready yet: holds no task
        assert not victim.sent
        r.sched.exited(victim, -9)
        if n < MAX_START_FAILURES:
            assert r.sched.broken is None
            assert not any(t.state == DONE for t in queued[1:])  # no task failed
        else:
            assert isinstance(r.sched.broken, aiomp.BrokenPoolError)
            assert f"{MAX_START_FAILURES} times in a row" in str(r.sched.broken)
    assert not r.sched.to_spawn
    assert all(isinstance(t.value, aiomp.BrokenPoolError) for t in queued[2:])


def test_a_ready_worker_resets_its_slots_start_up_count() -> None:
    r = Rig(1)
    for _ in range(2 * MAX_START_FAILURES):
        (w,) = [h for h in r.handles if not h.killed][-1:]
        r.sched.exited(w, -9)
        (new,) = r.spawn_requested()
        r.sched.exited(new, -9)  # one start-up death
        (new,) = r.spawn_requested()
        r.sched.ready(new)  # then a healthy start
        r.handles = [new]
    assert r.sched.broken is None


def test_an_initializer_that_raises_breaks_the_pool() -> None:
    r = Rig(2)
    t = r.task()
    r.sched.kill(r.handles[0], "")  # busy with nothing; irrelevant
    r.submit(t)
    cause = ValueError("init")
    r.sched.break_pool(cause)
    later = r.task()
    r.submit(later)
    assert isinstance(later.value, aiomp.BrokenPoolError) and later.value.__cause__ is cause


def test_broken_pool_fails_queued_tasks_with_fresh_errors() -> None:
    r = Rig(1)
    busy, q1, q2 = r.task(), r.task(), r.task()
    r.submit(busy, q1, q2)
    r.sched.break_pool(RuntimeError("x"))
    assert isinstance(q1.value, aiomp.BrokenPoolError)
    assert q1.value is not q2.value  # each raise site its own copy
    assert busy.state == RUNNING  # its own worker decides its fate


def test_kill_fails_the_tasks_only_once_the_worker_has_exited() -> None:
    r = Rig(1)
    (w,) = r.handles
    t = r.task()
    r.submit(t)
    r.sched.kill(w, " (cancelled)")
    assert w.killed and t.state == RUNNING
    assert list(r.sched.to_spawn) == [0]
    r.sched.exited(w, -15)
    assert isinstance(t.value, aiomp.BrokenWorkerError)
    assert str(t.value).endswith("(cancelled)")
    assert list(r.sched.to_spawn) == [0]  # replaced once, not twice


def test_a_task_whose_fds_cannot_be_sent_fails_alone() -> None:
    r = Rig(1)
    (w,) = r.handles

    def refuse(task: Task) -> bool:
        raise aiomp.TransportError("too many fds in flight")

    w.send = refuse  # type: ignore[method-assign]
    t = r.task()
    r.submit(t)
    assert isinstance(t.value, aiomp.TransportError)
    assert r.sched.idle and not r.sched.to_spawn


def test_terminate_fails_the_queue_and_starts_nothing() -> None:
    r = Rig(1)
    (w,) = r.handles
    busy, q = r.task(), r.task()
    r.submit(busy, q)
    r.sched.terminate(RuntimeError("shutting down"))
    assert isinstance(q.value, RuntimeError)
    r.sched.kill(w, "")
    r.sched.exited(w, -15)
    assert not r.sched.to_spawn and r.sched.unfinished == 0


@pytest.mark.parametrize("exitcode", [None, 1, -9])
def test_unfinished_count_is_exact_on_every_way_out(exitcode: int | None) -> None:
    r = Rig(2, concurrency=2)
    tasks = [r.task(is_async=True) for _ in range(7)]
    r.submit(*tasks)
    r.sched.drop(tasks[-1])
    a, _b = r.handles
    r.sched.exited(a, exitcode)
    for h in r.spawn_requested():
        r.sched.ready(h)
    while r.sched.unfinished:
        for h in r.handles:
            for t in list(h.sent):
                r.sched.complete(h, t, True, None)
    assert r.sched.queued == 0 and r.drained >= 1
    assert all(t.state in (DONE, DROPPED) for t in tasks)


def test_a_task_still_in_its_workers_outbox_can_be_recalled() -> None:
    """A cancelled task that never left the pool has not started: it never starts, and
    its worker is not killed to cancel it."""
    r = Rig(1, concurrency=2)
    (w,) = r.handles
    t1, t2 = r.task(is_async=True), r.task(is_async=True)
    r.submit(t1, t2)
    w.outbox.append(t2.tid)  # the socket was full
    assert not r.sched.recall(t1)  # sent: it has started
    assert r.sched.recall(t2)
    assert t2.state == DROPPED and w.sent == [t1.tid]
    assert r.sched.unfinished == 1 and not w.killed
    t3 = r.task(is_async=True)
    r.submit(t3)
    assert w.sent == [t1.tid, t3.tid]  # its slot was given back


# -- issue 25 ------------------------------------------------------------------------------


def test_sync_tasks_waiting_behind_the_one_that_killed_their_worker_go_to_another() -> None:
    """Issue 25 item 12: chunks sent to a worker behind the chunk it ran when it died had
    not started (it runs its sync tasks in the order sent): they go back to the head of
    the queue, in order, ahead of tasks never sent; only the first fails."""
    r = Rig(1)
    (w,) = r.handles
    group = object()
    c1, c2, c3, c4 = (r.task(group=group) for _ in range(4))
    r.submit(c1, c2, c3, c4)
    assert w.sent == [c1.tid, c2.tid, c3.tid] and c4.state == QUEUED
    r.sched.exited(w, 3)
    assert isinstance(c1.value, aiomp.BrokenWorkerError)
    assert "while it ran f" in str(c1.value)
    assert [t.tid for t in r.sched.queue] == [c2.tid, c3.tid, c4.tid]
    assert r.done == [c1] and r.sched.unfinished == 3
    (new,) = r.spawn_requested()
    r.sched.ready(new)
    assert new.sent == [c2.tid, c3.tid, c4.tid]


def test_after_a_finished_chunk_the_next_one_is_the_one_that_ran() -> None:
    r = Rig(1)
    (w,) = r.handles
    group = object()
    c1, c2, c3 = (r.task(group=group) for _ in range(3))
    r.submit(c1, c2, c3)
    r.sched.complete(w, c1.tid, True, [None])
    r.sched.exited(w, -9)
    assert isinstance(c2.value, aiomp.BrokenWorkerError)
    assert [t.tid for t in r.sched.queue] == [c3.tid]


def test_a_worker_not_in_order_fails_every_task_it_was_sent() -> None:
    """A worker that may run its tasks in any order (a Ray actor): only tasks never sent
    are known not to have started."""
    r = Rig(0)
    w = FakeHandle(0, in_order=False)
    r.handles.append(w)
    r.sched.add(w)
    r.sched.ready(w)
    group = object()
    c1, c2, c3 = (r.task(group=group) for _ in range(3))
    r.submit(c1, c2, c3)
    r.sched.exited(w, -9, unsent=[c3.tid])
    assert all(isinstance(c.value, aiomp.BrokenWorkerError) for c in (c1, c2))
    assert [t.tid for t in r.sched.queue] == [c3.tid]


def test_async_tasks_a_dead_worker_was_sent_had_started() -> None:
    r = Rig(1, concurrency=3)
    (w,) = r.handles
    tasks = [r.task(is_async=True) for _ in range(3)]
    r.submit(*tasks)
    r.sched.exited(w, -9)
    assert all(isinstance(t.value, aiomp.BrokenWorkerError) for t in tasks)


def test_unstarted_tasks_of_a_caller_that_left_are_dropped_not_requeued() -> None:
    """A cancelled map's chunks that wait behind its running chunk cannot be taken back
    from the socket: the pool kills the worker, and they must never start elsewhere."""
    r = Rig(1)
    (w,) = r.handles
    group = object()
    chunks = [r.task(group=group) for _ in range(3)]
    r.submit(*chunks)
    assert not any(r.sched.recall(c) for c in chunks)  # all sent: the worker is killed
    r.sched.kill(w, " (cancelled)")
    r.sched.exited(w, -15)
    assert isinstance(chunks[0].value, aiomp.BrokenWorkerError)
    assert [c.state for c in chunks[1:]] == [DROPPED, DROPPED]
    assert not r.sched.queue and r.sched.unfinished == 0 and r.drained >= 1


def test_a_failed_start_is_retried_with_growing_delays_then_breaks_the_pool() -> None:
    """Issue 25 item 10: a worker start that fails with an OSError (fork's EAGAIN) is
    retried after each delay in turn; a success resets the count; only when every retry
    has failed too does the pool break, with the OSError as the cause."""
    r = Rig(1)
    (w,) = r.handles
    queued = r.task()
    r.submit(r.task(), queued)
    r.sched.exited(w, 3)
    assert list(r.sched.to_spawn) == [0]
    error = BlockingIOError(11, "Resource temporarily unavailable")
    for _ in range(2):
        slot = r.sched.to_spawn.popleft()
        assert r.sched.spawn_failed(slot, error) == START_RETRY_DELAYS[0]
        r.sched.respawn(slot)
        assert list(r.sched.to_spawn) == [0] and r.sched.broken is None
        (new,) = r.spawn_requested()  # this start works: the count starts again
        r.sched.exited(new, -9)  # (a start-up death, counted apart)
    delays = []
    for _ in START_RETRY_DELAYS:
        delays.append(r.sched.spawn_failed(r.sched.to_spawn.popleft(), error))
        r.sched.respawn(0)
    assert tuple(delays) == START_RETRY_DELAYS and queued.state == QUEUED
    assert r.sched.spawn_failed(r.sched.to_spawn.popleft(), error) is None
    assert isinstance(r.sched.broken, aiomp.BrokenPoolError) and r.sched.broken.__cause__ is error
    assert isinstance(queued.value, aiomp.BrokenPoolError)
    r.sched.respawn(0)
    assert not r.sched.to_spawn


def test_a_start_failure_that_is_not_an_os_error_breaks_the_pool_at_once() -> None:
    r = Rig(1)
    (w,) = r.handles
    r.sched.exited(w, 3)
    assert r.sched.spawn_failed(r.sched.to_spawn.popleft(), RuntimeError("a bug")) is None
    assert isinstance(r.sched.broken, aiomp.BrokenPoolError)


def test_no_retried_start_once_the_pool_is_closed() -> None:
    r = Rig(1)
    (w,) = r.handles
    r.sched.exited(w, 3)
    assert r.sched.spawn_failed(r.sched.to_spawn.popleft(), OSError(11, "EAGAIN")) is not None
    r.sched.close()  # nothing queued: no worker is needed any more
    r.sched.respawn(0)
    assert not r.sched.to_spawn
