"""``aiomp.run_sync``: a function run in the running event loop's default pool.

One :class:`aiomp.Pool` per running event loop (asyncio, uvloop) or trio run, made by the
first ``run_sync`` on it, of :func:`aiomp._process.cpus.cpu_count` workers. Its keeper
task (:func:`aiomp._loop.runscope.start_for_run`) opens it, holds it while the loop runs
and leaves it when the loop's end cancels the task: the workers are then terminated and
reaped (nothing can be waiting for them by then). The keeper owns the pool, so that no
caller's task is tied to it (a trio nursery lives in the task that opened it).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import BrokenPoolError
from .._loop import is_cancellation
from .._loop.runscope import run_key, start_for_run
from .._pool.process_handle import ProcessHandle
from .._pool.process_kind import ProcessKind
from .._pool.tasks import fn_info
from .._process.checks import check_function
from .._process.child import kill_and_reap
from .._process.cpus import cpu_count
from .._wire import byvalue

if TYPE_CHECKING:
    from .._pool.engine import Engine
    from .._pool.pool import Pool

log = logging.getLogger("aiomp")

#: The default pool's start method: the one CUDA programs need, and Python 3.14's
#: default is forkserver only where a fork server is already warm.
START_METHOD = "spawn"


class DefaultPool:
    """The running loop's default pool and its state: ``ready`` is set once it is open
    (or could not be: ``error``)."""

    __slots__ = ("engine", "error", "pool", "ready")

    def __init__(self, pool: Pool, engine: Engine) -> None:
        self.pool, self.engine = pool, engine
        self.ready = anyio.Event()
        self.error: BaseException | None = None


async def _make_default() -> DefaultPool:
    """The default pool of this loop, its first worker launched first of all.

    The first call waits for one worker's start: another starts only when a call finds
    no worker for it (decision 0091), aiomp's keeper and multiprocessing's resource
    tracker once the first is ready (decision 0046). That first one is launched before the
    rest of the pool is even imported, so that its interpreter boots while this process
    imports and builds the pool (decision 0048). A failure closes what was started.
    """
    processes = cpu_count()
    kind = ProcessKind(START_METHOD, (None, ()), "prefix", defer_helpers=True)
    kind.launch_ahead(0, processes)
    try:
        # Imported here, after the launch, on purpose (see above).
        from .._pool.pool import on_demand

        return DefaultPool(*on_demand(kind, processes))
    except BaseException:
        await kind.close(False)  # shielded
        raise


#: run key (an asyncio loop, a trio run's root task) -> its default pool
_pools: dict[object, DefaultPool] = {}


def default_pool(key: object = None) -> Pool | None:
    """The default pool of the running loop (or of the loop ``key``), None before its first
    ``run_sync`` and after its end."""
    default = _pools.get(run_key() if key is None else key)
    return None if default is None else default.pool


async def run_sync(
    fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
) -> Any:
    """Run ``fn(*args, **kwargs)`` in a worker process of this event loop's default pool.

    ``fn`` may be sync or ``async def``, and a lambda, a closure or a function typed into a
    notebook (it travels by value). The pool is made on the first call on a loop, with up
    to one worker per CPU this process may use (its affinity capped by its cgroup's CPU
    quota), each started when a call finds none free, and closed when the loop ends
    (``asyncio.run``, uvloop, or the end of ``trio.run``; at the latest at interpreter
    exit). ``fn`` is pickled first: one that cannot be pickled even by value (it holds a
    lock) raises ``pickle.PicklingError`` before any worker starts. Exceptions,
    ``timeout=`` and cancellation are :meth:`aiomp.Pool.apply`'s: a cancelled or timed-out
    call stops its task, terminating its worker if need be, and a new worker takes its
    place.

    Keywords go to ``fn``, except ``timeout``, which is this call's own: give a
    function's own ``timeout`` keyword with ``functools.partial(fn, timeout=...)``.
    (anyio's and trio-parallel's ``run_sync`` take no keywords for ``fn`` at all.)
    """
    info = fn_info(fn)
    if START_METHOD not in info.checked:
        check_function(fn, START_METHOD)
        info.checked.add(START_METHOD)
    key = run_key()
    default = _pools.get(key)
    if default is None:
        # Arguments that cannot be pickled raise before the pool starts (the next calls
        # pickle them as the Pool does, with its message).
        byvalue.dumps((args, kwargs)).discard()
        default = _pools[key] = await _make_default()
        start_for_run(lambda: _keep(key, default))
    if not default.ready.is_set():
        await default.ready.wait()
    if default.error is not None:
        raise BrokenPoolError(f"the default pool could not start: {default.error}")
    return await default.pool.apply(fn, args, kwargs or None, timeout=timeout)


async def _keep(key: object, default: DefaultPool) -> None:
    """Hold ``default``'s pool open until the loop's end cancels this task."""
    try:
        async with default.pool:
            default.ready.set()
            try:
                await anyio.sleep_forever()
            finally:
                # The loop's end: nothing can wait for these workers any more, and their
                # termination is no news (not logged as that of a survivor).
                for h in default.engine.live_handles():
                    h.expect_kill()
    except BaseException as exc:
        if is_cancellation(exc):
            raise
        default.error = exc
        log.error("aiomp: the default pool failed", exc_info=exc)
    finally:
        if _pools.get(key) is default:
            del _pools[key]
        default.ready.set()


def _end_at_exit() -> None:
    """At interpreter exit, SIGKILL and reap the workers of the default pools whose loop
    never ended (a loop driven by hand, a notebook's kernel), quietly: nothing can be
    waiting for them. Registered after ``aiomp._process.child``'s exit hook, so it runs
    first (atexit is last-in, first-out), and that hook, which warns of children still
    running, finds none of these."""
    engines = [d.engine for d in list(_pools.values())]
    handles = [h for e in engines for h in e.live_handles()]
    children = [h.child for h in handles if isinstance(h, ProcessHandle)]
    # (and a first worker no engine took: the keeper task never ran, or never opened it)
    children += [c for e in engines if isinstance(e.kind, ProcessKind) for c in e.kind.unadopted()]
    kill_and_reap(children, quiet=True)


atexit.register(_end_at_exit)
# A fork of this process has no default pool: its parent's workers are not its own.
os.register_at_fork(after_in_child=_pools.clear)
run_sync.__module__ = "aiomp"
