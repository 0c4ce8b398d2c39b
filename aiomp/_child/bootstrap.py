"""What every child aiomp starts runs first (spawn's children and the Pool's workers).

:func:`begin`: the parent's sockets as fd 1 and 2 (``_child.output``), the signals a fork
inherited reset, the async library's fork marks cleared, the parent-death signal armed
(``PR_SET_PDEATHSIG``; a forkserver child lets go of the fork server, its real parent,
so that the server exits with our parent), a last check that the parent still lives,
and a process group of its own, which ends with it. Also here: :func:`exit_fast`, and
the refusal to start children while a spawn child re-runs its parent's unguarded main
module (:func:`check_not_bootstrapping`, registered with ``_lifecycle`` as a start
check). Owns nothing; standard library and [child] modules only.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from .. import _lifecycle
from .._lifecycle import pid_alive
from .._loop.forked import forget_async_library
from .._process import mp_private
from .._process.start import Start
from .output import redirect_output
from .placement import enter
from .report import report_error
from .seeds import reseed

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """``prctl(PR_SET_PDEATHSIG, sig)``, via ``_ctypes`` (a fifth of the cost of ctypes).

    Also lets go of the fork server (:func:`release_forkserver`), without which a
    forkserver child's death signal would not follow our parent's death.
    """
    release_forkserver()
    try:
        import _ctypes

        handle = _ctypes.dlopen(None)  # type: ignore[arg-type]
        func = _ctypes.dlsym(handle, "prctl")
        _ctypes.call_function(func, (_PR_SET_PDEATHSIG, int(sig)))
    except (ImportError, AttributeError, OSError):  # pragma: no cover - non-CPython
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))


def release_forkserver() -> None:
    """Close the fd by which this process keeps multiprocessing's fork server alive.

    The fork server exits when every holder of its "alive" pipe's write end has gone, and
    multiprocessing hands that end to each child it forks (a fork child inherits it too).
    Held here, it would keep the server running after our parent died, and a forkserver
    child's death signal watches the server, its real parent: no SIGKILL would come (R8).
    """
    fd = mp_private.take_forkserver_alive_fd()
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def begin(start: Start) -> None:
    """What every child aiomp starts does first (spawn's and the Pool's workers).

    Applies its env and records who it is (``_child.placement``); takes over fd 1 and 2
    when the parent forwards them, undoes what a fork inherited from the parent's loop,
    arms the parent-death signal and then, closing the race with a parent that died
    before it was armed, exits (status 1) if the parent has gone. Then, before any of the
    caller's code can start a process, it leads a process group of its own
    (:func:`lead_own_group`); last, a forked child reseeds the global generators.
    """
    enter(start.who, start.env)
    if start.output is not None:
        redirect_output(start.output)
    reset_signals()
    forget_async_library()
    set_parent_death_signal()
    # Reparented to init: our parent died (a forkserver child's parent is the server,
    # which exits with our parent once release_forkserver has let go of it).
    if not pid_alive(start.parent_pid) or os.getppid() == 1:
        os._exit(1)
    lead_own_group()
    if start.seed is not None:
        reseed(start.seed)


def lead_own_group() -> None:
    """Lead a process group of our own: every process this one starts (``subprocess``,
    ``os.fork``, ``multiprocessing``, a shell's pipeline) joins it, unless it makes a
    session or group of its own (``setsid``, ``start_new_session=True``, a daemon): those
    escape. The parent kills the group with this process and when it sees its exit; its
    keeper, when the parent dies (see ``aiomp._process.groups``)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - only a session leader cannot: not our child
        pass


def reset_signals() -> None:
    """Undo what a forked child inherits from its parent's event loop.

    Under ``fork`` a child keeps the parent's Python-level signal handlers and its
    ``set_wakeup_fd`` pipe: SIGTERM would then be swallowed (every terminate would wait
    out the grace period) and written into the *parent's* loop. Back to the defaults.
    """
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_fast() -> None:
    """Exit now, status 0, without tearing the interpreter down (a spawn child's teardown
    costs tens of milliseconds, for nothing: the parent has its report).

    Does first what a normal exit does for others: multiprocessing's exit hook (its
    finalizers, joining this process's own children), every ``atexit`` function (logging's
    flush among them) and a flush of stdout and stderr. Returns instead, and the child
    exits the usual way, while a non-daemon thread runs: a normal exit waits for it.
    """
    threading = sys.modules.get("threading")
    if threading is not None and any(
        not t.daemon for t in threading.enumerate() if t is not threading.current_thread()
    ):
        return
    mp_private.run_exit_functions()  # multiprocessing's _exit_function is one of them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


#: The exit status of a child refused by :func:`refuse_unguarded_main`: rare (no Python
#: or multiprocessing path exits with it), so that a Pool whose workers keep dying with
#: it can name the missing guard in its BrokenPoolError.
UNGUARDED_EXIT = 86

UNGUARDED_MAIN = (
    "this child re-ran the parent's main module while starting, and that module starts "
    "aiomp processes when imported: protect the entry point with "
    '`if __name__ == "__main__":` (spawn and forkserver children import the main '
    "module; only the guard keeps them from running the program again)"
)


def refuse_unguarded_main() -> None:
    """Report :data:`UNGUARDED_MAIN` to the parent and exit at once (status
    :data:`UNGUARDED_EXIT`).

    Called in a spawn child that is still importing its parent's ``__main__``, before
    multiprocessing has handed it its control socket: the socket is found among the
    inherited fds as the unix seqpacket socket whose peer is the parent. A Pool worker
    (stream channel) or a child without one prints the line on stderr instead.
    """
    sock = _inherited_report_socket()
    if sock is not None:
        report_error(sock, RuntimeError(UNGUARDED_MAIN), "", traceback=False)
        sock.close()
    else:
        os.write(2, f"aiomp: {UNGUARDED_MAIN}\n".encode())
    os._exit(UNGUARDED_EXIT)


def _inherited_report_socket() -> socket.socket | None:
    import struct

    ppid = os.getppid()
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if (
                sock.family == socket.AF_UNIX
                and sock.type == socket.SOCK_SEQPACKET
                and struct.unpack("3i", cred)[0] == ppid
            ):
                return sock
        except OSError:
            pass
        sock.close()
    return None


def check_not_bootstrapping() -> None:
    """Stop a spawn child that is re-running its parent's unguarded main module.

    A spawn child imports the parent's ``__main__`` before it runs anything; a script
    without an ``if __name__ == "__main__":`` guard starts aiomp processes again right
    there. multiprocessing would refuse with a long traceback in every child (and the
    parent would see only "exit code 1"); instead the child reports one line to its
    parent and exits (:func:`refuse_unguarded_main`). Run before every start of a child
    (a ``_lifecycle`` start check).
    """
    if mp_private.inheriting():
        refuse_unguarded_main()


_lifecycle.on_start_check(check_not_bootstrapping)
