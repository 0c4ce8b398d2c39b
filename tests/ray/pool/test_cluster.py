"""Contract tests for ``aiomp.ray.Pool`` across its cluster, on real Ray: placement on two
nodes and a node's loss, the example, faults that end in an error rather than a wait
(an unreachable address, Ray shut down under a task, an actor no node can hold), a Pool
inside an actor, more actors than fit, worker info and batching, serving.

The Ray instance, gates and bounds are those of ``tests/ray/pool/test_results.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import numpy as np
import pytest

import aiomp
from tests._gate import Gate
from tests._run import run_python
from tests.children import ray as funcs
from tests.ray.pool._ray import LOOPS, TIMEOUT, asyncio_only, pool, ray

pytestmark = [pytest.mark.anyio, pytest.mark.ray_fds_ok, pytest.mark.usefixtures("ray_head")]


@asyncio_only
async def test_two_nodes_placement_and_node_loss(ray_head: Any, gate: Gate) -> None:
    """Actors are placed on both raylets; removing one node fails only the tasks its actors
    held (BrokenWorkerError), and the pool replaces them on the remaining node."""
    head = ray_head.head_node.node_id
    node = ray_head.add_node(num_cpus=2, resources={"aiomp_w": 2}, object_store_memory=100 * 2**20)
    try:
        with anyio.fail_after(TIMEOUT * 2):
            await anyio.to_thread.run_sync(ray_head.wait_for_nodes)
            # A placeholder holds two of the head's four "aiomp_w": four actors that need
            # one each must then use both nodes.
            held, release = anyio.Event(), anyio.Event()

            async def holder() -> None:
                async with pool(1, num_cpus=0, resources={"aiomp_w": 2, "aiomp_head": 1}) as h:
                    await h.apply(funcs.square, (1,))
                    held.set()
                    await release.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await held.wait()
                async with pool(4, num_cpus=0, resources={"aiomp_w": 1}) as p:
                    results: dict[int, object] = {}

                    async def call(rank: int) -> None:
                        try:
                            results[rank] = await p.apply(funcs.at_gate, (rank, gate.address))
                        except Exception as exc:  # noqa: BLE001
                            results[rank] = exc

                    async with anyio.create_task_group() as calls:
                        for rank in range(4):
                            calls.start_soon(call, rank)
                        pids = await gate.ready(4)  # a sync task holds a whole actor: 4 actors
                        actors = p.actors()
                        assert {a.node_id for a in actors} == {head, node.node_id}
                        lost = {a.pid for a in actors if a.node_id == node.node_id}
                        assert len(lost) == 2
                        release.set()  # the placeholder goes: room on the head again
                        await anyio.to_thread.run_sync(ray_head.remove_node, node)
                        gate.release(*(r for r, pid in pids.items() if pid not in lost))
                    for rank, pid in pids.items():
                        if pid in lost:
                            assert isinstance(results[rank], aiomp.BrokenWorkerError), results
                        else:
                            assert results[rank] == rank
                    where = await p.map(funcs.node_and_pid, range(8), chunksize=1)
                    assert {n for n, _ in where} == {head}
                    assert p.statistics().replaced == 2
                    live = p.actors()  # a replacement still starting has no node yet
                    assert len(live) == 4 and {a.node_id for a in live} <= {head, None}
    finally:
        if node in ray_head.worker_nodes:
            ray_head.remove_node(node)


def test_example_runs(ray_head: Any) -> None:
    """examples/ray_pool.py, the local pipeline on Ray, joins the module's Ray instance."""
    out = run_python(
        "examples/ray_pool.py", "--batches", "8", "--address", ray_head.address, timeout=120
    )
    assert out.stdout.strip().endswith("ok")


# -- faults that end in an error, not a wait (issue 25 item 11) --------------------------


