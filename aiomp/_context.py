"""spawn / start_processes / ProcessContext: start, sentinel-driven join, terminate.

Each child is owned by one :class:`_Child`, which owns its OS resources: the
``multiprocessing`` process, a pidfd (exit notification and race-free signals) and the
parent end of its control socket. Exactly one task waits on each of those fds at a time;
every other task waiting for the same thing waits on an :class:`anyio.Event` that the
waiter sets (one waiter per process, fanning out).

Nothing here polls or uses threads: a child's exit is its pidfd becoming readable on the
event loop; its result or error is a datagram on its control socket. The error is sent
before the child's interpreter shuts down, so it reaches the parent within milliseconds.

Termination (on a failure, an exception in the ``async with`` body or cancellation) is one
primitive, :func:`terminate_all`, which the Pool uses for its workers too: SIGTERM to every
live child, ``grace_period`` seconds, SIGKILL to the survivors (each signal logged as torch
logs it), then reap. Once started nothing breaks it: a second cancellation or Ctrl-C only
cuts the grace period short (SIGKILL at once). It is bounded: a child that survives SIGKILL
for :data:`KILL_TIMEOUT` seconds (uninterruptible sleep) is reported and left to init.
Interpreter exit never waits on a child aiomp started: :func:`_kill_at_exit` SIGKILLs and
reaps the ones still running before multiprocessing's own exit hook would join them.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from . import _child, _output, _reduction, _transport
from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    exit_description,
)

log = logging.getLogger("aiomp")

START_METHODS = ("spawn", "forkserver", "fork")
#: Seconds to wait for a SIGKILLed child to vanish before giving up on it.
KILL_TIMEOUT = 5.0


def check_start_method(start_method: str) -> None:
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
            f"not {start_method!r}"
        )


def check_function(fn: object, start_method: str, what: str = "fn") -> bool:
    """Validate a function children will run; return whether it is a coroutine function.

    Raises ``TypeError`` for a non-callable or a coroutine object, and
    ``pickle.PicklingError`` when spawn/forkserver children could not import it.
    """
    if inspect.iscoroutine(fn):
        fn.close()
        raise TypeError(
            f"{what} must be a function, not a coroutine object: pass the async function "
            "itself (aiomp calls it in the child)"
        )
    if not callable(fn):
        raise TypeError(f"{what} must be callable, not {type(fn).__name__}")
    if start_method != "fork":
        if getattr(fn, "__module__", None) == "__main__" and not _main_importable():
            raise pickle.PicklingError(
                f"{what}={fn!r} is defined in an interactive __main__ (a notebook, a REPL, "
                f"`python -c` or a script read from stdin), which {start_method} children "
                "cannot import: move it into a module, or use start_method='fork'"
            )
        try:
            _reduction.dumps(fn).discard()  # a trial: undo what it promised
        except Exception as exc:
            raise pickle.PicklingError(
                f"{what}={fn!r} cannot be pickled for start_method={start_method!r} ({exc}); "
                "define it at module level (not a lambda or a local function), "
                "or use start_method='fork'"
            ) from exc
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def _main_importable() -> bool:
    """Whether spawn/forkserver children can import ``__main__``: it was run by module
    name (``python -m``) or from a file. A notebook, a REPL and ``python -c`` have no
    file; ``python -`` names ``<stdin>``, which a child cannot read again."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


@contextlib.contextmanager
def _unreadable_main_hidden() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that children cannot read while one is started.

    multiprocessing's spawn and forkserver children (and the fork server itself) re-run
    the parent's main script from its path. For ``python -`` that path is ``<stdin>``:
    they die before running anything. Without the path they skip the main module, as
    they do for ``python -c``; functions defined there are refused up front anyway
    (:func:`check_function`)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (
        main is None
        or getattr(main, "__spec__", None) is not None
        or not isinstance(path, str)
        or os.path.isfile(path)
    ):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def check_not_bootstrapping() -> None:
    """Stop a spawn child that is re-running its parent's unguarded main module.

    A spawn child imports the parent's ``__main__`` before it runs anything; a script
    without an ``if __name__ == "__main__":`` guard starts aiomp processes again right
    there. multiprocessing would refuse with a long traceback in every child (and the
    parent would see only "exit code 1"); instead the child reports one line to its
    parent and exits. See :func:`aiomp._child.refuse_unguarded_main`.
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        _child.refuse_unguarded_main()


def check_fork_safe() -> None:
    """R14: refuse fork with CUDA initialised; warn when other threads are running."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        from . import _cuda

        if _cuda.cuda_initialized():
            raise RuntimeError(
                "cannot fork: CUDA is initialised in this process and a forked child "
                "cannot use it; use start_method='spawn' or 'forkserver'"
            )
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        warnings.warn(
            f"start_method='fork' with {len(others)} other thread(s) running "
            f"({', '.join(others[:3])}): a lock held by one of them stays locked forever "
            "in the child; prefer 'spawn' or 'forkserver'",
            RuntimeWarning,
            stacklevel=4,
        )


