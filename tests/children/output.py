"""Functions that the output tests' children (tests/output/) run. The standard library only."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time


def write_lines(rank: int, n: int) -> int:
    """``n`` numbered lines on stdout and on stderr (through Python and through the fd),
    then a last stdout line without its newline."""
    for i in range(n):
        print(f"out {rank} {i}")
        os.write(2, f"err {rank} {i}\n".encode())
    sys.stdout.flush()  # block-buffered (the test's stdout is no terminal), like a pipe
    os.write(1, b"bad utf-8 \xff\n")
    print(f"last {rank}", end="")
    sys.stdout.flush()
    return rank


def write_then_crash(rank: int, how: str) -> None:
    print(f"before the crash {rank}", flush=True)  # written to the fd: must arrive
    os.write(1, b"partial, no newline")
    if how == "segv":
        import faulthandler
        import resource

        faulthandler.disable()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGSEGV)
    os._exit(3)


def write_a_lot(rank: int, mib: int) -> int:
    line = b"x" * 1023 + b"\n"
    for _ in range(mib * 1024):
        os.write(1, line)
    return rank


def log_records(rank: int) -> int:
    log = logging.getLogger("aiomp.test.child")
    log.warning("careful %s", rank)
    log.debug("below the parent's level")
    try:
        1 / 0  # noqa: B018
    except ZeroDivisionError:
        log.exception("it failed")
    return os.getpid()


def log_with_own_config(rank: int) -> int:
    logging.basicConfig(stream=sys.stdout, format="own: %(message)s")
    logging.getLogger("aiomp.test.child").warning("configured here")
    return rank


def progress_bar(rank: int, seen: object) -> int:
    """A tqdm-style bar on stderr: each redraw starts with a carriage return and the bar
    ends with a newline. After the half-way redraw it waits until the parent has shown it
    (``seen``, an aiomp.Event), so it finishes only if redraws are forwarded as they come."""
    for pct in (0, 50):
        sys.stderr.write(f"\rbar {pct}%")
        sys.stderr.flush()
    if not seen.sync.wait(timeout=30):  # type: ignore[attr-defined]
        return -1
    sys.stderr.write("\rbar 100%\n")
    sys.stderr.flush()
    return rank


def endless_line(rank: int, mib: int) -> int:
    """``mib`` MiB on stdout with no newline at all (a binary dump, say)."""
    chunk = b"y" * (64 << 10)
    for _ in range(mib * 16):
        os.write(1, chunk)
    return rank


# -- floods and grandchildren (tests/output/test_flood.py, test_grandchildren.py) ------------

#: 4096 short lines of 16 bytes: what a chatty child writes, in one write() each time.
FLOOD_BLOCK = b"".join(b"flood line %05d\n" % i for i in range(4096))
FLOOD_LINES = 4096


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def flood(rank: int, seconds: float) -> int:
    """Short lines on stdout as fast as it can for ``seconds``; returns how many. A writer
    that "never ends" ends after ``seconds`` all the same, so that a failing test fails
    instead of hanging."""
    deadline = time.monotonic() + seconds
    blocks = 0
    while time.monotonic() < deadline:
        _write_all(1, FLOOD_BLOCK)
        blocks += 1
    return blocks * FLOOD_LINES


#: A grandchild (a plain Python subprocess, so it holds only fds 0-2 of its parent): says
#: ``100 <pid>`` at the test's gate, waits to be released, then writes ``argv[2]`` lines.
_GRANDCHILD = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1])
s.sendall(b"100 %d\\n" % os.getpid())
s.recv(1)
for i in range(int(sys.argv[2])):
    print("grandchild", i, flush=True)
"""


def leave_a_grandchild_writing(rank: int, address: str, lines: int) -> int:
    """Start a subprocess on this process's stdout that writes ``lines`` lines once the
    test releases it at the gate (key 100), and return without waiting for it. It makes
    a session of its own, as a daemon does: one that stays in the child's process group
    dies with the child, so only such a one can write after it."""
    subprocess.Popen(
        [sys.executable, "-c", _GRANDCHILD, address[1:], str(lines)], start_new_session=True
    )
    return rank


def leave_a_grandchild_writing_and_die(address: str, lines: int) -> None:
    """A Pool task: :func:`leave_a_grandchild_writing`, then its worker exits."""
    leave_a_grandchild_writing(0, address, lines)
    os._exit(0)


def leave_yes_running(rank: int, address: str) -> int:
    """Start ``yes`` on this process's stdout (it writes as fast as the reader reads, for
    ever), tell the test its pid at the gate (key 100), and return. In a session of its
    own (see :func:`leave_a_grandchild_writing`), or it would die with this process."""
    yes = subprocess.Popen(["yes"], start_new_session=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address)
        s.sendall(b"100 %d\n" % yes.pid)
    return rank
