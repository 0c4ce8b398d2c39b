"""``aiomp.ray.Pool``: the same async Pool, its workers async Ray actors anywhere in a cluster.

::

    async with aiomp.ray.Pool(8, address="auto") as pool:   # was: aiomp.Pool(8)
        y = await pool.apply(f, (x,))
        ys = await pool.map(f, xs)

The calls and the scheduler are the local Pool's; only the worker handle differs (an
:class:`~aiomp._ray_handle.ActorHandle` drives one ``aiomp._ray_actor.Worker`` actor).
Ray places the actors, carries the messages and stores the arrays; how a call travels and
why nothing polls: docs/decisions/0031-ray-workers.md. What differs from
:class:`aiomp.Pool`:

* Functions are pickled with Ray's cloudpickle, so lambdas and functions of ``__main__``
  work. numpy arrays of :data:`ARRAY_THRESHOLD` bytes or more go through Ray's object
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
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import logging
import pickle
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import anyio

from . import _pool
from . import _protocol as P
from ._ray_handle import ActorHandle
from ._transport import running_asyncio_loop

__all__ = ("ARRAY_THRESHOLD", "ActorInfo", "Pool")

log = logging.getLogger("aiomp")

#: numpy arrays at least this large (bytes) travel through Ray's object store (``ray.put``);
#: smaller ones inside the task's pickle. Ray's own limit for inlining an argument.
ARRAY_THRESHOLD = 100 * 1024

_CTL_GROUP = {"ctl": 8}  # cancel and alive: never behind a task that blocks the actor's loop


@dataclasses.dataclass(frozen=True)
class ActorInfo:
    """One live worker of an :class:`aiomp.ray.Pool`, from :meth:`Pool.actors`."""

    slot: int
    actor_id: str
    #: The Ray node the actor runs on, and its process id there (None until it is ready).
    node_id: str | None
    pid: int | None


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


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError('aiomp.ray.Pool needs Ray: pip install "aiomp[ray]"') from exc
    return ray


def _cloudpickle(obj: object) -> bytes:
    """Pickle ``obj`` with Ray's cloudpickle: by value what a remote node could not import."""
    dumps: Callable[..., bytes] = importlib.import_module("ray.cloudpickle").dumps
    return dumps(obj, protocol=5)


_actor_class: Any = None


def _get_actor_class(ray: Any) -> Any:
    global _actor_class
    if _actor_class is None:
        from ._ray_actor import Worker

        _actor_class = ray.remote(concurrency_groups=_CTL_GROUP)(Worker)
    return _actor_class