class _Child:
    """One child process and the fds aiomp holds for it. Owned by a ProcessContext."""

    def __init__(
        self,
        rank: int,
        process: multiprocessing.process.BaseProcess,
        sock: socket.socket,
        start_method: str,
        report: bool = True,
        output: _output.Forwarder | None = None,
    ) -> None:
        self.rank = rank
        self.output = output  # its stdout/stderr, forwarded; closed once it has exited
        # report: the socket carries one final report that poll_message reads. A Pool
        # worker's socket carries a stream of messages its owner reads instead.
        self.report = report
        self.process = process
        self.sock: socket.socket | None = sock
        self.pid: int = process.pid  # type: ignore[assignment]
        self.pidfd = os.pidfd_open(self.pid)
        # forkserver children are not ours to reap: their status arrives on the sentinel.
        self.exit_fd = process.sentinel if start_method == "forkserver" else self.pidfd
        self.outcome: tuple[str, object] | None = None  # ("ok", value) / ("err", exc)
        self.exitcode: int | None = None
        self._exit_waiter: anyio.Event | None = None
        self._msg_waiter: anyio.Event | None = None
        self.sent_term = self.sent_kill = False  # each signal is sent (and logged) once
        _running.add(self)

    # -- exit -----------------------------------------------------------------------
    @property
    def exited(self) -> bool:
        return self.exitcode is not None

    def poll_exit(self) -> bool:
        if self.exitcode is None:
            code = self.process.exitcode  # non-blocking waitpid / sentinel read
            if code is not None:
                self.exitcode = code
                _running.discard(self)
                if self.output is not None:
                    self.output.close()  # forwards what it wrote last
                self.poll_message()
                self._release()
                if code != 0:
                    sweep_shared_memory()
        return self.exitcode is not None

    async def wait_exit(self) -> None:
        """Wait until the child has exited and been reaped. One waiter; the rest fan out."""
        while not self.poll_exit():
            waiter = self._exit_waiter
            if waiter is not None:
                await waiter.wait()
                continue
            self._exit_waiter = waiter = anyio.Event()
            try:
                await anyio.wait_readable(self.exit_fd)
            finally:
                self._exit_waiter = None
                waiter.set()
                if self.exitcode is not None:
                    self._release()  # deferred while we were waiting on the pidfd

    def signal(self, sig: int) -> None:
        if self.exitcode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM it, logged as torch logs it; once (concurrent terminations share it).

        A child that has already sent its report is on its way out: it is signalled
        too, in case it hangs on exit, but not logged as a survivor.
        """
        if not (self.sent_term or self.sent_kill or self.poll_exit()):
            self.sent_term = True
            if self.outcome is None:
                log.warning("Terminating process %d via signal SIGTERM", self.pid)
            self.signal(signal.SIGTERM)

    def kill(self, why: str = "") -> None:
        """SIGKILL it (logged once); safe to call again or after it has exited."""
        if not (self.sent_kill or self.poll_exit()):
            self.sent_kill = True
            log.warning("Terminating process %d via signal SIGKILL%s", self.pid, why)
            self.signal(signal.SIGKILL)

    def _release(self) -> None:
        # A task still waiting on an fd releases it when it wakes (wait_exit, wait_message):
        # closing an fd under its waiter would leave that waiter asleep forever.
        if self.sock is not None and self._msg_waiter is None:
            self.sock.close()
            self.sock = None
        if self.pidfd >= 0 and self._exit_waiter is None:
            os.close(self.pidfd)
            self.pidfd = -1

    # -- messages -------------------------------------------------------------------
    def poll_message(self) -> None:
        """Read the child's report if it is there (never waits)."""
        if self.outcome is not None or self.sock is None or not self.report:
            return
        try:
            got = _transport.try_recv(self.sock)
        except _transport.Closed as exc:
            # A child that exits with our message unread makes the kernel report
            # ECONNRESET once, ahead of what it sent: its report may still be queued.
            got = None
            if isinstance(exc.__cause__, ConnectionResetError):
                try:
                    got = _transport.try_recv(self.sock)
                except (_transport.Closed, OSError):
                    pass
            if got is None:
                self.sock.close()
                self.sock = None
                return
        except OSError as exc:
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) sent a report that could not be "
                    f"received: {exc}",
                    self.rank,
                    self.pid,
                ),
            )
            return
        if got is None:
            return
        try:
            _, body, fds = _transport.decode(*got)
            msg: Any = _reduction.loads(body, fds)
        except Exception as exc:  # noqa: BLE001 - reported as the child's failure
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) returned a value that could not be "
                    f"unpickled in the parent: {exc!r}",
                    self.rank,
                    self.pid,
                ),
            )
            return
        if msg[0] == "ok":
            self.outcome = ("ok", msg[1])
        else:
            self.outcome = (
                "err",
                ProcessRaisedException(
                    f"process {self.rank} (pid {self.pid}) raised:\n\n{msg[1].rstrip()}",
                    self.rank,
                    self.pid,
                ),
            )

    async def wait_message(self) -> None:
        """Wait until the child's report has arrived or its socket has closed."""
        while self.outcome is None and self.sock is not None:
            self.poll_message()
            if self.outcome is not None or self.sock is None:
                return
            waiter = self._msg_waiter
            if waiter is not None:
                await waiter.wait()
                continue
            self._msg_waiter = waiter = anyio.Event()
            try:
                await anyio.wait_readable(self.sock)
            finally:
                self._msg_waiter = None
                waiter.set()
                if self.exitcode is not None:
                    self.poll_message()
                    self._release()

    def failure(self) -> ProcessException | None:
        """The failure this child stands for, if any, as soon as it is known."""
        if self.outcome is not None and self.outcome[0] == "err":
            return self.outcome[1]  # type: ignore[return-value]
        if self.exitcode is not None and self.exitcode != 0:
            what, name = exit_description(self.exitcode)
            return ProcessExitedException(
                f"process {self.rank} {what}", self.rank, self.pid, self.exitcode, name
            )
        return None

    async def watch(self, on_failure: Callable[[], None]) -> None:
        """Return once the child has exited; call ``on_failure`` as soon as it fails."""

        async def messages() -> None:
            await self.wait_message()
            if self.failure() is not None:
                on_failure()

        async with anyio.create_task_group() as tg:
            tg.start_soon(messages)
            await self.wait_exit()
            tg.cancel_scope.cancel()
        if self.failure() is not None:
            on_failure()


