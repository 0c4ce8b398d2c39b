"""What the pool says when a worker dies on its own: one WARNING on the ``aiomp`` logger.

Its callers get :class:`aiomp.BrokenWorkerError`, but a service's log would show nothing:
each death the pool did not cause itself (it did not terminate the worker, nor ask it
to exit) is logged with the worker's slot and pid, its signal or exit code, whether the
OOM killer killed it, its peak RSS where known, and the tasks it was running. The
pool's own kills (a timeout, a cancellation) log at INFO where they are made; a pool
whose initializer raised has said so at ERROR.
"""

from __future__ import annotations

import logging

from .health import death_error
from .kinds import Handle
from .workers import EXITING, KILLED, RETIRING, STARTING, WorkerSlot, not_started

log = logging.getLogger("aiomp")


def died_on_its_own(w: WorkerSlot, exitcode: int | None, asked: bool) -> bool:
    """Whether the exit of ``w``'s worker (``exitcode``) is a death the pool did not
    cause: not terminated by it, nor an exit 0 after it asked (``asked``: the pool is
    closing or broken, or the worker was retired)."""
    if w.state == KILLED or exitcode is None:
        return False
    return exitcode != 0 or not (asked or w.state in (RETIRING, EXITING))


def log_death(w: WorkerSlot, exitcode: int, unsent: list[int]) -> None:
    """Log the death of ``w``'s worker (see the module docstring)."""
    handle: Handle = w.handle
    waiting = set(not_started(handle.in_order, w.running, unsent))
    ran = [t.name for tid, t in w.running.items() if tid not in waiting]
    if w.state == STARTING:
        during = "during start-up"
    elif ran:
        during = "while it ran " + ", ".join(ran)
    else:
        during = "while it ran no task"
    why = f" ({handle.why})" if handle.why else ""
    log.warning("aiomp: %s", death_error(handle, exitcode, during, why))
