"""Functions that spawn's children run (tests/spawn/), beside the shared
``tests.children.common``.

Light, like ``common``: the standard library only.
"""

from __future__ import annotations

import os
import select
import signal
import threading

from tests.children.common import gate_connect, gate_wait


def wait_for_signals() -> None:
    """Block until a signal's Python handler raises (KeyboardInterrupt, for SIGINT).

    Race-free, unlike a ``signal.pause()`` loop: a signal that arrives after the
    interpreter's last check for pending signals but before ``pause()`` starts is already
    handled at the C level, so ``pause()`` sleeps on forever. The C handler also writes the
    signal number to the wakeup fd, which ``select`` sees whenever it was written.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    while True:
        select.select([r], [], [])
        os.read(r, 512)  # the Python handlers run as soon as select returns


def ready_then_wait_for_signals(rank: int, address: str) -> None:
    gate_connect(rank, address).close()
    wait_for_signals()


class _Trace:
    """Writes ``path`` when it is finalised: at interpreter teardown, for a global one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._open, self._close = os.open, os.close  # teardown may have cleared `os`

    def __del__(self) -> None:
        self._close(self._open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))


_kept: list[_Trace] = []


def exit_traces(rank: int, directory: str) -> str:
    """Leave a trace of what the child's exit does: an ``atexit`` function's file, a
    global finalised at teardown, and a last line without a newline on stdout."""
    import atexit
    import sys

    atexit.register(lambda: open(f"{directory}/atexit-{rank}", "w").close())
    _kept.append(_Trace(f"{directory}/teardown-{rank}"))
    sys.stdout.write(f"last words of {rank}")  # no newline: only a flush sends it
    return "done"


def thread_outlives_fn(rank: int, directory: str) -> None:
    """Return while a non-daemon thread still has work left: the exit must wait for it."""
    import threading
    import time

    def late() -> None:
        time.sleep(0.3)  # handshake-free: the thread must outlive fn (the scenario, not a wait)
        open(f"{directory}/thread-{rank}", "w").close()

    threading.Thread(target=late).start()


async def async_library(rank: int) -> str:
    """What sniffio (and so anyio) says runs this child's event loop."""
    import sniffio

    return str(sniffio.current_async_library())


def exit_leaving_a_grandchild(rank: int, address: str) -> None:
    """Fork a grandchild that keeps every inherited fd (the report socket among them)
    open until the test releases it at the gate as rank ``100 + rank``; then exit with
    status 3 without reporting. It leaves the child's process group (``setsid``) before
    the child exits, or it would end with the child."""
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            os.setsid()
            os.write(w, b"x")
            gate_wait(100 + rank, address)
        finally:
            os._exit(0)
    os.read(r, 1)
    os._exit(3)


def raise_then_hang_in_teardown(rank: int, address: str) -> None:
    """Rank 0 leaves a non-daemon thread blocked at the gate (the interpreter's exit
    waits for it: a teardown that never ends on its own) and raises; the others wait at
    the gate."""
    if rank:
        gate_wait(rank, address)
        return
    conn = gate_connect(rank, address)
    threading.Thread(target=conn.recv, args=(1,)).start()
    raise ValueError("rank 0 failed")


def return_then_hold_exit(rank: int, address: str) -> int:
    """Return ``rank`` (its report goes out at once) while a non-daemon thread, blocked at
    the gate, keeps the process from exiting until the test releases it."""
    conn = gate_connect(rank, address)
    threading.Thread(target=conn.recv, args=(1,)).start()
    return rank


def raise_with_a_grandchild_and_hang(rank: int, address: str) -> None:
    """Fork a grandchild that holds every inherited fd (the report socket among them) at
    the gate as rank ``100 + rank``, leave a non-daemon thread blocked at the gate (a
    teardown that never ends on its own), and raise: neither the child's exit nor the
    socket's last close can tell the parent, only the report."""
    if os.fork() == 0:
        try:
            gate_wait(100 + rank, address)
        finally:
            os._exit(0)
    conn = gate_connect(rank, address)
    threading.Thread(target=conn.recv, args=(1,)).start()
    raise ValueError(f"rank {rank} failed")
