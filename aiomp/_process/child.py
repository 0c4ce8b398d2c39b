"""One child process: start it, wait for its exit, signal it, reap it, terminate it.

The process toolkit under :func:`aiomp.spawn` (``_context``) and the Pool (``_handle``,
``_pool``). A :class:`Child` owns one ``multiprocessing`` process and its pidfd (exit
notification and race-free signals); :func:`launch` starts one, handing it the child's
end of a channel its caller made (spawn's report socket, a Pool worker's stream).
Exactly one task waits on a child's exit fd at a time; the others wait for it
(:class:`aiomp._loop.fdwait.FdWaiters`); spawn's children override :meth:`Child.wait_exit` to
wait through their spawn's one epoll set (see
docs/decisions/0018-one-waiter-per-spawn.md). Nothing here polls or uses threads: an exit is the
pidfd becoming readable on the event loop.

Termination is one primitive, :func:`terminate_all`: SIGTERM to every live child,
``grace`` seconds, SIGKILL to the survivors (each signal logged as torch logs it), then
reap (see docs/decisions/0021-termination.md). It is
bounded: a child that survives SIGKILL for :data:`KILL_TIMEOUT` seconds (uninterruptible
sleep) is reported and left to init. Interpreter exit never waits on a child aiomp
started: :func:`_kill_at_exit` SIGKILLs and reaps the ones still running before
multiprocessing's own exit hook would join them.

Other layers hang their checks on process events without this module knowing them
(``_shm``'s sweep of a failed child's names, ``_cuda``'s fork check): see
docs/decisions/0016-process-hooks.md.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.util
import operator
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, SupportsIndex, TypeVar

import anyio

from .. import _lifecycle
from .._child import bootstrap as _child
from .._loop.waiters import FdWaiters
from .._output import forwarder as _output
from .._wire import pickling as _reduction
from . import groups as _groups

log = logging.getLogger("aiomp")

START_METHODS = ("spawn", "forkserver", "fork")
#: Seconds to wait for a SIGKILLed child to vanish before giving up on it.
KILL_TIMEOUT = 5.0


def count(name: str, value: object) -> int:
    """``value`` as an int >= 1 (anything with ``__index__``, a numpy integer too, but not a
    bool): ``TypeError`` for another type, as Python's pools raise, ``ValueError`` below 1."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{name} must be an int >= 1, not {type(value).__name__} ({value!r})")
    n = operator.index(value)
    if n < 1:
        raise ValueError(f"{name} must be an int >= 1, not {value!r}")
    return n


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
def unreadable_main_hidden() -> Iterator[None]:
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
    parent and exits. See :func:`aiomp._child.bootstrap.refuse_unguarded_main`.
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        _child.refuse_unguarded_main()


def check_fork_safe() -> None:
    """Refuse fork when a hook says so (``_cuda``: CUDA initialised); warn when other
    threads are running. See docs/decisions/0016-process-hooks.md."""
    _reduction.init_reductions()  # the aiomp module of each library imported: its hooks
    for check in _lifecycle.fork_checks():
        check()
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        warnings.warn(
            f"start_method='fork' with {len(others)} other thread(s) running "
            f"({', '.join(others[:3])}): a lock held by one of them stays locked forever "
            "in the child; prefer 'spawn' or 'forkserver'",
            RuntimeWarning,
            stacklevel=4,
        )


#: ``waitid`` flags that ask whether a child has exited without reaping it.
_EXITED_NOWAIT = os.WEXITED | os.WNOHANG | os.WNOWAIT


