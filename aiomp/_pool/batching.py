"""``pool.batched``: dynamic batching of concurrent calls into one task per batch.

::

    b = pool.batched(model, max_batch_size=32, max_delay=0.005, stack=True)
    y = await b(x)          # from many tasks at once: one model(xs) per batch

The parts, and who does what::

    callers (their own tasks) --- append ---> the open batch --- full ---> full batches
                                                   |                           |
    dispatcher (one task in the pool's group, while a batch is open, full or    |
    left by a caller in the queue) ------- hands to the pool ------------------+
                                                   |
                                                   v
    a Task of the pool (an ``apply`` of ``fn(xs)``) -- on_done --> each caller's Signal

* **When a batch goes.** The open batch goes to a worker as soon as one is free to take
  it (nothing queued, a worker with room: ``admission.has_room``), having waited for
  company only while calls keep arriving (one loop pass at a time, at most ``max_delay``
  after its first call): a call on an idle pool costs an ``apply`` and a loop pass.
  While every worker is busy it keeps filling; once full it is queued like any task.
  The dispatcher sleeps on a :class:`Wakeup` that calls, and the scheduler's room hook
  (``admission.Room``), set.
* **Load shedding** (``max_pending``): a full batch is queued only if the pool admits a
  task; otherwise it waits for room and a call that finds no batch to join raises
  :class:`aiomp.PoolOverloadedError` at once.
* **Stacking** (``stack=True``): the rows are copied once into one array, in shared
  memory when the batch is at least the wire's inline size (64 KiB), else a plain one
  that travels in the task's message as any small array does.
* **Errors.** A batch whose ``fn`` raised (an exception from the worker, with its remote
  traceback) is split in two halves, each run again as a batch of its own, down to
  single rows: only a row that raises on its own fails, in its own caller (bisection:
  why, in docs/decisions/0060-batched-bad-rows.md). Done in the task's ``on_done`` (maybe
  a loop callback: it encodes and submits, never awaits), so that the halves are
  submitted before the pool could see itself drained. ``split_on_error=False``: every
  caller gets the exception.
* **Cancellation** (docs/decisions/0040-batched-cancellation.md): a caller leaving before
  its batch has gone to a worker is taken out of it (an unsent batch: out of its list; a
  queued one: the dispatcher makes its message again without it, in its place in the
  queue, or drops it once empty); one leaving after returns at once, and its element is
  discarded. A running batch is never stopped for its callers.

Owns the unsent batches of each batcher; the pool closes it (``close``) as it closes its
iterators: leaving normally queues what is unsent, leaving by an error fails it.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._loop.wakeup import Signal, Wakeup
from .._process.checks import count
from .._wire.datagram import MAX_INLINE
from . import protocol as P
from .admission import has_room, overload_error, overloaded
from .engine import CLOSED, CLOSING, OPEN, Engine
from .tasks import QUEUED, FnInfo, Task, fn_info, fresh, new_task, tids

if TYPE_CHECKING:
    import numpy as np

X = TypeVar("X")
R = TypeVar("R")

#: The live batchers of each pool, to warn when one is made again and again.
_made: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[Batched[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _raised_by_fn(exc: BaseException) -> bool:
    """Whether ``exc`` is what ``fn`` raised in the worker (it carries the worker's
    traceback), rather than the pool's (a dead worker, a broken or closed pool)."""
    return isinstance(exc.__cause__, P.RemoteTraceback)


class _Caller:
    """One call's place in a batch and its outcome."""

    __slots__ = ("arg", "batch", "gone", "ok", "signal", "value")

    def __init__(self, arg: object, signal: Signal, batch: _Batch) -> None:
        self.arg = arg
        self.signal = signal
        self.batch = batch  # the one it is in now (a half of it, after a failure)
        self.gone = False  # left after its batch was encoded: its element is discarded
        self.ok = False
        self.value: Any = None


