"""Worker health (docs/design.md "Worker health", issue 30): a hang says where it hung, an
OOM kill says so, and a worker whose private memory keeps growing is retired.

The timeout and cancellation tests run on asyncio, uvloop and trio; the memory ones on
asyncio only (their subject is the worker, not the loop). Workers meet the test at a
:class:`Gate` before they hang; every await is bounded.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from tests._gate import Gate
from tests._procs import dead
from tests.children import common as funcs
from tests.children import health as h
from tests.pool import _pools as pools
from tests.pool._pools import asyncio_only

TIMEOUT = 30
GRACE = 0.5  # a hung worker's stack is read and printed within it
pool = functools.partial(pools.pool, grace_period=GRACE)

pytestmark = pytest.mark.anyio


async def warm(p: aiomp.Pool) -> None:
    """The worker ready first: a busy machine may take longer than a test's timeout to
    start one, and a task timed out before it starts never reaches the gate."""
    assert await p.apply(funcs.pool_square, (1,)) == 1


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


# -- a hang says where it hung ------------------------------------------------------------


async def test_timeout_notes_the_stack_of_the_hung_function(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30: the TimeoutError carries the worker's stack (all threads) as a note, and
    the kill is logged at INFO with the task's name and why (issue 31 item 5), not as a
    WARNING about SIGTERM."""
    caplog.set_level(logging.INFO, logger="aiomp")
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await warm(p)
            with pytest.raises(TimeoutError) as info:
                await p.apply(h.hang_in_named_function, (0, gate.address), timeout=1.0)
            pid = (await gate.ready(1))[0]
            assert dead(pid)
            assert await p.apply(funcs.pool_square, (3,)) == 9
    text = notes(info.value)
    assert "most recent call first" in text, text
    assert "in hang_in_named_function" in text, text
    assert f"pid {pid}" in text, text
    ours = [r for r in caplog.records if r.name == "aiomp" and str(pid) in r.getMessage()]
    assert [r.levelno for r in ours] == [logging.INFO], [r.getMessage() for r in ours]
    assert "hang_in_named_function" in ours[0].getMessage()
    assert "did not finish within 1.0 s" in ours[0].getMessage()


async def test_cancellation_logs_the_stack_at_info(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30: a cancelled caller's running sync task: the INFO line on the ``aiomp``
    logger names the task, says why its worker was killed, and carries its stack."""
    caplog.set_level(logging.INFO, logger="aiomp")
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, h.hang_in_named_function, (0, gate.address))
                pid = (await gate.ready(1))[0]
                tg.cancel_scope.cancel()
            assert dead(pid)
    ours = [r for r in caplog.records if r.name == "aiomp" and str(pid) in r.getMessage()]
    assert [r.levelno for r in ours] == [logging.INFO], [r.getMessage() for r in ours]
    message = ours[0].getMessage()
    assert "cancelled" in message and "hang_in_named_function" in message, message
    assert "in hang_in_named_function" in message.split("most recent call first")[1], message


@pytest.mark.parametrize("fn", [h.hang_in_c_sleep, h.hang_in_c_read], ids=["sleep", "read"])
async def test_a_worker_hung_in_c_shows_its_stack_and_dies(gate: Gate, fn: Any) -> None:
    """Issue 30: a worker inside a C call (time.sleep, a blocking read) still prints
    where it is, and dies within the grace period."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await warm(p)
            start = time.monotonic()
            with pytest.raises(TimeoutError) as info:
                await p.apply(fn, (0, gate.address), timeout=1.0)
            took = time.monotonic() - start
            assert dead((await gate.ready(1))[0])
    assert f"in {fn.__name__}" in notes(info.value)
    assert took < 1.0 + GRACE + 2.0, took


async def test_a_worker_that_cannot_print_still_dies_within_the_grace_period(
    gate: Gate,
) -> None:
    """Issue 30: a worker blocking every signal (it can neither print nor take SIGTERM)
    is SIGKILLed after the grace period; the note says its stack could not be read."""
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            await warm(p)
            start = time.monotonic()
            with pytest.raises(TimeoutError) as info:
                await p.apply(h.hang_unable_to_print, (0, gate.address), timeout=1.0)
            took = time.monotonic() - start
            assert dead((await gate.ready(1))[0])
            assert await p.apply(funcs.pool_square, (2,)) == 4
    assert "could not be read" in notes(info.value), notes(info.value)
    assert took < 1.0 + GRACE + 3.0, took


# -- why did it die ---------------------------------------------------------------------


def test_broken_worker_error_pickles_with_its_health_attributes() -> None:
    """R10: oom_killed and peak_rss survive pickling, under their public names."""
    err = aiomp.BrokenWorkerError("m", 1, 2, -9, "SIGKILL", oom_killed=True, peak_rss=123)
    back = pickle.loads(pickle.dumps(err))
    assert (back.oom_killed, back.peak_rss, back.exit_code, back.pid) == (True, 123, -9, 2)
    plain = pickle.loads(pickle.dumps(aiomp.BrokenWorkerError("m", 1, 2, -9, "SIGKILL")))
    assert (plain.oom_killed, plain.peak_rss) == (False, None)


@asyncio_only
async def test_a_killed_worker_reports_its_peak_rss_and_no_oom() -> None:
    """Issue 30: peak_rss from the reaped worker's rusage; SIGKILL by someone else than
    the OOM killer is not called an OOM kill."""
    with anyio.fail_after(TIMEOUT):
        async with pool(start_method="spawn") as p:
            await p.apply(h.grow, (64,))
            with pytest.raises(aiomp.BrokenWorkerError) as info:
                await p.apply(funcs.pool_kill_self, (signal.SIGKILL,))
            assert await p.apply(funcs.pool_square, (2,)) == 4
    err = info.value
    assert err.oom_killed is False
    assert err.peak_rss is not None and err.peak_rss >= 64 << 20, err.peak_rss
    assert "OOM" not in str(err)


def _memory_cgroup(limit: int) -> Iterator[str]:
    """A fresh memory cgroup limited to ``limit`` bytes (v2 or v1); yields the file to
    write a pid into to move it there. Skips where this process cannot make one."""
    name = f"aiomp-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = [p for _, ctl, p in lines if "memory" in ctl.split(",")]
    if v1 and os.path.isdir("/sys/fs/cgroup/memory"):
        base = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/")
        limit_file, procs = "memory.limit_in_bytes", "cgroup.procs"
    else:
        v2 = [p for hid, _, p in lines if hid == "0"]
        base = Path("/sys/fs/cgroup") / (v2[0].lstrip("/") if v2 else "")
        limit_file, procs = "memory.max", "cgroup.procs"
    path = base / name
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc}): needs root and cgroup rights")
    try:
        try:
            (path / limit_file).write_text(str(limit))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        except OSError as exc:
            pytest.skip(f"cannot limit a memory cgroup here ({exc})")
        yield str(path / procs)
    finally:
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:  # the dead worker's memory is still being uncharged
                time.sleep(0.05)  # handshake-free: polling the kernel, bounded (100 tries)


