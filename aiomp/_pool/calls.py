"""The Pool's calls: ``apply``, ``map`` / ``starmap``, on a running :class:`Engine`.

Each call pickles its tasks in the caller (an argument that cannot be pickled raises at
the call site, before anything is sent), checks for cancellation, then hands them to the
engine and waits; leaving early (cancellation, timeout) abandons them, shielded.

``apply``'s hot path (asyncio, no timeout) sends the task's frame to the idle worker the
scheduler would pick before the call first yields, and makes the Task and the
scheduler's record after the send, while the worker wakes: sending after the yield costs
a sixth of the round trip. Unless a cancellation may be pending for the caller: then the
task goes to the engine from a callback that runs once the caller has yielded, and is
dropped unsent if the wait was cancelled by then. A task the worker must be sent its
function for first (``DEF``) is submitted as usual.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .._loop.wakeup import Signal, Wakeup
from .._process.checks import count
from . import protocol as P
from .admission import admit
from .engine import OPEN, Engine, stack_note
from .tasks import DONE, FnInfo, Task, as_args, fn_cache, fn_info, new_task, tids

if TYPE_CHECKING:
    import asyncio

_ref = weakref.ref


def make_task(
    engine: Engine,
    fn: Callable[..., object],
    info: FnInfo,
    flags: int,
    items: Any,
    *,
    group: object = None,
    index: int = 0,
    on_done: Callable[[Task], None] | None = None,
) -> Task:
    """A chunk of a map (``items``), pickled here by the engine's kind, as its Task."""
    tid = next(tids)
    message = engine.kind.encode((tid, fn, info, flags, items, None, group))
    return new_task(engine.concurrency, info, tid, message, group, index, len(items), on_done)


async def _wait(
    engine: Engine, tasks: list[Task], signal: Signal, timeout: float | None = None
) -> None:
    """Wait for ``signal``; abandon ``tasks`` on cancellation or timeout."""
    try:
        if timeout is None:
            await signal.wait()
            return
        with anyio.move_on_after(timeout) as scope:
            await signal.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.abandon(tasks)
        raise
    if scope.cancelled_caught and not signal.is_set():
        with anyio.CancelScope(shield=True):
            killed = await engine.abandon(tasks, timeout)
        error = TimeoutError(f"{tasks[0].name} did not finish within {timeout} s")
        for handle in killed:  # where it hung (docs/design.md, "Worker health")
            if note := stack_note(handle):
                error.add_note(note)
        raise error


