"""Whether a process is alive, and the hooks other layers hang on process events.

The lowest layer of the process toolkit; owns the hook lists. Standard library only,
imported by children (``_child``, the Pool's worker), by ``_memory`` and ``_cuda`` (which
register hooks here when they are imported) and by ``_process`` (which runs them), so
that ``_process`` runs checks it does not know: ``_cuda``'s refusal to fork with CUDA
initialised, ``_memory``'s sweep of a failed child's names, the child bootstrap's refusal
to start children while a spawn child re-runs its parent's unguarded main module.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: a child must not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Callable


#: Run before every start of a child; each raises (or exits) to refuse it.
_start_checks: list[Callable[[], None]] = []
#: Run before a ``fork`` start; each raises to refuse it (CUDA initialised, say).
_fork_checks: list[Callable[[], None]] = []
#: Run after a child aiomp started was seen to exit abnormally (a non-zero exit code).
_failed_exits: list[Callable[[], None]] = []
#: Run once, in the root of a process tree, when it makes its first shared segment.
_first_segments: list[Callable[[], None]] = []


def on_start_check(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` before every start of a child; it raises (or exits) to refuse it."""
    if fn not in _start_checks:
        _start_checks.append(fn)
    return fn


def on_fork_check(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` before every ``fork`` start; it raises to refuse the fork."""
    if fn not in _fork_checks:
        _fork_checks.append(fn)
    return fn


def on_failed_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` once a child has been reaped after it exited abnormally."""
    if fn not in _failed_exits:
        _failed_exits.append(fn)
    return fn


def on_first_segment(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` when the root of a process tree makes its first shared segment.

    From then on messages in flight may take every fd the process can open, and an
    import needs one: a layer that starts consumers imports up front what that needs.
    """
    if fn not in _first_segments:
        _first_segments.append(fn)
    return fn


def start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot); None if it is gone or a zombie.

    A pid with its start time names one process even after the pid is reused.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start: int = 0) -> bool:
    """True if process ``pid`` runs (and, given ``start``, is the one that started then).

    A zombie counts as dead. When it cannot tell (no ``/proc``, out of fds), it answers
    True: the callers keep a name or go on working, the safe side.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # one syscall settles "gone"
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    try:
        now = start_time(pid)
    except OSError:
        return True
    if now is None:  # a zombie, or gone since; or no /proc to tell
        return not os.path.isdir("/proc/self")
    return not start or now == start


def fork_checks() -> list[Callable[[], None]]:
    """The registered fork checks, to run before a ``fork`` start."""
    return list(_fork_checks)


def failed_exit() -> None:
    """Run the hooks for a child that was reaped after it exited abnormally."""
    for fn in _failed_exits:
        fn()


def first_segment() -> None:
    """Run the hooks for the first shared segment of a process tree's root."""
    for fn in _first_segments:
        fn()


def run_start_checks() -> None:
    """Run the start checks, before a child starts."""
    for fn in _start_checks:
        fn()