@pytest.fixture
def memory_cgroup() -> Iterator[str]:
    yield from _memory_cgroup(96 << 20)


@asyncio_only
async def test_an_oom_killed_worker_says_so(memory_cgroup: str) -> None:
    """Issue 30: a worker past its cgroup's memory limit: oom_killed, a peak_rss near
    the limit, "killed by the OOM killer" in the message; the pool serves on."""
    with anyio.fail_after(TIMEOUT):
        async with pool(
            start_method="spawn", initializer=h.join_cgroup, initargs=(memory_cgroup,)
        ) as p:
            with pytest.raises(aiomp.BrokenWorkerError) as info:
                await p.apply(h.allocate_forever, (8,))
            assert await p.apply(funcs.pool_square, (5,)) == 25
    err = info.value
    assert err.oom_killed is True, err
    assert "killed by the OOM killer" in str(err), err
    # At least what it allocated in the cgroup; what it held before joining it (its start)
    # counts too, so no upper bound.
    assert err.peak_rss is not None and err.peak_rss >= 48 << 20, err.peak_rss


# -- memory that only grows -------------------------------------------------------------


@asyncio_only
async def test_max_memory_retires_a_growing_worker_after_the_crossing_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 30: private memory past max_memory over the post-initializer level: the
    worker is retired after the task that crossed it, with an INFO line saying why."""
    caplog.set_level(logging.INFO, logger="aiomp")
    with anyio.fail_after(TIMEOUT):
        async with pool(max_memory=100 << 20) as p:
            pids = [await p.apply(h.grow, (40,)) for _ in range(4)]
            stats = p.statistics()
    assert pids[0] == pids[1] == pids[2] != pids[3], pids
    assert stats.replaced == 1
    lines = [r for r in caplog.records if r.name == "aiomp" and "max_memory" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert str(pids[0]) in lines[0].getMessage() and "grow" in lines[0].getMessage()


@asyncio_only
async def test_max_memory_retires_a_growing_async_worker_too() -> None:
    """Issue 30: the same check between an event-loop worker's tasks."""
    with anyio.fail_after(TIMEOUT):
        async with pool(max_memory=100 << 20) as p:
            pids = [await p.apply(h.grow_async, (40,)) for _ in range(4)]
            stats = p.statistics()
    assert pids[0] == pids[1] == pids[2] != pids[3], pids
    assert stats.replaced == 1


@asyncio_only
async def test_max_memory_ignores_a_shared_array_the_parent_touched() -> None:
    """Issue 30: shared memory does not count: a worker reading a large shared array
    that the parent wrote first is not retired."""
    array = aiomp.zeros(48 << 20, dtype=np.uint8)  # type: ignore[attr-defined]
    array[:] = 1
    with anyio.fail_after(TIMEOUT):
        async with pool(max_memory=16 << 20) as p:
            first = await p.apply(h.read_shared, (array,))
            again = await p.apply(h.read_shared, (array,))
            stats = p.statistics()
    assert first[0] == again[0] and first[1] == float(48 << 20)
    assert stats.replaced == 0


def test_max_memory_is_checked() -> None:
    with pytest.raises(ValueError, match="max_memory"):
        aiomp.Pool(1, max_memory=0)
