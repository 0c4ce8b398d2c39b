"""Process groups: what a child starts ends with it, and the keeper that sees to it when
the parent dies.

Every child aiomp starts leads a process group of its own, made before any of the
caller's code runs (``_child.begin``), which holds whatever it starts (``subprocess``,
``os.fork``, ``multiprocessing``, a shell's pipeline) unless that leaves it (``setsid``).
The group ends with the child:

* while the parent lives, the parent kills it: with the child on every path that kills
  the child (``_process.Child.signal``), and when it sees the child's exit, before the
  reap (``Child.poll_exit``): a function that returned, a worker retired, a crash;
* when the parent dies (its SIGKILL included), the *keeper* does: one process per aiomp
  parent, started with its first child (:func:`register`), that is neither the parent's
  child nor, without a terminal, in its process group or session. It holds a pidfd of
  the parent and one of each child registered, and when the parent exits it SIGKILLs
  each registered child's group (the children die of their parent-death signal at the
  same moment), then exits.

A group is signalled through its leader's pidfd (:func:`signal_group`). In a terminal the
keeper stands in the parent's (foreground) group and passes the terminal's signals on to
the children's groups, which a Ctrl-C would not reach any more (:data:`PASSED_ON`).

The keeper is this module run by ``python -I -S`` (:data:`_KEEPER_MAIN`, :func:`keep`):
it imports only the standard library, and no ``site``.
"""

from __future__ import annotations

import _thread
import array
import atexit
import errno
import os
import select
import signal
import socket
import sys

#: ``pidfd_send_signal``'s flag (Linux 6.9) to signal the process group the pidfd's
#: process leads. The kernel finds that group by its pid object, not by its number, so
#: a number reused since cannot be hit, and it finds it after the leader's reap too.
#: Cleared where the kernel refuses it (EINVAL).
PIDFD_SIGNAL_PROCESS_GROUP = 4
pidfd_groups = True

#: What a terminal (Ctrl-C, Ctrl-\, Ctrl-Z, a hang-up) or a job kill sends to the process
#: group of the program in the foreground: a keeper that stands in that group passes
#: them on to the children's groups, as if the children were still in it.
PASSED_ON = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGCONT,
    signal.SIGHUP,
    signal.SIGTERM,
)

#: The keeper's end of its socket, in the keeper.
KEEPER_FD = 3
#: Milliseconds between the keeper's reads of its socket while messages come (a socket
#: holds some 280; the parent queues the rest), doubling up to IDLE_MS while none come.
DRAIN_MS, IDLE_MS = 50, 2000


