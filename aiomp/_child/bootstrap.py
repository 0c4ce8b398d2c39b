"""The child side of :func:`aiomp.spawn`: the target of every process aiomp starts.

The child:

1. asks the kernel to SIGKILL it when its parent dies (``PR_SET_PDEATHSIG``; a forkserver
   child's parent is the fork server, which it lets exit with our process), then checks
   that the parent has not already gone; then becomes the leader of a process group of
   its own, which ends with it (:func:`lead_own_group`);
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

import os
import signal
import socket
import sys

from .._lifecycle import pid_alive
from .._wire import datagram as _transport
from .._wire import pickling as _reduction

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

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
    """Make fd 1 and fd 2 the given sockets (see ``aiomp._output.forwarder``).

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
    """Send this process's logging records to the parent (``aiomp._output.forwarder``).

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