def sweep_shared_memory() -> None:
    """A child that died abnormally may have left named segments (``file_system``
    strategy): remove those whose creator is dead and that nobody holds (R5)."""
    try:
        if any(n.startswith("aiomp-") for n in os.listdir("/dev/shm")):
            from . import _shm

            _shm.janitor()
    except OSError:
        pass


class ProcessContext:
    """The processes started by :func:`spawn`: join them, read results, terminate them."""

    def __init__(self, children: list[_Child], grace_period: float) -> None:
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

    async def _watch_all(self) -> None:
        """Return once every child has exited, or as soon as one has failed."""
        async with anyio.create_task_group() as tg:

            def failed() -> None:
                self._first_failure()
                tg.cancel_scope.cancel()

            for c in self._children:
                if not c.exited:
                    tg.start_soon(c.watch, failed)

    async def join(self, timeout: float | None = None) -> bool:
        """Wait for every process to exit successfully: True, or False if ``timeout`` passes.

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

        ``grace_period=0`` SIGKILLs at once. Once started it cannot be broken (see
        :func:`terminate_all`): a cancellation or KeyboardInterrupt that arrives meanwhile
        cuts the grace period short (SIGKILL now), and is re-raised once every process has
        been reaped. Bounded: about ``grace_period + KILL_TIMEOUT`` seconds at most.
        """
        grace = self.grace_period if grace_period is None else grace_period
        await terminate_all(self._children, grace)


