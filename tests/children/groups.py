"""Functions that the children of ``tests/spawn/test_descendants.py`` and
``tests/spawn/test_keeper.py`` run: they start processes of own (a ``sleep 1000`` and an
``os.fork`` child) and say which.

Light, like ``common``: the standard library only, and ``subprocess`` imported where used.
"""

from __future__ import annotations

import os
import signal
import socket

from tests.children.common import block_forever, gate_connect, gate_wait


def start_descendants() -> list[int]:
    """Start a ``sleep 1000`` and an ``os.fork`` child that blocks; return their pids."""
    import subprocess

    sleeper = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
    forked = os.fork()
    if forked == 0:  # it keeps every fd it inherited, as a careless fork does
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            block_forever()
        finally:
            os._exit(0)
    return [sleeper.pid, forked]


def report(address: str, key: int, pids: list[int]) -> None:
    """Tell the test's gate each pid, under keys ``2 * key`` and ``2 * key + 1``."""
    for i, pid in enumerate(pids):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(address)
            s.sendall(b"%d %d\n" % (2 * key + i, pid))


def descendants(*_: object) -> list[int]:
    """A task or a spawned function that leaves its descendants running as it returns."""
    return start_descendants()


def descendants_then_block(key: int, address: str) -> None:
    """Start descendants, report them at the gate, then block (until killed)."""
    report(address, key, start_descendants())
    block_forever()


def descendants_then_return(rank: int, address: str) -> None:
    """Start descendants, report them, and return (leaving them running) once released."""
    report(address, rank, start_descendants())
    gate_wait(rank + 10, address)


def descendants_or_fail(rank: int, address: str) -> None:
    """Rank 0 starts descendants, reports them and blocks; rank 1 fails once released."""
    if rank == 0:
        descendants_then_block(0, address)
    gate_wait(rank + 10, address)
    raise RuntimeError("rank 1 failed")


def ready_for_ctrl_c(rank: int, address: str) -> None:
    """Report ready, then block until a Ctrl-C (SIGINT) raises KeyboardInterrupt here."""
    from tests.children.spawn import wait_for_signals

    gate_connect(rank, address).close()
    wait_for_signals()


def descendants_after_group_signal(*_: object) -> list[int]:
    """Start descendants that, as this process, ignore SIGUSR1, then send SIGUSR1 to the
    whole process group (as code that pokes every helper it started does) and return
    their pids, leaving them running."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    pids = start_descendants()
    os.killpg(0, signal.SIGUSR1)
    return pids


def reaps_to_the_last_child(*_: object) -> str:
    """Start a process, reap it with ``os.wait()``, then ask (without waiting) whether any
    child is left: "none left" is what a reap-them-all loop needs to end."""
    import subprocess

    # Held until the end: a Popen collected at once polls its process, and may reap it
    # before os.wait() does.
    true = subprocess.Popen(["true"], stdin=subprocess.DEVNULL)
    os.wait()
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return "none left"
    finally:
        true.returncode = 0  # (reaped above)
    return "a child is left, still running" if pid == 0 else f"reaped {pid}"
