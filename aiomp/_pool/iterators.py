"""``Pool.imap`` and ``Pool.imap_unordered``: a :class:`ResultIterator` over a running
:class:`~aiomp._pool.engine.Engine`, which submits chunks as its input is read and keeps
at most ``buffersize`` of them unconsumed. Owns its feeder task (for an async input) in the
pool's task group.
"""

from __future__ import annotations

import collections
import inspect
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._errors import BrokenPoolError
from .._process.checks import count
from . import protocol as P
from .admission import admit
from .calls import make_task
from .engine import Engine
from .tasks import DONE, QUEUED, Task, fn_info, fresh

T = TypeVar("T")


class ResultIterator(Generic[T]):
    """What :meth:`Pool.imap` and :meth:`Pool.imap_unordered` return."""

    def __init__(
        self,
        engine: Engine,
        fn: Callable[..., T],
        iterable: Any,
        chunksize: int,
        star: bool,
        ordered: bool,
        buffersize: int | None,
    ) -> None:
        engine.check_open()
        self._fn_info = info = fn_info(fn)
        chunksize = count("chunksize", chunksize)
        if buffersize is None:
            buffersize = 2 * engine.processes * (engine.concurrency if info.is_async else 1)
        else:
            buffersize = count("buffersize", buffersize)
        self._engine = engine
        self._fn = fn
        self._flags = (P.F_ASYNC if info.is_async else 0) | (P.F_STAR if star else 0)
        self._chunksize = chunksize
        self._buffersize = buffersize
        self._ordered = ordered
        self._ait: AsyncIterator[Any] | None = None
        self._it: Iterator[Any] | None = None
        if hasattr(iterable, "__aiter__"):
            self._ait = iterable.__aiter__()
        else:
            self._it = iter(iterable)
        self._tasks: dict[int, Task] = {}  # submitted and not yet consumed, by index
        self._done: collections.deque[Task] = collections.deque()  # unordered: completed
        self._next = 0  # ordered: the index to consume next
        self._count = 0  # chunks submitted
        self._items: collections.deque[T] = collections.deque()
        self._exhausted = False
        self._error: BaseException | None = None  # raised once the in-flight are consumed
        self._wake: anyio.Event | None = None
        self._space: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._started = False
        self._closed: BaseException | None = None
        self._broken: BrokenPoolError | None = None  # raised on every step from then on
        engine.iterators[self] = None

    def __aiter__(self) -> ResultIterator[T]:
        return self

    async def __aenter__(self) -> ResultIterator[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: drop queued chunks, stop reading the input. Never blocks."""
        self.close(None)
        await anyio.lowlevel.checkpoint()

    async def __anext__(self) -> T:
        """The next result. Cancelling it leaves the iterator as it was."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._items:
                return self._items.popleft()
            if self._broken is not None:
                raise fresh(self._broken)
            if self._closed is not None:
                err = self._closed
                if isinstance(err, StopAsyncIteration):
                    raise StopAsyncIteration
                self._closed = StopAsyncIteration()  # raised once, then the end
                raise err
            if not self._started:
                await anyio.lowlevel.checkpoint()
                self._start()
                continue
            task = self._take()
            if task is not None:
                if task.ok:
                    self._items.extend(task.value)
                    continue
                if isinstance(task.value, BrokenPoolError):
                    self._break(task)
                    continue
                raise task.value
            if self._exhausted and not self._tasks:
                input_error, self._error = self._error, None
                self.close(None)
                if input_error is not None:
                    raise input_error
                raise StopAsyncIteration
            self._wake = event = anyio.Event()
            try:
                await event.wait()
            finally:
                self._wake = None

    def _break(self, task: Task) -> None:
        """The pool broke: no more results will come. Count what was not run."""
        lost = task.size + sum(t.size for t in self._tasks.values() if not t.ok)
        more = "" if self._exhausted else " (the rest of the input was not read)"
        err = BrokenPoolError(
            f"the pool broke with {lost} input(s) of this iterator not run{more}: {task.value}",
            lost,
        )
        err.__cause__ = task.value.__cause__
        self.close(None)
        self._broken = err

    def _start(self) -> None:
        self._started = True
        self._engine.check_open()
        if self._engine.max_pending is not None:
            admit(self._engine, self._fn_info.is_async)
        if self._it is not None:
            self._fill()
        else:
            self._scope = anyio.CancelScope()
            tg = self._engine.tg
            assert tg is not None
            tg.start_soon(self._feed)

    def _take(self) -> Task | None:
        if self._ordered:
            task = self._tasks.get(self._next)
            if task is None or task.state != DONE:
                return None
            self._next += 1
        else:
            if not self._done:
                return None
            task = self._done.popleft()
        del self._tasks[task.index]
        if self._it is not None:
            self._fill()
        elif self._space is not None:
            self._space.set()
        return task

    def _submit(self, chunk: list[Any]) -> None:
        engine = self._engine
        task = make_task(
            engine,
            self._fn,
            self._fn_info,
            self._flags,
            chunk,
            group=self,
            index=self._count,
            on_done=self._on_done,
        )
        self._tasks[self._count] = task
        self._count += 1
        engine.submit(task)

    def _fill(self) -> None:
        """Pull from a sync input until ``buffersize`` chunks are in flight."""
        assert self._it is not None
        while not self._exhausted and len(self._tasks) < self._buffersize:
            try:
                chunk = list(itertools.islice(self._it, self._chunksize))
            except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
                self._error = exc
                self._exhausted = True
                return
            if chunk:
                self._submit(chunk)
            if len(chunk) < self._chunksize:
                self._exhausted = True

    async def _feed(self) -> None:
        """Pull from an async input while there is room (a task in the pool's group)."""
        ait = self._ait
        assert ait is not None and self._scope is not None
        finished = False  # the input said StopAsyncIteration
        try:
            with self._scope:
                while not finished:
                    while len(self._tasks) >= self._buffersize:
                        self._space = anyio.Event()
                        await self._space.wait()
                    self._space = None
                    chunk: list[Any] = []
                    try:
                        while len(chunk) < self._chunksize:
                            chunk.append(await ait.__anext__())
                    except StopAsyncIteration:
                        finished = True
                    if self._closed is not None:
                        break  # closed while the input was read (an event wins over a cancel)
                    if chunk:
                        self._submit(chunk)
        except Exception as exc:  # noqa: BLE001 - raised to the consumer, in order
            self._error = exc
        finally:
            self._exhausted = True
            self._space = None
            if self._wake is not None:
                self._wake.set()
            # An async generator we stopped reading gets its finally blocks run now. Other
            # async iterables (a memory stream, say) are the caller's to close.
            if not finished and inspect.isasyncgen(ait):
                with anyio.CancelScope(shield=True), anyio.move_on_after(self._engine.grace):
                    await ait.aclose()

    def _on_done(self, task: Task) -> None:
        if not self._ordered:
            self._done.append(task)
        if self._wake is not None:
            self._wake.set()

    def close(self, error: BaseException | None) -> None:
        """Stop (for :meth:`aclose`, and the pool as it closes): queued chunks are dropped;
        the next step raises ``error``, or ends the iteration."""
        if self._closed is not None:
            return
        self._closed = error if error is not None else StopAsyncIteration()
        if self._scope is not None:
            self._scope.cancel()
        for task in self._tasks.values():
            if task.state == QUEUED:
                self._engine.drop(task)
        self._tasks.clear()
        self._done.clear()
        self._items.clear()
        self._exhausted = True
        self._engine.iterators.pop(self, None)
        if self._wake is not None:
            self._wake.set()
