"""``aiomp.ray.spawn``: :func:`aiomp.spawn`'s job with its ranks as Ray actors in a cluster.

:func:`spawn` checks its arguments at the call and returns the local spawn's
:class:`~aiomp._spawn.api.SpawnHandle` (awaitable, and an ``async with`` that supervises the
job: the first failure stops the others and cancels the body). Awaited or entered, it
(see :func:`start_ranks`):

1. pickles ``(fn, args)`` with Ray's cloudpickle, refusing what cannot cross nodes
   (``TypeError``: an ``aiomp.Queue`` or ``aiomp.Event``, an array in aiomp's shared memory);
2. connects to Ray (``aiomp.ray._session``), unless this process already has a session;
3. checks that the cluster's live nodes could hold the job's placement group at all (else
   ``ValueError`` at once: Ray would wait silently for ever), creates it and waits until Ray
   has reserved it (cancellable: the group is removed);
4. starts one ``aiomp.ray._rank.RankActor`` per bundle, waits for each one's ``init`` (its
   node, address, pid; rank 0's free port), then starts ``fn`` in each with its env
   (torchrun's variables with ``rendezvous=True``, then ``env=``) and returns the
   :class:`~aiomp.ray._ranks.RayProcessContext`.

Owns nothing once it has returned: the context owns the actors, the group and a session
the job started. On a failure or cancellation while starting, the context releases them
before the error goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import io
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from .._loop import running_asyncio_loop
from .._output.lines import Output, check_output
from .._process import placement as _placement
from .._process.checks import count
from .._spawn.api import SpawnHandle
from . import _session
from ._handle import watch
from ._kind import capacity, fmt_resources
from ._ranks import Rank, RayProcessContext

#: Ray's placement strategies: ``PACK`` (the default) fills as few nodes as it can,
#: ``SPREAD`` spreads the ranks, the ``STRICT_`` ones insist (one node / one rank a node).
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

#: The actor class, made once per process (Ray registers it on first use).
_actor_class: list[Any] = []


@dataclasses.dataclass(frozen=True)
class Job:
    """One call's checked arguments."""

    fn: Callable[..., object]
    nprocs: int
    args: tuple[object, ...]
    address: str | None
    bundle: dict[str, float]  # what each rank asks of its node (its placement bundle)
    options: dict[str, Any]  # ray.remote's options for each actor
    strategy: str
    rendezvous: bool
    envs: list[dict[str, str]] | None
    grace_period: float
    output: Output


