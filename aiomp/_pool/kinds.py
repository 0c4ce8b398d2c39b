"""The seam between a Pool's engine and its workers: a *kind* of worker and its handles.

The engine (:mod:`aiomp._pool.engine`) knows workers only through this module. A
:class:`WorkerKind` prepares what every worker needs, starts one worker per call and
turns a call into a task's message; each worker it starts is a :class:`Handle`, which
sends tasks, decodes what comes back and reports it through the engine's
:class:`Events`. Two kinds exist: local processes (:mod:`aiomp._pool.process_kind`) and
Ray actors (:mod:`aiomp.ray`); the contract tests run one suite over both and a fake.

Owns nothing.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import anyio

    from .tasks import FnInfo, Task


class Handle(abc.ABC):
    """One worker as the engine and its scheduler see it. No method but :meth:`run` may
    block or await: they are called from tasks and from loop callbacks alike."""

    #: The worker's slot in the pool (its replacement gets the same).
    slot: int
    #: The worker runs the sync tasks it holds one at a time, in the order they were sent:
    #: one sent behind another has not started while the one before it has no outcome.
    in_order: bool = True
    #: The worker can hold a sync task *queued ahead* behind the one it runs and be told
    #: to skip it (``cancel``, answered ``on_skipped``) until it starts it: see
    #: docs/decisions/0065-tasks-queued-ahead.md. Needs ``in_order``.
    looks_ahead: bool = False
    #: Set (by :meth:`run`) once the worker has exited and the handle is closed. Made in
    #: a task, when the handle is.
    dead: anyio.Event
    #: Why the worker died on its own, where its kind can tell ("" otherwise).
    why: str = ""
    #: Set once the worker has exited, before ``on_exit``, where its kind can tell (see
    #: ``aiomp._pool.health``): whether the kernel's OOM killer killed it, its peak
    #: resident set in bytes, and (after :meth:`expect_kill`) the stack of all its
    #: threads that it printed as it was terminated (None: it could not print).
    oom_killed: bool = False
    peak_rss: int | None = None
    stack: str | None = None
    #: Whether its kind can keep its stack at a kill (:meth:`expect_kill`).
    prints_stack: bool = False
    #: Whether :meth:`run` has begun: it runs once (see :meth:`finish_unwatched`).
    watching: bool = False

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """``worker N (pid P)``, for messages."""

    @property
    @abc.abstractmethod
    def pid(self) -> int | None:
        """The worker's process id, or None while its kind cannot tell."""

    @abc.abstractmethod
    def send(self, task: Task) -> bool:
        """Send (or queue in order for sending) ``task``; False: the worker has gone and
        nothing was sent. An OSError: the task cannot be sent anywhere (its fds)."""

    def try_send_now(self, frame: bytes, fid: int) -> bool:
        """Send the small task frame ``frame`` of function ``fid`` before its Task exists,
        if it can go whole at once and nothing must go before it; False: nothing was sent
        (the caller submits the Task instead). A kind whose messages are not frames never
        sends one."""
        return False

    @abc.abstractmethod
    def unsend(self, task: Task) -> bool:
        """Take back ``task`` if none of it has left the pool yet (True), else False."""

    @abc.abstractmethod
    def send_exit(self) -> None:
        """Ask the worker to exit once it has sent its results."""

    @abc.abstractmethod
    def cancel(self, tid: int) -> None:
        """Ask the worker to cancel async task ``tid``."""

    def expect_kill(self) -> None:
        """The pool is about to terminate this worker on purpose (a timeout, a
        cancellation) and logs why itself: keep its stack at the kill in :attr:`stack`,
        where the kind can (a kind that cannot leaves it None)."""
        return

    @abc.abstractmethod
    def kill(self, now: bool = False) -> None:
        """Terminate the worker (SIGTERM, grace period, SIGKILL; with ``now``, SIGKILL at
        once); :meth:`run` reports its exit."""

    async def run(self) -> None:
        """The worker's watcher, a task in the pool's task group: :meth:`watch_exit`, once (it
        sets :attr:`watching` first; a second call returns at once)."""
        if not self.watching:
            self.watching = True
            await self.watch_exit()

    @abc.abstractmethod
    async def watch_exit(self) -> None:
        """Wait until the worker has exited (killing it when asked: bounded), then report
        ``on_exit`` once and set :attr:`dead`. Shielded: cancelling the group does not
        stop it."""

    async def finish_unwatched(self) -> None:
        """If :meth:`run` has not begun, kill the worker at once and run the watcher here,
        in the caller's task (bounded): its task may have been cancelled before its first
        step, as ``asyncio.run`` cancels the tasks left at its end, and the exit must be
        reported all the same. Nothing if it has begun; if the watcher's own task starts
        later, it returns at once."""
        if not self.watching:
            self.kill(now=True)
            await self.run()


