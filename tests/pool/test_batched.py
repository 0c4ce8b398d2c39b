"""``pool.batched`` (docs/design.md "Serving: dynamic batching"; issue 28): batches form and
respect ``max_batch_size``, every caller gets its own element, ``stack=True`` travels as
one shared-memory array, and each fault does what the contract says.

On asyncio, uvloop and trio. No sleeps: a batch the test must hold meets it at a
:class:`Gate`; every await is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common
from tests.children import serve as funcs
from tests.pool._pools import FAST, settled

TIMEOUT = 30

pytestmark = pytest.mark.anyio


async def gather(call: Callable[[Any], Awaitable[Any]], xs: list[Any]) -> list[Any]:
    """``call(x)`` for each x, all at once; the results (or exceptions) in order."""
    out: list[Any] = [None] * len(xs)

    async def one(i: int) -> None:
        try:
            out[i] = await call(xs[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(xs)):
            tg.start_soon(one, i)
    return out


async def test_each_caller_gets_its_own_element(anyio_backend: object) -> None:
    """issue 28: 70 concurrent callers, batches of at most 32 that do form."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=FAST) as pool:
            b = pool.batched(funcs.double_all, max_batch_size=32, max_delay=0.05)
            got = await gather(b, list(range(70)))
            assert [r[0] for r in got] == [2 * x for x in range(70)]
            sizes = {r[1] for r in got}
            assert max(sizes) == 32 and max(sizes) <= 32
            b = pool.batched(funcs.double_all_async, max_batch_size=4, max_delay=0.05)
            got = await gather(b, list(range(9)))
            assert [r[0] for r in got] == [2 * x for x in range(9)]
            assert sorted({r[1] for r in got}) == [1, 4]
            # One call alone: closed by the delay.
            assert await b(5) == (10, 1)


async def test_stack_is_one_shared_array_and_views_come_back(anyio_backend: object) -> None:
    """issue 28: stack=True: fn gets one shared-memory array; callers get views of one
    result; a call of another shape or dtype: ValueError at once."""
    gate = Gate()
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=FAST) as pool:
            b = pool.batched(funcs.stacked_info, max_batch_size=8, max_delay=0.05, stack=True)
            xs = [np.full((32, 32), float(i)) for i in range(8)]  # 64 KiB in all: shared
            got = await gather(b, xs)
            for i, row in enumerate(got):
                assert isinstance(row, np.ndarray)
                assert list(row) == [8.0, 1.0, float(i)]
            assert all(np.shares_memory(got[0].base, r) for r in got)  # views of one
            small = pool.batched(funcs.stacked_info, max_batch_size=8, stack=True)
            got = await gather(small, [np.full((4, 4), float(i)) for i in range(8)])
            assert [list(r) for r in got] == [[8.0, 0.0, float(i)] for i in range(8)]  # inline
            big = pool.batched(funcs.stacked_times_two, max_batch_size=4, stack=True)
            ys = [np.full((128, 128), float(i)) for i in range(4)]
            out = await gather(big, ys)
            for i, r in enumerate(out):
                assert r.shape == (128, 128) and (r == 2.0 * i).all()

            opened: list[Any] = []
            async with anyio.create_task_group() as tg:

                async def opener() -> None:
                    opened.append(await b(np.zeros((32, 32))))

                # The only worker is busy: the batch stays open.
                tg.start_soon(pool.apply, common.gate_wait, (0, gate.address))
                await gate.ready(1)
                tg.start_soon(opener)
                await settled()  # the batch is open, its rows (32, 32) float64
                for bad in (np.zeros((3, 4)), np.zeros((32, 32), "f4"), 1):
                    with pytest.raises(ValueError, match="stack=True"):
                        await b(bad)
                gate.release()
            assert isinstance(opened[0], np.ndarray)
    gate.close()


async def test_fn_raising_is_raised_in_every_caller(anyio_backend: object) -> None:
    """issue 28: fn's exception in each caller, as Pool.apply raises it: with
    split_on_error=False, the batch's; by default, each row's own (run alone)."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=FAST) as pool:
            b = pool.batched(funcs.raise_value_error, max_batch_size=3)
            got = await gather(b, [1, 2, 3])
            for exc in got:
                assert isinstance(exc, ValueError) and "bad batch of 1" in str(exc)
                assert exc.__cause__ is not None and "raise_value_error" in str(exc.__cause__)
            b = pool.batched(funcs.raise_value_error, max_batch_size=3, split_on_error=False)
            got = await gather(b, [1, 2, 3])
            for exc in got:
                assert isinstance(exc, ValueError) and "bad batch of 3" in str(exc)
                assert exc.__cause__ is not None and "raise_value_error" in str(exc.__cause__)
            assert len({id(e) for e in got}) == 3


async def test_wrong_length_is_value_error_naming_both(anyio_backend: object) -> None:
    """issue 28: a result of the wrong length: ValueError in each, naming both lengths."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=FAST) as pool:
            b = pool.batched(funcs.one_short, max_batch_size=3)
            for exc in await gather(b, [1, 2, 3]):
                assert isinstance(exc, ValueError)
                assert "2" in str(exc) and "3" in str(exc), exc