def spawn(
    fn: Callable[..., object] | Callable[..., Awaitable[object]],
    nprocs: int = 1,
    args: tuple[object, ...] = (),
    *,
    address: str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: Mapping[str, float] | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    strategy: str = "PACK",
    rendezvous: bool = False,
    env: _placement.Env = None,
    grace_period: float = 5.0,
    output: Output = "prefix",
) -> SpawnHandle:
    """Run ``fn(rank, *args)`` in ``nprocs`` Ray actors, placed together or not at all.

    Used as the local :func:`aiomp.spawn` is: ``async with aiomp.ray.spawn(fn, 4) as ctx:``
    supervises the job (the first rank to fail stops the others and cancels the body;
    leaving the block joins every rank, and ``ctx.results`` holds their return values in
    rank order), or ``ctx = await aiomp.ray.spawn(...)`` returns the started context.

    - A rank that raises: :class:`aiomp.ProcessRaisedException` with its traceback, its
      exception (rebuilt here) as ``__cause__``. A rank whose actor or node dies:
      :class:`aiomp.ray.ActorExitedException` (an :class:`aiomp.ProcessExitedException`
      naming the node). The other ranks are then stopped: an ``async def`` fn is
      cancelled inside its actor, and after ``grace_period`` seconds every actor is
      killed. However the job ends, its actors are killed and its placement group
      removed, so the cluster's resources come back.
    - ``num_cpus``, ``num_gpus``, ``resources``: what each rank asks (its bundle of the
      job's placement group; ``num_gpus=1`` gives each rank a GPU of its own, and Ray
      sets ``CUDA_VISIBLE_DEVICES``). ``strategy``: the group's, one of
      :data:`STRATEGIES`. A job that the cluster's live nodes could never hold raises
      ``ValueError`` at once; one that waits for resources other jobs hold waits
      (cancellable).
    - ``address``, ``runtime_env``: as for :class:`aiomp.ray.Pool` (``aiomp`` must be
      importable where the ranks run). A session this call opens is shut down when the
      job ends.
    - ``rendezvous=True`` sets what ``torchrun`` sets in each rank: ``RANK``,
      ``WORLD_SIZE``, ``LOCAL_RANK`` (its rank among the job's ranks on its node),
      ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (rank 0's node) and a ``MASTER_PORT`` free on
      that node, so ``torch.distributed.init_process_group`` works across nodes;
      ``env`` (a dict, or ``env(rank)`` giving one) is applied over them.
    - ``output``: ``"prefix"`` (the default) writes each line a rank writes to its fd 1 or
      2 to this process's stdout or stderr as ``[rank N] line``; a callable ``(rank,
      stream, line)`` receives them; ``"inherit"`` leaves them to Ray (its worker logs,
      and ``log_to_driver``).
    - In each rank ``aiomp.get_worker_info()`` gives its rank (``id``) and ``nprocs``.

    Cancelled while it starts (waiting for resources included), it removes what it made
    (actors, placement group, a session it opened) before the cancellation goes on;
    cancelled in the block or in ``join()``, it stops the ranks as on a failure (shielded,
    bounded: about ``grace_period`` plus 20 s at most).

    ``fn`` and ``args`` travel with cloudpickle (a lambda, a script's function work);
    what cannot cross nodes raises ``TypeError`` when the job starts, before anything
    runs. Runs on asyncio and uvloop; under trio it raises ``RuntimeError``.
    """
    check_output(output)
    n = count("nprocs", nprocs)
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, not {type(args).__name__}")
    _check_function(fn)
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, not {value!r}")
    if not isinstance(grace_period, (int, float)) or grace_period < 0:
        raise ValueError(f"grace_period must be a number >= 0, not {grace_period!r}")
    if address is not None and not isinstance(address, str):
        raise TypeError(f"address must be a str or None, not {type(address).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    bundle = {
        k: float(v) for k, v in {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}.items() if v
    }
    if not bundle:
        raise ValueError(
            "each rank must ask for some resource (num_cpus, num_gpus or resources): Ray "
            "places the ranks by a placement group, whose bundles cannot be empty"
        )
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_restarts": 0,  # a rank that dies fails the job; Ray must not revive it
        "max_concurrency": 2,  # init, then run
    }
    if resources:
        options["resources"] = dict(resources)
    if runtime_env:
        options["runtime_env"] = dict(runtime_env)
    job = Job(
        fn,
        n,
        args,
        address,
        bundle,
        options,
        strategy,
        bool(rendezvous),
        _placement.slot_envs(env, n),
        float(grace_period),
        output,
    )
    name = getattr(fn, "__qualname__", type(fn).__name__)
    return SpawnHandle(functools.partial(start_ranks, job), f"aiomp.ray.spawn({name}, {n})")


def _check_function(fn: object) -> None:
    """``TypeError`` for what is no function (a coroutine object included)."""
    if inspect.iscoroutine(fn):
        fn.close()
        raise TypeError(
            "fn must be a function, not a coroutine object: pass the async function itself "
            "(aiomp calls it in each rank)"
        )
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")


async def start_ranks(job: Job) -> RayProcessContext:
    """Start the job's ranks (see the module docstring); the started context."""
    loop = running_asyncio_loop()
    if loop is None:
        raise RuntimeError(
            "aiomp.ray.spawn runs on asyncio and uvloop only (Ray's async API is "
            "asyncio's); under trio use aiomp.spawn, or run the Ray job in an asyncio thread"
        )
    ray = _session.import_ray()
    blob = dumps_for_nodes((job.fn, job.args))
    started = False
    if not ray.is_initialized():
        started = await _session.connect(ray, job.address)
    ctx: RayProcessContext | None = None
    try:
        held, nodes = await anyio.to_thread.run_sync(capacity, ray, abandon_on_cancel=True)
        _check_placeable(job, held, nodes)
        pg = ray.util.placement_group([job.bundle] * job.nprocs, strategy=job.strategy)
        ctx = RayProcessContext([], job.grace_period, ray, pg, started)
        await _reserved(pg, loop)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        cls = _get_actor_class(ray)
        for rank in range(job.nprocs):
            placed = strategy(pg, placement_group_bundle_index=rank)
            actor = cls.options(**job.options, scheduling_strategy=placed).remote()
            ctx.add(Rank(rank, actor, loop, job.output, ctx.changed))
        for r in ctx.ranks:
            r.init(job.nprocs, job.rendezvous and r.rank == 0)
        await ctx.wait_for(lambda: ctx.failed() or all(r.ready for r in ctx.ranks))
        if ctx.failed():
            await ctx.terminate(0)
            raise ctx.failure()
        envs = _rank_envs(job, ctx.ranks)
        for r in ctx.ranks:
            r.run(blob, None if envs is None else envs[r.rank])
    except BaseException:
        with anyio.CancelScope(shield=True):
            if ctx is not None:
                await ctx.release()
            elif started:
                await anyio.to_thread.run_sync(_session.shutdown_ray, ray)
        raise
    return ctx


