"""Regression tests for the Pool's lifecycle under the loops users run (issues 8 and 18).

conftest runs every async test here on a plain ``asyncio.run`` loop, uvloop and
``trio.run``; each test names the bug it pins. Workers are never slept on: they meet the
test at a :class:`Gate`, and every await is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiomp
from tests._gate import Gate
from tests._procs import dead
from tests.children import pool as funcs
from tests.pool._pools import pool

pytestmark = pytest.mark.anyio

TIMEOUT = 30


async def square_or_broken(
    p: aiomp.Pool, i: int, outcomes: collections.Counter[str], answered: set[int] | None = None
) -> None:
    """Square ``i`` in ``p``: its own result, or BrokenWorkerError, and nothing else.
    ``answered`` collects the pids of workers that ran a task (ready ones)."""
    try:
        square, pid = await p.apply(funcs.square_and_pid, (i,))
        assert square == i * i
        if answered is not None:
            answered.add(pid)
        outcomes["ok"] += 1
    except aiomp.BrokenWorkerError:
        outcomes["broken"] += 1


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # a fork server child may be reaped before the pool knows
        pass


def wait_dead_without_yielding(pid: int) -> None:
    """Block (no checkpoint: the pool's watcher must not see it yet) until ``pid`` died."""
    deadline = time.monotonic() + 10
    while not dead(pid):
        assert time.monotonic() < deadline, f"pid {pid} did not die"
        os.sched_yield()


async def test_maxtasksperchild_replaces_workers_under_a_plain_loop() -> None:
    """Issue 8 bug 1: the retire/replace path ran anyio in a loop callback and broke the
    pool under plain asyncio (`Not currently running on any asynchronous event loop`)."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1, maxtasksperchild=1) as p:
            pids = [await p.apply(funcs.pid) for _ in range(4)]
            assert len(set(pids)) == 4
            assert await p.map(funcs.square, range(6), chunksize=1) == [x * x for x in range(6)]
            assert p.statistics().replaced >= 9


async def test_a_call_in_a_cancelled_scope_touches_no_worker(tmp_path: Path) -> None:
    """Issue 8 bug 2: `s.cancel(); await pool.apply(f)` sent the task, then killed and
    replaced the worker to cancel it."""
    marker = tmp_path / "ran"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pid)
            for call in (
                lambda: p.apply(funcs.append, (str(marker), "apply")),
                lambda: p.apply(funcs.append, (str(marker), "timeout"), timeout=10),
                lambda: p.map(funcs.append, [(str(marker), "map")]),
                lambda: p.starmap(funcs.append, [(str(marker), "starmap")]),
            ):
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await call()
                assert scope.cancelled_caught
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with p.imap(funcs.square, [1, 2]) as it:
                    await it.__anext__()
            assert await p.apply(funcs.pid) == pid
            assert p.statistics().replaced == 0
        assert not marker.exists()


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
async def test_a_call_after_a_native_cancel_touches_no_worker(tmp_path: Path) -> None:
    """Issue 8 bug 2, asyncio's own way: a task with a cancel already requested."""
    marker = tmp_path / "ran"
    async with pool(1) as p:
        pid = await p.apply(funcs.pid)

        async def cancelled_first() -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await p.apply(funcs.append, (str(marker), "apply"))

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(cancelled_first())
        # (An asyncio.timeout whose deadline has passed delivers its cancellation from a
        # callback at the next loop iteration: a call made before that is sent, and then
        # cancelled as a running task. aiomp cannot see such a timeout in advance.)
        assert await p.apply(funcs.pid) == pid
        assert p.statistics().replaced == 0
    assert not marker.exists()


async def test_a_worker_that_died_idle_is_not_handed_a_task() -> None:
    """Issue 8 bug 3: a send that failed because the idle worker had died counted as
    sent, and the task failed with `BrokenWorkerError ... while it ran`."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            for i in range(12):
                pid = await p.apply(funcs.pid)
                os.kill(pid, signal.SIGKILL)
                wait_dead_without_yielding(pid)
                assert await p.apply(funcs.square, (i,)) == i * i  # on the replacement
            assert p.statistics().replaced == 12


async def test_a_worker_killed_during_start_up_is_replaced(gate: Gate) -> None:
    """Issue 8 bug 4: SIGKILL of a worker while its initializer ran broke the whole pool
    although the other worker was healthy."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=funcs.init_at_gate, initargs=(gate.address,)) as p:
            pids = await gate.ready(2)
            victim, survivor = pids
            os.kill(victim, signal.SIGKILL)
            gate.release(survivor)
            results = await p.map(funcs.square, range(20), chunksize=1)
            assert results == [x * x for x in range(20)]
            (replacement,) = set(await gate.ready(3)) - {victim, survivor}
            gate.release(replacement)  # the replacement ran the initializer too
            assert await p.map(funcs.square, range(4)) == [0, 1, 4, 9]
            assert p.statistics().replaced == 1
            assert p.statistics().workers == 2


async def test_replacements_killed_before_ready_lose_no_task() -> None:
    """Issue 8 bug 4, without an initializer: killing replacement workers before they said
    ready failed 4,988 of 5,000 queued tasks and left no worker. Now a killed worker fails
    only the task it held; the queue waits for the next replacement."""
    outcomes: collections.Counter[str] = collections.Counter()
    kills = 0
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(square_or_broken, p, i, outcomes)
                await anyio.lowlevel.checkpoint()
                for _ in range(2):  # twice in a row: a third start-up death would break it
                    before = set(p.pids())
                    for pid in before:
                        kill(pid)
                        kills += 1
                    while not (set(p.pids()) - before):  # the replacements, just started
                        await anyio.lowlevel.checkpoint()
            assert outcomes["ok"] + outcomes["broken"] == 200
            assert outcomes["broken"] <= kills
            assert await p.map(funcs.square, range(4)) == [0, 1, 4, 9]
            assert p.statistics().workers == 2


async def test_start_up_deaths_in_a_row_break_the_pool() -> None:
    """Issue 8 bug 4's limit: a worker that dies during start-up every time (3 in a row for
    one slot) breaks the pool with BrokenPoolError, which says so."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1, initializer=funcs.init_kill_self) as p:
            with pytest.raises(aiomp.BrokenPoolError, match="3 times in a row") as info:
                await p.apply(funcs.square, (2,))
            assert "SIGKILL" in str(info.value)
            assert isinstance(info.value.__cause__, aiomp.BrokenWorkerError)
            with pytest.raises(aiomp.BrokenPoolError):
                await p.apply(funcs.square, (2,))
            assert p.statistics().replaced == 2


@pytest.mark.parametrize("ordered", [True, False], ids=["imap", "imap_unordered"])
async def test_imap_does_not_end_silently_when_the_pool_breaks(ordered: bool) -> None:
    """Issue 18 item 2: after the pool broke, imap_unordered gave some results, some
    BrokenWorkerErrors, then a normal end: most inputs were never run or reported."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1, initializer=funcs.init_kill_self) as p:
            fn = p.imap if ordered else p.imap_unordered
            it = fn(funcs.square, range(1000), buffersize=8)
            got: list[BaseException] = []
            for _ in range(3):  # a caller that catches per item and goes on
                try:
                    await it.__anext__()
                except aiomp.BrokenWorkerError as exc:  # pragma: no cover - the old bug
                    got.append(exc)
                except aiomp.BrokenPoolError as exc:
                    got.append(exc)
            assert len(got) == 3
            assert all(isinstance(e, aiomp.BrokenPoolError) for e in got)
            first = got[0]
            assert isinstance(first, aiomp.BrokenPoolError)
            # the inputs read and not run: the buffer's 8, and one more read to refill it
            assert first.not_run in (8, 9)
            assert f"{first.not_run} input(s) of this iterator not run" in str(first)
            assert "rest of the input was not read" in str(first)
            await it.aclose()


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_random_worker_kills_during_a_stream_of_apply() -> None:
    """Chaos (issue 9): SIGKILL random workers while 400 applies stream through a pool.
    Every call either returns its own result or fails with BrokenWorkerError; none is
    lost, duplicated or mixed up, and the pool ends healthy with no leaks."""
    seed = int(os.environ.get("AIOMP_CHAOS_SEED") or random.randrange(2**32))
    print(f"chaos seed {seed}")  # replay: AIOMP_CHAOS_SEED=<seed>
    rng = random.Random(seed)
    outcomes: collections.Counter[str] = collections.Counter()
    answered: set[int] = set()
    with anyio.fail_after(60):
        async with pool(3) as p:
            async with anyio.create_task_group() as tg:
                for i in range(400):
                    tg.start_soon(square_or_broken, p, i, outcomes, answered)
                    # Ready workers only: killing starting ones three times in a row would
                    # break the pool by design (a busy machine starts workers slowly).
                    ready = sorted(set(p.pids()) & answered)
                    if ready and rng.random() < 0.03:
                        kill(rng.choice(ready))
                    if i % 20 == 0:
                        await anyio.lowlevel.checkpoint()
            assert outcomes["ok"] + outcomes["broken"] == 400
            assert await p.map(funcs.square, range(10)) == [x * x for x in range(10)]
            assert p.statistics().workers == 3


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
async def test_a_second_cancel_during_shutdown_kills_at_once(gate: Gate) -> None:
    """Issue 18 item 1, the Pool's side: a second native cancellation (a second Ctrl-C)
    during the grace period must not abort termination and leave the worker alive; it
    means "now": SIGKILL at once, and the worker is still reaped before the pool exits."""

    async def service() -> None:
        async with pool(1, grace_period=5) as p:
            await p.apply(funcs.deaf_at_gate, (gate.address,))

    task = asyncio.create_task(service())
    (pid,) = (await gate.ready(1)).values()
    start = time.monotonic()
    task.cancel()
    await asyncio.sleep(0.3)  # handshake-free: the interval between two Ctrl-Cs
    assert not dead(pid)  # in its grace period: it ignores SIGTERM
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert dead(pid)
    assert time.monotonic() - start < 5  # well before the grace period would have ended


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_a_dropped_task_leaves_no_named_segment(gate: Gate, file_system: None) -> None:
    """Issue 9 item 1(b): under file_system, a task cancelled while queued had its send
    counted when it was pickled; nothing ever opened it, so its /dev/shm name outlived
    the program. A dropped task now undoes what pickling promised (the leak check after
    this test finds no name)."""
    big = np.ones(1 << 18, dtype=np.float32)  # 1 MiB: travels through shared memory
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, funcs.block_at_gate, (0, gate.address))
            await gate.ready(1)
            with anyio.move_on_after(0.1):
                await p.apply(funcs.nbytes, (big,))
            assert p.statistics().queued == 0
            gate.release(0)
            assert await p.apply(funcs.nbytes, (big,)) == big.nbytes


