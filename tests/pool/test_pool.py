"""Contract tests for ``aiomp.Pool`` (README "Pool"), through the public API: results,
dispatch and errors here; crashes, timeouts and cancellation in test_crashes.py; the
workers' lifetime and what they are sent in test_workers.py.

Tests whose subject is the event-loop plumbing (results, crashes, timeouts, cancellation,
imap back-pressure) run on asyncio, uvloop and trio; the rest run on asyncio only, to keep
the file fast on two cores. Workers are never slept on: a task the test must wait for
meets it at a :class:`Gate`, and every await is bounded by ``anyio.fail_after``. Most
pools use the fork server (conftest starts it once), which starts a worker in
milliseconds; ``test_workers.py::test_start_methods`` covers spawn and fork.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import aiomp
from aiomp._pool import workers as _workers
from tests._gate import Gate
from tests.children import common as funcs
from tests.pool._pools import asyncio_only, pool, remote_text, settled

TIMEOUT = 20

pytestmark = pytest.mark.anyio


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
