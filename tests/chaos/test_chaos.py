"""Chaos: many producers and consumers, cancellation storms, SIGKILL and SIGINT, fd
exhaustion (the kills and fd exhaustion in ``tests/chaos/test_kills.py``). Each scenario is
bounded (well under a minute), runs with a fixed seed and the session's random seed
(printed; ``AIOMP_CHAOS_SEED=<n>`` replays it), and asserts:

- exactly-once delivery: every item put arrives once (a put that was cancelled put
  nothing, a get that was cancelled took nothing), intact;
- nothing leaked: fds, ``/dev/shm`` names, live or zombie children (the autouse leak check,
  plus explicit checks on the processes and names of subprocess trees);
- no hang: every wait is bounded by ``anyio.fail_after`` or a subprocess timeout.

Counts are printed as ``CHAOS ...`` lines (``-s`` shows them); docs/reliability.md records
a run. The Pool's own chaos scenario (workers SIGKILLed during a stream of ``apply``) lives
with the Pool tests.
"""

from __future__ import annotations

import gc
import math
import random

import anyio
import pytest

import aiomp
from tests.chaos import _chaos
from tests.chaos._checks import GRACE, SEEDS, TIMEOUT, exactly_once, names_of

# -- many producers and consumers, both strategies, all three loops -------------------------

PRODUCERS, PER_PRODUCER = 3, 400


@pytest.mark.anyio
@SEEDS
async def test_many_producers_and_consumers(strategy: str, seed: int) -> None:
    """3 producers x 400 mixed items (ints, bytes, 100 B / 100 KiB / 2 MiB arrays) through
    one bounded queue to 2 consumer processes and the parent at once. Every item arrives
    once and intact; once every process has exited no name of theirs is left (a
    producer's exit clean-up races a consumer's release of the same segments)."""
    q, out = aiomp.Queue(maxsize=32), aiomp.Queue()
    keys: list[tuple[int, int]] = []

    async def parent_consumes() -> None:
        async for key, payload in q:
            _chaos.check(key, payload)
            keys.append(key)
            del payload

    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            _chaos.consume, 2, args=(q, out, strategy), grace_period=GRACE
        ) as consumers:
            async with anyio.create_task_group() as tg:
                tg.start_soon(parent_consumes)
                async with aiomp.spawn(
                    _chaos.produce,
                    PRODUCERS,
                    args=(q, PER_PRODUCER, seed, strategy),
                    grace_period=GRACE,
                ) as producers:
                    pass
                q.close()
        out.close()
        by_parent = len(keys)
        async for batch in out:
            keys.extend(batch)
    expected = [(r, i) for r in range(PRODUCERS) for i in range(PER_PRODUCER)]
    lost, duplicated = exactly_once(expected, keys)
    assert sum(consumers.results) == len(keys) - by_parent  # type: ignore[arg-type]
    gc.collect()
    leaked = names_of(producers.pids() + consumers.pids())
    assert not leaked, "every process of the run has exited: its names must be gone"
    _chaos.record(
        "mpmc",
        strategy=strategy,
        seed=seed,
        messages=len(expected),
        by_parent=by_parent,
        lost=lost,
        duplicated=duplicated,
        leaked=len(leaked),
    )


# -- cancellation storms around get and put --------------------------------------------------

STORM = 300


@pytest.mark.anyio
@SEEDS
async def test_cancellation_storm(strategy: str, seed: int) -> None:
    """Every put and get is raced by a random deadline (0-2 ms) on small bounded queues
    through an echoing child. A cancelled put put nothing (its shared blocks are released),
    a cancelled get took nothing: what was put is what comes back, once each."""
    rng = random.Random(seed)
    q, back = aiomp.Queue(maxsize=4), aiomp.Queue(maxsize=4)
    sent: list[tuple[int, int]] = []
    got: list[tuple[int, int]] = []
    cancelled = {"put": 0, "get": 0}

    async def consumer() -> None:
        while True:
            item = None
            with anyio.move_on_after(rng.random() * 0.002):
                try:
                    item = await back.get()
                except aiomp.QueueClosedError:
                    return
            if item is None:
                cancelled["get"] += 1
                continue
            _chaos.check(*item)
            got.append(item[0])
            del item

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            async with aiomp.spawn(_chaos.echo, 1, args=(q, back, strategy), grace_period=GRACE):
                for i in range(STORM):
                    key = (0, i)
                    item = (key, _chaos.make(key, seed))
                    done = False
                    with anyio.move_on_after(rng.random() * 0.002):
                        await q.put(item)
                        done = True
                    if done:
                        sent.append(key)
                    else:
                        cancelled["put"] += 1
                    del item
                q.close()
            back.close()
    lost, duplicated = exactly_once(sent, got)
    _chaos.record(
        "storm",
        strategy=strategy,
        seed=seed,
        messages=len(sent),
        cancelled_puts=cancelled["put"],
        cancelled_gets=cancelled["get"],
        lost=lost,
        duplicated=duplicated,
    )


WAITERS = 12


@pytest.mark.anyio
@SEEDS
async def test_many_waiting_gets_raced_by_deadlines(strategy: str, seed: int) -> None:
    """Twelve tasks of the parent wait on one unbounded queue at once (one reader kept for
    all of them on asyncio and uvloop, the wait handed from task to task on trio), half of
    the gets raced by a random deadline (0-2 ms), while a child puts mixed items. Every
    item arrives once and intact: a cancelled get took nothing, and a waiter cancelled
    while it held the wait handed it on (no other waiter was left asleep)."""
    rng = random.Random(seed)
    q = aiomp.Queue()
    keys: list[tuple[int, int]] = []
    cancelled = 0

    async def consumer() -> None:
        nonlocal cancelled
        while True:
            item = None
            deadline = rng.random() * 0.002 if rng.random() < 0.5 else math.inf
            with anyio.move_on_after(deadline):
                try:
                    item = await q.get()
                except aiomp.QueueClosedError:
                    return
            if item is None:
                cancelled += 1
                continue
            _chaos.check(*item)
            keys.append(item[0])
            del item

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            for _ in range(WAITERS):
                tg.start_soon(consumer)
            async with aiomp.spawn(
                _chaos.produce, 1, args=(q, STORM, seed, strategy), grace_period=GRACE
            ):
                pass
            q.close()  # every waiter wakes to QueueClosedError once the items are taken
    lost, duplicated = exactly_once([(0, i) for i in range(STORM)], keys)
    _chaos.record(
        "waiters",
        strategy=strategy,
        seed=seed,
        messages=STORM,
        cancelled_gets=cancelled,
        lost=lost,
        duplicated=duplicated,
    )
