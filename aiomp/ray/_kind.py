"""The Ray kind of worker: what :class:`aiomp.ray.Pool` starts for each slot.

A :class:`RayKind` connects to Ray (or starts a local instance) before the first worker,
starts one async actor (``aiomp.ray._actor.TaskActor``) per call, watches that the Ray
session still runs while the pool is open, and turns calls into messages Ray carries
(cloudpickle; large numpy arrays through the object store, once per array per call).
Owns the Ray session it started (shut down when the pool closes), the pickled
initializer, and the object-store puts of the latest call while it has tasks.
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
import sys
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from .._loop import running_asyncio_loop
from .._pool import protocol as P
from .._pool.kinds import Call, Events, InitCall, Options, WorkerKind
from .._pool.tasks import fresh
from . import _session
from ._handle import ActorHandle

log = logging.getLogger("aiomp")

#: numpy arrays at least this large (bytes) travel through Ray's object store (``ray.put``);
#: smaller ones inside the task's pickle. Ray's own limit for inlining an argument.
ARRAY_THRESHOLD = 100 * 1024

#: How often (seconds) an open pool checks that the Ray session it uses still runs: Ray
#: has no shutdown hook, and after ``ray.shutdown()`` no ref's callback runs any more.
SESSION_CHECK = 1.0

_CTL_GROUP = {"ctl": 8}  # cancel and alive: never behind a task that blocks the actor's loop


class _Puts:
    """The arrays put into the object store for one call, shared by its tasks: ``id`` ->
    ``(array, ref)`` (the array kept, so that its id names it alone). It lives while a task
    of the call is unfinished, so that a call's later chunks reuse the puts of its earlier
    ones, and no longer: a caller may change an array in place before its next call."""

    __slots__ = ("entries", "group", "pending")

    def __init__(self, group: object) -> None:
        self.group = group
        self.entries: dict[int, tuple[Any, Any]] = {}
        self.pending = 0


class _Call:
    """A task's message: its blob and the refs of the arrays it names (see
    docs/decisions/0031-ray-workers.md). Dropping the refs lets Ray free the arrays once the actor
    has them."""

    __slots__ = ("_done", "blob", "refs")

    def __init__(
        self, blob: bytes, refs: list[Any], done: Callable[[], None] | None = None
    ) -> None:
        self.blob = blob
        self.refs = refs
        self._done = done

    def close(self) -> None:
        """The task is finished or dropped (maybe in a loop callback: nothing async)."""
        self.refs = []
        done, self._done = self._done, None
        if done is not None:
            done()

    discard = close


class _Pickler(pickle.Pickler):
    """Pickles a task's arguments, putting large numpy arrays into the object store."""

    def __init__(self, file: io.BytesIO, ndarray: Any, put: Callable[[Any], int]) -> None:
        super().__init__(file, protocol=5)
        self._ndarray = ndarray
        self._put = put

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, self._ndarray) and obj.nbytes >= ARRAY_THRESHOLD:
            return self._put(obj)
        return None


def cloudpickle_dumps(obj: object) -> bytes:
    """Pickle ``obj`` with Ray's cloudpickle: by value what a remote node could not import."""
    dumps: Callable[..., bytes] = importlib.import_module("ray.cloudpickle").dumps
    return dumps(obj, protocol=5)


def capacity(ray: Any) -> tuple[dict[str, float], list[dict[str, float]]]:
    """What the caller holds if it is a Ray actor or task (for as long as the pool lives
    inside it), and what each live node of the cluster has for the pool's actors: its
    resources, less those on the caller's node. Blocks (RPCs to Ray's GCS)."""
    ctx = ray.get_runtime_context()
    held: dict[str, float] = {}
    if getattr(getattr(ctx, "worker", None), "mode", None) == ray.WORKER_MODE:
        held = {k: float(v) for k, v in ctx.get_assigned_resources().items() if v}
    here = ctx.get_node_id()
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = {k: float(v) for k, v in node.get("Resources", {}).items()}
        if node.get("NodeID") == here:
            for k, v in held.items():
                if k in have:
                    have[k] -= v
        nodes.append(have)
    return held, nodes


def _unplaceable(
    demand: Mapping[str, float], held: Mapping[str, float], nodes: list[dict[str, float]]
) -> str:
    where = "; ".join(fmt_resources({k: node.get(k, 0.0) for k in demand}) for node in nodes[:8])
    beside = (
        f" beside what the caller holds there ({fmt_resources(held)}: it runs in a Ray actor or "
        "task, which keeps them while the pool lives)"
        if held
        else ""
    )
    return (
        f"Ray cannot place an actor of this pool: each asks {fmt_resources(demand)}, more than any "
        f"node of the cluster has{beside}; its nodes have {where or 'nothing (none alive)'}"
    )


