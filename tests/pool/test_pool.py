"""Contract tests for ``aiomp.Pool`` (README "Pool"), through the public API.

Tests whose subject is the event-loop plumbing (results, crashes, timeouts, cancellation,
imap back-pressure) run on asyncio, uvloop and trio; the rest run on asyncio only, to keep
the file fast on two cores. Workers are never slept on: a task the test must wait for
meets it at a :class:`Gate`, and every await is bounded by ``anyio.fail_after``. Most
pools use the fork server (conftest starts it once), which starts a worker in
milliseconds; ``test_start_methods`` covers spawn and fork.
"""

from __future__ import annotations

import functools
import gc
import itertools
import operator
import os
import pickle
import signal
import socket
import sys
import threading
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiomp
from aiomp._pool import calls as _calls
from aiomp._pool import protocol as P
from aiomp._pool import tasks as _tasks
from aiomp._pool import workers as _workers
from aiomp._wire import stream as _transport
from tests._gate import Gate
from tests._run import run_python
from tests.children import common as funcs

TIMEOUT = 20
GRACE = 0.3
FAST = "forkserver"
REPO = Path(__file__).resolve().parents[2]

#: For tests whose subject does not depend on the event loop.
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])

pytestmark = pytest.mark.anyio


async def settled() -> None:
    """Every task is blocked, and calls made so far have reached the pool: on asyncio,
    ``apply`` hands its task over from a loop callback once its caller has yielded."""
    await anyio.wait_all_tasks_blocked()
    await anyio.lowlevel.checkpoint()


def pool(processes: int = 2, **kwargs: Any) -> aiomp.Pool:
    kwargs.setdefault("start_method", FAST)
    kwargs.setdefault("grace_period", GRACE)
    return aiomp.Pool(processes, **kwargs)


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited and been reaped (no ``/proc`` entry, or not one of ours)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return state[0] in ("Z", "X") or int(state[1]) != os.getpid()


def remote_text(exc: BaseException) -> str:
    assert exc.__cause__ is not None, "no remote traceback attached"
    return str(exc.__cause__)


# -- results ---------------------------------------------------------------------------


async def test_apply_map_starmap_sync_and_async() -> None:
    async def numbers() -> AsyncIterator[int]:
        for i in range(7):
            yield i

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert await p.apply(funcs.pool_square, (7,)) == 49
            assert await p.apply(funcs.pool_add, (1, 2), {"c": 3}) == 6
            assert await p.apply(funcs.pool_async_square, (5,)) == 25
            assert await p.map(funcs.pool_square, range(10)) == [x * x for x in range(10)]
            assert await p.map(funcs.pool_async_square, range(10), chunksize=3) == [
                x * x for x in range(10)
            ]
            assert await p.map(funcs.pool_square, numbers()) == [x * x for x in range(7)]
            assert await p.map(funcs.pool_square, []) == []
            assert await p.starmap(funcs.pool_add, [(1, 2), (3, 4)]) == [3, 7]
            assert await p.starmap(funcs.pool_async_add, zip(range(5), range(5), strict=True)) == [
                0,
                2,
                4,
                6,
                8,
            ]
            # A sync function that returns a coroutine is awaited too.
            assert await p.apply(funcs.pool_returns_coroutine, (3,)) == 9


@asyncio_only
async def test_map_of_many_items_is_batched() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert await p.map(abs, range(-5000, 5000)) == [abs(x) for x in range(-5000, 5000)]
            # 4 chunks per worker, as multiprocessing does: 8 tasks for 10k items.
            assert p.statistics().completed == 8
            assert await p.map(abs, range(10), chunksize=1) == list(range(10))
            assert p.statistics().completed == 18


async def test_imap_and_imap_unordered() -> None:
    async def numbers() -> AsyncIterator[int]:
        for i in range(20):
            yield i

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert [x async for x in p.imap(funcs.pool_square, range(20))] == [
                x * x for x in range(20)
            ]
            assert [x async for x in p.imap(funcs.pool_async_square, numbers(), 3)] == [
                x * x for x in range(20)
            ]
            got = [x async for x in p.imap_unordered(funcs.pool_square, numbers(), chunksize=4)]
            assert sorted(got) == [x * x for x in range(20)]
            assert [x async for x in p.imap(funcs.pool_square, [])] == []