class Events(Protocol):
    """What a handle reports to its engine (from tasks and loop callbacks; never awaits)."""

    @property
    def on_result(self) -> Callable[[Handle, int, bool, Any], object]:
        """``on_result(handle, tid, ok, value)``: task ``tid``'s outcome, a value or (not
        ``ok``) the exception to raise in its caller. The scheduler's own ``complete``,
        with no frame between the handle and it."""

    def on_ready(self, handle: Handle) -> None:
        """The worker has run the initializer and takes tasks."""

    def on_retire(self, handle: Handle, tid: int, grown: int, limit: int) -> None:
        """The worker's private memory has grown ``grown`` bytes, past the pool's
        ``max_memory`` (``limit``), as it ran task ``tid``: retire it after its tasks."""

    def on_skipped(self, handle: Handle, tid: int) -> None:
        """Task ``tid``, held by the worker behind another, was not started and never
        will be there (a ``cancel`` reached it first, or the worker is retiring)."""

    def on_init_failed(self, handle: Handle, cause: BaseException) -> None:
        """The initializer raised ``cause`` in the worker: the pool breaks."""

    def on_lost(self, handle: Handle, exc: BaseException) -> None:
        """A message from the worker was lost: its task would wait forever, so the
        worker is terminated (its tasks fail with BrokenWorkerError)."""

    def on_exit(self, handle: Handle, exitcode: int | None, unsent: list[int]) -> None:
        """The worker has exited (None: it survived SIGKILL); ``unsent``: the ids of the
        tasks that never left the pool."""

    def kill(self, handle: Handle, reason: str) -> None:
        """Terminate the worker and replace it; its tasks fail saying ``reason``."""

    def live_handles(self) -> list[Handle]:
        """The workers that take tasks (neither retiring, killed nor gone)."""

    @property
    def broken(self) -> BaseException | None:
        """Why the pool is broken (calls fail with it), or None."""

    def break_pool(self, error: BaseException) -> None:
        """Break the pool: queued and later tasks fail with BrokenPoolError from ``error``."""

    def task_name(self, handle: Handle, tid: int) -> str | None:
        """The function name of task ``tid``, or None: ``handle`` holds no such task."""


#: A call to :meth:`WorkerKind.encode`: ``(tid, fn, info, flags, items, kwds, group)``.
#: Task ``tid`` runs ``fn`` (``info``: its :class:`FnInfo`) with the wire's ``flags``
#: (:mod:`aiomp._pool.protocol`) over ``items`` (apply's arguments, or a map chunk's
#: inputs) and ``kwds``; ``group`` is what a map's chunks share (None for apply). A plain
#: tuple: apply makes one per call, and a class's constructor would cost a call more.
Call = tuple[int, "Callable[..., object]", "FnInfo", int, Any, "dict[str, object] | None", object]


#: The call each worker makes before its first task: ``(initializer, initargs)``, the
#: pool's own (sent pickled as one, by every kind).
InitCall = tuple["Callable[..., object] | None", tuple[object, ...]]


class Options(Protocol):
    """The pool's settings a kind reads."""

    concurrency: int
    grace: float
    #: How many workers the pool keeps (a worker's ``get_worker_info().num_workers``).
    processes: int


class WorkerKind(abc.ABC):
    """How a pool gets its workers and what its tasks look like."""

    #: ``map``'s default chunk size makes this many chunks per worker slot.
    chunks_per_slot: int = 4
    #: Whether tasks are frames of the process wire (:mod:`aiomp._pool.protocol`), whose
    #: workers map shared memory; False for a kind with a wire of its own (Ray's).
    process_wire: bool = False
    #: The start method of the workers, the key under which :attr:`FnInfo.checked`
    #: records that a function can be imported by them; None: not aiomp's processes.
    start_method: str | None = None

    @abc.abstractmethod
    async def prepare(self, processes: int) -> int:
        """Make ready what every worker needs (before the first starts); returns how
        many workers to keep (``processes``, unless the kind decides: Ray's capacity).
        On failure or cancellation, :meth:`close` follows."""

    @abc.abstractmethod
    def start(self, slot: int, events: Events, options: Options) -> Handle | None:
        """Start a worker for ``slot`` and return its handle, whose :meth:`Handle.run`
        the engine starts (from a task, never a loop callback); None: no worker can be
        started any more, and the kind has told the engine why."""

    @abc.abstractmethod
    def encode(self, call: Call) -> Any:
        """The message of ``call``'s task, made in the caller: raises here if it cannot be
        pickled. Its ``close()`` is called once the task is done, ``discard()`` if it
        never runs (a small frame, ``bytes``, needs neither)."""

    def watch(self) -> Callable[[], Awaitable[None]] | None:
        """A task to run while the pool is open (cancelled as it shuts down), or None."""
        return None

    @abc.abstractmethod
    async def close(self, linger: bool) -> None:
        """Release what :meth:`prepare` and the workers left (after every worker is
        reaped, or after a failed start); ``linger``: their output may still be read for a
        moment. Shielded by the caller."""

    def describe(self) -> str:
        """The kind's settings for the pool's ``repr``."""
        return ""
