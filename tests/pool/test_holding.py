"""Unit tests of ``aiomp._pool.holding``: the default pool's first worker starts alone.

Issue 29's first-call target (``run_sync``'s first call no slower than anyio's): the
other slots wait until that worker's first result is in (or it is ready with nothing to
do), more tasks wait than workers are starting, or a worker has exited; never once the
pool is closing or broken.
"""

from __future__ import annotations

import aiomp
from aiomp._pool.holding import HoldingScheduler
from tests.pool._scheduler import Rig


class HoldingRig(Rig):
    """Slot 0 started (not ready), slots 1..n-1 held, as ``Engine.open`` does."""

    def __init__(self, processes: int = 3) -> None:
        super().__init__(0)
        self.sched = HoldingScheduler(1, None, self._spawn, self._drained)
        (first,) = self.sched.initial_slots(processes)
        self.first = self.start(first, ready=False)

    @property
    def held(self) -> tuple[int, ...]:
        assert isinstance(self.sched, HoldingScheduler)
        return self.sched.held


def test_the_first_call_is_sent_to_the_first_worker_then_the_others_start() -> None:
    r = HoldingRig(3)
    t = r.task()
    r.submit(t)  # the first call: one task, one worker starting for it
    assert r.held == (1, 2) and not r.sched.to_spawn and r.spawns == 0
    r.sched.ready(r.first)
    assert r.first.sent == [t.tid]  # sent before any other worker is asked for
    # Not asked for while that task runs: their launches would hold the loop while its
    # result waits.
    assert r.held == (1, 2) and not r.sched.to_spawn and r.spawns == 0
    r.sched.complete(r.first, t.tid, True, None)
    assert r.held == () and list(r.sched.to_spawn) == [1, 2] and r.spawns == 1
    others = r.spawn_requested()
    assert [h.slot for h in others] == [1, 2]


def test_more_waiting_tasks_than_starting_workers_release_the_others() -> None:
    r = HoldingRig(2)
    r.submit(r.task())
    assert r.held == (1,)
    r.submit(r.task())  # two concurrent first calls: one would wait for the other
    assert r.held == () and list(r.sched.to_spawn) == [1]


def test_a_ready_worker_with_nothing_to_do_releases_the_others() -> None:
    r = HoldingRig(2)  # the first call was cancelled before the worker was ready
    r.sched.ready(r.first)
    assert r.held == () and list(r.sched.to_spawn) == [1]


def test_a_first_worker_that_dies_starting_releases_the_others() -> None:
    r = HoldingRig(2)
    r.submit(r.task())
    r.sched.exited(r.first, 1)
    assert r.held == ()
    assert sorted(r.sched.to_spawn) == [0, 1]  # its replacement and the held slot


def test_nothing_held_starts_once_the_pool_is_closing_or_broken() -> None:
    r = HoldingRig(2)
    r.sched.close()
    r.sched.ready(r.first)
    assert r.held == () and not r.sched.to_spawn
    b = HoldingRig(2)
    b.sched.break_pool(aiomp.BrokenPoolError("broken"))
    b.sched.ready(b.first)
    assert b.held == (1,) and not b.sched.to_spawn
