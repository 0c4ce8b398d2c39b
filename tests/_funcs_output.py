"""Functions that ``test_output.py``'s children run. The standard library only."""

from __future__ import annotations

import logging
import os
import signal
import sys


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
