"""``aiomp.ray.Pool``: the same async Pool, its workers async Ray actors anywhere in a cluster.

::

    async with aiomp.ray.Pool(8, address="auto") as pool:   # was: aiomp.Pool(8)
        y = await pool.apply(f, (x,))
        ys = await pool.map(f, xs)

It is :class:`aiomp.Pool` with another kind of worker: a :class:`~aiomp.ray._kind.RayKind`,
whose :class:`~aiomp.ray._handle.ActorHandle` drives one ``aiomp.ray._actor.TaskActor``
actor. The calls, the engine and the scheduler are the local Pool's. Ray places the
actors, carries the messages and stores the arrays; each ref's done-callback hands its
outcome to the pool's loop, so nothing polls. What differs from :class:`aiomp.Pool`:

* Functions are pickled with Ray's cloudpickle, so lambdas and functions of ``__main__``
  work. numpy arrays of 100 KiB or more go through Ray's object
  store (once per array per call) and arrive **read-only**, in arguments and in results.
* Runs on asyncio and uvloop (Ray's asyncio integration); ``RuntimeError`` under trio.
* An actor (or its node) that dies fails the tasks it held with
  :class:`aiomp.BrokenWorkerError` and is replaced; a task sent in the moment between the
  death and the pool learning of it fails too (Ray cannot say whether it started).
* ``timeout=`` or cancelling a running sync task kills its actor (``ray.kill``); a running
  async task is first cancelled inside the actor, and its actor killed only if it has not
  finished within ``grace_period``. A queued task that is cancelled never starts.
* ``map``'s default chunk size is ``ceil(n / processes)`` (times ``concurrency`` for an
  async function): a Ray call costs about a millisecond, far more than a local one.
* An actor starts in about a second. ``address=None`` uses the Ray instance initialised
  in this process or running on this machine, or starts a local one (seconds) and shuts
  it down when the pool closes; a session opened with ``ray.init`` is left running.
* Faults end in an error, not a wait: an address where nothing answers raises
  ``ConnectionError`` within 5 seconds; an actor that no node of
  the cluster could hold (beside what the caller holds, inside a Ray actor or task)
  raises ``ValueError`` on entering, as Ray's own Pool does; ``ray.shutdown()`` under an
  open pool breaks it within a second (its running tasks fail with
  :class:`aiomp.BrokenWorkerError`, the others with :class:`aiomp.BrokenPoolError`).

:func:`spawn` does the same for :func:`aiomp.spawn`: ``async with aiomp.ray.spawn(fn, 4,
rendezvous=True, address="auto") as ctx:`` runs ``fn(rank, *args)`` in four Ray actors
placed together (one placement group) or not at all, with the local job's semantics:
results in rank order, the first failure ends the job (the others stopped, the group
removed), output labelled by rank (see ``aiomp.ray._spawn`` and ``aiomp.ray._ranks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._pool import pool as _pool
from .._pool.engine import Engine
from ._kind import RayKind
from ._ranks import ActorExitedException, RankInfo, RayProcessContext
from ._spawn import spawn

__all__ = (
    "ActorExitedException",
    "ActorInfo",
    "Pool",
    "RankInfo",
    "RayProcessContext",
    "spawn",
)


@dataclasses.dataclass(frozen=True)
class ActorInfo:
    """One live worker of an :class:`aiomp.ray.Pool`, from :meth:`Pool.actors`."""

    slot: int
    actor_id: str
    #: The Ray node the actor runs on, and its process id there (None until it is ready).
    node_id: str | None
    pid: int | None


class Pool(_pool.Pool):
    """An :class:`aiomp.Pool` whose workers are async Ray actors.

    ``async with aiomp.ray.Pool(8, address="auto") as pool:`` connects to Ray (see
    ``address``), starts ``processes`` actors concurrently and returns at once; tasks wait
    for the first actor to be ready. Its methods and semantics are :class:`aiomp.Pool`'s
    (see the module docstring of ``aiomp.ray`` for what Ray changes: arrays arrive
    read-only, start-up takes about a second per actor).

    - ``processes``: actors to keep (default: as many as the cluster's nodes can hold,
      by ``num_cpus``, ``num_gpus`` and ``resources``).
    - ``address``: ``None`` uses the Ray session of this process, else a Ray instance
      running on this machine, else starts a local one (shut down when the pool closes).
      ``"auto"`` or ``"ray://host:port"`` joins a cluster. A session the caller opened
      with ``ray.init`` is always used, and left running. Where nothing answers at the
      address, entering raises ``ConnectionError`` (within 5 s).
    - ``num_cpus``, ``num_gpus``, ``resources``, ``runtime_env``: each actor's Ray
      placement and environment (``aiomp`` must be importable where the actors run).
      If no node could hold one actor (inside a Ray actor or task: beside what the
      caller holds), entering raises ``ValueError``, as Ray's Pool does; an autoscaling
      cluster counts only the nodes that are up.
    - ``concurrency``: the actor's ``max_concurrency``, async tasks at once per actor.
    - ``initializer``, ``initargs``, ``maxtasksperchild``, ``grace_period``,
      ``max_pending``: as for :class:`aiomp.Pool`; the initializer may be any callable
      cloudpickle can carry.

    Runs on asyncio and uvloop; under trio, entering it raises ``RuntimeError``.
    """

    def __init__(
        self,
        processes: int | None = None,
        *,
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        concurrency: int = 1,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        maxtasksperchild: int | None = None,
        grace_period: float = 5.0,
        max_pending: int | None = None,
    ) -> None:
        n, concurrency, maxtasksperchild, grace = _pool.check_options(
            processes, concurrency, maxtasksperchild, grace_period
        )
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str or None, not {type(address).__name__}")
        options: dict[str, Any] = {
            "max_concurrency": concurrency,
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "max_restarts": 0,  # the pool replaces an actor; Ray must not revive it
        }
        if resources:
            options["resources"] = dict(resources)
        if runtime_env:
            options["runtime_env"] = dict(runtime_env)
        init = (initializer, tuple(initargs))
        self._ray_kind = kind = RayKind(init, n is None, address, options)
        n = 1 if n is None else n
        _pool.attach(self, Engine(kind, n, concurrency, maxtasksperchild, grace), max_pending)

    def actors(self) -> list[ActorInfo]:
        """The live actors that take tasks: their ids, nodes and process ids."""
        return [ActorInfo(h.slot, h.actor_id, h.node_id, h.pid) for h in self._ray_kind.live()]


for _cls in (Pool, ActorInfo):
    _cls.__module__ = "aiomp.ray"
spawn.__module__ = "aiomp.ray"