async def terminate_all(children: Sequence[_Child], grace: float) -> None:
    """Terminate ``children`` for good: SIGTERM each live one, wait up to ``grace`` seconds
    for them to exit, SIGKILL the survivors, and reap them all.

    aiomp's one kill path (spawn's contexts and the Pool's workers). Once started, it
    always ends with every child reaped or SIGKILLed, whatever arrives meanwhile:

    * it runs shielded from anyio and trio cancel scopes;
    * an interruption that gets through a shield (a native asyncio ``Task.cancel()``, as
      ``asyncio.run`` sends on Ctrl-C and again when it shuts down; a KeyboardInterrupt,
      which trio raises inside the wait and asyncio may raise anywhere) ends the grace
      period at once: the survivors get SIGKILL and are reaped, and then the first
      interruption is re-raised. A second Ctrl-C means "now", never "leave them running".

    ``grace <= 0`` means "now": SIGKILL without a SIGTERM first.

    Bounded: it returns (or re-raises) within about ``grace + KILL_TIMEOUT`` seconds. A
    child that outlives SIGKILL by :data:`KILL_TIMEOUT` (uninterruptible sleep) is logged
    and left to the kernel.
    """
    _protect_from_trio_ki()
    live = [c for c in children if not c.poll_exit()]
    if grace > 0:
        for c in live:
            c.terminate()
    interrupted: BaseException | None = None
    deadline = time.monotonic() + grace
    killing = False
    try:
        with anyio.CancelScope(shield=True):
            while survivors := [c for c in live if not c.poll_exit()]:
                now = time.monotonic()
                if not killing and (interrupted is not None or now >= deadline):
                    killing, deadline = True, now + KILL_TIMEOUT
                    why = " (interrupted)" if interrupted is not None else ""
                    for c in survivors:
                        c.kill(why)
                elif killing and now >= deadline:
                    log.error(
                        "aiomp: pids %s survived SIGKILL for %s s (uninterruptible sleep?)",
                        [c.pid for c in survivors],
                        KILL_TIMEOUT,
                    )
                    break
                try:
                    await _wait_all(survivors, deadline - now)
                except (KeyboardInterrupt, anyio.get_cancelled_exc_class()) as exc:
                    interrupted = interrupted or exc
    except BaseException:
        for c in live:  # an unexpected error (or an interruption between our awaits)
            c.kill(" (interrupted)")
        raise
    if interrupted is not None:
        raise interrupted


