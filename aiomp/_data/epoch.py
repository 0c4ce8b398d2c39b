"""One epoch of a map-style dataset in a :class:`aiomp.DataLoader`: its batches in flight,
in order, with the resume count (iterable-style datasets: :mod:`aiomp._data.streams`;
``num_workers=0``: :mod:`aiomp._data.local`).

The consumer's ``__anext__`` tops the requests up to the prefetch bound (batches requested
and not yet handed out), then waits for the batch it hands out next (``in_order``) or any
ready one. The batches travel by the epoch's :class:`~.feeds.Feeds` (its retries and
``timeout=`` deadlines are there); a batch's failure is raised by the ``__anext__`` that
hands it out, never in the loader's tasks. An epoch left early (``break``) closes its
feeds: the batches still being built are dropped.

What an epoch uses of the loader that made it is :class:`Owner`, given when it is made:
no epoch module imports the loader's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Protocol

import anyio

from .._errors import QueueClosed
from . import options as _options
from .feeds import Feeds, Host


class Owner(Host, Protocol):
    """What an epoch (map-style, iterable-style, or ``num_workers=0``) reads of the
    loader that made it: its settings, its task host (:class:`~.feeds.Host`), and what to
    call with a batch handed out (``pinned``) and at the epoch's end (``finished``)."""

    num_workers: int
    prefetch_factor: int
    timeout: float | None
    max_retries: int
    in_order: bool
    seed: int
    batch_size: int | None
    drop_last: bool

    def pinned(self, batch: Any) -> Any: ...

    def finished(self, epoch: object) -> None: ...


class MapEpoch:
    """The async iterator of one map-style epoch (what ``async for batch in loader``
    iterates)."""

    def __init__(
        self,
        loader: Owner,
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
        self.last_k: int | None = None  # the batch __anext__ handed out last
        self.ready: dict[int, tuple[bool, Any]] = {}
        self.requested = 0  # requested and not yet handed out
        self.running = 0  # requested and not yet back
        self.limit = loader.prefetch_factor * loader.num_workers
        self.done = False  # no more batches to request
        self.closed = False  # left (or ended): its feeds are closed
        self.feeds = Feeds(
            loader, loader.num_workers, epoch, loader.seed, loader.max_retries, loader.timeout
        )

    def __aiter__(self) -> MapEpoch:
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
        assert self.last_k is not None
        self.handed_out.add(self.last_k)
        self._request()
        if not ok:
            raise _options.user_error(value)
        return self.loader.pinned(value)

    async def _receive(self) -> None:
        """Wait for the feeds' next outcome and file it in ``ready``."""
        outcome = await self.feeds.receive()
        if outcome is not None:
            k, ok, value = outcome
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
        while not self.done and self.requested < self.limit:
            indices = next(self.batches, None)
            if indices is None:
                self.done = True
                return
            k, self.next_k = self.next_k, self.next_k + 1
            if k in self.resumed:
                continue  # handed out before the resume
            self.feeds.send(k, indices)
            self.requested += 1
            self.running += 1

    def close(self) -> None:
        """Stop taking this epoch's batches (those still being built are dropped)."""
        self.done = self.closed = True
        self.feeds.close()
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