async def apply(
    engine: Engine,
    fn: Callable[..., Any],
    args: Any = (),
    kwds: dict[str, object] | None = None,
    *,
    timeout: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwds)`` in a worker and return its result.

    ``fn`` may be sync or ``async def``. Its exception is raised here, as the same
    type, with the worker's traceback as ``__cause__`` (``SystemExit`` and
    ``KeyboardInterrupt`` too, as ``concurrent.futures`` raises them; the worker lives
    on). An argument that cannot be
    pickled raises here before anything is sent, and so does
    :class:`aiomp.PoolOverloadedError` on a pool made with ``max_pending=N`` that holds N
    tasks not started yet (unless a worker is free to start this one at once). If the
    worker dies while it runs the task: :class:`aiomp.BrokenWorkerError`.

    ``timeout`` (seconds, counted from this call, queueing included) raises
    ``TimeoutError``. A call made in a cancelled scope sends nothing. On timeout or
    cancellation a task that has not started never starts; a running one is stopped
    as :class:`aiomp.Pool` describes (its worker terminated and replaced if need be)
    before the cancellation goes on.
    """
    sched = engine.sched
    if engine.state != OPEN or sched.broken is not None:
        engine.check_open()
    try:
        info = fn_cache.get(_ref(fn))  # hot path: tests/budgets
    except TypeError:
        info = None
    if info is None:
        info = fn_info(fn)
    if engine.max_pending is not None:
        admit(engine, info.is_async)
    flags = P.F_APPLY | P.F_ASYNC if info.is_async else P.F_APPLY
    loop = engine.loop
    tid = next(tids)
    fid = info.fid
    if (
        fid
        and not args
        and type(args) is tuple
        and not kwds
        and engine.start_method in info.checked
    ):
        message: Any = P.noargs_task(tid, flags | P.F_NOARGS, fid)  # hot path: tests/budgets
    else:
        items = args if type(args) is tuple else as_args(args)
        message = engine.kind.encode(
            (tid, fn, info, flags, items, dict(kwds) if kwds else None, None)
        )
    if loop is None or timeout is not None:  # trio, or a timeout: the general path
        task = new_task(engine.concurrency, info, tid, message)
        return await _apply_general(engine, task, timeout)
    probe = engine.probe
    assert probe is not None
    current = probe.current_task(loop)  # hot path: tests/budgets
    if current is None or current.cancelling() or probe.scope_cancelled(current, loop):
        task = new_task(engine.concurrency, info, tid, message)
        waiter = _submit_once_yielded(engine, loop, task)
    else:  # the hot path: sent before the Task exists (docs/decisions/0027)
        worker = None
        if sched.idle and not sched.queued and type(message) is bytes:
            worker = sched.take_idle()[0]
            if not worker.handle.try_send_now(message, fid):
                sched.untake(worker)
                worker = None
        task = new_task(engine.concurrency, info, tid, message)
        if worker is not None:
            sched.started(worker, task)
        else:
            sched.submit(task)
            if task.state == DONE:  # failed at once (a broken pool): nothing to wait for
                if task.ok:
                    return task.value
                raise task.value
        task.waiter = waiter = loop.create_future()
    try:
        await waiter
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.abandon([task])
        raise
    if task.ok:
        return task.value
    raise task.value


async def _apply_general(engine: Engine, task: Task, timeout: float | None) -> Any:
    """``apply``'s path on any loop, with a ``timeout``: a checkpoint first (nothing is
    sent for a call made in a cancelled scope), then submit and wait."""
    signal = Signal(engine.loop)
    task.on_done = lambda _: signal.set()
    await anyio.lowlevel.checkpoint()
    try:
        engine.check_open()
    except BaseException:
        task.drop()
        raise
    engine.submit(task)
    await _wait(engine, [task], signal, timeout)
    if task.ok:
        return task.value
    raise task.value


def _submit_once_yielded(
    engine: Engine, loop: asyncio.AbstractEventLoop, task: Task
) -> asyncio.Future[None]:
    """``apply``'s path (asyncio) where a cancellation may be pending for the caller: the
    task goes to the engine from a callback that runs once the caller has yielded, and
    is dropped unsent if its wait was cancelled by then. Returns what to wait on."""
    task.waiter = waiter = loop.create_future()
    loop.call_soon(_submit_unless_cancelled, engine, task, waiter)
    return waiter


def _submit_unless_cancelled(engine: Engine, task: Task, waiter: asyncio.Future[None]) -> None:
    if waiter.done():  # cancelled before the task could start: it never does
        task.drop()
        return
    try:
        engine.check_open()
    except BaseException as exc:  # noqa: BLE001 - closed or broken meanwhile
        task.drop()
        task.state = DONE
        task.value = exc
        waiter.set_result(None)
        return
    engine.submit(task)


async def map_(
    engine: Engine,
    fn: Callable[..., Any],
    iterable: Any,
    chunksize: int | None,
    star: bool,
    on_progress: Callable[[int, int], object] | None = None,
) -> list[Any]:
    """:meth:`Pool.map` and :meth:`Pool.starmap`."""
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress must be callable, not {type(on_progress).__name__}")
    engine.check_open()
    info = fn_info(fn)
    if engine.max_pending is not None:
        admit(engine, info.is_async)
    if isinstance(iterable, (list, tuple, range)):
        # Sliced chunk by chunk, never copied whole; a range's chunks stay ranges (a few
        # bytes to pickle, and no int objects made in the parent at all).
        items: Sequence[Any] = iterable
    elif hasattr(iterable, "__aiter__"):
        items = [x async for x in iterable]
    else:
        items = list(iterable)
    n = len(items)
    if chunksize is None:
        slots = engine.processes * (engine.concurrency if info.is_async else 1)
        chunksize = max(1, math.ceil(n / (engine.kind.chunks_per_slot * slots)))
    else:
        chunksize = count("chunksize", chunksize)
    loop = engine.loop
    if loop is None or not n or engine.probe is None or engine.probe.pending(loop):
        await anyio.lowlevel.checkpoint()
        engine.check_open()
        if not n:
            return []
    # else the chunks go out before this task first yields, as apply's task does: the
    # wait below is the checkpoint .
    flags = (P.F_ASYNC if info.is_async else 0) | (P.F_STAR if star else 0)
    gather = _Gather(engine, n, chunksize)
    tasks = gather.tasks
    try:
        for i, start in enumerate(range(0, n, chunksize)):
            tasks.append(
                make_task(
                    engine,
                    fn,
                    info,
                    flags,
                    items[start : start + chunksize],
                    group=gather,
                    index=i,
                    on_done=gather,
                )
            )
    except BaseException:
        for task in tasks:
            task.drop()
        raise
    for task in tasks:
        engine.submit(task)
    if on_progress is None:
        await _wait(engine, tasks, gather.signal)
    else:
        await _wait_reporting(engine, gather, n, on_progress)
    if gather.error is not None:
        raise gather.error
    assert gather.results is not None  # n > 0 chunks, all done
    return gather.results


async def _wait_reporting(
    engine: Engine, gather: _Gather, total: int, on_progress: Callable[[int, int], object]
) -> None:
    """Wait for a map, calling ``on_progress(done, total)`` from this task (never from a
    loop callback) each time chunks have finished; abandon the map on cancellation."""
    progress = gather.progress = Wakeup(engine.loop)
    reported = 0
    try:
        while True:
            if gather.done != reported:
                reported = gather.done
                on_progress(reported, total)
            if gather.signal.is_set():
                return
            await progress.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await engine.abandon(gather.tasks)
        raise


class _Gather:
    """Collects a map's chunks; its signal fires when all are done or one has failed.

    Each chunk's results are copied into their place in the map's result list as they
    come (in the reader callback, while the workers compute the next chunks), so nothing
    is left to assemble after the last one. The list itself is made when the first chunk
    comes, not before the first send .
    """

    __slots__ = (
        "chunksize",
        "done",
        "engine",
        "error",
        "n",
        "progress",
        "remaining",
        "results",
        "signal",
        "tasks",
    )

    def __init__(self, engine: Engine, n: int, chunksize: int) -> None:
        self.engine = engine
        self.tasks: list[Task] = []
        self.n = n
        self.results: list[Any] | None = None  # made by the first chunk to come
        self.chunksize = chunksize
        self.remaining = math.ceil(n / chunksize)
        self.error: BaseException | None = None
        self.signal = Signal(engine.loop)
        self.done = 0  # inputs whose results have come
        self.progress: Wakeup | None = None

    def __call__(self, task: Task) -> None:
        if self.progress is not None:
            self.progress.set()
        if task.ok and len(task.value) == task.size:
            self.done += task.size
            start = task.index * self.chunksize
            results = self.results
            if results is None:
                results = self.results = [None] * self.n
            results[start : start + task.size] = task.value
        elif self.error is None:
            if task.ok:  # cannot happen unless a worker is broken; never a shifted list
                task.ok = False
                task.value = RuntimeError(
                    f"a chunk of {task.name} came back with {len(task.value)} results "
                    f"for {task.size} inputs"
                )
            self.error = task.value
            self.signal.set()
            for other in self.tasks:  # now, before the freed worker takes the next one
                self.engine.drop(other)
        self.remaining -= 1
        if not self.remaining:
            self.signal.set()