def test_unreachable_address_fails_at_once_and_connecting_is_cancellable() -> None:
    """Issue 25 item 11: ``fail_after(30)`` around ``Pool(address=<nothing listens>)`` had
    not fired after 90 s (``ray.init`` retried for two minutes in a thread the await could
    not leave, then raised SystemExit). In a fresh interpreter: see
    ``tests.children.ray.connect_faults``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code = "from tests.children.ray import connect_faults; connect_faults()"
    out = run_python("-c", code, timeout=90, env=env)
    assert out.stdout.strip().endswith("ok")


@LOOPS
async def test_ray_shutdown_under_a_running_task_fails_it_promptly(
    gate: Gate, ray_reconnect: None
) -> None:
    """Issue 25 item 11: after ``ray.shutdown()`` under a running task the call never
    completed (no ref's callback runs again; a replacement actor's ``.remote()`` even
    started a local Ray of its own). The task fails with BrokenWorkerError within about
    SESSION_CHECK seconds, later calls with BrokenPoolError."""
    results: list[object] = []
    done = anyio.Event()

    async def call() -> None:
        try:
            results.append(await p.apply(funcs.at_gate, (0, gate.address)))
        except Exception as exc:  # noqa: BLE001
            results.append(exc)
        finally:
            done.set()

    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            assert await p.apply(funcs.square, (2,)) == 4
            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await gate.ready(1)
                await anyio.to_thread.run_sync(ray.shutdown)
                with anyio.fail_after(10):  # SESSION_CHECK (1 s), with room for a busy host
                    await done.wait()
            assert isinstance(results[0], aiomp.BrokenWorkerError), results
            # Ray may report the actor's death before its session ends: either is clear.
            assert "Ray was shut down" in str(results[0]) or "owner has died" in str(results[0])
            with pytest.raises(aiomp.BrokenPoolError, match="Ray was shut down"):
                await p.apply(funcs.square, (1,))
        assert not ray.is_initialized()  # nothing started a Ray instance of its own


@LOOPS
async def test_an_actor_no_node_can_hold_fails_at_once() -> None:
    """Issue 25 item 11: a pool whose actors no node could hold waited silently for ever.
    Entering raises ValueError (as Ray's Pool does) naming what was asked and what the
    nodes have; nothing is started."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(ValueError, match=r"each asks \{CPU: 8\}.* its nodes have \{CPU: 4\}"):
            async with pool(1, num_cpus=8):
                pass
        with pytest.raises(ValueError, match=r"asks \{aiomp_none: 1\}"):
            async with pool(1, num_cpus=0, resources={"aiomp_none": 1}):
                pass


@asyncio_only
async def test_a_pool_inside_an_actor_counts_what_the_actor_holds() -> None:
    """Issue 25 item 11: a pool opened inside another pool's actor, asking for what only
    that actor's own CPU would complete, waited for ever. The head has 4 CPUs and the
    outer actor holds 1: an inner actor asking 4 raises ValueError, one asking 3 runs."""
    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            got = await p.apply(funcs.nested_pool, (4,))
            assert got.startswith("ValueError: Ray cannot place"), got
            assert "beside what the caller holds there ({CPU: 1}" in got, got
            assert await p.apply(funcs.nested_pool, (3,)) == "ok 9"


@asyncio_only
async def test_more_actors_than_fit_serve_with_those_that_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 25 item 11: more actors than the cluster holds are not an error (an
    autoscaling cluster may grow), but no longer silent: a warning says how many fit."""
    with anyio.fail_after(TIMEOUT):
        async with pool(2, num_cpus=3) as p:  # the head has 4 CPUs: one fits
            assert "2 actors asked, and the cluster's nodes can hold 1" in caplog.text
            assert await p.apply(funcs.square, (5,)) == 25


@LOOPS
async def test_worker_info_and_batched(anyio_backend: object) -> None:
    """issue 28: an actor's get_worker_info() is its slot; pool.batched works on Ray,
    stack=True included (read-only views through the object store), and each caller of a
    failing batch gets the error."""
    from tests.children import serve

    with anyio.fail_after(TIMEOUT):
        async with pool(1) as p:
            who = await p.apply(serve.who)
            assert who is not None and who[:4] == (0, 1, None, None)
            b = p.batched(serve.double_all, max_batch_size=4, max_delay=0.05)
            got = await _gather(b, list(range(6)))
            assert [r[0] for r in got] == [2 * x for x in range(6)]
            assert max(r[1] for r in got) == 4
            s = p.batched(serve.stacked_times_two, max_batch_size=3, stack=True)
            rows = await _gather(s, [np.full((128, 128), float(i)) for i in range(3)])
            for i, r in enumerate(rows):
                assert (r == 2.0 * i).all() and not r.flags.writeable
            bad = p.batched(serve.raise_value_error, max_batch_size=2)
            for exc in await _gather(bad, [1, 2], catch=True):
                assert isinstance(exc, ValueError) and exc.__cause__ is not None


@asyncio_only
async def test_serving_on_ray() -> None:
    """issue 40 on aiomp.ray.Pool: wait_ready, a bad row failing alone (its halves run
    again on the actor), and max_pending refusing what cannot start."""
    from tests.children import serve

    with anyio.fail_after(TIMEOUT):
        async with pool(1, max_pending=0) as p:
            await p.wait_ready()
            b = p.batched(serve.fails_on_negative, max_batch_size=4, max_delay=60)
            got = await _gather(b, [1, -2, 3, 4], catch=True)
            assert [g[0] for g in got if not isinstance(g, Exception)] == [2, 6, 8]
            assert isinstance(got[1], ValueError) and str(got[1]) == "negative rows [-2]"
            async with anyio.create_task_group() as tg:
                tg.start_soon(p.apply, time.sleep, (1.0,))
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(aiomp.PoolOverloadedError):
                    await p.apply(serve.who)


async def _gather(call: Any, xs: list[Any], catch: bool = False) -> list[Any]:
    out: list[Any] = [None] * len(xs)

    async def one(i: int) -> None:
        try:
            out[i] = await call(xs[i])
        except Exception as exc:
            if not catch:
                raise
            out[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(xs)):
            tg.start_soon(one, i)
    return out