class _Batch:
    """The callers of one batch, in arrival order, and its task once handed over."""

    __slots__ = ("callers", "first", "row", "sent", "task")

    def __init__(self, first: float) -> None:
        self.callers: list[_Caller] = []  # those still waiting
        self.first = first  # when its first call came
        self.row: tuple[tuple[int, ...], Any] | None = None  # stack: every row's shape, dtype
        self.sent: list[_Caller] = []  # the callers its message was made of, in order
        self.task: Task | None = None  # None: not handed to the pool yet


class Batched(Generic[X, R]):
    """The async callable :meth:`aiomp.Pool.batched` returns: ``await b(x)``."""

    def __init__(
        self,
        engine: Engine,
        fn: Callable[[Any], Any],
        max_batch_size: int,
        max_delay: float,
        stack: bool,
        split_on_error: bool = True,
    ) -> None:
        self._engine = engine
        self._fn = fn
        self._info: FnInfo = fn_info(fn)
        self._flags = P.F_APPLY | P.F_ASYNC if self._info.is_async else P.F_APPLY
        self._weight = 1 if self._info.is_async else engine.concurrency
        self.max_batch_size = count("max_batch_size", max_batch_size)
        if not max_delay >= 0:
            raise ValueError(f"max_delay must be >= 0, not {max_delay!r}")
        self.max_delay = float(max_delay)
        self.stack = stack
        self.split_on_error = bool(split_on_error)
        self._open: _Batch | None = None
        self._full: collections.deque[_Batch] = collections.deque()
        self._left: dict[_Batch, None] = {}  # queued batches that callers left
        self._inflight = 0  # batches handed to the pool and not done
        self._wake: Wakeup | None = None  # the dispatcher's, while it runs
        self._closed = False
        self._warn_if_made_again()

    def __repr__(self) -> str:
        return (
            f"<aiomp batched {self._info.name} max_batch_size={self.max_batch_size} "
            f"max_delay={self.max_delay} stack={self.stack}>"
        )

    def _settings(self) -> tuple[object, ...]:
        return (self._fn, self.max_batch_size, self.max_delay, self.stack, self.split_on_error)

    def _warn_if_made_again(self) -> None:
        """One batcher per model: one made per request batches nothing (each batches its
        own calls only), so a second live one for the same function and settings warns."""
        made = _made.setdefault(self._engine, weakref.WeakSet())
        same = self._settings()
        if any(b._settings() == same for b in made):
            warnings.warn(
                f"pool.batched({self._info.name}, ...) was made again while another for it "
                f"is in use: each batches only its own calls. Make it once (e.g. in the "
                f"app's lifespan) and share it between requests",
                RuntimeWarning,
                stacklevel=4,
            )
        made.add(self)

    async def __call__(self, x: X) -> R:
        """``fn(xs)[i]`` for this call's place ``i`` in its batch ``xs``.

        Raises in this caller what ``fn`` raised on this row alone (as ``Pool.apply``
        raises it: same type, the worker's traceback as ``__cause__``),
        ``BrokenWorkerError`` if its worker died, ``ValueError`` if ``fn`` returned a
        result of another length than the batch's (with ``stack=True``: at once, for an
        argument that is not an array of the batch's shape and dtype),
        ``PoolOverloadedError`` at once where the pool's ``max_pending`` refuses the
        batch it would join. Cancellation: see the module docstring.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        engine = self._engine
        engine.check_open()
        batch = self._open
        if batch is None:
            if self._full and overloaded(engine, self._weight):
                raise overload_error(engine)
            batch = _Batch(anyio.current_time())
        if self.stack:
            self._check_row(batch, x)
        self._open = batch
        me = _Caller(x, Signal(engine.loop), batch)
        callers = batch.callers
        callers.append(me)
        if len(callers) >= self.max_batch_size:
            self._open = None
            self._full.append(batch)
            self._poke()
        elif len(callers) == 1:
            self._poke()
        try:
            await me.signal.wait()
        except BaseException:
            self._leave(me)
            raise
        if me.ok:
            result: R = me.value
            return result
        raise me.value

    def _check_row(self, batch: _Batch, x: object) -> None:
        import numpy as np

        if not isinstance(x, np.ndarray):
            raise ValueError(f"batched(stack=True) takes numpy arrays, not {type(x).__name__}")
        row = (x.shape, x.dtype)
        if batch.row is None or not batch.callers:
            batch.row = row
        elif row != batch.row:
            raise ValueError(
                f"batched(stack=True): this batch's arrays are {batch.row[0]} "
                f"{batch.row[1]}, not {row[0]} {row[1]}"
            )

    # -- the dispatcher --------------------------------------------------------------
    def _poke(self) -> None:
        """Wake the dispatcher, starting it if it is not running (from a task)."""
        if self._wake is not None:
            self._wake.set()
            return
        engine = self._engine
        tg = engine.tg
        if tg is None or engine.state == CLOSED or self._closed:
            return  # (the pool's close has handed over or failed what was unsent)
        self._wake = Wakeup(engine.loop)
        engine.iterators[self] = None  # closed with the pool (see close)
        tg.start_soon(self._dispatch, name=f"aiomp batched {self._info.name}")

    async def _dispatch(self) -> None:
        """Hand batches to the pool (see the module docstring), until none is unsent nor
        running (it stays for the next one: one task per busy spell, not per batch)."""
        wake = self._wake
        assert wake is not None
        engine = self._engine
        watching = False
        try:
            while not self._closed:
                self._remake_left()
                if engine.broken is not None:
                    self._fail_unsent(engine.broken)
                while self._full and not overloaded(engine, self._weight):
                    self._hand(self._full.popleft())
                batch = self._open
                if batch is not None and batch.callers and has_room(engine, self._weight):
                    await self._wait_for_company(batch)
                    if self._open is batch and has_room(engine, self._weight):
                        self._open = None
                        self._hand(batch)
                    continue
                unsent = bool(batch is not None and batch.callers) or bool(self._full)
                if not unsent and not self._inflight:
                    return  # (and _remake_left has emptied _left)
                if unsent != watching:  # room matters only to a batch unsent
                    watching = unsent
                    (engine.room.watch if watching else engine.room.unwatch)(wake)
                await wake.wait()
        finally:
            engine.room.unwatch(wake)
            self._wake = None
            if not self._closed:
                engine.iterators.pop(self, None)
                if self._open is not None or self._full:  # cancelled: the pool is going
                    self._fail_unsent(RuntimeError("the pool was terminated"))

    async def _wait_for_company(self, batch: _Batch) -> None:
        """A worker is free: wait while each loop pass brings more calls, at most
        ``max_delay`` after the batch's first call (none comes: it goes now)."""
        deadline = batch.first + self.max_delay
        n = len(batch.callers)
        while n < self.max_batch_size and anyio.current_time() < deadline:
            await anyio.lowlevel.checkpoint()
            if self._open is not batch or len(batch.callers) <= n:
                return
            n = len(batch.callers)

    def close(self, error: BaseException | None) -> None:
        """The pool is closing: leaving normally, what is unsent is handed over now (it
        queues); else its callers fail with ``error``. Stops the dispatcher."""
        self._closed = True
        self._engine.iterators.pop(self, None)
        if self._engine.state == CLOSING:
            self._remake_left()
            while self._full:
                self._hand(self._full.popleft())
            if self._open is not None:
                batch, self._open = self._open, None
                self._hand(batch)
        else:
            self._fail_unsent(error or RuntimeError("the pool was closed"))
        if self._wake is not None:
            self._wake.set()

    def _fail_unsent(self, error: BaseException) -> None:
        unsent = [*self._full, *([self._open] if self._open is not None else [])]
        self._full.clear()
        self._open = None
        for batch in unsent:
            self._fail(batch.callers, error)

    # -- handing over: the batch becomes a task --------------------------------------
    def _hand(self, batch: _Batch) -> None:
        """Make ``batch`` (its callers still waiting) a task of the pool, or fail its
        callers with why it cannot be (maybe in a loop callback: never awaits)."""
        callers = list(batch.callers)
        if not callers:
            return
        engine = self._engine
        if engine.state not in (OPEN, CLOSING):
            self._fail(callers, RuntimeError("the pool was terminated before the batch ran"))
            return
        tid = next(tids)
        try:
            message = self._encode(tid, callers)
        except Exception as exc:  # noqa: BLE001 - every caller's outcome
            self._fail(callers, exc)
            return
        task = new_task(engine.concurrency, self._info, tid, message)
        task.on_done = lambda t: self._done(batch, t)
        batch.task = task
        batch.sent = callers
        self._inflight += 1
        engine.submit(task)

    def _encode(self, tid: int, callers: list[_Caller]) -> Any:
        """The task message of ``fn(xs)`` for these callers: with ``stack``, ``xs`` is one
        array (see :meth:`_stacked`)."""
        xs: Any = [c.arg for c in callers]
        if self.stack:
            xs = self._stacked(xs)
        return self._engine.kind.encode((tid, self._fn, self._info, self._flags, (xs,), None, None))

    def _stacked(self, rows: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
        from .._arrays.shared import stack

        # In shared memory unless the wire would copy it into the message anyway (under
        # MAX_INLINE, as any small array: a lone call's row costs a copy, not a segment;
        # docs/decisions/0061) or the kind is Ray's, whose object store takes it whole.
        big = len(rows) * rows[0].nbytes >= MAX_INLINE
        return stack(rows, shared=big and self._engine.kind.process_wire)

    # -- outcomes (maybe in a loop callback: only Signals, encodes and submits) --------
    def _done(self, batch: _Batch, task: Task) -> None:
        self._inflight -= 1
        self._settle(batch, task)
        if not self._inflight and self._wake is not None:
            # The dispatcher may be done: woken after the callers, so that one calling
            # again at once finds it still there (one task per busy spell).
            self._wake.set()

    def _settle(self, batch: _Batch, task: Task) -> None:
        callers = batch.sent
        if not task.ok:
            exc = task.value
            if self.split_on_error and len(callers) > 1 and _raised_by_fn(exc):
                self._split(callers)
            else:
                self._fail(callers, exc)
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

    def _split(self, callers: list[_Caller]) -> None:
        """``fn`` raised on these rows together: run each half again as a batch of its
        own (the callers that left are left out), so that only rows that raise alone
        fail."""
        live = [c for c in callers if not c.gone]
        half = (len(live) + 1) // 2
        for part in (live[:half], live[half:]) if len(live) > 1 else (live,):
            if part:
                sub = _Batch(0.0)
                sub.callers = part
                for c in part:
                    c.batch = sub
                self._hand(sub)

    @staticmethod
    def _fail(callers: list[_Caller], exc: BaseException) -> None:
        for c in callers:
            if not c.gone and not c.signal.is_set():
                c.ok, c.value = False, fresh(exc)
                c.signal.set()

    # -- leaving early ---------------------------------------------------------------
    def _leave(self, me: _Caller) -> None:
        """``me`` is cancelled (or failed waiting): out of its batch before hand-off,
        discarded after; never waits (the dispatcher remakes a queued batch's message)."""
        if me.signal.is_set():
            return
        batch = me.batch
        task = batch.task
        if task is not None and task.state != QUEUED:
            me.gone = True  # running: it goes on for the others; this element is dropped
            return
        batch.callers.remove(me)
        if task is None:  # unsent
            if not batch.callers:
                if self._open is batch:
                    self._open = None
                elif batch in self._full:
                    self._full.remove(batch)
            return
        me.gone = True  # (should the old message run after all: its row is discarded)
        self._left[batch] = None
        self._poke()

    def _remake_left(self) -> None:
        """Queued batches that callers left: made again without them, in their place in
        the queue (the same task), or dropped once empty."""
        while self._left:
            batch = next(iter(self._left))
            del self._left[batch]
            task = batch.task
            if task is None or task.state != QUEUED:
                continue  # it has started meanwhile: the rows of those gone are dropped
            if not batch.callers:
                self._engine.drop(task)  # the batch left empty never runs
                self._inflight -= 1
                continue
            callers = list(batch.callers)
            try:
                message = self._encode(task.tid, callers)
            except Exception as exc:  # noqa: BLE001 - (it encoded before: cannot happen)
                self._engine.drop(task)
                self._inflight -= 1
                self._fail(callers, exc)
                continue
            old, task.message = task.message, message
            batch.sent = callers
            if type(old) is not bytes:
                old.discard()