def fmt_resources(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


_actor_class: Any = None


def _get_actor_class(ray: Any) -> Any:
    global _actor_class
    if _actor_class is None:
        from ._actor import TaskActor

        _actor_class = ray.remote(concurrency_groups=_CTL_GROUP)(TaskActor)
    return _actor_class


class RayKind(WorkerKind):
    """See the module docstring."""

    # One chunk per slot, not multiprocessing's four: a Ray call costs about a millisecond
    # (a local worker's round trip: tens of us), the work of thousands of small items.
    chunks_per_slot = 1

    def __init__(
        self, init: InitCall, auto_processes: bool, address: str | None, options: dict[str, Any]
    ) -> None:
        self._init_call = init
        self._auto_processes = auto_processes
        self._address = address
        #: ``ray.remote``'s options for each actor (``num_cpus`` and ``num_gpus`` included).
        self._options = options
        self._ray: Any = None
        self._actor_cls: Any = None
        self._init_blob = b""
        self._started_ray = False  # this pool called ray.init: it shuts Ray down at exit
        # fn -> its cloudpickle (weak: the cache must not keep a function alive).
        self._fn_keys: weakref.WeakKeyDictionary[object, bytes] = weakref.WeakKeyDictionary()
        self._puts: _Puts | None = None  # the latest call's, while it has tasks
        self._job: str | None = None  # the Ray session's job id, while it is the pool's
        self._events: Events | None = None  # the engine, once a worker has started
        self.handles: dict[ActorHandle, None] = {}  # live actors, by start order

    def live(self) -> list[ActorHandle]:
        """The actors that take tasks (neither retiring, killed nor gone), by slot order."""
        if self._events is None:
            return []
        live = set(self._events.live_handles())
        return [h for h in self.handles if h in live]

    def describe(self) -> str:
        return f"num_cpus={self._options['num_cpus']} num_gpus={self._options['num_gpus']}"

    async def close(self, linger: bool) -> None:
        """Shut down the Ray session this pool started (Ray bounds it)."""
        self._puts = None
        if self._started_ray:
            self._started_ray = False
            await anyio.to_thread.run_sync(_session.shutdown_ray, self._ray)

    def watch(self) -> Callable[[], Awaitable[None]] | None:
        return self._watch_session

    async def prepare(self, processes: int) -> int:
        if running_asyncio_loop() is None:
            raise RuntimeError(
                "aiomp.ray.Pool runs on asyncio and uvloop only (Ray's async API is "
                "asyncio's); under trio use aiomp.Pool, or run the Ray pool in an asyncio "
                "thread"
            )
        ray = self._ray = _session.import_ray()
        try:
            self._init_blob = cloudpickle_dumps(self._init_call)
        except Exception as exc:
            exc.add_note("(while pickling the pool's initializer and initargs for Ray)")
            raise
        if not ray.is_initialized():
            await self._connect()
        self._actor_cls = _get_actor_class(ray)
        self._job = ray.get_runtime_context().get_job_id()
        # Ray's state calls ask its GCS (RPCs): in a thread, as ray.init.
        held, nodes = await anyio.to_thread.run_sync(capacity, ray, abandon_on_cancel=True)
        demand = {
            k: float(v)
            for k, v in {
                "CPU": self._options["num_cpus"],
                "GPU": self._options["num_gpus"],
                **self._options.get("resources", {}),
            }.items()
            if v
        }
        if demand:
            # How many actors each node could hold: none anywhere, and they would wait
            # for ever (Ray queues an actor it cannot place, silently).
            fits = [min(node.get(k, 0.0) // v for k, v in demand.items()) for node in nodes]
            if not any(n >= 1 for n in fits):
                raise ValueError(_unplaceable(demand, held, nodes))
        else:  # an actor that asks for nothing: one per CPU
            fits = [node.get("CPU", 0.0) for node in nodes]
        room = int(sum(fits))
        if self._auto_processes:
            return max(1, room)
        if processes > room:  # those that fit serve; the others wait for room
            log.warning(
                "aiomp.ray.Pool: %d actors asked, and the cluster's nodes can hold %d of "
                "them (each asks %s): the others wait until Ray has room",
                processes,
                room,
                fmt_resources(demand),
            )
        return processes

    async def _connect(self) -> None:
        """``ray.init(address=...)``, in a thread: it blocks for seconds (it may start a
        whole local instance), and for minutes where nothing answers at the address, so
        that is tried first (``ConnectionError``). Cancelled, it abandons the thread (see
        :meth:`__aenter__`)."""
        where = await anyio.to_thread.run_sync(
            _session.bootstrap_address, self._address, abandon_on_cancel=True
        )
        if where is not None:
            await _session.probe(*where, self._address)
        connecting = _session.Connecting(self._ray, self._address)
        try:
            self._started_ray = await anyio.to_thread.run_sync(
                connecting.run, abandon_on_cancel=True
            )
        except anyio.get_cancelled_exc_class():
            if connecting.take():
                log.warning(
                    "aiomp.ray.Pool: cancelled while ray.init(address=%r) connects; it goes "
                    "on in its thread (it cannot be interrupted), and a session it opens "
                    "will be shut down there",
                    self._address,
                )
            else:  # it had connected: the session is this pool's to shut down
                self._started_ray = connecting.started
            raise

    def _session_ok(self) -> bool:
        """The Ray session the pool started with still runs (never auto-inits one: Ray's
        calls start a local instance when none is initialised)."""
        ray = self._ray
        try:
            return bool(ray.is_initialized()) and (
                ray.get_runtime_context().get_job_id() == self._job
            )
        except Exception:  # noqa: BLE001 - disconnected between the two
            return False

    async def _watch_session(self) -> None:
        """Break the pool once its Ray session has ended (checked every SESSION_CHECK s)."""
        # A poll: Ray offers no event for it (see SESSION_CHECK).
        while True:
            await anyio.sleep(SESSION_CHECK)
            if not self._session_ok():
                self._session_lost()
                return

    def _session_lost(self) -> None:
        """``ray.shutdown()`` (and maybe ``ray.init`` again) under the pool: its actors and
        refs are gone, and no callback of theirs will run. Break the pool (queued and later
        calls: BrokenPoolError) and report every actor dead (its tasks: BrokenWorkerError).
        """
        if self._job is None:  # lost already
            return
        self._job = None
        self._started_ray = False  # gone: a session opened since is not this pool's
        why = "Ray was shut down (ray.shutdown()) while the pool was open"
        if self._events is not None:
            self._events.break_pool(RuntimeError(why))
        for h in list(self.handles):
            h.lost(why)

    def start(self, slot: int, events: Events, options: Options) -> ActorHandle | None:
        """Start an actor for ``slot`` (None: the Ray session has ended; the pool breaks)."""
        self._events = events
        self.handles = {h: None for h in self.handles if not h.closed}
        if not self._session_ok():
            self._session_lost()
            return None
        try:
            actor = self._actor_cls.options(**self._options).remote()
        except Exception:
            if self._session_ok():
                raise
            self._session_lost()  # ray.shutdown() in another thread, under this call
            return None
        loop = running_asyncio_loop()
        assert loop is not None
        h = ActorHandle(slot, actor, loop, options.grace, events)
        self.handles[h] = None
        h.init(self._init_blob, (slot, options.processes))
        return h

    def _fn_key(self, fn: object) -> bytes:
        try:
            return self._fn_keys[fn]
        except (KeyError, TypeError):
            pass
        key = cloudpickle_dumps(fn)
        try:
            self._fn_keys[fn] = key
        except TypeError:  # not weakly referenceable: pickled on every call
            pass
        return key

    def encode(self, call: Call) -> _Call:
        """A task's message, made in the caller: raises here if it cannot be pickled."""
        if not self._ray.is_initialized():  # ray.put would start a local Ray of its own
            self._session_lost()
            broken = None if self._events is None else self._events.broken
            if broken is None:
                raise RuntimeError("Ray was shut down (ray.shutdown()) while the pool was open")
            raise fresh(broken)
        tid, fn, info, flags, items, kwds, group = call
        try:
            key = self._fn_key(fn)
            task = (tid, flags, key, items, kwds)
            np = sys.modules.get("numpy")
            if np is None or (
                all(type(x) in P.PLAIN for x in items)
                and not (kwds and any(type(v) not in P.PLAIN for v in kwds.values()))
            ):
                return _Call(pickle.dumps(task, protocol=5), [])
            return self._encode_with_arrays(task, np.ndarray, group)
        except Exception as exc:
            exc.add_note(f"(while pickling a task of {info.name} for a Ray worker)")
            raise

    def _encode_with_arrays(self, task: tuple[Any, ...], ndarray: type, group: object) -> _Call:
        puts = self._puts
        if group is None or puts is None or puts.group is not group:
            puts = _Puts(group)
            self._puts = puts if group is not None else None
        memo = puts.entries
        refs: list[Any] = []
        index: dict[int, int] = {}  # id(array) -> its index among this task's refs
        put = self._ray.put

        def persist(arr: Any) -> int:
            i = index.get(id(arr))
            if i is None:
                got = memo.get(id(arr))
                if got is None:
                    got = memo[id(arr)] = (arr, put(arr))  # arr kept: its id stays its own
                i = index[id(arr)] = len(refs)
                refs.append(got[1])
            return i

        buf = io.BytesIO()
        _Pickler(buf, ndarray, persist).dump(task)
        if not refs:
            return _Call(buf.getvalue(), refs)
        puts.pending += 1

        def done() -> None:
            puts.pending -= 1
            if not puts.pending and self._puts is puts:
                self._puts = None  # the call is over: its arrays may change before the next

        return _Call(buf.getvalue(), refs, done)
