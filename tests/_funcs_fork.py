"""Functions that ``test_context_join.py``'s children run (beside the shared ``_funcs``).

Light, like ``_funcs``: the standard library only.
"""

from __future__ import annotations

import os
import threading

from tests._funcs import gate_connect, gate_wait


def exit_leaving_a_grandchild(rank: int, address: str) -> None:
    """Fork a grandchild that keeps every inherited fd (the report socket among them)
    open until the test releases it at the gate as rank ``100 + rank``; then exit with
    status 3 without reporting. It leaves the child's process group (``setsid``) before
    the child exits, or it would end with the child (issue 25 item 5)."""
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