async def _reserved(pg: Any, loop: Any) -> None:
    """Wait until Ray has reserved every bundle of ``pg`` (on the loop: no thread)."""
    done = loop.create_future()

    def settled(outcome: Any) -> None:
        if not done.done():
            done.set_result(outcome)

    watch(pg.ready(), loop, settled)
    outcome = await done
    if isinstance(outcome, BaseException):
        raise outcome


def _check_placeable(job: Job, held: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """``ValueError`` unless the live nodes could hold the job's group (beside what the
    caller holds, inside a Ray actor or task): its bundles are alike, so counting how many
    each node could hold is exact."""
    fits = [int(min(node.get(k, 0.0) // v for k, v in job.bundle.items())) for node in nodes]
    n = job.nprocs
    if job.strategy == "STRICT_PACK":
        ok, how = max(fits, default=0) >= n, "all on one node"
    elif job.strategy == "STRICT_SPREAD":
        ok, how = sum(f >= 1 for f in fits) >= n, "one a node"
    else:
        ok, how = sum(fits) >= n, "in all"
    if ok:
        return
    where = "; ".join(fmt_resources({k: node.get(k, 0.0) for k in job.bundle}) for node in nodes)
    beside = f" beside what the caller holds ({fmt_resources(held)})" if held else ""
    raise ValueError(
        f"Ray cannot place this job: {n} ranks, each asking {fmt_resources(job.bundle)} "
        f"({job.strategy}: {how}), and the cluster's live nodes could hold {sum(fits)} of "
        f"them{beside}; its nodes have {where or 'nothing (none alive)'}"
    )


def _rank_envs(job: Job, ranks: list[Rank]) -> list[dict[str, str]] | None:
    """Each rank's env: torchrun's variables (``rendezvous``), then ``env=`` over them."""
    if not job.rendezvous:
        return job.envs
    nodes = [r.node_id for r in ranks]
    master = ranks[0]
    envs = []
    for r in ranks:
        mine = [s.rank for s in ranks if s.node_id == r.node_id]
        rv = {
            "RANK": str(r.rank),
            "WORLD_SIZE": str(len(ranks)),
            "LOCAL_RANK": str(mine.index(r.rank)),
            "LOCAL_WORLD_SIZE": str(len(mine)),
            "GROUP_RANK": str(list(dict.fromkeys(nodes)).index(r.node_id)),
            "MASTER_ADDR": str(master.address),
            "MASTER_PORT": str(master.port),
        }
        envs.append(rv if job.envs is None else {**rv, **job.envs[r.rank]})
    return envs


def _get_actor_class(ray: Any) -> Any:
    if not _actor_class:
        from ._rank import RankActor

        _actor_class.append(ray.remote(concurrency_groups={"ctl": 4})(RankActor))
    return _actor_class[0]


def dumps_for_nodes(obj: object) -> bytes:
    """``obj`` pickled with Ray's cloudpickle; ``TypeError`` for what lives on this machine
    only (see :func:`local_only`)."""
    base: Any = importlib.import_module("ray.cloudpickle").CloudPickler

    class Pickler(base):  # type: ignore[misc]
        def reducer_override(self, o: Any) -> Any:
            why = local_only(o)
            if why is not None:
                raise TypeError(f"aiomp.ray.spawn: {why}")
            return super().reducer_override(o)

    buf = io.BytesIO()
    Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def local_only(obj: object) -> str | None:
    """Why ``obj`` cannot reach another node, or None."""
    from .._queue.event import Event
    from .._queue.queue import Queue

    if isinstance(obj, Queue):
        return (
            "an aiomp.Queue cannot reach another node (it is this machine's sockets and "
            "shared memory, passed as file descriptors): use a ray.util.queue.Queue, or "
            "return values from the ranks"
        )
    if isinstance(obj, Event):
        return (
            "an aiomp.Event cannot reach another node (it is this machine's shared memory): "
            "use a Ray actor, or torch.distributed's barrier in the ranks"
        )
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        from .._arrays.shared import is_shared

        if is_shared(obj):
            return (
                "an array in aiomp's shared memory (aiomp.zeros, aiomp.empty, "
                "aiomp.share_memory) is mapped on this machine only, and a rank on another "
                "node would get a copy that its writes never leave: pass a plain numpy "
                "array (each rank gets a copy), or share state with torch.distributed"
            )
    return None