async def _wait_all(children: Sequence[_Child], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every child to exit; return whether all did.

    One at a time: each must exit anyway, and no task group stands in the kill path.
    """
    with anyio.move_on_after(timeout):
        for c in children:
            await c.wait_exit()
    return all(c.exited for c in children)


_ki_protected = False


def _protect_from_trio_ki() -> None:
    """Under trio, let a KeyboardInterrupt reach the kill path only at its awaits.

    trio raises KeyboardInterrupt at once in code it does not protect, which could be
    anywhere between two awaits of :func:`terminate_all`; protected code gets it at its
    next wait instead, where terminate_all turns it into "SIGKILL now". Only when trio is
    already imported: aiomp never imports it.
    """
    global _ki_protected
    trio = sys.modules.get("trio")
    if trio is not None and not _ki_protected:
        _ki_protected = True
        for fn in (
            terminate_all,
            _wait_all,
            _Child.wait_exit,
            _Child.poll_exit,
            _Child.kill,
            _Child.terminate,
        ):
            trio.lowlevel.enable_ki_protection(fn)


#: Every child aiomp started that has not been seen to exit (removed by poll_exit).
_running: set[_Child] = set()


def _kill_at_exit() -> None:
    """At interpreter exit, SIGKILL and reap the children still running.

    multiprocessing's own exit hook joins every non-daemon child (and SIGTERMs and joins
    daemon ones) with no timeout: a child that ignores SIGTERM, or whose termination a
    second Ctrl-C cut short, would hang the exit forever. Registered after that hook, so
    it runs first (atexit is last-in, first-out). The children would die with us anyway
    (the parent-death signal), so this only makes that happen before the join, not after.
    """
    live = [c for c in list(_running) if c.exitcode is None and c.process.exitcode is None]
    if not live:
        return
    log.warning(
        "aiomp: %d child process(es) still running at interpreter exit: killing pids %s",
        len(live),
        [c.pid for c in live],
    )
    for c in live:
        c.kill(" (interpreter exit)")
    deadline = time.monotonic() + KILL_TIMEOUT
    for c in live:
        c.process.join(max(0.0, deadline - time.monotonic()))


multiprocessing.util  # noqa: B018 - imported above so that its exit hook is registered first
atexit.register(_kill_at_exit)


# -- starting ----------------------------------------------------------------------


async def start_children(
    fn: object,
    nprocs: int,
    args: tuple[object, ...],
    start_method: str,
    daemon: bool,
    grace_period: float,
    output: _output.Output = "prefix",
) -> ProcessContext:
    check_not_bootstrapping()
    _output.check_output(output)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, not {nprocs!r}")
    check_start_method(start_method)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, not {type(args).__name__}")
    is_async = check_function(fn, start_method)
    if start_method == "fork":
        check_fork_safe()
    # Pickle once, before any process starts: an unpicklable argument raises here.
    payload = _reduction.dumps((None if start_method == "fork" else fn, args, is_async))
    children: list[_Child] = []
    try:
        datagram, fds = payload.datagram()
        if start_method == "forkserver":
            await prepare_forkserver()
        for rank in range(nprocs):
            target_fn = fn if start_method == "fork" else None
            fw = None if output == "inherit" else _output.Forwarder(rank, output)
            children.append(
                launch(_child.main, rank, start_method, daemon, extra=(target_fn,), output=fw)
            )
        for _ in children[1:]:
            payload.sent_again()  # one message, sent to every child
        for c in children:
            assert c.sock is not None
            try:
                await _transport.send_async(c.sock, datagram, fds)
            except _transport.Closed:
                pass  # it died already; join reports how
    except BaseException:
        await terminate_all(children, 0)  # not started yet: nothing to wait for
        raise
    finally:
        payload.close()
    return ProcessContext(children, grace_period)


async def prepare_forkserver() -> None:
    """Start the fork server off the event loop (its first start waits for an interpreter)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        forkserver.ensure_running()  # already up: a non-blocking liveness check
    else:
        with _unreadable_main_hidden():
            await anyio.to_thread.run_sync(forkserver.ensure_running)


def launch(
    target: Callable[..., object],
    rank: int,
    start_method: str,
    daemon: bool,
    extra: tuple[object, ...] = (),
    name: str | None = None,
    report: bool = True,
    stream: bool = False,
    output: _output.Forwarder | None = None,
) -> _Child:
    """Start one process running ``target(rank, control_socket, parent_pid, *extra)``.

    The control socket is a datagram socket pair, or a stream pair with ``stream`` (a
    Pool worker's channel). With ``output``, the target also gets
    ``output=(stdout_end, stderr_end)`` as a keyword, to hand to
    :func:`aiomp._child.redirect_output` first thing; the returned child owns the
    forwarder from then on (and it is closed here if the start fails). Returns at once
    (the child boots concurrently). Call :func:`prepare_forkserver` first for
    ``"forkserver"``. Must run on the event loop's thread, in a task.
    """
    check_not_bootstrapping()
    mp: Any = multiprocessing.get_context(start_method)
    pair = _transport.stream_socketpair if stream else _transport.socketpair
    parent_sock, child_sock = pair()
    try:
        proc = mp.Process(
            target=target,
            args=(rank, child_sock, os.getpid(), *extra),
            kwargs={} if output is None else {"output": output.child_ends()},
            daemon=daemon,
            name=name or f"aiomp-{rank}",
        )
        with _unreadable_main_hidden():
            proc.start()
        if output is not None:
            output.start()
    except BaseException:
        parent_sock.close()
        if output is not None:
            output.close()
        raise
    finally:
        child_sock.close()
    return _Child(rank, proc, parent_sock, start_method, report, output)


