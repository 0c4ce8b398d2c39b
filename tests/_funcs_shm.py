"""Functions that the shared-memory regression tests and the chaos suite run in children.

Kept apart from ``tests/_funcs.py`` (shared by every test module). Standard library only at
module level: spawn children import this module to unpickle their function.
"""

from __future__ import annotations

import gc
import os


def drain(rank: int, q: object, n: int, strategy: str) -> list[int]:
    """Take ``n`` arrays (or a QueueClosed) and return each one's first value."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    seen = []
    for _ in range(n):
        arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        seen.append(int(arr[0]))
        del arr
    return seen


def put_unread_and_wait(rank: int, q: object, ready: object, strategy: str) -> None:
    """Put a shared array on ``q`` that nobody will read, say ready, and wait to die."""
    import signal

    import numpy as np

    import aiomp

    aiomp.set_sharing_strategy(strategy)
    q.sync.put(np.full(200_000, rank, np.float64))  # type: ignore[attr-defined]
    ready.sync.put(os.getpid())  # type: ignore[attr-defined]
    while True:
        signal.pause()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def consume_mixed(rank: int, q: object, out: object, strategy: str) -> tuple[int, int]:
    """Chaos consumer: take items until the queue closes, check each array against its
    key, send back the keys; return (items, most fds seen)."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    count = most = 0
    keys = []
    for item in q.sync:  # type: ignore[attr-defined]
        key, payload = item
        check(key, payload)
        keys.append(key)
        del item, payload
        count += 1
        if len(keys) >= 64:
            out.sync.put(keys)  # type: ignore[attr-defined]
            keys = []
            most = max(most, fd_count())
    if keys:
        out.sync.put(keys)  # type: ignore[attr-defined]
    gc.collect()
    return count, most


def produce_mixed(rank: int, q: object, n: int, seed: int, strategy: str) -> int:
    """Chaos producer: put ``n`` mixed items, keys ``(rank, i)``."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    for i in range(n):
        q.sync.put(((rank, i), make((rank, i), seed)))  # type: ignore[attr-defined]
    return n


def make(key: tuple[int, int], seed: int) -> object:
    """The payload for ``key``: an int, bytes, a small array, a 100 KiB array or a 2 MiB
    one (each kind in turn, by a seeded draw)."""
    import random

    import numpy as np

    kind = random.Random(hash((key, seed))).randrange(8)
    fill = (key[0] * 1_000_003 + key[1]) % 251
    if kind < 2:
        return fill
    if kind < 4:
        return bytes([fill]) * 100
    if kind < 5:
        return np.full(100, fill, np.uint8)
    if kind < 7:
        return np.full(100 << 10, fill, np.uint8)
    return np.full(2 << 20, fill, np.uint8)


def check(key: tuple[int, int], payload: object) -> None:
    fill = (key[0] * 1_000_003 + key[1]) % 251
    if isinstance(payload, int):
        assert payload == fill, (key, payload)
    elif isinstance(payload, bytes):
        assert payload == bytes([fill]) * 100, key
    else:
        assert payload[0] == fill and payload[-1] == fill, key  # type: ignore[index]


def hold_arrays_until_killed(rank: int, q: object, held: object) -> None:
    """Chaos: take arrays and keep them until SIGKILLed (reports each one taken)."""
    import signal

    keep = []
    while True:
        arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        keep.append(arr)
        held.sync.put(int(arr[0]))  # type: ignore[attr-defined]
        if len(keep) >= 3:
            break
    while True:
        signal.pause()


def signal_then_wait(started: object, go: object) -> bool:
    """Pool task: say it runs, then wait for ``go`` (keeps its worker busy)."""
    started.set()  # type: ignore[attr-defined]
    return bool(go.sync.wait(timeout=60))  # type: ignore[attr-defined]


def nbytes(arr: object) -> int:
    return int(arr.nbytes)  # type: ignore[attr-defined]
