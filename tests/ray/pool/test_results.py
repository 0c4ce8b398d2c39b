"""Contract tests for ``aiomp.ray.Pool`` (README "Beyond one machine"), on real Ray:
results and faults of one Pool (the cluster-wide ones in ``tests/ray/pool/test_cluster.py``).

One Ray instance serves the whole package (``tests/ray/pool/conftest.py``): a
``ray.cluster_utils.Cluster`` head node
(Ray's processes start in seconds, not per test); the two-node test adds a second raylet
to it and removes it again. The local Pool's behavioural tests are ported: results,
exceptions with the remote traceback, an actor killed mid-task, timeout, cancellation,
maxtasksperchild, initializer, imap back-pressure, arrays. Loop plumbing is tested on
asyncio and uvloop; under trio the pool must refuse with a clear error.

Actors meet the test at a :class:`Gate`; every await is bounded by ``anyio.fail_after``.
Ray's own long-lived processes are registered with conftest's leak check as persistent,
and the driver's gRPC sockets are exempt from its fd check (``ray_fds_ok``, see conftest).
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from tests._gate import Gate
from tests.children import ray as funcs
from tests.ray.pool._ray import GRACE, LOOPS, REPO, TIMEOUT, asyncio_only, pool, ray

pytestmark = [pytest.mark.anyio, pytest.mark.ray_fds_ok, pytest.mark.usefixtures("ray_head")]


@LOOPS
async def test_results() -> None:
    async def numbers() -> AsyncIterator[int]:
        for i in range(20):
            yield i

    with anyio.fail_after(TIMEOUT):
        async with pool(2, concurrency=2) as p:
            assert await p.apply(funcs.square, (7,)) == 49
            assert await p.apply(funcs.add, (1,), {"y": 2}) == 3
            assert await p.apply(funcs.async_square, (5,)) == 25
            assert await p.apply(lambda x: x + 1, (1,)) == 2  # cloudpickled, by value
            before = p.statistics().completed
            assert await p.map(funcs.square, range(100)) == [x * x for x in range(100)]
            assert p.statistics().completed - before == 2  # a chunk per actor by default
            assert await p.map(funcs.async_square, numbers()) == [x * x for x in range(20)]
            assert await p.starmap(funcs.add, [(1, 2), (3, 4)]) == [3, 7]
            assert [x async for x in p.imap(funcs.square, range(20), 3)] == [
                x * x for x in range(20)
            ]
            got = [x async for x in p.imap_unordered(funcs.square, numbers(), chunksize=4)]
            assert sorted(got) == [x * x for x in range(20)]
            assert await p.map(funcs.square, []) == []
            stats = p.statistics()
            assert stats.workers == 2 and stats.running == stats.queued == 0
            assert len(p.actors()) == 2 and p.pids()  # the second may still be starting
            assert "aiomp.ray.Pool open" in repr(p)


@asyncio_only
async def test_exception_is_its_own_type_with_the_actor_traceback() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with pytest.raises(ValueError, match="boom") as info:
                await p.apply(funcs.fail, ("boom",))
            assert "in fail" in str(info.value.__cause__)
            assert "children/ray.py" in str(info.value.__cause__)
            with pytest.raises(ValueError, match="boom"):  # map raises the first, bare
                await p.map(funcs.fail, ["boom", "boom"])
            with pytest.raises(pickle.PicklingError, match="result of unpicklable_result"):
                await p.apply(funcs.unpicklable_result)
            assert await p.apply(funcs.square, (3,)) == 9  # the actor lives on
            assert p.statistics().replaced == 0
            with pytest.raises(TypeError):  # pickled in the caller: raises here, sends nothing
                await p.apply(funcs.add, (1,), {"y": (i for i in ())})
            # Issue 25 item 9, as on a process pool: the caller gets the task's SystemExit,
            # and the actor serves on (it re-raised it and died).
            with pytest.raises(SystemExit) as exit_info:
                await p.apply(sys.exit, (3,))
            assert exit_info.value.code == 3
            assert await p.apply(funcs.square, (4,)) == 16
            assert p.statistics().replaced == 0


@LOOPS
async def test_actor_killed_mid_task_fails_only_its_task_and_is_replaced(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            results: dict[int, object] = {}

            async def call(rank: int) -> None:
                try:
                    results[rank] = await p.apply(funcs.at_gate, (rank, gate.address))
                except Exception as exc:  # noqa: BLE001
                    results[rank] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, 0)
                tg.start_soon(call, 1)
                pids = await gate.ready(2)
                os.kill(pids[0], signal.SIGKILL)
                gate.release(1)
            assert isinstance(results[0], aiomp.BrokenWorkerError), results[0]
            assert "while it ran at_gate" in str(results[0])
            assert results[1] == 1
            # The replacement serves: two actors, the killed one not among them.
            got = set(await p.map(funcs.pid, range(8), chunksize=1))
            assert pids[0] not in got
            assert await p.apply(funcs.square, (4,)) == 16


@asyncio_only
async def test_timeout_kills_a_sync_task_and_replaces_its_actor(gate: Gate) -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            first = await p.apply(funcs.pid)
            with pytest.raises(TimeoutError):
                await p.apply(funcs.at_gate, (0, gate.address), timeout=1.0)
            assert await p.apply(funcs.pid) != first
            assert p.statistics().replaced == 1


@LOOPS
async def test_cancelling_an_async_task_cancels_it_inside_the_actor(
    gate: Gate, tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    with anyio.fail_after(TIMEOUT):
        async with pool(1, concurrency=2, grace_period=10) as p:
            first = await p.apply(funcs.pid)
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.async_at_gate, (0, gate.address, str(flag)))
                await gate.ready(1)
                tg.cancel_scope.cancel()
            assert flag.read_text() == "cancelled"  # its cleanup ran before we went on
            assert await p.apply(funcs.pid) == first  # the actor was not killed
            assert p.statistics().replaced == 0


@asyncio_only
async def test_cancelled_calls_never_start(gate: Gate, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await p.apply(funcs.record, (str(log),))  # sends nothing
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, funcs.at_gate, (0, gate.address))
                await gate.ready(1)
                with anyio.move_on_after(0.2):  # queued behind the blocked actor
                    await p.apply(funcs.record, (str(log),))
                assert p.statistics().queued == 0  # dropped
                gate.release(0)
            await p.apply(funcs.square, (1,))
            assert not log.exists()


@asyncio_only
async def test_maxtasksperchild_and_initializer() -> None:
    with anyio.fail_after(TIMEOUT):
        async with pool(
            1, maxtasksperchild=2, initializer=funcs.init_state, initargs=("ready",)
        ) as p:
            pids = [await p.apply(funcs.pid) for _ in range(4)]
            assert pids[0] == pids[1] != pids[2] == pids[3]
            assert await p.apply(funcs.state) == ["ready"]  # once per actor
            assert p.statistics().replaced == 2
        async with pool(1, initializer=funcs.init_fail) as p:
            with pytest.raises(aiomp.BrokenPoolError, match="initializer raised KeyError"):
                await p.apply(funcs.square, (1,))


@asyncio_only
async def test_imap_endless_input_is_read_only_as_fast_as_consumed() -> None:
    pulled = 0

    def endless() -> Iterator[int]:
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield i

    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            async with p.imap(funcs.square, endless(), 2, buffersize=3) as it:
                for i in range(10):
                    assert await it.__anext__() == i * i
                    assert pulled <= (i + 1) + 3 * 2 + 2
            assert p.statistics().queued == 0


@asyncio_only
async def test_arrays_go_through_the_object_store_once_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large arrays are put once per call and arrive read-only; large results come back
    through the object store. Pins a bug found while building this: a result in the object
    store whose ref the handle did not hold until Ray's callback made Ray abort the whole
    process (``ObjectUnknownOwner`` in ``PlasmaCallback``)."""
    big = np.arange(100_000, dtype=np.float64)  # 800 kB: above ARRAY_THRESHOLD
    small = np.arange(10, dtype=np.float64)
    puts = []
    real_put = ray.put

    def counting_put(value: Any, **kw: Any) -> Any:
        puts.append(value.nbytes)
        return real_put(value, **kw)

    monkeypatch.setattr(ray, "put", counting_put)
    with anyio.fail_after(TIMEOUT):
        async with pool(2) as p:
            _, writable, total = await p.apply(funcs.array_info, (big,))
            assert not writable and total == big.sum()  # read-only, as Ray gives them
            assert puts == [big.nbytes]
            got = await p.starmap(funcs.array_info, [(big, i) for i in range(8)], chunksize=1)
            assert [t for _, _, t in got] == [big.sum() + i for i in range(8)]
            assert puts == [big.nbytes] * 2  # once for the whole call, not per chunk
            big += 1  # changed in place between two calls: the next call puts it again
            got = await p.starmap(funcs.array_info, [(big, 0)] * 2, chunksize=1)
            assert [t for _, _, t in got] == [big.sum()] * 2 and len(puts) == 3
            assert (await p.apply(funcs.array_info, (small,)))[2] == small.sum()
            assert len(puts) == 3  # small arrays travel inside the task
            out = await p.apply(funcs.ones, (200_000,))
            assert out.sum() == 200_000 and not out.flags.writeable


def test_bad_arguments_raise_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="num_cpus"):
        aiomp.ray.Pool(1, num_cpus=-1)
    with pytest.raises(ValueError, match="num_gpus"):
        aiomp.ray.Pool(1, num_gpus="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initializer must be callable"):
        aiomp.ray.Pool(1, initializer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="processes"):
        aiomp.ray.Pool(0)


@asyncio_only
async def test_default_processes_fill_the_cluster() -> None:
    with anyio.fail_after(TIMEOUT):
        async with aiomp.ray.Pool(num_cpus=2, grace_period=GRACE) as p:  # the head has 4
            assert p.processes == 2
            assert await p.apply(funcs.square, (2,)) == 4


@pytest.mark.parametrize("anyio_backend", [("trio", {})], ids=["trio"])
async def test_trio_is_refused_clearly() -> None:
    with pytest.raises(RuntimeError, match="asyncio and uvloop only"):
        async with aiomp.ray.Pool(1):
            pass


def test_import_aiomp_ray_does_not_import_ray() -> None:
    code = (
        "import sys, aiomp, aiomp.ray; p = aiomp.ray.Pool(2); "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
