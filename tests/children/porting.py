"""Functions the children of tests/spawn/test_porting.py and tests/pool/test_porting.py
run (issue 31: porting from torch without traps).

Light, like ``common``: the standard library only at module level.
"""

from __future__ import annotations

import random
import sys
import time

from tests.children.common import gate_wait


def fail_with_a_slow_atexit(rank: int, address: str, marker: str) -> None:
    """Rank 1 registers an ``atexit`` function that takes a moment (an experiment
    tracker's finish hook) and raises ValueError; the others wait at the gate."""
    if rank != 1:
        gate_wait(rank, address)
        return
    import atexit

    def finish() -> None:
        time.sleep(0.3)  # handshake-free: long enough for a SIGTERM at the report to cut it
        with open(marker, "w") as f:
            f.write("finished")

    atexit.register(finish)
    raise ValueError(f"rank {rank} failed")


Draws = tuple[list[float], list[float] | None, list[float] | None]


def draws() -> Draws:
    """Four draws from each global generator: ``random``, numpy's, torch's (None for a
    library this process has not imported)."""
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    return (
        [random.random() for _ in range(4)],
        None if np is None else [float(x) for x in np.random.random(4)],
        None if torch is None else [float(x) for x in torch.rand(4)],
    )


def rank_draws(rank: int) -> Draws:
    return draws()


def draws_at_gate(i: int, address: str) -> Draws:
    """Draw, then hold this worker at the gate until the test has seen every task."""
    out = draws()
    gate_wait(i, address)
    return out


def crunch_at_gate(seconds: float) -> float:
    """The README service's ``crunch``, held (when ``seconds`` is not 0) at the abstract
    gate named by ``AIOMP_TEST_GATE`` until the test lets it go or it is terminated."""
    if seconds:
        import os

        gate_wait(os.getpid(), "\0" + os.environ["AIOMP_TEST_GATE"])
    return seconds