async def test_imap_endless_input_is_read_only_as_fast_as_consumed() -> None:
    pulled = 0
    closed = anyio.Event()

    def endless() -> Iterator[int]:
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield i

    async def endless_async() -> AsyncIterator[int]:
        nonlocal pulled
        try:
            for i in itertools.count():
                pulled += 1
                yield i
        finally:
            closed.set()

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            for source, chunksize in ((endless, 1), (endless_async, 3)):
                pulled = 0
                async with p.imap(funcs.pool_square, source(), chunksize, buffersize=4) as it:
                    for i in range(10):
                        assert await it.__anext__() == i * i
                        # submitted-but-unconsumed chunks never exceed the buffer size
                        assert pulled <= (i + 1) + 4 * chunksize + chunksize
                with pytest.raises(StopAsyncIteration):
                    await it.__anext__()
            await closed.wait()  # aclose() closed the async generator
            assert p.statistics().queued == 0


async def test_imap_yields_before_the_input_ends() -> None:
    first = anyio.Event()

    async def source() -> AsyncIterator[int]:
        yield 1
        await first.wait()  # only the consumer's first result lets the input go on
        yield 2

    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            got = []
            async for x in p.imap_unordered(funcs.pool_square, source()):
                got.append(x)
                first.set()
            assert got == [1, 4]


@asyncio_only
async def test_imap_raises_failures_in_order_and_goes_on() -> None:
    def source() -> Iterator[int]:
        yield 3
        yield -1
        yield 4
        raise KeyError("the input broke")

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            it = p.imap(funcs.pool_square_or_raise, source())
            assert await it.__anext__() == 9
            with pytest.raises(ValueError, match="negative"):
                await it.__anext__()
            assert await it.__anext__() == 16
            with pytest.raises(KeyError, match="the input broke"):
                await it.__anext__()
            with pytest.raises(StopAsyncIteration):
                await it.__anext__()


@asyncio_only
async def test_large_arguments_and_results() -> None:
    big = b"x" * (1 << 20)  # past the datagram: the message travels in a memfd
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            assert await p.apply(len, (big,)) == len(big)
            assert await p.apply(bytes, (len(big),)) == bytes(len(big))


# -- dispatch ----------------------------------------------------------------------------


async def test_many_callers_share_the_workers() -> None:
    results: dict[int, int] = {}

    async def call(i: int) -> None:
        results[i] = await p.apply(funcs.pool_square, (i,))

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(call, i)
    assert results == {i: i * i for i in range(200)}
    assert p.statistics().completed == 200


@asyncio_only
async def test_tasks_wait_in_the_outbox_when_the_socket_is_full() -> None:
    chunk = b"y" * 60_000  # just under the inline limit: 200 of them overfill the buffer
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=200) as p, anyio.create_task_group() as tg:
            lengths: list[int] = []

            async def call() -> None:
                lengths.append(await p.apply(funcs.pool_async_len, (chunk,)))

            for _ in range(200):
                tg.start_soon(call)
    assert lengths == [len(chunk)] * 200


async def test_concurrency_runs_async_tasks_together(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=3) as p, anyio.create_task_group() as tg:
            results: list[object] = []

            async def run(n: int) -> None:
                results.append(await p.apply(funcs.pool_async_gate, (n, gate.address, n)))

            for n in range(4):
                tg.start_soon(run, n)
            pids = await gate.ready(3)  # three at once in the one worker
            assert len(set(pids.values())) == 1
            stats = p.statistics()
            assert (stats.running, stats.queued, stats.busy) == (3, 1, 1)
            one = next(iter(pids))
            gate.release(one)
            await gate.ready(4)  # the freed slot took the fourth
            gate.release(*(set(gate.pids) - {one}))
        assert sorted(r[0] for r in results) == [0, 1, 2, 3]  # type: ignore[index]


