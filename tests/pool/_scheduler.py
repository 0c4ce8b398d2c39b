"""The scheduler's test rig (``aiomp._pool.scheduler`` with fake worker handles), shared by
test_scheduler.py, test_scheduler_queued_ahead.py and test_holding.py."""

from __future__ import annotations

from typing import Any

from aiomp._pool.scheduler import Scheduler
from aiomp._pool.tasks import Task


class FakeHandle:
    """A worker that records what it was sent; ``alive=False`` makes sends fail.
    ``in_order``: it runs its sync tasks one at a time in the order sent (a process
    worker does; a Ray actor need not)."""

    def __init__(
        self, slot: int, pid: int = 0, in_order: bool = True, looks_ahead: bool = False
    ) -> None:
        self.slot = slot
        self.in_order = in_order
        self.looks_ahead = looks_ahead
        self.cancelled: list[int] = []  # ids it was told to skip (or cancel)
        self.pid = pid or 1000 + slot
        self.sent: list[int] = []
        self.outbox: list[int] = []  # sent, but still waiting for room in the socket
        self.alive = True
        self.exit_requested = False
        self.killed = False
        self.oom_killed = False  # what a process handle learns of its death
        self.peak_rss: int | None = None

    @property
    def name(self) -> str:
        return f"worker {self.slot} (pid {self.pid})"

    def send(self, task: Task) -> bool:
        if not self.alive:
            return False
        self.sent.append(task.tid)
        return True

    def unsend(self, task: Task) -> bool:
        if task.tid in self.outbox:
            self.outbox.remove(task.tid)
            self.sent.remove(task.tid)
            return True
        return False

    def send_exit(self) -> None:
        self.exit_requested = True

    def cancel(self, tid: int) -> None:
        self.cancelled.append(tid)

    def kill(self, now: bool = False) -> None:
        self.killed = True


class Rig:
    """A scheduler with fake workers, and helpers to make tasks."""

    def __init__(
        self,
        processes: int = 2,
        concurrency: int = 1,
        maxtasks: int | None = None,
        looks_ahead: bool = False,
    ) -> None:
        self.looks_ahead = looks_ahead
        self.spawns = 0
        self.drained = 0
        self.sched = Scheduler(concurrency, maxtasks, self._spawn, self._drained)
        self.handles: list[FakeHandle] = []
        self.done: list[Task] = []
        self._tid = 0
        for slot in range(processes):
            self.start(slot)

    def _spawn(self) -> None:
        self.spawns += 1

    def _drained(self) -> None:
        self.drained += 1

    def start(self, slot: int, ready: bool = True) -> FakeHandle:
        h = FakeHandle(slot, pid=2000 + len(self.handles), looks_ahead=self.looks_ahead)
        self.handles.append(h)
        self.sched.add(h)
        if ready:
            self.sched.ready(h)
        return h

    def spawn_requested(self) -> list[FakeHandle]:
        """Start what the scheduler asked for (as the pool's supervisor does)."""
        out = []
        while self.sched.to_spawn:
            out.append(self.start(self.sched.to_spawn.popleft(), ready=False))
        return out

    def task(
        self, weight: int | None = None, group: Any = None, is_async: bool = False, size: int = 1
    ) -> Task:
        self._tid += 1
        w = weight if weight is not None else (1 if is_async else self.sched.concurrency)
        return Task(
            self._tid, "f", w, is_async, b"msg", group=group, size=size, on_done=self.done.append
        )

    def submit(self, *tasks: Task) -> None:
        for t in tasks:
            self.sched.submit(t)
