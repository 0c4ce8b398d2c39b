"""One child process aiomp started: its pidfd, its exit, its signals, its reaping.

A :class:`Child` owns one ``multiprocessing`` process and its pidfd (exit notification
and race-free signals); :func:`aiomp._process.launch.launch` makes one. Every wait on a
child's exit goes through an :class:`aiomp._loop.fdset.FdSet`: a child alone has a set
of its own; spawn's children share their spawn's, which also watches their report
sockets. Nothing here polls or uses threads: an exit is the exit fd becoming readable on
the event loop, and the child is reaped by whichever path sees it first.

Owns the live-children registry too, and the kill at interpreter exit:
:func:`_kill_at_exit` SIGKILLs and reaps the children still running before
multiprocessing's own exit hook would join them. Other layers hang checks on process
events (``_lifecycle``) without this module knowing them.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import time

from .. import _lifecycle
from .._loop.fdset import FdSet
from .._output.forwarder import Forwarder
from . import groups as _groups
from . import mp_private

log = logging.getLogger("aiomp")

#: Seconds to wait for a SIGKILLed child to vanish before giving up on it.
KILL_TIMEOUT = 5.0
#: A child's exit fd is readable once it has exited.
EXIT_EVENTS = select.EPOLLIN
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
        output: Forwarder | None = None,
        exits: FdSet | None = None,
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
        if not self._via_server:
            # Ours alone to reap, with its rusage: multiprocessing's next start would
            # otherwise reap it first (it polls its list of children).
            mp_private.forget_child(process)
        self.exitcode: int | None = None
        #: Its peak resident set in bytes, once reaped (None: unknown, as for a
        #: forkserver child, which the server reaps).
        self.peak_rss: int | None = None
        #: Its owner terminates it on purpose and logs why itself (a Pool's timeout or
        #: cancellation): its SIGTERM is not logged as one to a survivor of a failure.
        self.expected_kill = False
        #: where every wait on its exit goes (its spawn's, or one of its own)
        self.exits = FdSet() if exits is None else exits
        self.sent_term = self.sent_kill = False  # each signal is sent (and logged) once
        #: This process is a fork of the one that started the child: the child is not
        #: ours (see :func:`_disown_in_fork`).
        self.disowned = False
        _running.add(self)
        _groups.register(self.pid, self.pidfd)  # for the keeper, should we die first
        self.exits.add(self.exit_fd, EXIT_EVENTS, self._exit_ready)

    def _exit_ready(self) -> bool:
        """The exit fd is readable (a loop callback on asyncio): reap it; True while it
        is still to watch (a spurious wake-up)."""
        return not self.poll_exit(ready=True)

    @property
    def exited(self) -> bool:
        """Whether it has exited, or is gone for this process (a fork of its parent)."""
        return self.exitcode is not None or self.disowned

    def finished(self) -> bool:
        return False

    def _exited(self) -> None:
        pass

    def poll_exit(self, ready: bool = False) -> bool:
        """Whether it has exited (reaping it if it just has, and killing what is left of
        its process group: every path that learns of an exit comes here); never waits.

        ``ready``: the caller has just seen :attr:`exit_fd` readable, so the child has
        exited: it is reaped without asking first (one syscall less per exit). A child
        :attr:`disowned` by a fork counts as gone in the fork: it is its parent's to reap.
        """
        if self.disowned:
            return True
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
        code, self.peak_rss = mp_private.reap(self.process)  # (it has exited: no wait)
        return code

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
        code = mp_private.popen_returncode(self.process)
        if code is None:  # not read already by another path
            try:
                code = mp_private.read_server_status(self.exit_fd)
            except (OSError, EOFError):
                code = 255
            mp_private.set_popen_returncode(self.process, code)
        return code

    async def wait_exit(self) -> None:
        """Wait until the child has exited and been reaped (at once in a fork of its
        parent: it is not ours to wait for). Cancellation leaves it as it was."""
        if not self.poll_exit():
            await self.exits.wait(self._reaped)

    def _reaped(self) -> bool:
        return self.exitcode is not None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child and to the process group it leads: whatever it
        started goes with it (see ``aiomp._process.groups``).

        The group is signalled once, the child with it; the child alone where its group
        is not made yet (it is still starting). A SIGKILL also goes to the child itself,
        in case it has left its group.
        """
        if self.exitcode is None and self.pidfd >= 0 and not self.disowned:
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
        return mp_private.popen_returncode(self.process) is None

    def terminate(self) -> None:
        """SIGTERM it, logged as torch logs it; once (concurrent terminations share it).

        A child that has said it is done is on its way out: it is signalled too, in case
        it hangs on exit, but not logged as a survivor; nor is one whose owner kills it
        on purpose (:attr:`expected_kill`: the owner logs why).
        """
        if not (self.sent_term or self.sent_kill or self.poll_exit()):
            self.sent_term = True
            if self.expected_kill:
                log.debug("Terminating process %d via signal SIGTERM", self.pid)
            elif not self.finished():
                log.warning("Terminating process %d via signal SIGTERM", self.pid)
            self.signal(signal.SIGTERM)

    def kill(self, why: str = "", quiet: bool = False) -> None:
        """SIGKILL it (logged once, unless ``quiet``: the kill is not news); safe to call
        again or after it has exited."""
        if not (self.sent_kill or self.poll_exit()):
            self.sent_kill = True
            if not quiet:
                log.warning("Terminating process %d via signal SIGKILL%s", self.pid, why)
            self.signal(signal.SIGKILL)

    def _release(self) -> None:
        """Reaped: forget and close the pidfd and the sentinel, then wake the waiters for
        its exit (it may have been reaped by another path than the watch: terminate_all
        polls)."""
        self.exits.forget(self.exit_fd)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        # The process object's sentinel pipe too: it would otherwise stay open until the
        # object is collected, which a reference cycle through a cancelled task of its
        # owner can put off for many children (``exitcode`` still reads the status).
        mp_private.close_sentinel(self.process)
        self.exits.check()


#: Every child aiomp started that has not been seen to exit (removed by poll_exit).
_running: set[Child] = set()


def _disown_in_fork() -> None:
    """A fork of this process (a user's ``os.fork``, a child started by ``fork``) owns
    none of its parent's children: each counts as gone here, so that nothing in the fork
    signals, waits for, joins or reaps them (its exit hooks, a pool or spawn unwinding
    in it). Their pidfds and exit fds are left open, never closed or unregistered: an
    epoll set the fork shares with the parent must keep watching them there.
    multiprocessing's own list of children is the parent's too (its exit hook would
    join them: "can only join a child process")."""
    for c in _running:
        c.disowned = True
        mp_private.forget_child(c.process)
    _running.clear()


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
    kill_and_reap(live, " (interpreter exit)")


def kill_and_reap(children: list[Child], why: str = "", quiet: bool = False) -> None:
    """SIGKILL ``children`` (:meth:`Child.kill`) and join them, :data:`KILL_TIMEOUT` for
    them all: for exit hooks, where no loop runs."""
    children = [c for c in children if not c.disowned]
    for c in children:
        c.kill(why, quiet)
    deadline = time.monotonic() + KILL_TIMEOUT
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))


multiprocessing.util  # noqa: B018 - imported above so that its exit hook is registered first
atexit.register(_kill_at_exit)
os.register_at_fork(after_in_child=_disown_in_fork)