async def test_map_reports_progress_from_the_callers_task() -> None:
    """Issue 11: a progress hook for map (imap already works with tqdm)."""
    seen: list[tuple[int, int]] = []
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            out = await p.map(
                funcs.square,
                range(100),
                chunksize=10,
                on_progress=lambda done, total: seen.append((done, total)),
            )
            assert out == [x * x for x in range(100)]
            assert seen[-1] == (100, 100)
            assert [d for d, _ in seen] == sorted({d for d, _ in seen})  # increasing, once each
            assert all(d % 10 == 0 for d, _ in seen)

            def broken(done: int, total: int) -> None:
                raise ValueError("the progress bar broke")

            with pytest.raises(ValueError, match="progress bar broke"):
                await p.starmap(
                    funcs.square, [(x,) for x in range(50)], chunksize=5, on_progress=broken
                )
            with pytest.raises(TypeError, match="on_progress must be callable"):
                await p.map(funcs.square, range(3), on_progress=3)  # type: ignore[call-overload]
            assert await p.map(funcs.square, range(3)) == [0, 1, 4]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_a_double_ctrl_c_kills_and_reaps_a_deaf_worker(loop: str) -> None:
    """Issue 18 item 1 with real signals: a service under asyncio.run / uvloop / trio.run
    whose worker ignores SIGTERM gets two Ctrl-Cs 0.3 s apart. The second means "now":
    the worker is SIGKILLed and reaped, and the process exits well within its grace
    period (10 s) instead of hanging."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.children.pool_sigint", loop],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the worker says ready: no sleep to wait for it
        worker = int(line.split()[-1])
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # handshake-free: the interval between two Ctrl-Cs
        assert proc.poll() is None  # the first one waits out the grace period
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=8)
        assert time.monotonic() - start < 8
        assert dead(worker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


async def test_worker_output_reaches_the_parent_labelled(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 13, the Pool's side: each line a worker writes reaches the parent with its
    slot, and its logging records go through the parent's logging with record.worker."""
    lines: list[tuple[int, str, str]] = []
    caplog.set_level(logging.WARNING, logger="aiomp.test.worker")
    with anyio.fail_after(TIMEOUT):
        async with pool(
            2, output=lambda slot, stream, line: lines.append((slot, stream, line))
        ) as p:
            assert await p.map(funcs.say, range(4), chunksize=1) == [0, 1, 2, 3]
    # the forwarders are drained when the workers exit: every line is there by now
    assert sorted(line for _, s, line in lines if s == "stdout") == [f"out {i}" for i in range(4)]
    assert sorted(line for _, s, line in lines if s == "stderr") == [f"err {i}" for i in range(4)]
    assert {slot for slot, _, _ in lines} <= {0, 1}
    records = [r for r in caplog.records if r.name == "aiomp.test.worker"]
    assert sorted(r.getMessage() for r in records) == [f"log {i}" for i in range(4)]
    assert all(getattr(r, "worker", None) in (0, 1) and r.pid != os.getpid() for r in records)


async def test_a_bad_output_value_is_refused_before_any_worker_starts() -> None:
    with pytest.raises((TypeError, ValueError)):
        aiomp.Pool(1, output="loud")  # type: ignore[arg-type]


def test_a_program_read_from_stdin_can_use_a_pool(tmp_path: Path) -> None:
    """Issue 11: under ``python -`` the main script is ``<stdin>``, which spawn and
    forkserver children (and the fork server) tried to re-run and died: the pool broke
    "during start-up". Now they skip it; a function typed into that script travels by
    value (issue 29; it was refused at the call)."""
    program = (
        "import asyncio, operator\n"
        "import aiomp\n"
        "def typed_here(x):\n"
        "    return x\n"
        "async def main():\n"
        "    for method in ('spawn', 'forkserver'):\n"
        "        async with aiomp.Pool(1, start_method=method) as p:\n"
        "            print(await p.apply(operator.add, (1, 2)))\n"
        "            print(await p.apply(typed_here, (1,)))\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-"],
        input=program,
        text=True,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:4] == ["3", "1"] * 2