def signal_group(pidfd: int, leader: int, sig: int, by_number: bool) -> bool:
    """Send ``sig`` to the process group ``leader`` leads (through its ``pidfd``); return
    whether any process got it (False: there is no such group, or nobody left in it).

    Where the kernel cannot signal a group through a pidfd (before Linux 6.9), or there
    is no pidfd (-1), the group is signalled by number, and only when ``by_number`` says
    that number is still the group's: the caller holds the leader unreaped, has just
    seen it alive, or has just seen it exit (a number stays taken while any process of
    its group lives: the kernel never hands out a pid still in use as a group id; when
    none lives there is nothing to signal, and ESRCH unless the pid numbers have gone
    round since).
    """
    global pidfd_groups
    if pidfd_groups and pidfd >= 0:
        try:
            signal.pidfd_send_signal(pidfd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
            return True
        except ProcessLookupError:
            return False
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return False  # (EPERM: nobody in it is ours to signal)
            pidfd_groups = False
    if not by_number:
        return False
    try:
        os.killpg(leader, sig)
    except OSError:  # ESRCH: no group (yet, or any more); EPERM: nobody ours in it
        return False
    return True


# -- the parent's side --------------------------------------------------------------------

_lock = _thread.allocate_lock()  # (starting a keeper; held a few milliseconds, once)
#: This process's end of its keeper's socket; None: none started (or none could be).
_sock: socket.socket | None = None
#: The keeper's end of that socket while its process is deferred (:func:`start_keeper`).
_unstarted: socket.socket | None = None
#: The children registered: pid -> pidfd, borrowed from its ``Child`` until unregistered.
_registered: dict[int, int] = {}
#: Messages the socket had no room for (a stopped keeper): sent before the next one.
_pending: list[tuple[bytes, int]] = []


def register(pid: int, pidfd: int) -> None:
    """Have the keeper SIGKILL the group of child ``pid`` (led by it: ``pidfd``) if this
    process dies first; starts the keeper with the first child. The pidfd stays the
    caller's, and open until :func:`unregister`. Never blocks (but for the keeper's start,
    about a millisecond once) and never raises: without a keeper the children's groups
    are still killed while this process lives."""
    if pidfd < 0:
        return
    _registered[pid] = pidfd
    _send(b"+%d" % pid, pidfd)


def unregister(pid: int) -> None:
    """The child ``pid`` has exited and its group was killed: the keeper forgets it."""
    if _registered.pop(pid, None) is not None and not _unqueue(b"+%d" % pid):
        _send(b"-%d" % pid, -1)


def _send(data: bytes, fd: int) -> None:
    if _shells:
        _reap_shells()
    sock = _sock or _restart(data)
    if sock is None:
        return
    try:
        _flush(sock)
        _deliver(sock, data, fd)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            return  # (ETOOMANYREFS) this one is lost: the parent still kills it
        _log("the keeper process has gone; starting another")
        _forget()
        _restart(b"")


def _restart(data: bytes) -> socket.socket | None:
    """Start a keeper; tell it each child registered but the one ``data`` adds (next)."""
    sock = start_keeper()
    try:
        for pid, pidfd in list(_registered.items()):
            if sock is not None and b"+%d" % pid != data:
                _deliver(sock, b"+%d" % pid, pidfd)
    except OSError:
        pass
    return sock


def _deliver(sock: socket.socket, data: bytes, fd: int) -> None:
    """Send one message after those queued; queue it where the socket has no room (a
    stopped keeper, or one still starting that many children's messages fill up):
    sent before the next message. Raises OSError where it cannot be sent."""
    if not _pending:
        try:
            _send_now(sock, data, fd)
            return
        except BlockingIOError:
            pass
    try:
        _pending.append((data, os.dup(fd) if fd >= 0 else -1))
    except OSError:
        pass  # (EMFILE) this one is lost: the others are kept


def _unqueue(data: bytes) -> bool:
    """Take ``data`` back if it is still queued (whether it was): a child that exits
    while its ``+pid`` waits for room must not keep a pidfd open here, one per child,
    for as long as the keeper is stopped."""
    for i, (queued, fd) in enumerate(_pending):
        if queued == data:
            del _pending[i]
            if fd >= 0:
                os.close(fd)
            return True
    return False


def _send_now(sock: socket.socket, data: bytes, fd: int) -> None:
    """Send one message, with ``fd`` (-1: none). (Not ``socket.send_fds``: before Python
    3.13 it drops its flags, and would block, or end us by a SIGPIPE.)"""
    fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd >= 0 else []
    sock.sendmsg([data], fds, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)


def _flush(sock: socket.socket) -> None:
    """Send what was queued, in order, while there is room. Raises OSError where the
    keeper has gone; a message it cannot take otherwise (ETOOMANYREFS) is dropped, so
    that it does not hold up every one after it."""
    while _pending:
        data, fd = _pending[0]
        try:
            _send_now(sock, data, fd)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                raise
        _pending.pop(0)
        if fd >= 0:
            os.close(fd)


def start_keeper(defer: bool = False) -> socket.socket | None:
    """Start this process's keeper; return our end of its socket (None: it could not be
    started, which is logged once).

    The keeper must not be our child (a task's ``os.wait()`` until ECHILD would never
    get there; in a subreaper parent an exited keeper would stay a zombie) and, without
    a terminal, must be out of our process group and session (a ``kill -9 -PGID`` must
    not take it with us): ``/bin/sh`` runs it in the background and exits at once, which
    leaves it to init (posix_spawn: no fork of this process, which may run threads). That
    shell is not waited for (it is reaped at a later message): the first child starts
    beside it. The signals it passes on are blocked until it has its handlers: none is
    lost or ends it meanwhile. Where it cannot start (no ``/bin/sh``, a pids limit), the
    next child tries again: a shell that failed shows as a keeper gone at the next message.

    With ``defer``, only the socket is made: what is registered waits in it until
    :func:`start_deferred_keeper` (``run_sync``'s first worker: decision 0048).
    """
    global _sock, _unstarted
    if _sock is not None:
        return _sock
    with _lock:
        if _sock is not None:
            return _sock
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:
            _log(f"no keeper process ({exc}): {_WITHOUT}", once=True)
            return None
        try:
            me = os.pidfd_open(os.getpid())
            try:
                _send_now(ours, b"P", me)  # the first message: who to watch
            finally:
                os.close(me)
            if not defer:
                _spawn(theirs, stand_in=_is_foreground(os.getpgrp()))
        except OSError as exc:
            ours.close()
            theirs.close()
            _log(f"no keeper process ({exc}): {_WITHOUT}", once=True)
            return None
        _sock, _unstarted = ours, (theirs if defer else None)
        if not defer:
            theirs.close()
        return ours


def start_deferred_keeper() -> None:
    """Start the keeper's process :func:`start_keeper` deferred, if any. Where it cannot
    start, the next child starts one, which learns every child registered."""
    global _unstarted
    with _lock:
        theirs, _unstarted = _unstarted, None
        if theirs is None:
            return
        try:  # (the shell holds the keeper's end from its start)
            _spawn(theirs, stand_in=_is_foreground(os.getpgrp()))
        except OSError as exc:
            _log(f"no keeper process ({exc}): {_WITHOUT}", once=True)
            _forget()
            return
        finally:
            theirs.close()


_WITHOUT = (
    "a child's own processes outlive it if this process is killed (tried again with the next child)"
)
_warned = False


def _log(text: str, once: bool = False) -> None:
    global _warned
    if not (once and _warned):
        _warned = _warned or once
        import logging

        logging.getLogger("aiomp").warning("aiomp: %s", text)


#: The keeper's interpreter imports this file (as ``groups``: its bytecode is cached, where
#: a script's is compiled at every start) and runs :func:`keep`; argv: this file's path, and
#: ``stand-in`` or ``session``.
_KEEPER_MAIN = (
    "import os, sys; sys.path.append(os.path.dirname(sys.argv[1])); import groups; "
    "groups.keep(sys.argv[2] == 'stand-in')"
)


def _spawn(end: socket.socket, stand_in: bool) -> None:
    """posix_spawn ``sh -c '"$@" &' ... python -I -S -c <_KEEPER_MAIN>`` with ``end`` on
    :data:`KEEPER_FD` and /dev/null on 0-2 (it must not hold the parent's output open:
    whoever reads it waits for its end), in a session of its own unless ``stand_in``.
    The shell is not waited for: it holds ``end`` from its start, and a keeper it fails
    to start is found gone at the next message (decision 0090). Raises OSError where it
    did not start."""
    fd = end.fileno()
    src = os.dup(fd) if fd == KEEPER_FD else fd  # (dup2 onto itself would keep CLOEXEC)
    try:
        actions = [
            (os.POSIX_SPAWN_DUP2, src, KEEPER_FD),
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        argv = ["sh", "-c", '"$@" &', "aiomp-keeper", sys.executable, "-I", "-S"]
        argv += ["-c", _KEEPER_MAIN, __file__]
        shell = os.posix_spawn(
            "/bin/sh",
            [*argv, "stand-in" if stand_in else "session"],
            os.environ,
            file_actions=actions,
            setsid=not stand_in,
            setsigmask=PASSED_ON,
        )
    finally:
        if src != fd:
            os.close(src)
    _reap_shells()
    # It forks and exits at once, but a shell under a pids limit may retry its fork with
    # sleeps (bash: 1, 2, 4, 8 s): never waited for on the loop's thread.
    try:
        _shells.append(os.pidfd_open(shell))
    except ProcessLookupError:  # reaped by a SIGCHLD handler that reaps every child
        pass


#: pidfds of the shells that started keepers: reaped at a later message once exited.
_shells: list[int] = []


def _reap_shells() -> None:
    """Reap the shells that have exited since (a failed one shows as a keeper gone)."""
    ready = select.poll()
    for fd in _shells:
        ready.register(fd, select.POLLIN)
    done = {fd for fd, _ in ready.poll(0)}
    for fd in done:
        try:
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # reaped by a SIGCHLD handler that reaps every child
            pass
        os.close(fd)
    _shells[:] = [fd for fd in _shells if fd not in done]


def _is_foreground(pgid: int) -> bool:
    """Whether ``pgid`` is the foreground process group of our controlling terminal."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # no controlling terminal
    try:
        return os.tcgetpgrp(fd) == pgid
    except OSError:
        return False
    finally:
        os.close(fd)


def _forget() -> None:
    """Let go of the keeper's socket and of what was queued for it: in a fork of this
    process (the keeper is not its keeper: it starts its own with its first child), or
    once the keeper has gone."""
    global _sock, _unstarted
    if _sock is not None:
        _sock.close()
        _sock = None
    if _unstarted is not None:
        _unstarted.close()
        _unstarted = None
    for _, fd in _pending:
        if fd >= 0:
            os.close(fd)
    _pending.clear()


def _forget_in_fork() -> None:
    global _lock
    _forget()
    _registered.clear()  # (their pidfds are the parent's children's, not ours to close)
    for fd in _shells:  # (the parent's shells: not ours to reap)
        os.close(fd)
    _shells.clear()
    # Another thread of the parent may have held it (starting the keeper) at the fork:
    # it would stay held here, and our own first child would wait for it forever.
    _lock = _thread.allocate_lock()


# A fork of this process (a child started by "fork", a user's os.fork) lets go of the
# socket at once: only this process may hold it, so that its end is this process's end
# for the keeper too. (It is close-on-exec for the processes that exec.)
os.register_at_fork(after_in_child=_forget_in_fork)
# At exit, after ``_process`` has killed and reaped the children still running (its exit
# hook is registered later, so it runs first): the keeper sees the end now, and the
# socket is not left to the garbage collector (a ResourceWarning).
atexit.register(_forget)


# -- the keeper ---------------------------------------------------------------------------


def keep(stand_in: bool) -> None:
    """The keeper's life: learn the parent (its pidfd, the first message) and the
    children (``+pid`` with a pidfd, ``-pid``) on :data:`KEEPER_FD`; when the parent exits
    (its pidfd is readable, or the socket ends), SIGKILL every registered group; exit.

    ``stand_in``: it stands in the parent's group, the terminal's foreground group, and
    passes :data:`PASSED_ON` on to every registered group. Otherwise it has a session of
    its own and ignores them. It ignores every other signal (but SIGKILL and SIGSTOP):
    one sent to the whole group it stands in must not end it before the parent.
    """
    sock = socket.socket(fileno=KEEPER_FD)
    groups: dict[int, int] = {}
    parent: list[int] = []
    taken = [0]  # messages read so far

    def read() -> bool:
        """Take every message waiting; False at the end (the parent has gone)."""
        while True:
            try:
                data, fds = _receive(sock)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            taken[0] += 1
            if data == b"P":
                parent.extend(fds)
                continue
            pid = int(data[1:])
            old = groups.pop(pid, -1)
            if old >= 0:
                os.close(old)
            if data[:1] == b"+" and fds:  # (none: we are out of fds; the parent kills it)
                groups[pid] = fds[0]

    def pass_on(sig: int, _: object) -> None:
        read()
        for pid, pidfd in list(groups.items()):
            signal_group(pidfd, pid, sig, by_number=True)

    for sig in PASSED_ON:
        signal.signal(sig, pass_on if stand_in else signal.SIG_IGN)
    _ignore_the_rest()
    with open("/proc/self/comm", "w") as comm:
        comm.write("aiomp-keeper")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    # Not woken by each message (a wake-up per child start and exit, on the parent's
    # path: decision 0090): it reads them every DRAIN_MS to IDLE_MS, and all before it kills.
    poller = select.poll()
    poller.register(sock, 0)  # (POLLHUP and POLLERR only: the parent's end closed)
    alive = read()  # (the parent's pidfd was sent before the keeper started)
    for fd in parent:
        poller.register(fd, select.POLLIN)
    wait = DRAIN_MS
    while alive:
        ready = poller.poll(wait)  # (a signal passed on interrupts it; PEP 475 resumes it)
        before = taken[0]
        alive = read() and not ready
        wait = DRAIN_MS if taken[0] != before else min(wait * 2, IDLE_MS)
    for pid, pidfd in groups.items():
        # The children die of their parent-death signal now: by number too, while
        # whoever is left in a group keeps its number taken.
        signal_group(pidfd, pid, signal.SIGKILL, by_number=True)


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the fds it carries, without waiting (BlockingIOError: none)."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(64, socket.CMSG_LEN(fds.itemsize), socket.MSG_DONTWAIT)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _ignore_the_rest() -> None:
    """The keeper ignores every signal it does not pass on: one sent to the whole group
    it stands in (the parent's: a ``os.killpg(0, SIGUSR1)``, or the terminal's) must not
    end it before the parent, or the children's groups outlive the parent."""
    for sig in signal.valid_signals():
        if sig in PASSED_ON or sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # pragma: no cover - one the C library reserves
            pass
