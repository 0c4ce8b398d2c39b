"""A scheduler that starts a pool's first worker alone: ``run_sync``'s default pool.

The first call on a fresh pool waits for one worker's start. Started together, the
other workers' interpreters compete with that one for the CPUs (on two cores, three
interpreters start at once), and their launches hold the parent's loop. So the engine
starts only slot 0, and :class:`HoldingScheduler` holds the other slots until that
worker's first result is in (or it is ready with nothing to do): launched between its
first task and that task's result, they would hold the loop while the result waits.
They are released earlier when more tasks wait than workers are starting, or a worker
has exited. Why: docs/decisions/0046-default-pool-first-alone.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from .kinds import Handle
from .scheduler import Scheduler
from .tasks import Task, when_done


class HoldingScheduler(Scheduler):
    """A :class:`Scheduler` whose slots given to :meth:`hold` wait (see the module
    docstring)."""

    held: tuple[int, ...] = ()

    def initial_slots(self, processes: int) -> range:
        """The first slot only: the others are held until :meth:`release_held`."""
        self.held = tuple(range(1, processes))
        return range(min(processes, 1))

    def may_look_ahead(self) -> bool:
        """Not while slots are held either: their workers take the queue first."""
        return not self.held and super().may_look_ahead()

    def release_held(self) -> None:
        """Ask for the held slots' workers now (nothing if none is held, or the pool is
        broken: no worker is started for a pool on its way out)."""
        if self.held and self.broken is None:
            self.to_spawn.extend(self.held)
            self.held = ()
            self.on_spawn()

    def close(self) -> None:
        super().close()
        self.held = ()  # a closing pool serves what it has with the workers it has

    def terminate(self, error: BaseException) -> None:
        super().terminate(error)
        self.held = ()

    def ready(self, handle: Handle) -> None:
        super().ready(handle)  # a queued task is sent to it first
        w = self.workers.get(handle)
        first = None if w is None else next(iter(w.running.values()), None)
        if first is None:  # it has nothing to do: nobody waits for a result
            self.release_held()
        else:  # once that task is done (no cost per result after it)
            when_done(first, lambda _: self.release_held())

    def exited(
        self, handle: Handle, exitcode: int | None, unsent: Iterable[int] = (), why: str = ""
    ) -> None:
        super().exited(handle, exitcode, unsent, why)
        self.release_held()

    def submit(self, task: Task) -> None:
        super().submit(task)
        if self.held and self.queued > self.starting:
            self.release_held()  # more tasks wait than workers are starting for them
