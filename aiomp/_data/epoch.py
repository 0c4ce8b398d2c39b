"""One epoch of a map-style dataset in a :class:`aiomp.DataLoader`: its batches in flight,
in order, with retries (iterable-style datasets: :mod:`aiomp._data.streams`).

The consumer's ``__anext__`` tops the requests up to the prefetch bound (batches requested
and not yet handed out), then waits for the batch it hands out next (``in_order``) or any
ready one. Each request is a task of the loader's task host that calls
``pool.apply`` and sends the outcome, success or exception, on a memory stream: a batch's
failure is raised by the ``__anext__`` that hands it out, never in the host. An epoch left
early (``break``) closes its stream: its requests still running finish in the workers and
their batches are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .._errors import BrokenWorkerError, QueueClosed
from .._loop import is_cancellation
from . import options as _options
from . import worker as _worker
from .sampling import derive

if TYPE_CHECKING:
    from .loader import DataLoader


class Epoch:
    """The async iterator of one epoch (what ``async for batch in loader`` iterates)."""

    def __init__(
        self,
        loader: DataLoader,
        epoch: int,
        skip: int,
        batches: Iterator[list[Any]],
        later: Iterable[int] = (),
    ) -> None:
        self.loader = loader
        self.epoch = epoch
        self.batches = batches  # the epoch's remaining batches (index lists)
        self.next_k = skip  # the index of the next batch to request
        self.handed = skip  # the index of the next batch to hand out, in order
        self.handed_count = skip  # batches of this epoch handed out (resumed ones included)
        #: Which batches were handed out (resumed ones included): with in_order=False,
        #: not only a prefix. ``later``: those handed out past ``skip`` before a resume.
        self.handed_out = Handed(skip, later)
        self.resumed = frozenset(later)  # not requested again
        self.last_k = -1  # the batch __anext__ handed out last
        self.ready: dict[int, tuple[bool, Any]] = {}
        self.requested = 0  # requested and not yet handed out
        self.running = 0  # requested and not yet back
        self.done = False  # no more batches to request
        self.closed = False  # left (or ended): its streams are closed
        self.send, self.receive = anyio.create_memory_object_stream[tuple[int, bool, Any]](math.inf)
        limit = loader.timeout is not None
        # With timeout=, a batch is sent only when a worker can take it at once, so that its
        # timeout counts from the moment a worker takes it (not its time in the queue).
        self.gate = anyio.Semaphore(loader.num_workers) if limit else None

    def __aiter__(self) -> Epoch:
        return self

    async def __anext__(self) -> Any:
        """The next batch (or its failure, raised). Cancellation leaves the epoch as it was."""
        self._request()
        while True:
            got = self._take()
            if got is not None:
                break
            if self.done and self.running == 0 and not self.ready:
                self.close()
                self.loader.finished(self)
                raise StopAsyncIteration
            await receive(self._receive)
        ok, value = got
        self.handed_count += 1
        self.handed_out.add(self.last_k)
        self._request()
        if not ok:
            raise _options.user_error(value)
        return self.loader.pinned(value)

    async def _receive(self) -> None:
        """Wait for one request's outcome and file it in ``ready``."""
        k, ok, value = await self.receive.receive()
        self.running -= 1
        self.ready[k] = (ok, value)

    def _take(self) -> tuple[bool, Any] | None:
        """The batch to hand out now, if it is here."""
        if self.loader.in_order:
            k = self.handed
            got = self.ready.pop(k, None)
            if got is None:
                return None
            self.handed += 1
            while self.handed in self.resumed:
                self.handed += 1
        elif self.ready:
            k = next(iter(self.ready))
            got = self.ready.pop(k)
        else:
            return None
        self.last_k = k
        self.requested -= 1
        return got

    def _request(self) -> None:
        """Request batches up to the prefetch bound."""
        loader = self.loader
        limit = loader.prefetch_factor * loader.num_workers
        while not self.done and self.requested < limit:
            indices = next(self.batches, None)
            if indices is None:
                self.done = True
                return
            k, self.next_k = self.next_k, self.next_k + 1
            if k in self.resumed:
                continue  # handed out before the resume
            self._dispatch(k, indices)
            self.requested += 1
            self.running += 1

    def _dispatch(self, k: int, indices: list[Any]) -> None:
        """Have batch ``k`` built: a Pool task of its own."""
        self.loader.host_tg().start_soon(self._fetch, k, indices)

    async def _fetch(self, k: int, indices: list[Any]) -> None:
        self.loader.in_flight += 1
        outcome: tuple[int, bool, Any]
        try:
            outcome = (k, True, await self._fetch_map(k, indices))
        except BaseException as exc:
            if is_cancellation(exc):
                raise
            outcome = (k, False, exc)
        finally:
            self.loader.fetched()
        try:
            self.send.send_nowait(outcome)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the epoch was left: the batch is dropped

    async def _apply(self, fn: Any, args: tuple[Any, ...]) -> Any:
        pool = self.loader.pool
        if self.gate is None:
            return await pool.apply(fn, args)
        async with self.gate:
            if not pool.statistics().idle:
                # No worker ready for it (starting, or a replacement starting): wait for
                # one first, so that the timeout does not count a worker's start.
                await pool.apply(_worker.ready)
            return await pool.apply(fn, args, timeout=self.loader.timeout)

    async def _fetch_map(self, k: int, indices: list[Any]) -> Any:
        seed = derive(self.loader.seed, self.epoch, k)
        for _ in range(self.loader.max_retries + 1):
            try:
                return await self._apply(_worker.build, (indices, seed))
            except BrokenWorkerError as exc:
                last = exc  # the pool has replaced the worker: the batch again
            except TimeoutError as exc:  # torch's RuntimeError too, with torch's text
                timeout = self.loader.timeout
                assert timeout is not None
                raise note_batch(_options.timed_out(timeout, exc), k, indices) from exc
            except BaseException as exc:
                if not is_cancellation(exc):
                    note_batch(exc, k, indices)
                raise
        raise broken(last, k, indices, self.loader.max_retries)

    def close(self) -> None:
        """Stop taking this epoch's batches (requests still running are dropped)."""
        self.done = self.closed = True
        self.receive.close()
        self.send.close()
        self.ready.clear()


