"""The child side of :func:`aiomp.spawn`: the target of every process aiomp starts.

The child:

1. asks the kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``; a forkserver
   child's parent is the fork server, which it lets exit with our process), then checks
   that the parent has not already gone; then becomes the leader of a process group of
   its own, which a keeper process kills when the child dies (:func:`lead_own_group`);
2. receives ``(fn, args, is_async)`` on its control socket (fds for shared arrays and
   queues travel in the same message);
3. runs ``fn(rank, *args)``, on a fresh event loop if it is a coroutine function;
4. sends back ``("ok", result)`` or ``("err", traceback text, exception)`` *before* the
   interpreter shuts down, so a failure reaches the parent at once, then exits (code 1
   after an error). A KeyboardInterrupt or a cancelled coroutine is reported as an error,
   never as success.

Imports only the standard library and aiomp's small modules: asyncio/uvloop for async
functions and numpy when an array arrives are loaded on demand.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from . import _reduction, _transport
from ._lifecycle import pid_alive

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> None:
    """``prctl(option, arg)``, via ``_ctypes`` (a fifth of the cost of ctypes)."""
    try:
        import _ctypes

        handle = _ctypes.dlopen(None)  # type: ignore[arg-type]
        func = _ctypes.dlsym(handle, "prctl")
        _ctypes.call_function(func, (option, arg))
    except (ImportError, AttributeError, OSError):  # pragma: no cover - non-CPython
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, arg)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """``prctl(PR_SET_PDEATHSIG, sig)``.

    Also lets go of the fork server (:func:`release_forkserver`), without which a
    forkserver child's death signal would not follow our parent's death.
    """
    release_forkserver()
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def release_forkserver() -> None:
    """Close the fd by which this process keeps multiprocessing's fork server alive.

    The fork server exits when every holder of its "alive" pipe's write end has gone, and
    multiprocessing hands that end to each child it forks (a fork child inherits it too).
    Held here, it would keep the server running after our parent died, and a forkserver
    child's death signal watches the server, its real parent: no SIGKILL would come (R8).
    """
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
        try:
            os.close(fd)
        except OSError:
            pass


def begin(
    parent_pid: int,
    output: tuple[socket.socket, socket.socket, bool, socket.socket, int] | None,
) -> None:
    """What every child aiomp starts does first (spawn's and the Pool's workers).

    Takes over fd 1 and 2 when the parent forwards them, undoes what a fork inherited
    from the parent's loop, arms the parent-death signal and then, closing the race with
    a parent that died before it was armed, exits (status 1) if the parent has gone.
    Last, before any of the caller's code can start a process, it leads a process group
    of its own (:func:`lead_own_group`).
    """
    if output is not None:
        redirect_output(output)
    reset_signals()
    forget_async_library()
    set_parent_death_signal()
    # Reparented to init: our parent died (a forkserver child's parent is the server,
    # which exits with our parent once release_forkserver has let go of it).
    if not pid_alive(parent_pid) or os.getppid() == 1:
        os._exit(1)
    lead_own_group()


#: ``pidfd_send_signal``'s flag (Linux 6.9) to signal the process group the pidfd's
#: process leads. The kernel finds that group by its pid object, not by its number, so
#: a number reused since cannot be hit. Cleared where the kernel refuses it (EINVAL).
PIDFD_SIGNAL_PROCESS_GROUP = 4
pidfd_groups = True

#: What a terminal (Ctrl-C, Ctrl-\, Ctrl-Z, a hang-up) or a job kill sends to the process
#: group of the program in the foreground: a keeper that stands in that group passes
#: them on to its child's group, as if the child were still in it.
PASSED_ON = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGCONT,
    signal.SIGHUP,
    signal.SIGTERM,
)


def signal_group(pidfd: int, leader: int, sig: int, by_number: bool) -> bool:
    """Send ``sig`` to the process group ``leader`` leads (through its ``pidfd``); return
    whether any process got it (False: there is no such group, or nobody left in it).

    Where the kernel cannot signal a group through a pidfd (before Linux 6.9) the group
    is signalled by number, and only when ``by_number`` says that number cannot have been
    reused: the caller still holds the leader unreaped, or has just seen it alive. (A
    number stays taken while any process of its group lives: the kernel never hands out
    a pid still in use as a process group id.)
    """
    global pidfd_groups
    if pidfd_groups:
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


def lead_own_group() -> None:
    """Lead a process group of our own, and fork a keeper that kills it when we die.

    Every process this one starts (``subprocess``, ``os.fork``, ``multiprocessing``, a
    shell's pipeline) joins the group, unless it makes a session or group of its own
    (``setsid``, ``start_new_session=True``, a daemon): those escape. The parent signals
    the group with the child (terminate, kill). What it cannot cover is the child's end
    itself: an exit (a Pool worker retired at close, a spawned function that returned and
    left a process running), a crash, a SIGKILL, or the parent-death signal after the
    parent's SIGKILL. The keeper covers those: a fork of this process, taken before any of
    the caller's code runs, that holds nothing but a pidfd of this process, waits for it
    to exit and then SIGKILLs the group (see :func:`_keep`).

    Leaving the parent's group takes the child out of reach of the terminal's signals
    (only the foreground group gets a Ctrl-C). Where the parent's group is the terminal's
    foreground group, the keeper stands in it instead and passes those signals on
    (:data:`PASSED_ON`); otherwise (no terminal, a background job, a child of a child) it
    stays in this group, out of reach of a SIGKILL aimed at the parent's group.

    Without a keeper (``fork`` failed: a pids limit; no fd left) the child still runs,
    and its group is still signalled with it.
    """
    old = os.getpgrp()
    stand_in = old if _is_foreground(old) else 0
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover - only a session leader cannot: not our child
        return
    me = os.getpid()
    try:
        pidfd = os.pidfd_open(me)
    except OSError:  # out of fds: no keeper (as below)
        return
    # Until the keeper has its place and its handlers, the signals it passes on wait
    # (blocked), so that none is lost or ends it; ours are delivered when we unblock.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    try:
        keeper = os.fork()
        if keeper == 0:
            _keep(pidfd, me, stand_in, mask)
        if stand_in:
            # As a shell does for a job, both sides move it, so that it stands in the
            # foreground group before this process goes on: a Ctrl-C from now on
            # reaches this group through it.
            try:
                os.setpgid(keeper, stand_in)
            except OSError:
                pass  # it has moved itself, or that group has gone with the parent
    except OSError:
        pass
    finally:
        os.close(pidfd)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


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


def _keep(pidfd: int, leader: int, stand_in: int, mask: set[int | signal.Signals]) -> None:
    """The keeper: wait for ``leader`` (``pidfd``) to exit, then SIGKILL its group; exit.

    It closes every other fd first: it must not hold the child's sockets (its parent
    waits for their hang-up), its output (the forwarder reads to end of file) or any of
    the caller's files. ``stand_in``: the terminal's foreground group to stand in and
    pass signals on from; 0: stay in the child's group and ignore them, so that the
    parent's SIGTERM to the group does not end the keeper before the child (every other
    signal it ignores either way). ``mask``:
    the signal mask to restore once its handlers are in place.

    Its last act is safe by number too (before Linux 6.9): it signals after the leader's
    exit, while any survivor in the group keeps the number taken. Never returns.
    """
    try:
        os.closerange(0, pidfd)
        os.closerange(pidfd + 1, os.sysconf("SC_OPEN_MAX"))
        handler: Any = signal.SIG_IGN
        if stand_in:
            try:
                os.setpgid(0, stand_in)
            except OSError:
                pass  # that group has gone, and the parent with it
            else:

                def handler(sig: int, _: object) -> None:
                    signal_group(pidfd, leader, sig, by_number=True)

        for sig in PASSED_ON:
            signal.signal(sig, handler)
        _ignore_the_rest()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _prctl(_PR_SET_NAME, b"aiomp-keeper")
        import select

        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll()  # (a signal passed on interrupts it; PEP 475 resumes it)
        signal_group(pidfd, leader, signal.SIGKILL, by_number=True)
    finally:
        os._exit(0)


def _ignore_the_rest() -> None:
    """The keeper ignores every signal it does not pass on: one sent to the whole group
    it stands in (the child's: a task's ``os.killpg(0, SIGUSR1)`` to poke what it started;
    or the terminal's) must not end it before its child, or the child's group outlives
    the child."""
    for sig in signal.valid_signals():
        if sig in PASSED_ON or sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # pragma: no cover - one the C library reserves
            pass


def run_fn(fn: object, rank_args: tuple[object, ...], is_async: bool) -> object:
    """Call ``fn(*rank_args)``; run a coroutine function on a fresh loop (uvloop if present)."""
    if not is_async:
        result = fn(*rank_args)  # type: ignore[operator]
        if type(result).__name__ != "coroutine":
            return result
        coro = result
    else:
        coro = fn(*rank_args)  # type: ignore[operator]
    with new_runner() as runner:
        return runner.run(coro)


def new_runner() -> asyncio.Runner:
    """An ``asyncio.Runner`` on a fresh event loop: uvloop when installed."""
    import asyncio

    factory: Callable[[], asyncio.AbstractEventLoop]
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    return asyncio.Runner(loop_factory=factory)


def forget_async_library() -> None:
    """A fork of a trio task keeps sniffio's mark that trio runs this thread (and anyio's,
    that asyncio does): clear both, or this child's own event loop would be taken for the
    parent's by anyio and every library that asks sniffio."""
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None:
        sniffio.thread_local.name = None
        sniffio.current_async_library_cvar.set(None)