@asyncio_only
async def test_sync_task_has_its_worker_alone(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=4) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, funcs.pool_gate, (0, gate.address))
            await gate.ready(1)
            tg.start_soon(p.apply, funcs.pool_async_gate, (1, gate.address))
            await settled()
            assert p.statistics().queued == 1  # not sent behind a sync task
            gate.release(0)
            await gate.ready(2)
            gate.release(1)


@asyncio_only
async def test_idle_workers_first_then_fifo(
    gate: Gate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's queue is FIFO. No task is queued ahead in a busy worker here (issue 41:
    behind pool_gate, which ran quickly once gate 0 opened, one would be; see
    tests/pool/test_queued_ahead.py for that order)."""
    monkeypatch.setattr(_workers, "ends_soon", lambda w, took, now: False)
    log = tmp_path / "order"
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, funcs.pool_gate, (0, gate.address))
            tg.start_soon(p.apply, funcs.pool_gate, (1, gate.address))
            pids = await gate.ready(2)
            assert len(set(pids.values())) == 2  # the second went to the idle worker
            for word in "abcde":
                tg.start_soon(p.apply, funcs.pool_append, (str(log), word))
                await settled()
            assert p.statistics().queued == 5
            gate.release(0)  # one worker runs the queue, in order
            await p.apply(funcs.pool_append, (str(log), "f"))  # FIFO: after a..e
            assert log.read_text().split() == list("abcdef")
            gate.release(1)


# -- errors ------------------------------------------------------------------------------


async def test_exception_is_same_type_with_remote_traceback() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(ValueError, match="boom 1") as info:
                await p.apply(funcs.pool_raise, ("boom 1",))
            text = remote_text(info.value)
            assert "Traceback (most recent call last)" in text
            assert "in pool_raise" in text and "ValueError: boom 1" in text
            with pytest.raises(ValueError, match="invalid literal"):
                await p.apply(int, ("x",))
            # map raises the failure itself, never an exception group
            with pytest.raises(ValueError, match="boom 2"):
                await p.map(funcs.pool_raise, ["boom 2"])
            with pytest.raises(ZeroDivisionError):
                await p.starmap(divmod, [(1, 1), (1, 0), (2, 1)], chunksize=1)
            assert await p.apply(funcs.pool_square, (3,)) == 9  # the worker is fine


@asyncio_only
async def test_map_raises_the_first_failure_and_drops_the_rest(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            log = tmp_path / "ran"
            with pytest.raises(ValueError, match="negative"):
                await p.starmap(
                    funcs.pool_log_square_or_raise,
                    [(str(log), x) for x in (1, -1, 2, 3, 4, 5)],
                    chunksize=1,
                )
            await p.apply(funcs.pool_pid)  # the worker has finished what it held
            # The chunks sent ahead behind the failing one (CHUNKS_AHEAD per worker: 2 and,
            # sent when 1 came back, 3) still ran; the rest were dropped when the failure
            # came back.
            assert log.read_text().split() == ["1", "-1", "2", "3"]


@asyncio_only
async def test_unpicklable_argument_raises_at_the_call_site() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(TypeError, match="lock"):
                await p.apply(funcs.pool_square, (threading.Lock(),))
            with pytest.raises(TypeError, match="lock"):
                await p.map(funcs.pool_square, [1, 2, threading.Lock()], chunksize=1)
            assert p.statistics().completed == 0  # nothing was sent
            lock = threading.Lock()
            with pytest.raises(pickle.PicklingError, match="even by value"):
                await p.apply(lambda: lock)  # a lambda travels by value; a lock cannot
            with pytest.raises(TypeError, match="callable"):
                await p.apply(3)  # type: ignore[arg-type]
            # A bare argument was "'int' object is not iterable" from deep in the call.
            with pytest.raises(TypeError, match=r"apply\(fn, \(x,\)\)"):
                await p.apply(funcs.pool_square, 3)  # type: ignore[call-overload]
            with pytest.raises(TypeError, match=r"apply\(fn, \(x,\)\)"):
                await p.apply(funcs.pool_square, "3")
            with pytest.raises(TypeError, match="kwds="):
                await p.apply(funcs.pool_square, {"x": 3})
            assert p.statistics().completed == 0
            assert await p.apply(funcs.pool_square, [3]) == 9


async def test_unpicklable_result_and_exceptions() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(pickle.PicklingError, match="pool_return_unpicklable") as info:
                await p.apply(funcs.pool_return_unpicklable)
            assert "Unpicklable refuses to be pickled" in str(info.value)
            with pytest.raises(aiomp.ProcessRaisedException) as info2:
                await p.apply(funcs.pool_raise_unpicklable, ("held a lock",))
            assert "PoolUnpicklableError: held a lock" in str(info2.value)
            assert "PoolUnpicklableError: held a lock" in remote_text(info2.value)
            with pytest.raises(
                aiomp.ProcessRaisedException, match="PoolUnunpicklableError: left/right"
            ):
                await p.apply(funcs.pool_raise_ununpicklable)
            # A task that cancels itself is not a cancellation of this caller.
            with pytest.raises(aiomp.ProcessRaisedException, match="CancelledError"):
                await p.apply(funcs.pool_async_cancel_self)
            with pytest.raises(MemoryError):
                await p.apply(funcs.pool_no_memory)
            assert await p.apply(funcs.pool_square, (4,)) == 16
            assert p.statistics().replaced == 0


# -- crashes -----------------------------------------------------------------------------

CRASHES = {
    "exit": (funcs.pool_exit, (3,), 3, None),
    "sigkill": (funcs.pool_kill_self, (signal.SIGKILL,), -signal.SIGKILL, "SIGKILL"),
    "sigsegv": (funcs.pool_kill_self, (signal.SIGSEGV,), -signal.SIGSEGV, "SIGSEGV"),
}


BACKENDS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def cases(*pairs: tuple[str, str]) -> list[Any]:
    """``(case, backend name)`` pairs as parameters for ``"case, anyio_backend"``."""
    return [pytest.param(case, BACKENDS[b], id=f"{case}-{b}") for case, b in pairs]


@pytest.mark.parametrize(
    "crash, anyio_backend",
    cases(*[("exit", b) for b in BACKENDS], ("sigkill", "asyncio"), ("sigsegv", "asyncio")),
)
async def test_crash_fails_only_its_tasks_and_the_pool_goes_on(crash: str, gate: Gate) -> None:
    fn, args, code, sig = CRASHES[crash]
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            survivor: list[object] = []

            async def bystander() -> None:
                survivor.append(await p.apply(funcs.pool_gate, (0, gate.address, "ok")))

            tg.start_soon(bystander)
            await gate.ready(1)
            with pytest.raises(aiomp.BrokenWorkerError) as info:
                await p.apply(fn, args)
            err = info.value
            assert isinstance(err, aiomp.ProcessExitedException)
            assert (err.exit_code, err.signal_name) == (code, sig)
            assert err.pid not in (gate.pids[0], None) and gone(err.pid)
            assert fn.__name__ in str(err)
            gate.release(0)
        assert survivor and survivor[0][0] == "ok"  # type: ignore[index]


@asyncio_only
async def test_crash_is_replaced_and_the_pool_goes_on() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pool_pid)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.map(funcs.pool_exit, [5])
            assert gone(pid)
            new = await p.apply(funcs.pool_pid)
            assert new != pid and p.pids() == [new]
            stats = p.statistics()
            assert (stats.workers, stats.replaced) == (1, 1)
            assert await p.map(funcs.pool_square, range(5)) == [0, 1, 4, 9, 16]


@asyncio_only
async def test_crash_fails_every_task_its_worker_held(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=3) as p, anyio.create_task_group() as tg:
            errors: list[BaseException] = []

            async def held(n: int) -> None:
                try:
                    await p.apply(funcs.pool_async_gate, (n, gate.address))
                except aiomp.BrokenWorkerError as exc:
                    errors.append(exc)

            tg.start_soon(held, 0)
            tg.start_soon(held, 1)
            await gate.ready(2)
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.pool_async_exit, (9,))
        assert len(errors) == 2 and all(e.exit_code == 9 for e in errors)  # type: ignore[attr-defined]


# -- timeout and cancellation ------------------------------------------------------------


async def test_timeout_terminates_a_sync_task_and_replaces_its_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(TimeoutError):
                await p.apply(funcs.pool_block, (0, gate.address), timeout=0.5)
            old = (await gate.ready(1))[0]  # it said ready before it was killed
            assert gone(old)
            assert await p.apply(funcs.pool_pid) != old
            assert p.statistics().replaced == 1


async def test_timeout_cancels_an_async_task_in_its_worker(gate: Gate, tmp_path: Path) -> None:
    marker = tmp_path / "cancelled"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            # The worker's event loop first: starting it (importing asyncio) can take
            # longer than the timeout below on a busy machine, and a task cancelled
            # before it starts never reaches the gate (it failed so at a load of 15).
            assert await p.apply(funcs.pool_async_square, (2,)) == 4
            with pytest.raises(TimeoutError):
                await p.apply(funcs.pool_async_block, (0, gate.address, str(marker)), timeout=0.5)
            await gate.ready(1)
            assert marker.read_text() == "cancelled"  # its coroutine saw CancelledError
            assert await p.apply(funcs.pool_pid) == gate.pids[0]  # and the worker lives on
            assert p.statistics().replaced == 0


@asyncio_only
async def test_async_task_that_ignores_cancellation_is_killed(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            # Cancelled once it runs (a timeout could pass before it starts on a busy
            # machine, and then it would never reach the gate).
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.pool_async_block_ignoring_cancel, (0, gate.address))
                await gate.ready(1)
                tg.cancel_scope.cancel()
            assert gone(gate.pids[0])
            assert await p.apply(funcs.pool_pid) != gate.pids[0]


async def test_cancelling_a_caller_kills_its_running_task(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:

            async def call() -> None:
                await p.apply(funcs.pool_block, (0, gate.address))

            tg.start_soon(call)
            pid = (await gate.ready(1))[0]
            tg.cancel_scope.cancel()
        assert gone(pid)  # terminated before the cancellation went on
        assert p.statistics().replaced == 1


async def test_cancelled_queued_task_never_starts(gate: Gate, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p, anyio.create_task_group() as tg:
            tg.start_soon(p.apply, funcs.pool_gate, (0, gate.address))
            await gate.ready(1)
            with anyio.CancelScope() as scope:

                async def queued() -> None:
                    await p.apply(funcs.pool_append, (str(marker), "ran"))

                async with anyio.create_task_group() as inner:
                    inner.start_soon(queued)
                    await settled()
                    assert p.statistics().queued == 1
                    scope.cancel()
            assert p.statistics().queued == 0
            gate.release(0)
            assert await p.apply(funcs.pool_square, (2,)) == 4
        assert not marker.exists()
        assert p.statistics().replaced == 0


@asyncio_only
async def test_cancelling_map_stops_its_chunks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            with anyio.move_on_after(0.5):
                await p.starmap(
                    funcs.pool_block, [(i, gate.address) for i in range(6)], chunksize=1
                )
            pids = await gate.ready(2)  # the two that ran; the other four never started
            assert all(gone(pid) for pid in pids.values())
            stats = p.statistics()
            assert (stats.running, stats.queued, stats.replaced) == (0, 0, 2)
            assert await p.map(funcs.pool_square, range(4)) == [0, 1, 4, 9]


async def test_cancelling_the_pool_block_terminates_every_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with pool(2) as p, anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.pool_block, (0, gate.address))
                await gate.ready(1)
                pids = p.pids()
                scope.cancel()
        assert scope.cancelled_caught
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


@asyncio_only
async def test_error_in_the_pool_block_terminates_every_worker(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(KeyError):  # the body's error itself, not a group
            async with pool(2) as p:
                await p.apply(funcs.pool_square, (1,))
                pids = p.pids()
                raise KeyError("body")
    assert all(gone(pid) for pid in pids)


@asyncio_only
async def test_cancelled_while_starting_leaves_nothing() -> None:
    for method in ("spawn", FAST):
        with anyio.fail_after(TIMEOUT):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with pool(2, start_method=method) as p:
                    await p.apply(funcs.pool_square, (1,))
            assert scope.cancelled_caught


@asyncio_only
async def test_cancelled_while_leaving_terminates_running_tasks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            errors: list[BaseException] = []

            async def outside(p: aiomp.Pool) -> None:
                try:
                    await p.apply(funcs.pool_block, (0, gate.address))
                except aiomp.BrokenWorkerError as exc:
                    errors.append(exc)

            with anyio.move_on_after(0.5) as scope:
                async with pool(1) as p:
                    tg.start_soon(outside, p)
                    await gate.ready(1)
                    # leaving normally waits for the running task: the deadline cancels that
            assert scope.cancelled_caught
        assert gone(gate.pids[0])
        assert len(errors) == 1 and "shutting down" in str(errors[0])


async def test_leaving_normally_waits_for_running_tasks(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            results: list[object] = []

            async def outside(p: aiomp.Pool) -> None:
                results.append(await p.apply(funcs.pool_gate, (0, gate.address, "done")))

            async def release_once_all_wait() -> None:
                await settled()  # the pool is waiting to close
                gate.release(0)

            async with pool(1) as p:
                tg.start_soon(outside, p)
                await gate.ready(1)
                tg.start_soon(release_once_all_wait)
            assert results and results[0][0] == "done"  # type: ignore[index]
            with pytest.raises(RuntimeError, match="closed"):
                await p.apply(funcs.pool_square, (1,))


# -- lifetime ----------------------------------------------------------------------------


@asyncio_only
async def test_maxtasksperchild_retires_workers() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1, maxtasksperchild=2) as p:
            pids = [await p.apply(funcs.pool_pid) for _ in range(5)]
            assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
            assert gone(pids[0]) and gone(pids[2])
            stats = p.statistics()
            assert (stats.workers, stats.replaced) == (1, 2)
            # map chunks count as tasks: the third worker has one left, then 2 + 1
            more = await p.map(funcs.pool_pid, range(4), chunksize=1)
            assert more[0] == pids[4] != more[1] == more[2] != more[3]


async def test_initializer_runs_before_the_first_task() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=funcs.pool_init, initargs=("hello",)) as p:
            assert await p.map(funcs.pool_get_init, range(4)) == ["hello"] * 4
        async with pool(1, initializer=funcs.pool_async_init, initargs=("async",)) as p:
            # an async initializer shares its loop with the worker's async tasks
            assert await p.apply(funcs.pool_async_same_loop) == ("async", True)


@pytest.mark.parametrize(
    "bad, anyio_backend", cases(*[("raise", b) for b in BACKENDS], ("exit", "asyncio"))
)
async def test_failing_initializer_breaks_the_pool(bad: str) -> None:
    init = funcs.pool_init_fail if bad == "raise" else funcs.pool_init_exit
    with anyio.fail_after(TIMEOUT):
        async with pool(2, initializer=init) as p:
            with pytest.raises(aiomp.BrokenPoolError) as info:
                await p.apply(funcs.pool_square, (2,))
            if bad == "raise":
                assert "initializer raised ValueError: the initializer refuses" in str(info.value)
                worker_error = info.value.__cause__
                assert isinstance(worker_error, aiomp.BrokenWorkerError)
                cause = worker_error.__cause__
                assert isinstance(cause, ValueError)
                assert "in pool_init_fail" in remote_text(cause)
            else:
                # an exit during start-up may be the OOM killer: retried, 3 times in a row
                assert "during start-up 3 times in a row" in str(info.value)
                assert "exit code 4" in str(info.value)
            with pytest.raises(aiomp.BrokenPoolError):  # at once, every time after
                await p.map(funcs.pool_square, range(3))
            if bad == "raise":
                assert p.statistics().replaced == 0  # a raising initializer is not retried


@asyncio_only
async def test_statistics(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p, anyio.create_task_group() as tg:
            stats = p.statistics()
            assert stats.workers == 2 and stats.running == stats.queued == 0
            with pytest.raises(AttributeError):
                stats.workers = 3  # type: ignore[misc]
            for n in range(3):
                tg.start_soon(p.apply, funcs.pool_gate, (n, gate.address))
            await gate.ready(2)
            stats = p.statistics()
            assert (stats.workers, stats.idle, stats.busy, stats.running, stats.queued) == (
                2,
                0,
                2,
                2,
                1,
            )
            gate.release()
            await gate.ready(3)
            gate.release(2)
        stats = p.statistics()
        assert stats.completed == 3 and stats.workers == 0


async def test_numpy_arrays_in_arguments_and_results() -> None:
    arr = np.arange(100_000, dtype=np.float64).reshape(100, 1000)
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            out = await p.apply(funcs.pool_np_double, (arr,))
            np.testing.assert_array_equal(out, arr * 2)
            outs = await p.map(funcs.pool_np_double, [arr[i] for i in range(4)])
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o, arr[i] * 2)


@asyncio_only
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_start_methods(method: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2, start_method=method) as p:
            assert await p.map(funcs.pool_square, range(6)) == [x * x for x in range(6)]
            assert await p.apply(funcs.pool_async_square, (3,)) == 9
            # workers may start processes of their own
            assert await p.apply(funcs.pool_is_daemon) is False


@asyncio_only
async def test_a_sync_worker_does_not_load_an_event_loop() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, grace_period=GRACE) as p:  # spawn: a clean interpreter
            modules = await p.apply(funcs.pool_modules)
            assert "asyncio" not in modules and "anyio" not in modules
            await p.apply(funcs.pool_async_square, (2,))
            modules = await p.apply(funcs.pool_modules)
            assert "asyncio" in modules and "anyio" not in modules


@asyncio_only
async def test_misuse() -> None:
    with pytest.raises(ValueError, match="processes"):
        aiomp.Pool(0)
    with pytest.raises(ValueError, match="concurrency"):
        aiomp.Pool(1, concurrency=0)
    with pytest.raises(ValueError, match="maxtasksperchild"):
        aiomp.Pool(1, maxtasksperchild=0)
    with pytest.raises(ValueError, match="start_method"):
        aiomp.Pool(1, start_method="thread")
    lock = threading.Lock()
    with pytest.raises(pickle.PicklingError, match="initializer"):
        aiomp.Pool(1, initializer=lambda: lock)
    p = pool(1)
    with pytest.raises(RuntimeError, match="not started"):
        await p.apply(funcs.pool_square, (1,))
    with anyio.fail_after(TIMEOUT):
        async with p:
            with pytest.raises(ValueError, match="chunksize"):
                await p.map(funcs.pool_square, [1], chunksize=0)
            with pytest.raises(ValueError, match="buffersize"):
                p.imap(funcs.pool_square, [1], buffersize=0)
    with pytest.raises(RuntimeError, match="closed"):
        p.imap(funcs.pool_square, [1])
    with pytest.raises(RuntimeError, match="once"):
        async with p:
            pass


def test_public_names() -> None:
    assert aiomp.Pool.__module__ == "aiomp"
    with pytest.warns(RuntimeWarning, match="never awaited or entered"):  # issue 31 item 1
        assert "aiomp.Pool" in repr(aiomp.Pool(1))
        gc.collect()
    assert issubclass(aiomp.BrokenWorkerError, aiomp.ProcessExitedException)


# -- examples ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("example", ["pool_service.py", "pool_pipeline.py"])
def test_examples_run(example: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
    }
    proc = run_python(f"examples/{example}", env=env)
    assert "ok" in proc.stdout.split()


# -- the wire: functions sent once per worker ------------------------------------------


@pytest.fixture
def ghost() -> Iterator[Callable[[], int]]:
    """A function of a module that exists only in this process: it pickles here, by
    reference, and cannot be unpickled in a worker."""
    mod = types.ModuleType("aiomp_test_ghost_module")

    def ghost_fn() -> int:
        return 1

    ghost_fn.__module__ = mod.__name__
    ghost_fn.__qualname__ = ghost_fn.__name__ = "ghost_fn"
    mod.ghost_fn = ghost_fn  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield ghost_fn
    del sys.modules[mod.__name__]


async def test_a_function_the_worker_cannot_load_fails_each_of_its_tasks(
    ghost: Callable[[], int],
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            for _ in range(2):  # the second task names the function the worker failed on
                with pytest.raises(ModuleNotFoundError, match="aiomp_test_ghost_module") as info:
                    await p.apply(ghost)
                assert "could not be unpickled in the worker" in str(info.value.__cause__)
            assert await p.apply(funcs.pool_square, (3,)) == 9


async def test_a_function_is_sent_to_each_worker_once() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            pid = await p.apply(funcs.pool_pid)
            for _ in range(3):
                assert await p.apply(funcs.pool_pid) == pid
            assert await p.map(funcs.pool_square, range(4)) == [0, 1, 4, 9]
            (w,) = p._engine.handles
            assert set(w.fns) == {
                _tasks.fn_info(funcs.pool_pid).fid,
                _tasks.fn_info(funcs.pool_square).fid,
            }


async def test_a_replacement_worker_is_taught_the_function_again() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            assert await p.apply(funcs.pool_square, (2,)) == 4
            with pytest.raises(aiomp.BrokenWorkerError):
                await p.apply(funcs.pool_exit, (3,))
            assert await p.apply(funcs.pool_square, (5,)) == 25


async def test_other_callables_travel_with_their_current_state() -> None:
    class Box:
        value = 1

        def get(self) -> int:
            return self.value

    with anyio.fail_after(TIMEOUT):
        async with pool() as p:
            assert await p.apply(functools.partial(funcs.pool_add, 1), (2,)) == 3
            assert await p.apply(functools.partial(funcs.pool_add, 1, c=10), (2,)) == 13
            assert await p.apply(operator.add, (2, 3)) == 5
            assert await p.apply((7).__add__, (1,)) == 8
            assert await p.apply(funcs.pool_add, (1, 2), {"c": 3}) == 6
            assert await p.starmap(funcs.pool_add, [(1, 2), (3, 4)]) == [3, 7]
            # A local class: by value (issue 29; it was refused), with its current state.
            box = Box()
            box.value = 5
            assert await p.apply(box.get) == 5
            box.value = 6
            assert await p.apply(box.get) == 6


# -- the hot paths (issue 17) ------------------------------------------------------------


def test_a_whole_frame_is_read_without_buffering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17 (the ``apply`` round trip): a frame that arrives whole and without fds is
    returned as read. Linux echoes ``MSG_CMSG_CLOEXEC`` back in ``recvmsg``'s flags, and
    the fast path took any flag for trouble, so every message of the round trip, in the
    pool and in the worker, went through the stream's buffer."""
    a, b = socket.socketpair()
    chan = _transport.Stream(a)

    def absorb(*_: object) -> None:
        raise AssertionError("a whole frame went through the buffer")

    monkeypatch.setattr(_transport.Stream, "_absorb", absorb)
    try:
        for tid, recv in ((1, chan.try_recv), (2, chan.recv_sync)):
            b.send(P.framed(P.OP_OK, tid, 0, pickle.dumps(None)))
            got = recv()
            assert got is not None
            assert P.unpack(*got)[:2] == (P.OP_OK, tid)
    finally:
        chan.close()
        b.close()