class Handed:
    """The batches of an epoch handed out: all those before ``prefix``, and ``later``
    (past it: with ``in_order=False`` batches are handed out as they are ready)."""

    def __init__(self, prefix: int, later: Iterable[int] = ()) -> None:
        self.prefix = prefix
        self.later = set(later)

    def add(self, k: int) -> None:
        self.later.add(k)
        while self.prefix in self.later:
            self.later.remove(self.prefix)
            self.prefix += 1

    def copy(self) -> Handed:
        return Handed(self.prefix, self.later)


async def receive(step: Callable[[], Awaitable[None]]) -> None:
    """Run an epoch's ``step`` (its wait for the next outcome); an epoch closed under it
    (the loader was left, or its task host failed) raises RuntimeError, never waits."""
    try:
        await step()
    except (anyio.ClosedResourceError, anyio.EndOfStream, QueueClosed) as exc:
        raise EpochClosed(
            "aiomp.DataLoader: this epoch was closed (the loader was left, or its tasks failed)"
        ) from exc


class EpochClosed(RuntimeError):
    """Raised by an epoch's iterator once the epoch was closed under it."""


def note_batch(exc: BaseException, k: int, indices: list[Any]) -> BaseException:
    """``exc``, raised while batch ``k`` was built, with a note naming the batch."""
    exc.add_note(f"aiomp.DataLoader: building batch {k} (samples {indices})")
    return exc


def broken(
    last: BrokenWorkerError, k: int, indices: list[Any] | None, retries: int
) -> BrokenWorkerError:
    """The error of a batch whose worker died on each of its ``1 + retries`` tries."""
    samples = "" if indices is None else f" (samples {indices})"
    tries = f"on each of its {retries + 1} tries" if retries else "while building it"
    err = BrokenWorkerError(
        f"aiomp.DataLoader: batch {k}{samples}: the worker died {tries}; last: {last.msg}",
        last.error_index,
        last.pid,
        last.exit_code,
        last.signal_name,
    )
    for name, value in last.__dict__.items():  # oom_killed, peak_rss, where known
        err.__dict__.setdefault(name, value)
    err.batch_index = k  # type: ignore[attr-defined]
    err.indices = indices  # type: ignore[attr-defined]
    err.__cause__ = last
    return err
