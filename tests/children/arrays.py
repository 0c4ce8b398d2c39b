"""Functions that the one-array fast path tests (tests/arrays/test_fastpath.py) run in
children. Standard library only at module level: spawn children import this module."""

from __future__ import annotations

import os
from typing import Any


def describe(a: Any) -> tuple[object, ...]:
    """What a received array must agree on, whichever path sent it."""
    import aiomp

    flags = a.flags
    return (
        type(a).__name__,
        a.dtype.str,
        a.dtype.descr,
        a.shape,
        a.strides,
        flags.c_contiguous,
        flags.f_contiguous,
        flags.writeable,
        flags.aligned,
        a.tobytes(),
        aiomp.is_shared(a),
    )


def describe_both(rank: int, q: object, n: int) -> list[tuple[tuple[object, ...], ...]]:
    """Take ``n`` pairs, each an array sent alone then the same array inside a tuple (the
    pickled path), and describe both as this process received them."""
    out = []
    for _ in range(n):
        alone = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        (pickled,) = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        out.append((describe(alone), describe(pickled)))
    return out


def put_alone_and_wait(rank: int, q: object, ready: object, n: int) -> None:
    """Put a fresh array alone (copied at put) and a shared one, say ready, wait to die."""
    import signal

    import numpy as np

    import aiomp

    q.sync.put(np.full(n, 3.0))  # type: ignore[attr-defined]
    shared = aiomp.empty(n)
    shared[:] = 4.0
    q.sync.put(shared)  # type: ignore[attr-defined]
    ready.sync.put(os.getpid())  # type: ignore[attr-defined]
    while True:
        signal.pause()