async def test_worker_killed_mid_batch(anyio_backend: object) -> None:
    """issue 28: a worker SIGKILLed mid-batch: BrokenWorkerError in each; the pool goes on."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method=FAST) as pool:
            b = pool.batched(funcs.die_in_batch, max_batch_size=3)
            for exc in await gather(b, [1, 2, 3]):
                assert isinstance(exc, aiomp.BrokenWorkerError)
            ok = pool.batched(funcs.double_all, max_batch_size=2)
            assert await gather(ok, [1, 2]) == [(2, 2), (4, 2)]


async def test_cancel_before_hand_off_takes_the_caller_out(anyio_backend: object) -> None:
    """issue 28: a caller cancelled while its batch is open, or closed and queued, is
    taken out (fn never sees it); a queued batch left empty is dropped."""
    gate = Gate()
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, start_method=FAST) as pool:
                results: dict[int, Any] = {}
                b = pool.batched(funcs.double_all, max_batch_size=3, max_delay=60)
                async with anyio.create_task_group() as tg:
                    # The only worker is busy: the batches below wait in the pool.
                    tg.start_soon(pool.apply, common.gate_wait, (0, gate.address))
                    await gate.ready(1)
                    scopes = {}
                    for x in (1, 2, 3, 4, 5, 6):
                        scopes[x] = anyio.CancelScope()

                        async def call(x: int = x) -> None:
                            with scopes[x]:
                                results[x] = await b(x)

                        tg.start_soon(call)
                        await settled()
                    # Batch (1, 2, 3) and batch (4, 5, 6) are closed and queued.
                    scopes[2].cancel()
                    for x in (4, 5, 6):
                        scopes[x].cancel()
                    await settled()
                    assert pool.statistics().queued == 1
                    # An open batch: 7 is taken out before it goes; 8 goes alone.
                    for x in (7, 8):
                        scopes[x] = anyio.CancelScope()

                        async def call2(x: int = x) -> None:
                            with scopes[x]:
                                results[x] = await b(x)

                        tg.start_soon(call2)
                        await settled()
                    scopes[7].cancel()
                    await settled()
                    gate.release()  # (1, 3) runs, then 8 alone, once the worker is free
                assert results == {1: (2, 2), 3: (6, 2), 8: (16, 1)}
                assert pool.statistics().completed == 3  # the gate's task, two batches
    finally:
        gate.close()


async def test_cancel_after_hand_off_returns_at_once(anyio_backend: object) -> None:
    """issue 28: a caller cancelled while its batch runs returns at once; the worker is
    not killed and the others get theirs."""
    gate = Gate()
    try:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, start_method=FAST) as pool:
                pid = await pool.apply(funcs.who)
                assert pid is not None
                b = pool.batched(funcs.gate_then_double, max_batch_size=3, max_delay=60)
                results: dict[int, Any] = {}
                cancelled = anyio.CancelScope()
                async with anyio.create_task_group() as tg:

                    async def call(x: int) -> None:
                        results[x] = await b((gate.address, x))

                    async def doomed() -> None:
                        with cancelled:
                            results[2] = await b((gate.address, 2))
                        results[2] = "cancelled"

                    # The only worker is busy: the three calls form one batch.
                    tg.start_soon(pool.apply, common.gate_wait, (0, gate.address))
                    await gate.ready(1)
                    tg.start_soon(call, 1)
                    await settled()
                    tg.start_soon(doomed)
                    await settled()
                    tg.start_soon(call, 3)
                    await settled()
                    gate.release(0)
                    await gate.ready(2)  # the batch runs, held at the gate
                    cancelled.cancel()
                    await settled()
                    assert results == {2: "cancelled"}  # while the batch still runs
                    gate.release(pid[4])
                assert results == {1: 2, 2: "cancelled", 3: 6}
                assert await pool.apply(funcs.who) == pid
                assert pool.statistics().replaced == 0
    finally:
        gate.close()
