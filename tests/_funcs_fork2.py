"""Functions that ``test_context_startup.py``'s children run (beside the shared ``_funcs``).

Light, like ``_funcs``: the standard library only.
"""

from __future__ import annotations

import os
import threading

from tests._funcs import gate_connect, gate_wait


def return_then_hold_exit(rank: int, address: str) -> int:
    """Return ``rank`` (its report goes out at once) while a non-daemon thread, blocked at
    the gate, keeps the process from exiting until the test releases it."""
    conn = gate_connect(rank, address)
    threading.Thread(target=conn.recv, args=(1,)).start()
    return rank


def raise_with_a_grandchild_and_hang(rank: int, address: str) -> None:
    """Fork a grandchild that holds every inherited fd (the report socket among them) at
    the gate as rank ``100 + rank``, leave a non-daemon thread blocked at the gate (a
    teardown that never ends on its own), and raise: neither the child's exit nor the
    socket's last close can tell the parent, only the report."""
    if os.fork() == 0:
        try:
            gate_wait(100 + rank, address)
        finally:
            os._exit(0)
    conn = gate_connect(rank, address)
    threading.Thread(target=conn.recv, args=(1,)).start()
    raise ValueError(f"rank {rank} failed")
