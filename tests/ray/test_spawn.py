"""Contract tests for ``aiomp.ray.spawn`` (issue 43), on a real two-node Ray cluster.

One ``ray.cluster_utils.Cluster`` serves the module: a head and a worker node of one
logical CPU each, so a job of two ranks asking one CPU each has a rank on each node (and
the next such job can start only once the last one's placement group is gone). The
node-loss test adds a third node and removes it mid-job. Ranks meet the test at a
:class:`Gate`; every await is bounded by ``anyio.fail_after``. Ray's long-lived processes
are registered with conftest's leak check as persistent, and the driver's gRPC sockets
are exempt from its fd check (``ray_fds_ok``), as in ``tests/ray/pool/``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._run import run_python
from tests.children import ray_spawn as funcs

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "aiomp[ray]")')

import aiomp.ray  # noqa: E402 - after the skip

TIMEOUT = 90  # an actor starts in about a second, far longer on two busy cores
GRACE = 0.3
REPO = Path(__file__).resolve().parents[2]

LOOPS = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])

pytestmark = [pytest.mark.anyio, pytest.mark.ray_fds_ok]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two nodes of one logical CPU each; this process's driver connected to them."""
    from ray.cluster_utils import Cluster

    from tests.conftest import _PERSISTENT, child_pids

    store = 80 * 2**20
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
    )
    try:
        c.add_node(num_cpus=1, object_store_memory=store, resources={"aiomp_x": 1})
        c.wait_for_nodes()
        ray.init(
            address=c.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )
        _PERSISTENT.update(child_pids())  # Ray's own processes live as long as the module
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def spawn(fn: Any, nprocs: int = 2, args: tuple[Any, ...] = (), **kw: Any) -> Any:
    kw.setdefault("grace_period", GRACE)
    return aiomp.ray.spawn(fn, nprocs, args, **kw)