class Child:
    """One child process and the pidfd aiomp holds for it (see the module docstring).

    Subclasses add what their channel carries: :meth:`_exited` runs once, when the exit
    is first seen and before the fds are released, and :meth:`finished` says whether the
    child said it was done (a SIGTERM to it is then not logged as one to a survivor).
    """

    def __init__(
        self,
        rank: int,
        process: multiprocessing.process.BaseProcess,
        start_method: str,
        output: _output.Forwarder | None = None,
    ) -> None:
        self.rank = rank
        # Its stdout/stderr, forwarded until they end (after its exit: its own children
        # may hold them) or its spawn or pool closes them (``_output.close_all``).
        self.output = output
        self.process = process
        self.pid: int = process.pid  # type: ignore[assignment]
        # forkserver children are not ours to reap: their status arrives on the sentinel.
        self._via_server = start_method == "forkserver"
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            if not self._via_server:
                raise  # our own child stays a zombie until we reap it: cannot happen
            # It ran and exited already, and the fork server reaped it (a child with its
            # payload in its start needs nobody): nothing left to signal; its status
            # waits on the sentinel.
            self.pidfd = -1
        self.exit_fd = process.sentinel if self._via_server else self.pidfd
        self.exitcode: int | None = None
        self.waiters = FdWaiters()
        self.sent_term = self.sent_kill = False  # each signal is sent (and logged) once
        _running.add(self)
        _groups.register(self.pid, self.pidfd)  # for the keeper, should we die first

    @property
    def exited(self) -> bool:
        return self.exitcode is not None

    def finished(self) -> bool:
        return False

    def _exited(self) -> None:
        pass

    def poll_exit(self, ready: bool = False) -> bool:
        """Whether it has exited (reaping it if it just has, and killing what is left of
        its process group: every path that learns of an exit comes here); never waits.

        ``ready``: the caller has just seen :attr:`exit_fd` readable, so the child has
        exited: it is reaped without asking first (see
        docs/decisions/0018-one-waiter-per-spawn.md).
        """
        if self.exitcode is None:
            code = self._server_status(ready) if self._via_server else self._reap(ready)
            if code is not None:
                self.exitcode = code
                _running.discard(self)
                if self.output is not None:
                    # What it wrote last is queued; its own children may write on.
                    self.output.child_exited()
                self._exited()
                self._release()
                if code != 0:
                    _lifecycle.failed_exit()
        return self.exitcode is not None

    def _reap(self, exited: bool) -> int | None:
        """Our own child's exit status, reaping it; None while it runs. ``exited``: its
        pidfd was just seen readable. What is left of its group is killed first, while
        its zombie keeps the group's number its own (see :meth:`_end_group`)."""
        if not (exited or self._exited_unreaped()):
            return None
        self._end_group()
        return self.process.exitcode  # (a non-blocking waitpid: it has exited)

    def _exited_unreaped(self) -> bool:
        """Whether our own child has exited (leaving it to be reaped)."""
        try:
            return os.waitid(os.P_PIDFD, self.pidfd, _EXITED_NOWAIT) is not None
        except ChildProcessError:
            return True  # reaped already (multiprocessing reaps as it starts a process)

    def _server_status(self, ready: bool) -> int | None:
        """A forkserver child's exit status, once the server has sent it (it reaped the
        child); its group is killed then (exact through the pidfd, which holds the
        group's pid object)."""
        code = self._read_server_status() if ready else self.process.exitcode
        if code is not None:
            self._end_group()
        return code

    def _end_group(self) -> None:
        """The child has exited: SIGKILL whatever is left in the group it led (a function
        that returned, a worker retired or crashed leaves nothing running), and tell
        the keeper it is done. See ``aiomp._process.groups``."""
        _groups.signal_group(self.pidfd, self.pid, signal.SIGKILL, by_number=True)
        _groups.unregister(self.pid)

    def _read_server_status(self) -> int:
        """The exit status the fork server wrote on the sentinel, which is readable.

        What multiprocessing's ``Popen.poll`` does once its selector has said so, without
        the selector; the status is stored where ``Popen.poll`` finds it, so
        ``process.exitcode`` agrees. A sentinel at EOF (the server died) reads as 255,
        as there.
        """
        popen: Any = self.process._popen  # type: ignore[attr-defined]
        if popen.returncode is None:  # not read already by another path
            from multiprocessing import forkserver

            try:
                popen.returncode = forkserver.read_signed(self.exit_fd)
            except (OSError, EOFError):
                popen.returncode = 255
        code: int = popen.returncode
        return code

    async def wait_exit(self) -> None:
        """Wait until the child has exited and been reaped. Cancellation leaves it as it
        was (another waiter takes over the pidfd)."""
        while not self.poll_exit():
            try:
                await self.waiters.wait(self.exit_fd)
            finally:
                if self.exitcode is not None:
                    self._release()  # deferred while we were waiting on the pidfd

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child and to the process group it leads: whatever it
        started goes with it (see ``aiomp._process.groups``).

        The group is signalled once, the child with it; the child alone where its group
        is not made yet (it is still starting). A SIGKILL also goes to the child itself,
        in case it has left its group.
        """
        if self.exitcode is None and self.pidfd >= 0:
            grouped = _groups.signal_group(self.pidfd, self.pid, sig, self._unreaped())
            if not grouped or sig == signal.SIGKILL:
                try:
                    signal.pidfd_send_signal(self.pidfd, sig)
                except ProcessLookupError:
                    pass

    def _unreaped(self) -> bool:
        """Whether its pid (the number of the group it leads) is still its own: we have
        not reaped it or, for a forkserver child (the server reaps it), it runs now."""
        if self._via_server:
            poller = select.poll()  # (not select(): pidfds above 1023 are common enough)
            poller.register(self.pidfd, select.POLLIN)
            return not poller.poll(0)
        popen: Any = self.process._popen  # type: ignore[attr-defined]
        return popen.returncode is None

    def terminate(self) -> None:
        """SIGTERM it, logged as torch logs it; once (concurrent terminations share it).

        A child that has said it is done is on its way out: it is signalled too, in case
        it hangs on exit, but not logged as a survivor.
        """
        if not (self.sent_term or self.sent_kill or self.poll_exit()):
            self.sent_term = True
            if not self.finished():
                log.warning("Terminating process %d via signal SIGTERM", self.pid)
            self.signal(signal.SIGTERM)

    def kill(self, why: str = "") -> None:
        """SIGKILL it (logged once); safe to call again or after it has exited."""
        if not (self.sent_kill or self.poll_exit()):
            self.sent_kill = True
            log.warning("Terminating process %d via signal SIGKILL%s", self.pid, why)
            self.signal(signal.SIGKILL)

    def _release(self) -> None:
        # A task still waiting on an fd releases it when it wakes (wait_exit): closing an
        # fd under its waiter would leave that waiter asleep forever.
        if self.pidfd >= 0 and not self.waiters.waiting(self.exit_fd):
            os.close(self.pidfd)
            self.pidfd = -1


async def terminate_all(children: Sequence[Child], grace: float) -> None:
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


async def _wait_all(children: Sequence[Child], timeout: float) -> bool:
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
            Child.wait_exit,
            Child.poll_exit,
            Child.kill,
            Child.terminate,
        ):
            trio.lowlevel.enable_ki_protection(fn)


#: Every child aiomp started that has not been seen to exit (removed by poll_exit).
_running: set[Child] = set()


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


_FORKSERVER_PRELOAD = ("multiprocessing.popen_forkserver", "_ctypes", "aiomp._pool.worker_main")


async def prepare_forkserver() -> None:
    """Start the fork server off the event loop (its first start waits for an interpreter)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        forkserver.ensure_running()  # already up: a non-blocking liveness check
    else:
        # The server imports once what every aiomp child needs (``_worker`` imports
        # ``_child``; unpickling the sockets a child is given imports popen_forkserver;
        # arming the parent-death signal loads ``_ctypes``, a dlopen of libffi),
        # so that the children it forks start with it loaded; see
        # docs/decisions/0017-spawn-start-up.md. The user's preloads stay.
        preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
        ours = [m for m in _FORKSERVER_PRELOAD if m not in preload]
        if server is not None and ours:
            server.set_forkserver_preload([*preload, *ours])
        with unreadable_main_hidden():
            await anyio.to_thread.run_sync(forkserver.ensure_running)


