"""One worker of :class:`aiomp.ray.Pool` as the pool sees it: a Ray actor and its refs.

An :class:`ActorHandle` is the Ray kind's :class:`~aiomp._pool.kinds.Handle`: the same
methods and ``dead`` event as the process handle, and the same reports to the engine's
:class:`~aiomp._pool.kinds.Events`: each task's outcome decoded, as
``on_result(handle, tid, ok, value)`` (an error as the exception to raise), and
``on_exit(handle, exitcode, unsent)``, once, after the actor is gone.

Each ref the handle makes (the actor's ``init``, each task's ``run``, and ``alive``, which
returns only when the actor dies) gets a done-callback that Ray runs on its thread and
that hands the outcome to the pool's loop; each ref is held until then (see
docs/decisions/0031-ray-workers.md and *Nothing anyio in loop callbacks* in docs/architecture.md).

:meth:`run` is the *watcher*, one task in the pool's task group per actor. It waits until
the actor must go (:meth:`kill`, :meth:`send_exit`) or has gone (``alive`` failed, or a
task's ref failed with ``RayActorError``), then ``ray.kill``\\ s it, waits (at most the
grace period plus :data:`CONFIRM` seconds) until Ray confirms the death and every ref it was
sent has settled, so that a task that finished just before the death keeps its result, and
reports the exit. Every ref still unsettled then belonged to a dead actor: the scheduler
fails those tasks with :class:`aiomp.BrokenWorkerError`.

Once Ray's session has ended (``ray.shutdown()``), nothing is asked of Ray any more (its
calls would start a local instance of their own) and :meth:`lost` reports the actor gone:
no ref of it will ever settle.
"""

from __future__ import annotations

import pickle
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._loop.wakeup import Signal
from .._pool.kinds import Events, Handle
from .._pool.protocol import ErrorPayload
from .._pool.tasks import Task

if TYPE_CHECKING:
    import asyncio

#: The exit code reported for an actor the pool killed (``ray.kill`` sends SIGKILL).
KILLED = -signal.SIGKILL
#: ... for one that died on its own (Ray does not say how): "exit code 1".
DIED = 1
#: Seconds (beyond the grace period) to wait for Ray to confirm a death it was told of.
CONFIRM = 10.0


def watch(ref: Any, loop: Any, done: Callable[[Any], None]) -> None:
    """Call ``done(outcome)`` on ``loop`` (an asyncio loop) once ``ref`` has settled: its
    value, or the exception that getting it raises (no actor method of aiomp's returns an
    exception)."""
    held: Any = ref

    def settled(outcome: Any) -> None:  # on Ray's thread
        nonlocal held
        held = None  # kept until now: Ray crashes resolving a ref that nobody holds
        try:
            loop.call_soon_threadsafe(done, outcome)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    # What ``ref.future()`` and ``await ref`` use, without a concurrent Future between.
    ref._on_completed(settled)