async def gone(pid: int) -> None:
    """Wait until process ``pid`` (a rank's actor, on this machine) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def node_ids(cluster: Any) -> set[str]:
    return {cluster.head_node.node_id, *(n.node_id for n in cluster.worker_nodes)}


@asyncio_only
async def test_ranks_on_both_nodes_results_in_rank_order_output_labelled(
    cluster: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with spawn(funcs.where, 2, (7,)) as ctx:
            assert isinstance(ctx, aiomp.ProcessContext)
            actors = ctx.actors()
        got = ctx.results
    assert [r[:3] for r in got] == [(0, 7, (0, 2)), (1, 7, (1, 2))]
    assert {r[3] for r in got} == node_ids(cluster)  # one rank on each node
    assert [a.node_id for a in actors] == [r[3] for r in got]
    assert ctx.pids() == [r[4] for r in got]
    out, err = capfd.readouterr()
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
    assert "[rank 0] to stderr" in err and "[rank 1] to stderr" in err
    for pid in ctx.pids():  # the job's actors are gone once it is over
        with anyio.fail_after(TIMEOUT):
            await gone(pid)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})], ids=["uvloop"])
async def test_awaited_with_a_line_callback(cluster: Any) -> None:
    """The job awaited (no ``async with``), on uvloop, its lines to a callback."""
    lines: list[tuple[int, str, str]] = []
    with anyio.fail_after(TIMEOUT):
        ctx = await spawn(funcs.where, 2, (1,), output=lambda *x: lines.append(x))
        assert await ctx.join() is True
    assert [r[0] for r in ctx.results] == [0, 1]
    assert sorted(lines) == [
        (0, "stderr", "to stderr"),
        (0, "stdout", "hello from rank 0"),
        (1, "stderr", "to stderr"),
        (1, "stdout", "hello from rank 1"),
    ]


@asyncio_only
async def test_a_result_that_cannot_travel_fails_its_rank(cluster: Any) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException, match="could not be sent") as info:
            async with spawn(funcs.unpicklable, 1):
                pass
    assert info.value.error_index == 0 and "generator" in str(info.value)


@asyncio_only
async def test_gloo_all_reduce_across_nodes(cluster: Any) -> None:
    pytest.importorskip("torch")
    with anyio.fail_after(TIMEOUT * 2):  # each rank imports torch
        async with spawn(funcs.all_reduce, 2, rendezvous=True) as ctx:
            address = ctx.actors()[0].node_address
    (s0, env0), (s1, env1) = ctx.results
    assert s0 == s1 == 3.0
    for rank, env in enumerate((env0, env1)):
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",  # alone on its node
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": address,
        }


@asyncio_only
async def test_a_failing_rank_ends_the_job_and_the_cluster_runs_the_next(
    cluster: Any, gate: Gate
) -> None:
    """Rank 1 raises while rank 0 (sync: only a kill stops it) waits: the body is
    cancelled, the error is rank 1's with its traceback, rank 0's process is gone, and a
    job that needs the whole cluster runs next (the placement group was removed)."""
    body_cancelled = False
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException) as info:
            async with spawn(funcs.fail_or_wait, 2, (gate.address,)) as ctx:
                pids = await gate.ready(2)
                gate.release(1)
                try:
                    with anyio.fail_after(20):  # the failure cancels the body before this
                        await anyio.sleep_forever()
                finally:
                    body_cancelled = True
        assert body_cancelled
        exc = info.value
        assert exc.error_index == 1 and exc.pid == pids[1]
        assert "ValueError: rank 1 failed" in str(exc) and "in fail_or_wait" in str(exc)
        assert isinstance(exc.__cause__, ValueError)
        assert "children/ray_spawn.py" in str(exc.__cause__.__cause__)
        await gone(pids[0])
        await gone(pids[1])
        async with spawn(funcs.square, 2) as ctx:
            pass
        assert ctx.results == [0, 1]


@asyncio_only
async def test_cancelling_the_body_cancels_async_ranks_inside_their_actors(
    cluster: Any, gate: Gate, tmp_path: Path
) -> None:
    path = str(tmp_path / "flag")
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with spawn(funcs.async_at_gate, 2, (gate.address, path), grace_period=30):
                await gate.ready(2)
                scope.cancel()
        assert scope.cancelled_caught
    for rank in (0, 1):  # the coroutine saw CancelledError: no kill needed
        assert Path(f"{path}.{rank}").read_text() == "cancelled"  # noqa: ASYNC240 - a few bytes


@asyncio_only
async def test_a_job_waiting_for_resources_is_cancellable(cluster: Any, gate: Gate) -> None:
    """A job the cluster could hold, but not while another job holds its CPUs, waits for
    them; cancelled, it removes its placement group (nothing of it is left waiting)."""

    def live_groups() -> list[str]:
        return [k for k, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"]

    with anyio.fail_after(TIMEOUT):
        async with spawn(funcs.at_gate, 2, (gate.address,)):
            await gate.ready(2)
            held = live_groups()
            with anyio.move_on_after(2) as scope:  # it cannot start before the release
                await spawn(funcs.square, 1)
            assert scope.cancelled_caught
            assert live_groups() == held
            gate.release()


@LOOPS
async def test_an_unplaceable_job_raises_at_once(cluster: Any) -> None:
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(ValueError, match=r"3 ranks, each asking \{CPU: 1\}.* could hold 2"):
            async with spawn(funcs.square, 3):
                pass
        with pytest.raises(ValueError, match=r"STRICT_PACK: all on one node"):
            async with spawn(funcs.square, 2, strategy="STRICT_PACK"):
                pass
        with pytest.raises(ValueError, match=r"asking \{aiomp_none: 1\}"):
            async with spawn(funcs.square, 1, num_cpus=0, resources={"aiomp_none": 1}):
                pass
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


@asyncio_only
async def test_a_node_removed_mid_job_ends_it_with_an_error(cluster: Any, gate: Gate) -> None:
    """Two ranks asking the resource only the worker node and a third node have; the
    third node is removed while both wait: ActorExitedException naming that node, and
    the other rank's process is gone."""
    node = cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20, resources={"aiomp_x": 1})
    try:
        with anyio.fail_after(TIMEOUT * 2):
            await anyio.to_thread.run_sync(cluster.wait_for_nodes)
            with pytest.raises(aiomp.ProcessExitedException) as info:
                async with spawn(
                    funcs.at_gate, 2, (gate.address,), num_cpus=0, resources={"aiomp_x": 1}
                ) as ctx:
                    pids = await gate.ready(2)
                    where = {a.rank: a.node_id for a in ctx.actors()}
                    assert set(where.values()) == {n.node_id for n in cluster.worker_nodes}
                    await anyio.to_thread.run_sync(cluster.remove_node, node)
                    with anyio.fail_after(30):  # an error, not a wait: it cancels the body
                        await anyio.sleep_forever()
            exc = info.value
            assert isinstance(exc, aiomp.ray.ActorExitedException), exc
            lost = next(r for r, n in where.items() if n == node.node_id)
            assert exc.error_index == lost and exc.node_id == node.node_id
            assert "died" in str(exc)
            await gone(pids[1 - lost])
    finally:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)