class SpawnHandle:
    """What :func:`spawn` returns: await it for a ProcessContext, or use ``async with``.

    ``async with`` supervises the children while the body runs: the first failure
    terminates the others and cancels the body, and leaving the block raises that failure.
    Leaving normally joins every process. Leaving by an exception or a cancellation
    terminates them (SIGTERM, the grace period, SIGKILL), reaps them and re-raises.
    """

    def __init__(
        self,
        fn: object,
        nprocs: int,
        args: tuple[object, ...],
        start_method: str,
        daemon: bool,
        grace_period: float,
        output: _output.Output,
    ) -> None:
        self._params = (fn, nprocs, args, start_method, daemon, grace_period, output)
        self._ctx: ProcessContext | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def __await__(self) -> Generator[Any, None, ProcessContext]:
        return self._start().__await__()

    async def _start(self) -> ProcessContext:
        # The same frame depth as __aenter__, so that a warning's stacklevel points at the
        # caller's line for `await spawn(...)` as it does for `async with spawn(...)`.
        return await start_children(*self._params)

    async def __aenter__(self) -> ProcessContext:
        ctx = self._ctx = await start_children(*self._params)
        tg = self._tg = anyio.create_task_group()
        await tg.__aenter__()
        tg.start_soon(self._supervise, ctx, tg.cancel_scope)
        return ctx

    @staticmethod
    async def _supervise(ctx: ProcessContext, body: anyio.CancelScope) -> None:
        await ctx._watch_all()
        if ctx._first_failure() is not None:
            await ctx.terminate()
            body.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        ctx, tg = self._ctx, self._tg
        assert ctx is not None and tg is not None
        swallowed = clean = False
        try:
            swallowed = await exit_task_group(tg, exc)
            if exc is None:
                await ctx.join()
            clean = exc is None
        finally:
            # Any way out but a clean join (the body raised, a child failed, or we were
            # cancelled while waiting for the children) terminates and reaps them.
            if not clean or ctx._failure is not None:
                await ctx.terminate()
        if ctx._failure is not None and (exc is None or swallowed):
            raise ctx._failure
        return False


async def exit_task_group(tg: anyio.abc.TaskGroup, exc: BaseException | None) -> bool:
    """Leave ``tg`` with ``exc``, what the body of an ``async with`` raised (or None).

    trio's nursery wraps what the body raised in a group of its own (another layer when
    the body raised a group itself, e.g. a KeyboardInterrupt in the user's nursery): when
    it holds nothing else, the body's exception leaves the block as it was raised, and
    this returns False. A group that adds other errors (our own tasks': bugs) is raised.
    """
    try:
        return bool(
            await tg.__aexit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        )
    except BaseExceptionGroup as group:
        if exc is None or list(_leaves(group)) != list(_leaves(exc)):
            raise
        return False


def _leaves(exc: BaseException) -> Generator[BaseException, None, None]:
    """The exceptions inside ``exc``, however deeply grouped; ``exc`` itself if not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _leaves(e)
    else:
        yield exc


def spawn(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    *,
    args: tuple[object, ...] = (),
    start_method: str = "spawn",
    daemon: bool = False,
    grace_period: float = 5.0,
    output: _output.Output = "prefix",
) -> SpawnHandle:
    """Start ``nprocs`` processes running ``fn(i, *args)``; ``i`` is the rank.

    ``await aiomp.spawn(...)`` returns a started :class:`ProcessContext`;
    ``async with aiomp.spawn(...) as ctx:`` supervises them (see :class:`SpawnHandle`).
    ``fn`` may be an ``async def`` function: the child runs it on a fresh event loop
    (uvloop when installed). Numpy arrays in ``args`` travel through shared memory.

    Raises ``ValueError`` for an unknown ``start_method`` or ``nprocs < 1``, and
    ``TypeError`` / ``pickle.PicklingError`` for an ``fn`` children could not run, before
    any process starts. Starting never blocks the event loop.

    ``output``: ``"prefix"`` (the default) forwards each line a child writes to its
    fd 1 or 2 to this process's ``sys.stdout`` / ``sys.stderr`` as ``[rank N] line``,
    read on the event loop (see ``aiomp._output``); ``"inherit"`` leaves the children
    the raw fds; a callable ``(rank, stream, line)`` receives each line instead.
    """
    return SpawnHandle(fn, nprocs, args, start_method, daemon, grace_period, output)


def start_processes(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    *,
    args: tuple[object, ...] = (),
    start_method: str = "spawn",
    daemon: bool = False,
    grace_period: float = 5.0,
    output: _output.Output = "prefix",
) -> SpawnHandle:
    """The torch-compatible name of :func:`spawn`."""
    return SpawnHandle(fn, nprocs, args, start_method, daemon, grace_period, output)


for _obj in (ProcessContext, spawn, start_processes):
    _obj.__module__ = "aiomp"  # printed and pickled under the public name
