"""Functions that ``test_context.py``'s children run (beside the shared ``_funcs``).

Light, like ``_funcs``: the standard library only.
"""

from __future__ import annotations

import os
import select
import signal

from tests._funcs import gate_connect


def wait_for_signals() -> None:
    """Block until a signal's Python handler raises (KeyboardInterrupt, for SIGINT).

    Race-free, unlike a ``signal.pause()`` loop: a signal that arrives after the
    interpreter's last check for pending signals but before ``pause()`` starts is already
    handled at the C level, so ``pause()`` sleeps on forever (the flake of
    ``test_sigint_in_child_is_failure``). The C handler also writes the signal number to
    the wakeup fd, which ``select`` sees whenever it was written.
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