@asyncio_only
async def test_ray_shutdown_under_a_running_job_ends_it(cluster: Any, gate: Gate) -> None:
    """As for aiomp.ray.Pool (issue 25 item 11): after ``ray.shutdown()`` no ref of the
    job settles; the job ends within about SESSION_CHECK seconds with
    ActorExitedException, and nothing starts a Ray instance of its own. Reconnected, the
    cluster runs the next job (Ray ended the old job's actors and group with its driver)."""
    try:
        with anyio.fail_after(TIMEOUT):
            # Whichever Ray tells first: the session check, or an actor's death (its owner,
            # the driver, went with the session).
            shut_down = "Ray was shut down|because its owner has died"
            with pytest.raises(aiomp.ray.ActorExitedException, match=shut_down):
                async with spawn(funcs.at_gate, 2, (gate.address,)):
                    await gate.ready(2)
                    await anyio.to_thread.run_sync(ray.shutdown)
                    with anyio.fail_after(20):  # SESSION_CHECK (1 s), with room for a busy host
                        await anyio.sleep_forever()
            assert not ray.is_initialized()
    finally:
        if not ray.is_initialized():
            ray.init(
                address=cluster.address,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
            )
    with anyio.fail_after(TIMEOUT):
        async with spawn(funcs.square, 2) as ctx:
            pass
    assert ctx.results == [0, 1]


def test_arguments_that_cannot_cross_nodes_raise_type_error() -> None:
    """An aiomp.Queue or Event, or an array in aiomp's shared memory, raises TypeError
    naming what to use instead, before anything starts (no cluster needed)."""

    async def main() -> None:
        q = aiomp.Queue()
        try:
            with pytest.raises(TypeError, match=r"aiomp.Queue cannot reach another node.*ray"):
                async with aiomp.ray.spawn(funcs.square, 2, ([1, {"q": q}],)):
                    pass
        finally:
            q.close()
        shared = aiomp.zeros(16)
        with pytest.raises(TypeError, match=r"shared memory.*plain numpy array"):
            await aiomp.ray.spawn(funcs.square, 1, (shared[2:],))
        del shared
        event = aiomp.Event()
        with pytest.raises(TypeError, match=r"aiomp.Event cannot reach another node"):
            await aiomp.ray.spawn(funcs.square, 1, ({"nested": [event]},))

    ray_was = ray.is_initialized()
    anyio.run(main)
    assert ray.is_initialized() == ray_was  # refused before connecting


def test_bad_arguments_raise_at_the_call() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        aiomp.ray.spawn(funcs.square, 0)
    with pytest.raises(ValueError, match="num_cpus"):
        aiomp.ray.spawn(funcs.square, 1, num_cpus=-1)
    with pytest.raises(ValueError, match="strategy must be one of"):
        aiomp.ray.spawn(funcs.square, 1, strategy="pack")
    with pytest.raises(ValueError, match="must ask for some resource"):
        aiomp.ray.spawn(funcs.square, 1, num_cpus=0)
    with pytest.raises(ValueError, match="output must be"):
        aiomp.ray.spawn(funcs.square, 1, output="nowhere")
    with pytest.raises(TypeError, match="fn must be callable"):
        aiomp.ray.spawn(3, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="args must be a tuple"):
        aiomp.ray.spawn(funcs.square, 1, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="env"):
        aiomp.ray.spawn(funcs.square, 1, env={"A": 1})  # type: ignore[dict-item]


@pytest.mark.parametrize("anyio_backend", [("trio", {})], ids=["trio"])
async def test_trio_is_refused_clearly() -> None:
    with pytest.raises(RuntimeError, match="asyncio and uvloop only"):
        async with aiomp.ray.spawn(funcs.square, 1):
            pass


def test_example_runs(cluster: Any) -> None:
    """examples/ray_ddp.py joins the module's cluster: DDP over gloo across its two nodes,
    the weights equal on both, each rank's print labelled. (Its ``--fail`` path is the
    failing rank of the test above, with torch.)"""
    pytest.importorskip("torch")
    out = run_python("examples/ray_ddp.py", "--address", cluster.address, timeout=180)
    assert out.stdout.strip().endswith("ok"), out.stdout
    assert "2 ranks on 2 node(s)" in out.stdout and "equal on every rank: True" in out.stdout
    assert "[rank 0] node " in out.stdout and "[rank 1] node " in out.stdout


def test_an_actor_exited_exception_says_how_its_rank_ended() -> None:
    """A rank its job killed exited by SIGKILL; one that died on its own, with 1 (Ray does
    not say how); every attribute travels in a pickle, under the public name."""
    import pickle

    where = {"node_id": "n1", "node_address": "10.0.0.2", "actor_id": "a1"}
    killed = aiomp.ray.ActorExitedException("was killed", 0, 11, killed=True, **where)
    died = aiomp.ray.ActorExitedException("died", 1, None, **where)
    assert (killed.exit_code, killed.signal_name) == (-9, "SIGKILL")
    assert (died.exit_code, died.signal_name) == (1, None)
    for exc in (killed, died):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is aiomp.ray.ActorExitedException and vars(copy) == vars(exc)
