"""Helpers shared by the spawn contract tests: bounds, start methods, exit codes."""

from __future__ import annotations

import os
import signal

import aiomp

#: Bound on every await on a child. Generous: two shared cores, cold interpreters.
TIMEOUT = 20
GRACE = 0.5
METHODS = ["spawn", "forkserver", "fork"]


def exitcodes(ctx: aiomp.ProcessContext) -> list[int | None]:
    return [p.exitcode for p in ctx.processes]


#: A failed child is terminated along with the others if it has not exited yet (as torch
#: does): its error has already arrived, so its exit status is either.
FAILED = (1, -signal.SIGTERM)


def gone(pid: int) -> bool:
    """Whether our child ``pid`` has exited and been reaped (a zombie has not been)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return True
    return ppid != os.getpid()  # the pid was reused by a process that is not ours