C = TypeVar("C", bound=Child)


def launch(
    make: Callable[[int, multiprocessing.process.BaseProcess, str, _output.Forwarder | None], C],
    target: Callable[..., object],
    rank: int,
    start_method: str,
    daemon: bool,
    channel: socket.socket,
    *,
    extra: tuple[object, ...] = (),
    name: str | None = None,
    output: _output.Forwarder | None = None,
) -> C:
    """Start one process running ``target(rank, channel, parent_pid, *extra)``; return
    ``make(rank, process, start_method, output)`` (:class:`Child` or a subclass).

    ``channel`` is the child's end of a socket pair the caller made and keeps the other
    end of; it is closed here, started or not. With ``output``, the target also gets
    ``output=(stdout_end, stderr_end, ...)`` as a keyword, to hand to
    :func:`aiomp._child.bootstrap.begin`; the returned child owns the forwarder from then on (and
    it is closed here if the start fails). Returns at once (the child boots
    concurrently). Call :func:`prepare_forkserver` first for ``"forkserver"``. Must run
    on the event loop's thread, in a task.
    """
    check_not_bootstrapping()
    # Up before the child runs, so that registering it (``Child``) is one message.
    _groups.start_keeper()
    mp: Any = multiprocessing.get_context(start_method)
    try:
        proc = mp.Process(
            target=target,
            args=(rank, channel, os.getpid(), *extra),
            kwargs={} if output is None else {"output": output.child_ends()},
            daemon=daemon,
            name=name or f"aiomp-{rank}",
        )
        with unreadable_main_hidden():
            proc.start()
        if output is not None:
            output.start()
    except BaseException:
        if output is not None:
            output.close()
        raise
    finally:
        channel.close()
    try:
        return make(rank, proc, start_method, output)
    except BaseException:  # no pidfd (EMFILE): nothing may own a process nobody watches
        proc.kill()
        proc.join()
        if output is not None:
            output.close()
        raise
