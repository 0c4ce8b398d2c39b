"""``pool.batched``: dynamic batching of concurrent calls into one task per batch.

::

    b = pool.batched(model, max_batch_size=32, max_delay=0.005, stack=True)
    y = await b(x)          # from many tasks at once: one model(xs) per batch

Calls collect in the open :class:`_Batch`; it closes when ``max_batch_size`` calls are
in it or ``max_delay`` seconds after its first call, whichever comes first, and is then
one task of the pool (an ``apply`` of ``fn(xs)``), queued like any other until a worker
is free. Nothing here runs in the background: the call that fills a batch closes it, and
otherwise its callers wait with the batch's deadline and the first to wake past it
closes it. A batch's outcome reaches its callers from the task's ``on_done`` (maybe a
loop callback: only wake-ups that loop callbacks may set).

Cancellation (see docs/decisions/0040-batched-cancellation.md): a caller leaving before
its batch has gone to a worker is taken out of it (an open batch: out of its list; a
queued one: its message is made again without it, in its place in the queue; one left
empty is dropped); one leaving after returns at once, and its element is discarded.
A running batch is never stopped for its callers.

Built over the engine's names a call uses (``kind.encode``, ``submit``, ``sched.drop``)
and the Task's; owns the open batch of each batched callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._loop.wakeup import Signal
from .._process.checks import count
from . import protocol as P
from .engine import Engine
from .tasks import QUEUED, FnInfo, Task, fn_info, fresh, new_task, tids

if TYPE_CHECKING:
    import numpy as np

X = TypeVar("X")
R = TypeVar("R")


class _Caller:
    """One call's place in a batch and its outcome."""

    __slots__ = ("arg", "gone", "ok", "signal", "value")

    def __init__(self, arg: object, signal: Signal) -> None:
        self.arg = arg
        self.signal = signal
        self.gone = False  # left after hand-off: its element is discarded
        self.ok = False
        self.value: Any = None


class _Batch:
    """The callers of one batch, in arrival order, and its task once closed."""

    __slots__ = ("callers", "deadline", "task")

    def __init__(self, deadline: float) -> None:
        self.callers: list[_Caller] = []
        self.deadline = deadline
        self.task: Task | None = None  # None: still open