def reset_signals() -> None:
    """Undo what a forked child inherits from its parent's event loop.

    Under ``fork`` a child keeps the parent's Python-level signal handlers and its
    ``set_wakeup_fd`` pipe: SIGTERM would then be swallowed (every terminate would wait
    out the grace period) and written into the *parent's* loop. Back to the defaults.
    """
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def redirect_output(
    ends: tuple[socket.socket, socket.socket, bool, socket.socket, int],
) -> None:
    """Make fd 1 and fd 2 the given sockets (see ``aiomp._output``).

    ``sys.stdout`` is line-buffered when the third item says so (the parent's stdout is
    a terminal), as it would have been on the inherited fd; ``sys.stderr`` always is.
    The records socket and level are for :func:`forward_logging`, once fn is loaded.
    """
    out, err, line_buffered, _, _ = ends
    for fd, end in ((1, out), (2, err)):
        os.dup2(end.fileno(), fd)
        end.close()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        lines = line_buffered or fd == 2
        try:
            ours = stream.fileno() == fd
        except (AttributeError, OSError, ValueError):
            ours = False
        if ours and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=lines)
        else:
            # A fork child inherits whatever the parent had put there (pytest's capture,
            # an app's redirection), which would not reach the fd.
            mode = 1 if lines else -1
            text = open(fd, "w", buffering=mode, errors="backslashreplace", closefd=False)  # noqa: SIM115
            setattr(sys, name, text)