@asyncio_only
async def test_map_slices_its_input_and_places_each_chunks_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list, tuple or range is sliced chunk by chunk, never copied whole, and a range's
    chunks stay ranges (a few bytes each on the wire); each chunk's results land in their
    place in the result list as they come, whatever order the chunks finish in."""
    sent: list[type] = []
    make_task = _calls.make_task

    def spy(pool: Any, fn: Any, info: Any, flags: int, items: Any, *args: Any, **kw: Any) -> Any:
        sent.append(type(items))
        return make_task(pool, fn, info, flags, items, *args, **kw)

    monkeypatch.setattr(_calls, "make_task", spy)
    r = range(3, 3000, 7)
    squares = [x * x for x in r]
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            assert await p.map(funcs.pool_square, r) == squares
            assert set(sent) == {range} and len(sent) == 8
            assert await p.map(funcs.pool_square, tuple(r), chunksize=13) == squares
            assert await p.map(funcs.pool_square, list(r), chunksize=100) == squares
            assert await p.starmap(funcs.pool_add, [(x, 1) for x in r]) == [x + 1 for x in r]
            # A sync function that returns coroutines: each is awaited in the worker.
            assert await p.map(funcs.pool_returns_coroutine, range(5), chunksize=2) == [
                0,
                1,
                4,
                9,
                16,
            ]