class Batched(Generic[X, R]):
    """The async callable :meth:`aiomp.Pool.batched` returns: ``await b(x)``."""

    def __init__(
        self,
        engine: Engine,
        fn: Callable[[Any], Any],
        max_batch_size: int,
        max_delay: float,
        stack: bool,
    ) -> None:
        self._engine = engine
        self._fn = fn
        self._info: FnInfo = fn_info(fn)
        self._flags = P.F_APPLY | P.F_ASYNC if self._info.is_async else P.F_APPLY
        self.max_batch_size = count("max_batch_size", max_batch_size)
        if not max_delay >= 0:
            raise ValueError(f"max_delay must be >= 0, not {max_delay!r}")
        self.max_delay = float(max_delay)
        self.stack = stack
        self._open: _Batch | None = None
        #: stack=True: the shape and dtype of every row of the open batch.
        self._row: tuple[tuple[int, ...], Any] | None = None

    def __repr__(self) -> str:
        return (
            f"<aiomp batched {self._info.name} max_batch_size={self.max_batch_size} "
            f"max_delay={self.max_delay} stack={self.stack}>"
        )

    async def __call__(self, x: X) -> R:
        """``fn(xs)[i]`` for this call's place ``i`` in its batch ``xs``.

        Raises in this caller what ``fn`` raised (as ``Pool.apply`` raises it: same type,
        the worker's traceback as ``__cause__``), ``BrokenWorkerError`` if its worker
        died, ``ValueError`` if ``fn`` returned a result of another length than the
        batch's (with ``stack=True``: at once, for an argument that is not an array of
        the batch's shape and dtype). Cancellation: see the module docstring.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._engine.check_open()
        batch = self._open
        if batch is None or (self.stack and not batch.callers):
            self._row = None
        if self.stack:
            self._check_row(x)
        if batch is None:
            batch = self._open = _Batch(anyio.current_time() + self.max_delay)
        me = _Caller(x, Signal(self._engine.loop))
        batch.callers.append(me)
        if len(batch.callers) >= self.max_batch_size:
            self._close(batch)
        try:
            while not me.signal.is_set():
                if batch.task is None:
                    with anyio.move_on_at(batch.deadline):
                        await me.signal.wait()
                    if batch.task is None and anyio.current_time() >= batch.deadline:
                        self._close(batch)
                else:
                    await me.signal.wait()
        except BaseException:
            self._leave(batch, me)
            raise
        if me.ok:
            result: R = me.value
            return result
        raise me.value

    def _check_row(self, x: object) -> None:
        import numpy as np

        if not isinstance(x, np.ndarray):
            raise ValueError(f"batched(stack=True) takes numpy arrays, not {type(x).__name__}")
        row = (x.shape, x.dtype)
        if self._row is None:
            self._row = row
        elif row != self._row:
            raise ValueError(
                f"batched(stack=True): this batch's arrays are {self._row[0]} "
                f"{self._row[1]}, not {row[0]} {row[1]}"
            )

    # -- closing: the batch becomes a task -------------------------------------------
    def _close(self, batch: _Batch) -> None:
        """Make ``batch`` a task of the pool (its callers fail with why it cannot be)."""
        if self._open is batch:
            self._open = None
        callers = batch.callers
        if not callers:
            return
        tid = next(tids)
        try:
            self._engine.check_open()
            message = self._encode(tid, callers)
        except Exception as exc:  # noqa: BLE001 - every caller's outcome
            self._fail(callers, exc)
            return
        task = new_task(self._engine.concurrency, self._info, tid, message)
        task.on_done = lambda t: self._done(batch, t)
        batch.task = task
        self._engine.submit(task)

    def _encode(self, tid: int, callers: list[_Caller]) -> Any:
        """The task message of ``fn(xs)`` for these callers: with ``stack``, ``xs`` is one
        array, stacked straight into shared memory (an object-store array on Ray)."""
        xs: Any = [c.arg for c in callers]
        if self.stack:
            xs = self._stacked(xs)
        return self._engine.kind.encode((tid, self._fn, self._info, self._flags, (xs,), None, None))

    def _stacked(self, rows: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
        from .._arrays.shared import stack

        # Ray's kind (no process wire): its object store takes the array whole.
        return stack(rows, shared=self._engine.wire is not None)

    # -- outcomes (maybe in a loop callback: only Signals) ---------------------------
    def _done(self, batch: _Batch, task: Task) -> None:
        callers = batch.callers
        if not task.ok:
            self._fail(callers, task.value)
            return
        result: Any = task.value
        try:
            n = len(result)
        except TypeError:
            n = -1
        if n != len(callers) or (self.stack and not hasattr(result, "shape")):
            got = f"a result of length {n}" if n >= 0 else f"a {type(result).__name__}"
            self._fail(
                callers,
                ValueError(
                    f"{self._info.name} returned {got} for a batch of {len(callers)} "
                    f"(batched: one element per call)"
                ),
            )
            return
        for i, c in enumerate(callers):
            if not c.gone:
                c.ok, c.value = True, result[i]
                c.signal.set()

    @staticmethod
    def _fail(callers: list[_Caller], exc: BaseException) -> None:
        for c in callers:
            if not c.gone:
                c.ok, c.value = False, fresh(exc)
                c.signal.set()

    # -- leaving early ---------------------------------------------------------------
    def _leave(self, batch: _Batch, me: _Caller) -> None:
        """``me`` is cancelled (or failed waiting): out of its batch before hand-off,
        discarded after; never waits."""
        if me.signal.is_set():
            return
        task = batch.task
        if task is None or task.state == QUEUED:
            batch.callers.remove(me)
        else:
            me.gone = True  # running: it goes on for the others; this element is dropped
            return
        if task is None:
            if not batch.callers and self._open is batch:
                self._open = None
            return
        if not batch.callers:
            self._engine.sched.drop(task)  # the batch left empty never runs
            return
        # Queued: the same task, in its place in the queue, made again without ``me``.
        try:
            message = self._encode(task.tid, batch.callers)
        except Exception as exc:  # noqa: BLE001 - (it encoded before: cannot happen)
            self._engine.sched.drop(task)
            self._fail(batch.callers, exc)
            return
        old, task.message = task.message, message
        if type(old) is not bytes:
            old.discard()