class Pool(_pool.Pool):
    """An :class:`aiomp.Pool` whose workers are async Ray actors.

    ``async with aiomp.ray.Pool(8, address="auto") as pool:`` connects to Ray (see
    ``address``), starts ``processes`` actors concurrently and returns at once; tasks wait
    for the first actor to be ready. Its methods and semantics are :class:`aiomp.Pool`'s
    (see the module docstring of ``aiomp.ray`` for what Ray changes: arrays arrive
    read-only, start-up takes about a second per actor).

    - ``processes``: actors to keep (default: the cluster's CPUs divided by ``num_cpus``,
      or its GPUs divided by ``num_gpus``).
    - ``address``: ``None`` uses the Ray session of this process, else a Ray instance
      running on this machine, else starts a local one (shut down when the pool closes).
      ``"auto"`` or ``"ray://host:port"`` joins a cluster. A session the caller opened
      with ``ray.init`` is always used, and left running.
    - ``num_cpus``, ``num_gpus``, ``resources``, ``runtime_env``: each actor's Ray
      placement and environment (``aiomp`` must be importable where the actors run).
    - ``concurrency``: the actor's ``max_concurrency``, async tasks at once per actor.
    - ``initializer``, ``initargs``, ``maxtasksperchild``, ``grace_period``: as for
      :class:`aiomp.Pool`; the initializer may be any callable cloudpickle can carry.

    Runs on asyncio and uvloop; under trio, entering it raises ``RuntimeError``.
    """

    # One chunk per slot, not multiprocessing's four: a Ray call costs about a millisecond
    # (a local worker's round trip: tens of us), the work of thousands of small items.
    _chunks_per_slot = 1

    def __init__(
        self,
        processes: int | None = None,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        maxtasksperchild: int | None = None,
        concurrency: int = 1,
        grace_period: float = 5.0,
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            1 if processes is None else processes,
            maxtasksperchild=maxtasksperchild,
            concurrency=concurrency,
            grace_period=grace_period,
        )
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, not {value!r}")
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str or None, not {type(address).__name__}")
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._auto_processes = processes is None
        self._address = address
        self._num_cpus = num_cpus
        self._num_gpus = num_gpus
        self._options: dict[str, Any] = {
            "max_concurrency": concurrency,
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            "max_restarts": 0,  # the pool replaces an actor; Ray must not revive it
        }
        if resources:
            self._options["resources"] = dict(resources)
        if runtime_env:
            self._options["runtime_env"] = dict(runtime_env)
        self._ray: Any = None
        self._actor_cls: Any = None
        self._init_blob = b""
        self._started_ray = False  # this pool called ray.init: it shuts Ray down at exit
        # fn -> its cloudpickle (weak: the cache must not keep a function alive).
        self._fn_keys: weakref.WeakKeyDictionary[object, bytes] = weakref.WeakKeyDictionary()
        self._puts: _Puts | None = None  # the latest call's, while it has tasks

    def __repr__(self) -> str:
        state = ("new", "open", "closing", "closed")[self._state]
        return (
            f"<aiomp.ray.Pool {state} processes={self._processes} "
            f"concurrency={self._concurrency} num_cpus={self._num_cpus} "
            f"num_gpus={self._num_gpus}>"
        )

    def pids(self) -> list[int]:
        """Process ids of the live, ready actors (each on its own node: see :meth:`actors`)."""
        return [info.pid for info in self.actors() if info.pid is not None]

    def actors(self) -> list[ActorInfo]:
        """The live actors that take tasks: their ids, nodes and process ids."""
        out = []
        for w in self._sched.live_workers():
            # The scheduler types handles by its Handle protocol; this pool makes ActorHandles.
            h: ActorHandle = w.handle  # type: ignore[assignment]
            out.append(ActorInfo(h.slot, h.actor_id, h.node_id, h.pid))
        return out

    # -- lifetime ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        """Connect to Ray (see ``address``) and start the actors (returns before they are
        ready). On cancellation or failure the actors started so far are killed, and a Ray
        instance this pool started is shut down."""
        try:
            return await super().__aenter__()
        except BaseException:
            await self._disconnect()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """As :meth:`aiomp.Pool.__aexit__`, then shut down a Ray instance this pool started."""
        try:
            return await super().__aexit__(exc_type, exc, tb)
        finally:
            await self._disconnect()

    async def _prepare(self) -> None:
        if running_asyncio_loop() is None:
            raise RuntimeError(
                "aiomp.ray.Pool runs on asyncio and uvloop only (Ray's async API is "
                "asyncio's); under trio use aiomp.Pool, or run the Ray pool in an asyncio "
                "thread"
            )
        ray = self._ray = _import_ray()
        try:
            self._init_blob = _cloudpickle((self._initializer, self._initargs))
        except Exception as exc:
            exc.add_note("(while pickling the pool's initializer and initargs for Ray)")
            raise
        if not ray.is_initialized():
            # ray.init blocks for seconds (it may start a whole local instance): a thread.
            await anyio.to_thread.run_sync(self._connect)
        self._actor_cls = _get_actor_class(ray)
        if self._auto_processes:
            total = ray.cluster_resources()
            if self._num_gpus:
                n = total.get("GPU", 0) // self._num_gpus
            elif self._num_cpus:
                n = total.get("CPU", 1) // self._num_cpus
            else:
                n = total.get("CPU", 1)
            self._processes = max(1, int(n))

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        ray.init(address=self._address)
        self._started_ray = True

    async def _disconnect(self) -> None:
        """Shut down the Ray session this pool started (shielded; Ray bounds it)."""
        self._puts = None
        if self._started_ray:
            self._started_ray = False
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._ray.shutdown)

    def _release_init(self) -> None:
        self._puts = None

    # -- workers -----------------------------------------------------------------------
    def _spawn(self, slot: int) -> None:
        """Start an actor for ``slot`` and its watcher (from a task, never a callback)."""
        assert self._tg is not None and self._loop is not None
        actor = self._actor_cls.options(**self._options).remote()
        h = ActorHandle(
            slot, actor, self._loop, self._grace, self._on_result, self._on_ready, self._on_exit
        )
        self._handles[h] = None
        self._sched.add(h)
        h.init(self._init_blob)
        self._tg.start_soon(h.run)

    def _on_ready(self, h: ActorHandle, answer: tuple[Any, ...]) -> None:
        """The actor's initializer has run (in a loop callback)."""
        if answer[0]:
            self._sched.ready(h)
            return
        self._initializer_failed(h, self._rebuild(h, answer[1]))
        self._sched.kill(h, " (its initializer raised)")

    def _on_result(self, h: ActorHandle, tid: int, ok: bool, value: Any) -> None:
        """A task's outcome (in a loop callback): a value, an ErrorPayload, or a Ray error."""
        if not ok:
            if isinstance(value, P.ErrorPayload):
                value = self._rebuild(h, value)
            elif isinstance(value, self._ray.exceptions.RayTaskError):
                # The actor's run() answers every error of the task itself: what fails
                # after it is Ray serializing the result.
                task = self._sched.task(h, tid)
                cause = getattr(value, "cause", None) or value
                err = pickle.PicklingError(
                    f"the result of {task.name if task else 'a task'} could not be pickled "
                    f"to return it from {h.name}: {type(cause).__name__}: {cause}"
                )
                err.__cause__ = value
                value = err
        self._sched.complete(h, tid, ok, value)

    def _on_exit(self, h: Any, exitcode: int | None, unsent: list[int]) -> None:
        w = self._sched.workers.get(h)
        if w is not None and h.why and not w.reason:
            w.reason = f" ({h.why})"
        super()._on_exit(h, exitcode, unsent)

    def _rebuild(self, h: ActorHandle, error: P.ErrorPayload) -> BaseException:
        return error.exception(h.name, h.slot, h.pid)

    # -- tasks (see _calls.make_task) ----------------------------------------------------
    def _fn_key(self, fn: object) -> bytes:
        try:
            return self._fn_keys[fn]
        except (KeyError, TypeError):
            pass
        key = _cloudpickle(fn)
        try:
            self._fn_keys[fn] = key
        except TypeError:  # not weakly referenceable: pickled on every call
            pass
        return key

    def _encode(
        self,
        tid: int,
        fn: Callable[..., Any],
        info: Any,
        flags: int,
        items: Any,
        kwds: dict[str, object] | None,
        group: object,
    ) -> _Call:
        """A task's message, made in the caller: raises here if it cannot be pickled."""
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


for _cls in (Pool, ActorInfo):
    _cls.__module__ = "aiomp.ray"
