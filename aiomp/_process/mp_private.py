"""Every private name of ``multiprocessing`` and ``atexit`` that aiomp reads or writes.

Owns nothing. Standard library only (children import it). Gathered here so that one unit
test (``tests/spawn/test_mp_private.py``) checks each of them against the running Python and
fails loudly when Python moves one, instead of a caller falling back in silence.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    import multiprocessing.process


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


def reap(process: multiprocessing.process.BaseProcess) -> tuple[int | None, int | None]:
    """Reap our own child ``process`` if it has exited: ``(exit status, peak RSS in
    bytes)``; ``(None, None)`` while it runs. The status is stored where ``Popen.poll``
    finds it, so ``process.exitcode`` agrees. Reaped already (by ``Popen.poll``): its
    status, and no RSS."""
    import os

    popen = process._popen  # type: ignore[attr-defined]
    if popen.returncode is not None:
        return popen.returncode, None
    try:
        pid, status, usage = os.wait4(popen.pid, os.WNOHANG)
    except ChildProcessError:
        return process.exitcode, None
    if pid == 0:
        return None, None
    popen.returncode = os.waitstatus_to_exitcode(status)
    return popen.returncode, usage.ru_maxrss * 1024  # (Linux counts it in KiB)
