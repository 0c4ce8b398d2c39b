"""The ranks of one :func:`aiomp.ray.spawn` job as the parent sees them, and their context.

A :class:`Rank` is one ``aiomp.ray._rank.RankActor`` and the refs it was sent: ``init``,
``run`` (its outcome), ``alive`` (fails when the actor dies) and a chain of ``output``
long polls whose bytes it labels as the local spawn does (``aiomp._output.lines``). Each
ref gets a done-callback that Ray runs on its thread and that hands the outcome to the
loop (:func:`watch`), as ``aiomp.ray._handle`` does: nothing polls.

:class:`RayProcessContext` is an :class:`aiomp.ProcessContext` whose processes are those
actors. Owns the job's actors, its placement group and, where the job started it, the Ray
session: :meth:`RayProcessContext.release` kills every actor, waits (bounded) until Ray
says each is dead, removes the placement group (its resources are the cluster's again) and
shuts down a session the job started. Every way out of the job goes through it once.
While it waits, the context checks every ``SESSION_CHECK`` seconds that Ray's session
still runs: after ``ray.shutdown()`` no ref settles, and the ranks not done are reported
lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from collections.abc import Callable
from typing import Any

import anyio

from .._errors import ProcessException, ProcessExitedException, ProcessRaisedException
from .._output.forwarder import LINGER
from .._output.lines import ChildLines, Output
from .._pool.protocol import ErrorPayload
from .._spawn.context import ProcessContext
from . import _session
from ._handle import CONFIRM, DIED, KILLED, death_reason, watch
from ._kind import SESSION_CHECK


class ActorExitedException(ProcessExitedException):
    """A rank's Ray actor died, or its node did: a :class:`aiomp.ProcessExitedException`
    that names where it ran. ``node_id`` and ``node_address`` are its Ray node's (None if it
    died before it was ready); ``actor_id`` is its actor's. ``exit_code`` is -9
    (``SIGKILL``) for a rank the job killed as it ended, 1 for one that died on its own
    (Ray does not say how a process ended)."""

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int | None,
        *,
        killed: bool = False,
        node_id: str | None = None,
        node_address: str | None = None,
        actor_id: str = "",
    ) -> None:
        """``killed``: by its job, as the job ended (``exit_code`` -9), rather than on its
        own (1)."""
        code, name = (KILLED, "SIGKILL") if killed else (DIED, None)
        super().__init__(msg, error_index, error_pid, code, name)
        self.node_id = node_id
        self.node_address = node_address
        self.actor_id = actor_id


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where one rank of an :func:`aiomp.ray.spawn` job runs, from ``ctx.actors()``."""

    rank: int
    actor_id: str
    #: Its Ray node's id and address, and its process id there.
    node_id: str | None
    node_address: str | None
    pid: int | None


def _ignore(_: object) -> None:
    pass