class ActorHandle(Handle):
    """See the module docstring."""

    #: Ray may run an actor's calls in any order: only a task never sent is known not
    #: to have started.
    in_order = False

    def __init__(
        self,
        slot: int,
        actor: Any,  # a Ray ActorHandle (ray ships no types)
        loop: asyncio.AbstractEventLoop,  # Ray's asyncio integration: asyncio only
        grace: float,
        events: Events,
    ) -> None:
        import ray

        self._ray = ray
        self._connected: Callable[[], bool] = ray.is_initialized
        self._actor_error = ray.exceptions.RayActorError
        self._task_error = ray.exceptions.RayTaskError
        self.slot = slot
        self.actor = actor
        self.actor_id: str = actor._actor_id.hex()
        self.node_id: str | None = None
        self._pid: int | None = None
        self._loop = loop
        self._grace = grace
        self._events = events
        self._on_result = events.on_result
        self._run = actor.run.remote
        self._cancel = actor.cancel.options(concurrency_group="ctl").remote
        self.pending = 0  # refs sent and not yet settled (init and tasks)
        self._settled = Signal(loop)  # pending reached 0 after the stop
        self._stop = Signal(loop)  # the actor must go, or has gone
        self._gone = Signal(loop)  # Ray said the actor is dead
        self.closed = False  # nothing more is sent
        self.exitcode: int | None = DIED
        self.why = ""  # Ray's reason for the death, when it died on its own
        # Made here, in a task (handles are made by the pool's supervisor task).
        self.dead = anyio.Event()
        self._watch(actor.alive.options(concurrency_group="ctl").remote(), self._alive_done)

    @property
    def name(self) -> str:
        where = f"pid {self._pid}" if self._pid is not None else f"actor {self.actor_id[:8]}"
        return f"worker {self.slot} ({where})"

    @property
    def pid(self) -> int | None:
        """The actor's process id on its node (None until it is ready)."""
        return self._pid

    # -- refs -------------------------------------------------------------------------
    def _watch(self, ref: Any, done: Callable[[Any], None]) -> None:
        watch(ref, self._loop, done)

    def init(self, blob: bytes, who: tuple[int, int]) -> None:
        """Have the actor record ``who`` (its slot, the pool's size: its
        ``get_worker_info()``) and run the pool's initializer; ``on_ready`` gets the
        answer."""
        self.pending += 1
        self._watch(self.actor.init.remote(blob, who), self._init_done)

    def _init_done(self, answer: Any) -> None:
        self._settle()
        if isinstance(answer, BaseException):
            self._died(answer)
            return
        if answer[0]:
            self._pid, self.node_id = answer[1], answer[2]
            self._events.on_ready(self)
            return
        self._events.on_init_failed(self, self._rebuild(answer[1]))
        self._events.kill(self, " (its initializer raised)")

    def _rebuild(self, error: ErrorPayload) -> BaseException:
        return error.exception(self.name, self.slot, self.pid)

    def _alive_done(self, outcome: Any) -> None:
        self._died(
            outcome
            if isinstance(outcome, BaseException)
            else RuntimeError("the actor's alive() returned")
        )
        self._gone.set()

    def _died(self, exc: BaseException) -> None:
        self.closed = True  # from now on a task meant for it goes to another actor
        if not self._stop.is_set():
            self.why = death_reason(exc)
            self._stop.set()

    def _settle(self) -> None:
        self.pending -= 1
        if not self.pending:
            self._settled.set()

    # -- sending (never blocks, never touches anyio) -----------------------------------
    def unsend(self, task: Task) -> bool:
        """Ray queues a submitted call on its side, out of reach: it cannot be taken back."""
        return False

    def send(self, task: Task) -> bool:
        """Submit ``task`` to the actor; False once the actor is known to be gone."""
        if self.closed or not self._connected():
            return False
        msg = task.message
        tid = task.tid
        self.pending += 1
        self._watch(self._run(msg.blob, *msg.refs), lambda out: self._task_done(tid, out))
        return True

    def _task_done(self, tid: int, outcome: Any) -> None:
        self._settle()
        if isinstance(outcome, ErrorPayload):
            self._on_result(self, tid, False, self._rebuild(outcome))
        elif not isinstance(outcome, BaseException):
            self._on_result(self, tid, True, outcome)
        elif isinstance(outcome, self._actor_error):
            self._died(outcome)  # the scheduler fails the task once the exit is reported
        elif isinstance(outcome, self._task_error):
            # The actor's run() answers every error of the task itself: what fails after
            # it is Ray serializing the result.
            cause = getattr(outcome, "cause", None) or outcome
            err = pickle.PicklingError(
                f"the result of {self._events.task_name(self, tid) or 'a task'} could not "
                f"be pickled to return it from {self.name}: {type(cause).__name__}: {cause}"
            )
            err.__cause__ = outcome
            self._on_result(self, tid, False, err)
        else:  # Ray could not run it or return its result (cancellation)
            self._on_result(self, tid, False, outcome)

    def send_exit(self) -> None:
        """The pool has no more tasks for the actor: it goes (killed, exit code 0)."""
        if not self._stop.is_set():
            self.exitcode = 0
            self._stop.set()

    def cancel(self, tid: int) -> None:
        """Cancel async task ``tid`` inside the actor (its coroutine sees CancelledError)."""
        if not self.closed and self._connected():
            # Watched, so that Ray counts its error (the actor died meanwhile) as handled.
            self._watch(self._cancel(tid), _ignore)

    def kill(self, now: bool = False) -> None:
        """Have the watcher kill the actor (``ray.kill``, which does not wait: ``now`` is
        how it always kills) and report its exit."""
        if not self._stop.is_set():
            self.exitcode = KILLED
            self._stop.set()

    def lost(self, why: str) -> None:
        """Ray's session has ended under the pool: the actor is gone with it, and no ref
        will settle. The watcher reports the exit at once (tasks held: BrokenWorkerError)."""
        self.closed = True
        if not self._stop.is_set():
            self.why = why
            self._stop.set()
        self._gone.set()
        self.pending = 0
        self._settled.set()

    # -- the watcher -------------------------------------------------------------------
    async def watch_exit(self) -> None:
        """Wait until the actor must go or has gone; kill it, wait for Ray to say so and
        for its refs to settle (bounded by the grace period), then report the exit.

        Shielded: cancelling the pool's task group does not stop it; it always ends.
        """
        try:
            with anyio.CancelScope(shield=True):
                await self._stop.wait()
                self.closed = True
                try:
                    if self._connected():
                        self._ray.kill(self.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - Ray forgot it: it is gone already
                    pass
                with anyio.move_on_after(self._grace + CONFIRM):
                    await self._gone.wait()
                    if self.pending:
                        self._settled = Signal(self._loop)
                        await self._settled.wait()
                if not self._gone.is_set():
                    self.exitcode = None  # Ray did not confirm the death
        finally:
            self.closed = True
            self._events.on_exit(self, self.exitcode, [])
            self.dead.set()


def _ignore(_: object) -> None:
    pass


def death_reason(exc: BaseException) -> str:
    """The line of Ray's error that says why the actor died."""
    text = str(exc)
    for line in text.splitlines():
        if "dead because" in line or "died because" in line:
            return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".strip()
