"""The on-demand rule of ``run_sync``'s default pool (``Scheduler(on_demand=True)``,
decision 0091): a worker starts when a task finds no worker for it, up to the pool's
size, as anyio's and trio-parallel's pools do. It replaced a scheduler that held the
other slots until the first worker's first result (decision 0046): issue 41.

Unit tests of the pure scheduler, with fake workers (no processes, no loop).
"""

from __future__ import annotations

import aiomp
from aiomp._pool.scheduler import Scheduler
from tests.pool._scheduler import Rig


class OnDemandRig(Rig):
    """An on-demand scheduler of ``processes`` slots, opened as ``Engine.open`` does."""

    def __init__(self, processes: int = 3) -> None:
        super().__init__(0)
        self.sched = Scheduler(1, None, self._spawn, self._drained, on_demand=True)
        assert list(self.sched.open(processes)) == []  # none starts as the pool opens


def test_the_first_call_starts_one_worker_and_nothing_more() -> None:
    r = OnDemandRig(3)
    t = r.task()
    r.submit(t)  # the first call finds no worker: one starts for it
    assert list(r.sched.to_spawn) == [0] and r.spawns == 1
    (first,) = r.spawn_requested()
    r.sched.ready(first)
    assert first.sent == [t.tid]
    r.sched.complete(first, t.tid, True, None)
    # Its result starts no other worker (their launches would cost the caller's loop
    # and CPUs for nothing): the next call finds that one idle.
    assert not r.sched.to_spawn and r.spawns == 1
    t2 = r.task()
    r.submit(t2)
    assert first.sent == [t.tid, t2.tid] and not r.sched.to_spawn


def test_a_task_that_finds_every_worker_busy_starts_another_up_to_the_size() -> None:
    r = OnDemandRig(2)
    r.submit(r.task())
    (first,) = r.spawn_requested()
    r.submit(r.task())  # two concurrent calls: one would wait for the other's worker
    (second,) = r.spawn_requested()
    assert (first.slot, second.slot) == (0, 1)
    r.sched.ready(first)
    r.sched.ready(second)
    assert first.sent and second.sent
    r.submit(r.task())  # the pool's size is reached: it waits for a worker
    assert not r.sched.to_spawn and r.sched.queued == 1


def test_tasks_wait_for_a_starting_worker_before_another_starts() -> None:
    r = OnDemandRig(3)
    r.submit(r.task())
    r.spawn_requested()
    r.submit(r.task())  # two tasks, one worker starting: one more
    r.spawn_requested()
    assert r.sched.starting == 2 and r.sched.queued == 2 and r.sched.spare == [2]


def test_no_look_ahead_while_a_worker_may_still_start() -> None:
    """A busy worker's look-ahead slot must not take a task that a new worker would
    start at once."""
    r = OnDemandRig(2)
    assert not r.sched.may_look_ahead()


def test_nothing_starts_on_demand_once_the_pool_is_closing_or_broken() -> None:
    r = OnDemandRig(2)
    r.sched.close()
    r.submit(r.task())
    assert not r.sched.to_spawn
    b = OnDemandRig(2)
    b.sched.break_pool(aiomp.BrokenPoolError("broken"))
    t = b.task()
    b.submit(t)
    assert not b.sched.to_spawn and t in b.done


def test_a_plain_pool_starts_every_worker_as_it_opens() -> None:
    s = Scheduler(1, None)
    assert list(s.open(3)) == [0, 1, 2] and not s.spare
