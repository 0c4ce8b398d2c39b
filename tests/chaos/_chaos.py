"""Helpers for the chaos suite: seeds, counters, and what children run.

Seeds: every scenario runs with a fixed seed and with one random seed per session, printed
(``AIOMP_CHAOS_SEED=<n>`` replays it). Counts (messages, kills, cancellations, lost,
duplicated, leaked) are printed as ``CHAOS <scenario> key=value ...`` lines; run with
``-s`` to see them (docs/reliability.md records a run).

Children import this module: standard library only at module level.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys

FIXED_SEED = 20261123
RANDOM_SEED = int(os.environ.get("AIOMP_CHAOS_SEED", random.SystemRandom().randrange(1 << 32)))
SEEDS = [FIXED_SEED, RANDOM_SEED]


def record(scenario: str, **counts: object) -> None:
    line = " ".join(f"{k}={v}" for k, v in counts.items())
    print(f"CHAOS {scenario} {line}", file=sys.stderr, flush=True)


def fill_of(key: tuple[int, int]) -> int:
    return (key[0] * 1_000_003 + key[1]) % 251


def make(key: tuple[int, int], seed: int) -> object:
    """The payload for ``key``: an int, bytes, a small array, a 100 KiB array or a 2 MiB
    one, drawn from ``seed``."""
    import numpy as np

    kind = random.Random(f"{seed}/{key}").randrange(16)
    fill = fill_of(key)
    if kind < 4:
        return fill
    if kind < 8:
        return bytes([fill]) * 100
    if kind < 10:
        return np.full(100, fill, np.uint8)
    if kind < 15:
        return np.full(100 << 10, fill, np.uint8)
    return np.full(2 << 20, fill, np.uint8)


def check(key: tuple[int, int], payload: object) -> None:
    fill = fill_of(key)
    if isinstance(payload, int):
        ok = payload == fill
    elif isinstance(payload, bytes):
        ok = payload == bytes([fill]) * 100
    else:
        ok = bool(payload[0] == fill and payload[-1] == fill)  # type: ignore[index]
    if not ok:
        raise AssertionError(f"item {key} arrived corrupted")


def produce(rank: int, q: object, n: int, seed: int, strategy: str) -> int:
    """Put ``n`` mixed items keyed ``(rank, i)``."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    for i in range(n):
        q.sync.put(((rank, i), make((rank, i), seed)))  # type: ignore[attr-defined]
    return n


def consume(rank: int, q: object, out: object, strategy: str) -> int:
    """Take items until ``q`` closes; check each; send the keys back in batches."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    count = 0
    keys: list[tuple[int, int]] = []
    for key, payload in q.sync:  # type: ignore[attr-defined]
        check(key, payload)
        keys.append(key)
        del payload
        count += 1
        if len(keys) >= 64:
            out.sync.put(keys)  # type: ignore[attr-defined]
            keys = []
    out.sync.put(keys)  # type: ignore[attr-defined]
    gc.collect()
    return count


def hold_until_killed(rank: int, q: object, took: object, strategy: str, n: int) -> None:
    """Take ``n`` arrays, report each key, keep them all, and wait to be SIGKILLed."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    held = []
    for _ in range(n):
        key, arr = q.sync.get(timeout=60)  # type: ignore[attr-defined]
        check(key, arr)
        held.append(arr)
        took.sync.put(key)  # type: ignore[attr-defined]
    while True:
        signal.pause()


def echo(rank: int, qin: object, qout: object, strategy: str) -> int:
    """Send back every item until ``qin`` closes."""
    import aiomp

    aiomp.set_sharing_strategy(strategy)
    n = 0
    for item in qin.sync:  # type: ignore[attr-defined]
        qout.sync.put(item)  # type: ignore[attr-defined]
        del item
        n += 1
    return n


def shm_names_of(pids: object) -> set[str]:
    prefixes = tuple(f"aiomp-{pid}-" for pid in pids)  # type: ignore[attr-defined]
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefixes)}
