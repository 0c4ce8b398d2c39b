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
