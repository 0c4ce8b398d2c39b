"""What ``/proc/PID/stat`` says of a process: one reader for the tests that watch their
children (and their pools' workers) die."""

from __future__ import annotations

import os


def state(pid: int) -> tuple[str, int] | None:
    """``(state letter, parent pid)`` of ``pid`` now, or None once it has no entry."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The name, in parentheses, may hold spaces and parentheses: split after it.
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone: ENOENT, or ESRCH while it was being reaped
        return None
    return fields[0], int(fields[1])


def dead(pid: int) -> bool:
    """Whether ``pid`` has died (a zombie, or gone), as the kernel sees it now."""
    now = state(pid)
    return now is None or now[0] in ("Z", "X")


def gone(pid: int) -> bool:
    """Whether our child ``pid`` has exited and been reaped (a zombie has not been): no
    entry, or the pid reused by a process that is not our child."""
    now = state(pid)
    return now is None or now[1] != os.getpid()
