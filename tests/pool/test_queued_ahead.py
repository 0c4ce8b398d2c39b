"""Regression tests of the tasks queued ahead in a worker (issue 41; see
docs/decisions/0065-tasks-queued-ahead.md), through the public API (the one seam: which
running task a task may be queued ahead behind).

A busy worker holds one sync task behind the one it runs and starts it without waiting
for the parent. Every contract that depends on the pool knowing where a task is holds:
a task queued ahead whose caller leaves never starts, a worker's death fails only the
task it ran, ``maxtasksperchild`` counts started tasks, ``max_memory`` is checked before
the next task starts, idle workers come first. conftest runs each test on a plain
``asyncio.run`` loop, uvloop and ``trio.run``; workers wait on a gate, never on a sleep.
"""

from __future__ import annotations

import collections
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._pool import workers as _workers
from tests._gate import Gate
from tests.children import common
from tests.children import pool as funcs
from tests.pool._pools import pool, settled

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def every_task_ends_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task is queued ahead only behind one expected to end soon (``ends_soon``: a
    function that ran quickly before): here, behind the tasks the tests hold at a gate."""
    monkeypatch.setattr(_workers, "ends_soon", lambda w, took, now: True)


TIMEOUT = 30


async def test_a_task_queued_ahead_whose_timeout_passes_never_starts(
    gate: Gate, tmp_path: Path
) -> None:
    """Its worker learns before it would start it (SKIPPED): it never runs, and the
    worker is neither killed nor replaced."""
    marker = tmp_path / "ran"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, common.pool_gate, (0, gate.address))
            pids = await gate.ready(1)
            with pytest.raises(TimeoutError):
                await p.apply(funcs.append, (str(marker), "ran"), timeout=0.3)
            assert p.statistics().running == 2  # it waits in the worker, to be skipped
            gate.release(0)
            assert await p.apply(funcs.pid) == pids[0]
            assert p.statistics().running == 0
        assert not marker.exists()
        assert p.statistics().replaced == 0


async def test_a_worker_that_dies_fails_only_the_task_it_ran(gate: Gate) -> None:
    """The task queued ahead behind the one that killed its worker goes back to the
    head of the queue and runs on the replacement; it never fails."""
    ahead: list[int] = []
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:

            async def dying() -> None:
                with pytest.raises(aiomp.BrokenWorkerError):
                    await p.apply(funcs.die_at_gate, (0, gate.address))

            async def queued_ahead() -> None:
                ahead.append(await p.apply(funcs.pid))

            tg.start_soon(dying)
            pids = await gate.ready(1)
            tg.start_soon(queued_ahead)
            await settled()
            assert (p.statistics().running, p.statistics().queued) == (2, 0)
            gate.release(0)
        assert ahead and ahead[0] != pids[0]
        assert p.statistics().replaced == 1


async def test_maxtasksperchild_counts_the_tasks_queued_ahead() -> None:
    """Each worker starts exactly ``maxtasksperchild`` tasks, those it held queued
    ahead among them."""
    pids: list[int] = []
    with anyio.fail_after(TIMEOUT):
        async with pool(1, maxtasksperchild=2) as p, anyio.create_task_group() as tg:

            async def one() -> None:
                pids.append(await p.apply(funcs.pid))

            for _ in range(6):
                tg.start_soon(one)
    assert sorted(collections.Counter(pids).values()) == [2, 2, 2], pids


async def test_max_memory_is_checked_before_the_task_queued_ahead_starts(gate: Gate) -> None:
    """The worker whose task grew past ``max_memory`` never starts the task it held
    queued ahead: that one runs on its replacement."""
    grown: list[int] = []
    ahead: list[int] = []
    with anyio.fail_after(TIMEOUT):
        async with pool(1, max_memory=48 << 20) as p, anyio.create_task_group() as tg:

            async def grow() -> None:
                grown.append(await p.apply(funcs.grow_at_gate, (0, gate.address, 96)))

            async def queued_ahead() -> None:
                ahead.append(await p.apply(funcs.pid))

            tg.start_soon(grow)
            await gate.ready(1)
            tg.start_soon(queued_ahead)
            await settled()
            assert p.statistics().running == 2
            gate.release(0)
        assert grown and ahead and grown[0] != ahead[0]
        assert p.statistics().replaced == 1


async def test_idle_workers_before_a_busy_workers_slot_ahead_then_fifo(
    gate: Gate, tmp_path: Path
) -> None:
    """A task goes to an idle worker before a busy worker's slot ahead; one task waits
    queued ahead in each busy worker, the rest in the pool, in order."""
    log = tmp_path / "order"
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, common.pool_gate, (0, gate.address))
            await gate.ready(1)
            tg.start_soon(p.apply, common.pool_gate, (1, gate.address))
            pids = await gate.ready(2)  # to the idle worker, not queued ahead
            assert len(set(pids.values())) == 2
            for word in "abcde":
                tg.start_soon(p.apply, funcs.append, (str(log), word))
                await settled()
            stats = p.statistics()
            assert (stats.queued, stats.running) == (3, 4)
            gate.release(0)
            await p.apply(funcs.append, (str(log), "f"))
            first, *rest = log.read_text().split()
            assert first in "ab" and rest == list("cdef")
            gate.release(1)
        assert sorted(log.read_text().split()) == list("abcdef")
