"""ProcessContext: the processes one :func:`aiomp.spawn` started, to join, read, terminate.

Owns the spawn's children (:class:`~aiomp._spawn.spawned.Spawned`) and the one
:class:`~aiomp._loop.fdset.FdSet` every wait on them goes through (the supervisor's,
``join``'s, termination's), and closes their output forwarders. Termination (on a
failure, an exception in the ``async with`` body or cancellation) is
:func:`aiomp._process.terminate.terminate_all`: SIGTERM, ``grace_period`` seconds,
SIGKILL, reap; once started nothing breaks it, and it is bounded.
"""

from __future__ import annotations

import multiprocessing

import anyio

from .._errors import ProcessException
from .._loop.fdset import FdSet
from .._output import forwarder as _output
from .._process.terminate import terminate_all
from .spawned import Spawned


class ProcessContext:
    """The processes started by :func:`spawn`: join them, read results, terminate them."""

    def __init__(self, children: list[Spawned], exits: FdSet, grace_period: float) -> None:
        self._exits = exits  # every wait on the children: their exits and reports
        self._children = children
        self.grace_period = grace_period
        self._failure: ProcessException | None = None
        self._results: list[object] | None = None
        self._lock = anyio.Lock()

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The ``multiprocessing`` process objects, by rank; ``exitcode`` stays readable."""
        return [c.process for c in self._children]

    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def results(self) -> list[object]:
        """Each rank's return value, once every process has exited successfully."""
        if self._results is None:
            raise RuntimeError("results are available once join() has returned True")
        return self._results

    def _first_failure(self) -> ProcessException | None:
        if self._failure is None:
            for c in self._children:
                exc = c.failure()
                if exc is not None:
                    self._failure = exc
                    break
        return self._failure

    def _finish(self) -> bool:
        if (
            self._results is None
            and all(c.exited for c in self._children)
            and self._first_failure() is None
        ):
            self._results = [c.outcome[1] if c.outcome else None for c in self._children]
        return self._results is not None

    def _settled(self) -> bool:
        return self._first_failure() is not None or all(c.exited for c in self._children)

    async def _watch_all(self) -> None:
        """Return once every child has exited, or as soon as one has failed."""
        await self._exits.wait(self._settled)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for every process to exit successfully: True, or False if ``timeout`` passes.

        It returns once what they wrote before they exited has been forwarded.

        On the first failure the others are terminated (SIGTERM, the grace period, SIGKILL)
        and the failure is raised: a :class:`ProcessRaisedException` or a
        :class:`ProcessExitedException`. Calling it again raises the same failure.

        On cancellation every process is terminated and reaped before the cancellation
        goes on.
        """
        # The lock's acquire is a checkpoint too: a join cancelled there (or in an
        # already-cancelled scope) must terminate the children like one cancelled mid-wait.
        try:
            async with self._lock:
                if self._finish():
                    return True
                if self._first_failure() is None:
                    with anyio.move_on_after(timeout):
                        await self._watch_all()
                        if self._first_failure() is None:
                            # what they wrote before they exited (their own children
                            # may write on: that is forwarded until the context closes)
                            await _output.forwarded(c.output for c in self._children)
        except BaseException:
            await self.terminate()
            raise
        if self._first_failure() is not None:
            await self.terminate()
            assert self._failure is not None
            raise self._failure
        return self._finish()

    async def terminate(self, grace_period: float | None = None) -> None:
        """SIGTERM every live process, wait ``grace_period`` seconds, SIGKILL survivors, reap.

        A process that has reported its error gets no SIGTERM: it is exiting already, and
        finishes on its own (its ``atexit`` functions run; its exit code is its own)
        within the same ``grace_period``, or is SIGKILLed with the survivors.

        ``grace_period=0`` SIGKILLs at once. Once started it cannot be broken (see
        :func:`aiomp._process.terminate.terminate_all`): a cancellation or
        KeyboardInterrupt that arrives meanwhile cuts the grace period short (SIGKILL
        now), and is re-raised once every process has been reaped. Then what they wrote
        is forwarded, streams that their own children still hold get ``_output.LINGER``
        seconds more to end, and the forwarders are closed. Bounded: about
        ``grace_period + KILL_TIMEOUT + LINGER`` seconds, plus the time to forward what
        they left in their socket buffers.
        """
        grace = self.grace_period if grace_period is None else grace_period
        # A child that reported its error is exiting: it finishes on its own (issue 31).
        exiting = [c for c in self._children if c.failure() is not None]
        try:
            await terminate_all(self._children, grace, exiting)
        except BaseException:
            await self._close_output(now=True)
            raise
        await self._close_output()

    async def _close_output(self, now: bool = False) -> None:
        """Close the children's forwarders (see :func:`_output.close_all`): at once with
        ``now``."""
        forwarders = [c.output for c in self._children]
        await _output.close_all(forwarders, 0 if now else _output.LINGER)


ProcessContext.__module__ = "aiomp"  # printed and pickled under the public name