class Rank:
    """One rank's actor and refs (see the module docstring). Its callbacks run on the loop
    and end in ``changed()``, which wakes whoever waits on the job."""

    def __init__(
        self,
        rank: int,
        actor: Any,  # a Ray ActorHandle
        loop: asyncio.AbstractEventLoop,
        output: Output,
        changed: Callable[[Rank], None],
    ) -> None:
        import ray

        self._actor_error = ray.exceptions.RayActorError
        self.rank = rank
        self.actor = actor
        self.actor_id: str = actor._actor_id.hex()
        self._loop = loop
        self._changed = changed
        self.node_id: str | None = None
        self.address: str | None = None
        self.pid: int | None = None
        self.port: int | None = None  # a free port on its node (rank 0 with rendezvous)
        self.ready = False  # init answered
        self.gone = False  # Ray said the actor is dead
        self.killed = False  # the job killed it (it had not finished)
        self.outcome: tuple[str, object] | None = None  # ("ok", value) / ("err", exc)
        self._lines = None if output == "inherit" else ChildLines(rank, output)
        self.output_done = self._lines is None
        ctl = actor.alive.options(concurrency_group="ctl")
        watch(ctl.remote(), loop, self._alive_done)

    def failure(self) -> ProcessException | None:
        if self.outcome is not None and self.outcome[0] == "err":
            return self.outcome[1]  # type: ignore[return-value]
        return None

    def init(self, nprocs: int, want_port: bool) -> None:
        ref = self.actor.init.remote(self.rank, nprocs, want_port, self._lines is not None)
        watch(ref, self._loop, self._init_done)

    def _init_done(self, answer: Any) -> None:
        if isinstance(answer, BaseException):
            self._died(answer)
        else:
            self.node_id, self.address, self.pid, self.port = answer
            self.ready = True
            self._changed(self)

    def run(self, blob: bytes, env: dict[str, str] | None) -> None:
        """Start ``fn`` in the actor, and the output polls."""
        watch(self.actor.run.remote(blob, env), self._loop, self._run_done)
        if self._lines is not None:
            self._poll_output()

    def _run_done(self, answer: Any) -> None:
        if self.outcome is not None:
            return
        if isinstance(answer, self._actor_error):
            self._died(answer)
            return
        if isinstance(answer, BaseException):  # Ray could not return the result
            cause = getattr(answer, "cause", None) or answer
            self._fail(
                f"returned a value that could not be sent to the parent: "
                f"{type(cause).__name__}: {cause}",
                answer,
            )
        elif answer[0]:
            self.outcome = ("ok", answer[1])
        else:
            payload: ErrorPayload = answer[1]
            self._fail(
                f"raised:\n\n{payload.text.rstrip()}",
                payload.cause(f"process {self.rank} ({self.where})"),
            )
        self._changed(self)

    @property
    def where(self) -> str:
        if self.address is None:
            return f"Ray actor {self.actor_id[:8]}"
        return f"pid {self.pid} on node {self.address}"

    def _fail(self, what: str, cause: BaseException | None) -> None:
        exc = ProcessRaisedException(
            f"process {self.rank} ({self.where}) {what}", self.rank, self.pid
        )
        exc.__cause__ = cause
        self.outcome = ("err", exc)

    def _alive_done(self, outcome: Any) -> None:
        self.gone = True
        self._died(outcome if isinstance(outcome, BaseException) else None)

    def _died(self, exc: BaseException | None) -> None:
        if self.outcome is None:
            if self.killed:
                self._exited("was killed as its job ended", killed=True)
            else:
                why = death_reason(exc) if exc is not None else "its actor is gone"
                self._exited(f"died ({why})")
        self._changed(self)

    def _exited(self, what: str, killed: bool = False) -> None:
        """This rank ends with :class:`ActorExitedException`: ``what`` befell its actor."""
        exc = ActorExitedException(
            f"process {self.rank} ({self.where}, Ray actor {self.actor_id[:8]}) {what}",
            self.rank,
            self.pid,
            killed=killed,
            node_id=self.node_id,
            node_address=self.address,
            actor_id=self.actor_id,
        )
        self.outcome = ("err", exc)

    # -- output ------------------------------------------------------------------------
    def _poll_output(self) -> None:
        ref = self.actor.output.options(concurrency_group="ctl").remote()
        watch(ref, self._loop, self._output_done)

    def _output_done(self, got: Any) -> None:
        lines = self._lines
        assert lines is not None
        if got is None or isinstance(got, BaseException):  # the end, or the actor's
            self.end_output()
            self._changed(self)
            return
        for i, data in got:
            lines.emit(i, data)
        self._poll_output()

    def end_output(self) -> None:
        """Forward a last unended line, once; no more output is read."""
        if not self.output_done and self._lines is not None:
            for i in (0, 1):
                self._lines.emit(i, b"", final=True)
        self.output_done = True

    # -- the end -----------------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel an ``async def`` fn inside the actor (a sync one runs on)."""
        if self.outcome is None and not self.gone:
            watch(self.actor.cancel.options(concurrency_group="ctl").remote(), self._loop, _ignore)

    def lost(self, why: str) -> None:
        """Ray's session has ended: the actor is gone with it, and no callback will come."""
        self.gone = True
        if self.outcome is None:
            self._exited(f"is lost: {why}")
        self.end_output()

    def kill(self, ray: Any) -> None:
        if not self.gone:
            self.killed = self.outcome is None
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - Ray forgot it: it is gone already
                self.gone = True