def forward_logging(sock: socket.socket, level: int) -> None:
    """Send this process's logging records to the parent (``aiomp._output``).

    Only when ``logging`` is already imported (by fn's module; a child that never logs
    does not pay for it), and only as ``logging.lastResort``: the handler Python uses
    when the code configured none, so a function that configures logging itself keeps
    its own. Records below ``level`` (the parent's effective root level) stay here.
    """
    if "logging" not in sys.modules:
        sock.close()
        return
    import logging
    import pickle

    class ToParent(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                d = dict(record.__dict__)
                d["msg"], d["args"] = record.getMessage(), None
                if record.exc_info and not record.exc_text:
                    d["exc_text"] = logging.Formatter().formatException(record.exc_info)
                d["exc_info"] = None
                d.pop("message", None)
                try:
                    data = pickle.dumps(d)
                except Exception:  # noqa: BLE001 - an unpicklable `extra`: the basics go
                    data = pickle.dumps({k: d[k] for k in _RECORD_BASICS if k in d})
                sock.send(data)
            except Exception:  # noqa: BLE001 - as any handler: report, never raise
                self.handleError(record)

    logging.lastResort = ToParent()
    root = logging.getLogger()
    if not root.handlers:
        root.setLevel(level)


_RECORD_BASICS = (
    "name",
    "msg",
    "levelname",
    "levelno",
    "pathname",
    "filename",
    "module",
    "lineno",
    "funcName",
    "created",
    "msecs",
    "relativeCreated",
    "thread",
    "threadName",
    "processName",
    "process",
    "exc_text",
    "stack_info",
)


def main(
    rank: int,
    sock: socket.socket,
    parent_pid: int,
    fn: object = None,
    spawned: bool = False,
    payload: bytes | None = None,
    output: tuple[socket.socket, socket.socket, bool, socket.socket, int] | None = None,
) -> None:
    """Entry point of a child :func:`aiomp.spawn` started (``multiprocessing.Process``
    target). ``spawned``: started by the ``spawn`` method, whose children exit through
    the interpreter's teardown (fork and forkserver children skip it already).
    ``payload``: the datagram of ``(fn, args, is_async)`` when it came with the start;
    None: it arrives on ``sock`` (it holds fds)."""
    begin(parent_pid, output)
    if payload is None:
        got = _transport.recv_sync(sock)
        assert got is not None
    else:
        got = (payload, [])
    _, body, fds = _transport.decode(*got)
    loaded: tuple[object, tuple[object, ...], bool] = _reduction.loads(body, fds)  # type: ignore[assignment]
    payload_fn, args, is_async = loaded
    if fn is None:
        fn = payload_fn
    del got, body, fds, payload, loaded
    if output is not None:
        forward_logging(output[3], output[4])
    try:
        result = run_fn(fn, (rank, *args), is_async)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, cancellation: failures
        report_error(sock, exc)
        sock.close()
        sys.exit(1)
    try:
        out = _reduction.dumps(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        report_error(sock, exc, f"the return value of rank {rank} could not be pickled")
        sock.close()
        sys.exit(1)
    send_message(sock, out)
    # Left open: it closes as this process exits, and that hang-up is when the parent
    # reads the report, with the exit itself (see
    # docs/decisions/0018-one-waiter-per-spawn.md). Detached, so that collecting it neither closes
    # nor warns.
    sock.detach()
    if spawned:
        del result, out
        exit_fast()


def exit_fast() -> None:
    """Exit now, status 0, without tearing the interpreter down; see
    docs/decisions/0017-spawn-start-up.md.

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
    import atexit

    atexit._run_exitfuncs()  # multiprocessing's _exit_function is one of them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


UNGUARDED_MAIN = (
    "this child re-ran the parent's main module while starting, and that module starts "
    "aiomp processes when imported: protect the entry point with "
    '`if __name__ == "__main__":` (spawn and forkserver children import the main '
    "module; only the guard keeps them from running the program again)"
)


def refuse_unguarded_main() -> None:
    """Report :data:`UNGUARDED_MAIN` to the parent and exit at once (status 1).

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
    os._exit(1)


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


def send_message(sock: socket.socket, out: _reduction.Message) -> None:
    try:
        _transport.send_sync(sock, *out.datagram())
    except _transport.Closed:
        pass  # the parent stopped listening: it is terminating us
    finally:
        out.close()


def format_error(exc: BaseException, context: str = "", traceback: bool = True) -> str:
    if traceback:
        import traceback as tb

        text = "".join(tb.format_exception(exc))
    else:
        text = f"{type(exc).__name__}: {exc}\n"
    return f"{context}:\n{text}" if context else text


def report_error(
    sock: socket.socket, exc: BaseException, context: str = "", traceback: bool = True
) -> None:
    """Send ``("err", traceback text, exc or None)``; the text always arrives.

    ``traceback=False`` sends only the exception's one-line summary as the text. Then
    ends the socket's sending side: the parent watches it for that hang-up, which comes
    now, before this process's teardown, even if a grandchild holds a copy of it (see
    docs/decisions/0018-one-waiter-per-spawn.md).
    """
    text = format_error(exc, context, traceback)
    try:
        out = _reduction.dumps(("err", text, exc))
        _reduction.loads(out.body, [])  # the parent must be able to rebuild it
    except BaseException:  # noqa: BLE001 - the text alone still travels
        out = _reduction.dumps(("err", text, None))
    send_message(sock, out)
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the parent is gone, or stopped listening
