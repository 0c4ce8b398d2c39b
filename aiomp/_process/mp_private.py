"""Every private name of ``multiprocessing`` and ``atexit`` that aiomp reads or writes.

Owns nothing. Standard library only (children import it). Gathered here so that one unit
test (``tests/spawn/test_mp_private.py``) checks each of them against the running Python and
fails loudly when Python moves one, instead of a caller falling back in silence.
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    import multiprocessing.process
    from typing import Any


def inheriting() -> bool:
    """Whether this process is a spawn child still preparing: importing its parent's
    ``__main__`` before multiprocessing hands it its process object."""
    import multiprocessing.process

    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def popen_returncode(process: multiprocessing.process.BaseProcess) -> int | None:
    """The exit status multiprocessing has read for ``process`` (None: not yet)."""
    code: int | None = process._popen.returncode  # type: ignore[attr-defined]
    return code


def set_popen_returncode(process: multiprocessing.process.BaseProcess, code: int) -> None:
    """Store ``code`` where ``Popen.poll`` finds it, so that ``process.exitcode`` agrees."""
    process._popen.returncode = code  # type: ignore[attr-defined]


def close_sentinel(process: multiprocessing.process.BaseProcess) -> None:
    """Close the sentinel of ``process``, whose exit status multiprocessing has read
    (``process.exitcode`` still answers, from that status): what ``Popen.close`` does."""
    popen = process._popen  # type: ignore[attr-defined]
    if popen is not None and popen.returncode is not None:
        popen.close()


def read_server_status(fd: int) -> int:
    """The exit status a fork server wrote on a child's sentinel ``fd`` (readable)."""
    from multiprocessing import forkserver

    status: int = forkserver.read_signed(fd)
    return status


def forkserver_pid() -> int | None:
    """The running fork server's pid, or None (none started, or module never imported)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:
        return None
    pid: int | None = forkserver._forkserver._forkserver_pid
    return pid


def forkserver_preload() -> list[str] | None:
    """The modules the fork server is to preload (None: no list set)."""
    from multiprocessing import forkserver

    preload: list[str] | None = forkserver._forkserver._preload_modules  # type: ignore[attr-defined]
    return preload


def take_forkserver_alive_fd() -> int | None:
    """Take the fd by which this process keeps the fork server alive (None: none held);
    multiprocessing forgets it, the caller closes it."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:
        return None
    server = forkserver._forkserver
    fd: int | None = server._forkserver_alive_fd
    server._forkserver_alive_fd = None
    return fd


def run_exit_functions() -> None:
    """Run every ``atexit`` function now (multiprocessing's exit hook is one of them)."""
    import atexit

    atexit._run_exitfuncs()


def forget_child(process: multiprocessing.process.BaseProcess) -> None:
    """Take ``process`` off multiprocessing's list of children, which every new
    ``Process.start`` polls (reaping those that have exited): its owner reaps it itself,
    with its rusage (:func:`reap`)."""
    import multiprocessing.process

    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


#: The exit status of a child reaped by someone else (its status is lost).
LOST_STATUS = 255


def reap(process: multiprocessing.process.BaseProcess) -> tuple[int | None, int | None]:
    """Reap our own child ``process`` if it has exited: ``(exit status, peak RSS in
    bytes)``; ``(None, None)`` while it runs. The status is stored where ``Popen.poll``
    finds it, so ``process.exitcode`` agrees. Reaped already (by ``Popen.poll``): its
    status, and no RSS. Reaped by someone else (``os.waitpid`` in the program, as torch's
    tests do with psutil): it has exited, its status is lost: :data:`LOST_STATUS`, as
    multiprocessing reads a fork server's lost status (issue 39 bug 2: waiting for a
    status nobody would give hung the pool's replacement of the worker)."""
    import os

    popen = process._popen  # type: ignore[attr-defined]
    if popen.returncode is not None:
        return popen.returncode, None
    try:
        pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
    except ChildProcessError:  # our own child, not ours to reap: someone else reaped it
        popen.returncode = LOST_STATUS
        return LOST_STATUS, None
    if pid == 0:
        return None, None
    popen.returncode = os.waitstatus_to_exitcode(status)
    return popen.returncode, usage.ru_maxrss * 1024  # (Linux counts it in KiB)


#: The read end of the resource tracker's pipe while its process is deferred
#: (:func:`defer_resource_tracker`), else None.
_tracker_read_end: int | None = None


def defer_resource_tracker() -> None:
    """If multiprocessing's resource tracker is not running, make the pipe it will read
    now and start its process later (:func:`start_deferred_tracker`).

    A spawn start makes multiprocessing start the tracker first (its fd is passed at the
    child's exec), and its interpreter then starts beside the child's and competes with
    it for the CPUs: the first ``run_sync`` waits for that child (decision 0046). With
    the pipe's write end as the tracker's fd, ``getfd()`` finds it alive (its read end
    is open here) and hands it to the child as before; what is sent meanwhile waits in
    the pipe for the tracker."""
    global _tracker_read_end
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker
    with tracker._lock:
        if _tracker_read_end is not None or tracker._fd is not None:
            return
        r, w = os.pipe()
        tracker._fd = w
        _tracker_read_end = r


def start_deferred_tracker() -> None:
    """Start the resource tracker's process deferred by :func:`defer_resource_tracker`
    (nothing if none is), as ``ResourceTracker.ensure_running`` does, on the pipe made
    then. Where it cannot start, the pipe's read end is closed all the same: the next
    ``getfd()`` finds the tracker dead and starts one (with multiprocessing's warning)."""
    global _tracker_read_end
    if _tracker_read_end is None:
        return  # (the common case: nothing deferred, nothing to import)
    from multiprocessing import resource_tracker, spawn, util

    tracker: Any = resource_tracker._resource_tracker
    mp_util: Any = util
    with tracker._lock:
        r, _tracker_read_end = _tracker_read_end, None
        if r is None:
            return
        try:
            fds = [r]
            try:
                fds.insert(0, sys.stderr.fileno())
            except Exception:  # noqa: BLE001 - no stderr: as ensure_running
                pass
            exe = spawn.get_executable()
            args = [exe, *mp_util._args_from_interpreter_flags()]
            args += ["-c", f"from multiprocessing.resource_tracker import main;main({r})"]
            ignored = resource_tracker._IGNORED_SIGNALS  # type: ignore[attr-defined]
            # Blocked until it has its handlers, as ensure_running does (bpo-33613).
            signal.pthread_sigmask(signal.SIG_BLOCK, ignored)
            try:
                tracker._pid = mp_util.spawnv_passfds(exe, args, fds)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
        except OSError:
            pass
        finally:
            os.close(r)


def _forget_deferred_tracker() -> None:
    """In a forked child: the deferred tracker is the parent's to start (it shares the
    parent's tracker, as multiprocessing's own forked children do)."""
    global _tracker_read_end
    r, _tracker_read_end = _tracker_read_end, None
    if r is not None:
        os.close(r)


os.register_at_fork(after_in_child=_forget_deferred_tracker)