class RayProcessContext(ProcessContext):
    """The ranks :func:`aiomp.ray.spawn` started, as Ray actors: join them, read results,
    terminate them. An :class:`aiomp.ProcessContext` (``join``, ``results``, ``pids``,
    ``terminate``), plus :meth:`actors`, where each rank runs; ``processes`` has no
    ``multiprocessing`` objects to give (``RuntimeError``)."""

    def __init__(
        self, ranks: list[Rank], grace_period: float, ray: Any, pg: Any, started_ray: bool
    ) -> None:
        self._ranks = ranks
        self.grace_period = grace_period
        self._failure: ProcessException | None = None
        self._results: list[object] | None = None
        self._lock = anyio.Lock()
        self._wake = asyncio.Event()  # set on every change of a rank (loop callbacks)
        self._ray = ray
        self._pg = pg
        self._started_ray = started_ray
        self._job = ray.get_runtime_context().get_job_id()  # the session's, while it runs
        self._released = False

    @property
    def ranks(self) -> list[Rank]:
        return self._ranks

    def add(self, rank: Rank) -> None:
        """(While starting) ``rank``'s actor is the job's from now on."""
        self._ranks.append(rank)

    def failed(self) -> bool:
        return self._failure is not None

    def failure(self) -> ProcessException:
        assert self._failure is not None
        return self._failure

    def changed(self, rank: Rank) -> None:
        """(A loop callback) ``rank`` changed: record the first failure, wake the waiters."""
        if self._failure is None:
            self._failure = rank.failure()
        self._wake.set()

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()``: checked after each change of a rank, and every
        SESSION_CHECK seconds whether Ray's session still runs (see :meth:`_session_lost`)."""
        while True:
            self._wake.clear()
            if done():
                return
            with anyio.move_on_after(SESSION_CHECK):
                await self._wake.wait()
            if not self._connected():
                self._session_lost()

    def _session_lost(self) -> None:
        """``ray.shutdown()`` under the job: no ref of it will settle. Every rank not done
        is reported gone, its output ended; nothing of Ray's is called again."""
        if self._job is None:
            return
        self._job = None
        self._started_ray = False  # gone: a session opened since is not the job's
        for r in self._ranks:
            r.lost("Ray was shut down (ray.shutdown()) while the job ran")
            self.changed(r)

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        raise RuntimeError(
            "the ranks of aiomp.ray.spawn are Ray actors, not multiprocessing processes: "
            "ctx.actors() says where each runs, ctx.pids() their process ids"
        )

    def pids(self) -> list[int]:
        """Each rank's process id, on its node."""
        return [r.pid if r.pid is not None else -1 for r in self._ranks]

    def actors(self) -> list[RankInfo]:
        """Where each rank runs: its actor, node and process id."""
        return [RankInfo(r.rank, r.actor_id, r.node_id, r.address, r.pid) for r in self._ranks]

    def _first_failure(self) -> ProcessException | None:
        return self._failure

    def _finish(self) -> bool:
        if self._results is None and all(
            r.outcome is not None and r.outcome[0] == "ok" for r in self._ranks
        ):
            self._results = [r.outcome[1] for r in self._ranks if r.outcome is not None]
        return self._results is not None

    def _settled(self) -> bool:
        return self._failure is not None or all(r.outcome is not None for r in self._ranks)

    async def _watch_all(self) -> None:
        await self.wait_for(self._settled)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for every rank to finish: True once all have returned (their output
        forwarded, their actors gone and the placement group removed), or False if
        ``timeout`` seconds pass first. On the first failure the others are stopped (see
        :meth:`terminate`) and it is raised. On cancellation every rank is stopped first."""
        try:
            async with self._lock:
                if self._failure is None and not self._finish():
                    with anyio.move_on_after(timeout):
                        await self._watch_all()
        except BaseException:
            await self.terminate()
            raise
        if self._failure is not None:
            await self.terminate()
            raise self._failure
        if self._finish():
            await self._close_output()
            return True
        return False

    async def terminate(self, grace_period: float | None = None) -> None:
        """Stop every rank still running: an ``async def`` fn is cancelled inside its actor,
        and after ``grace_period`` seconds every actor is killed (``ray.kill``); then the
        job's resources are released (see :meth:`release`). Shielded and bounded: about
        ``grace_period + 2 * CONFIRM`` seconds at most."""
        grace = self.grace_period if grace_period is None else grace_period
        with anyio.CancelScope(shield=True):
            if self._connected():
                for r in self._ranks:
                    r.cancel()
                with anyio.move_on_after(grace):
                    await self.wait_for(lambda: all(r.outcome is not None for r in self._ranks))
            await self._close_output(now=True)

    async def _close_output(self, now: bool = False) -> None:
        """What the ranks wrote, forwarded (waiting at most LINGER s, none with ``now``),
        then :meth:`release`."""
        with anyio.CancelScope(shield=True):
            if not now and not self._released:
                with anyio.move_on_after(LINGER):
                    await self.wait_for(lambda: all(r.output_done for r in self._ranks))
            await self.release()

    def _connected(self) -> bool:
        """The job's Ray session still runs (never starts one: Ray's calls would)."""
        ray = self._ray
        try:
            return (
                self._job is not None
                and bool(ray.is_initialized())
                and ray.get_runtime_context().get_job_id() == self._job
            )
        except Exception:  # noqa: BLE001 - disconnected between the two
            return False

    async def release(self) -> None:
        """Kill every actor, wait until Ray says each is gone (at most CONFIRM s), remove
        the placement group, shut down a Ray session the job started. Once; shielded."""
        if self._released:
            return
        self._released = True
        with anyio.CancelScope(shield=True):
            ray = self._ray
            if self._connected():
                for r in self._ranks:
                    r.kill(ray)
                with anyio.move_on_after(CONFIRM):
                    await self.wait_for(lambda: all(r.gone for r in self._ranks))
                await anyio.to_thread.run_sync(_remove_group, ray, self._pg)
            else:
                self._session_lost()
            for r in self._ranks:  # no callback of theirs comes any more
                r.end_output()
            if self._started_ray:
                self._started_ray = False
                await anyio.to_thread.run_sync(_session.shutdown_ray, ray)


def _remove_group(ray: Any, pg: Any) -> None:
    try:
        ray.util.remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - removed already (or Ray's session ended)
        pass


for _cls in (RayProcessContext, ActorExitedException, RankInfo):
    _cls.__module__ = "aiomp.ray"
