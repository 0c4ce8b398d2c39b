"""The sync face's channel: batches from the private loop thread to the consumer's thread.

``for batch in loader`` runs no event loop in its thread: the loader's async side runs on
a private loop (anyio's blocking portal, always asyncio). A portal call per batch costs a
task on that loop and two thread hops per batch (measured: a third of the sync consumer's
CPU per batch, light samples). Instead one *pump* task per epoch iterates the async epoch
on the loop and appends each batch to a small deque, under a lock; the consumer's thread
pops from it, waiting on a condition only when it is empty. The loop is woken from the
consumer's thread only when the pump waits for room (the deque full) and the consumer has
taken half of it: once per ``capacity // 2`` batches at most, never while the consumer
is the one waiting. See docs/decisions/0047-loader-feeds.md.
"""

from __future__ import annotations

import atexit
import enum
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from .epoch import Handed, MapEpoch

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures
    from collections.abc import Callable

    from .options import LengthWatch
    from .streams import StreamEpoch


class Kind(enum.Enum):
    """What the pump appends: a batch, the epoch's end, or the error to raise."""

    BATCH = "batch"
    END = "end"
    ERROR = "error"


#: How long the consumer waits on the condition before it looks whether the pump died.
POLL_SECONDS = 0.5


class Handoff:
    """The batches of one epoch on their way from the pump to a sync consumer.

    ``capacity``: at most this many batches wait here (taken off the epoch, not yet by
    the consumer), on top of the epoch's own prefetch bound. ``handed`` is the
    epoch's batches handed to the consumer (what ``state_dict`` reports).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.epoch: MapEpoch | StreamEpoch | None = None  # set by the pump as it starts
        self.handed = Handed(0)  # the epoch's batches handed to the consumer
        self.ended = False  # the consumer has seen the epoch's end
        self.items: deque[tuple[Kind, Any, int | None]] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.room: asyncio.Future[None] | None = None  # the pump's wait for room

    async def pump(self, open_epoch: Callable[[], MapEpoch | StreamEpoch]) -> None:
        """On the loop: open the epoch (``loader.__aiter__``: one hop from the consumer's
        thread starts the epoch and its pump) and move its batches here until its end. A
        batch's error (a ``BaseException`` from the dataset too) is moved as an item and
        the pump goes on, so that iterating on gives the later batches, as in async code.
        Cancelled by the consumer when it stops (the epoch stays as it was)."""
        import asyncio

        from .._loop import is_cancellation
        from .epoch import EpochClosed

        self.loop = asyncio.get_running_loop()
        try:
            epoch = open_epoch()
        except Exception as exc:  # noqa: BLE001 - raised in the consumer's thread
            self._append(Kind.ERROR, exc)
            return
        self.handed = (
            epoch.handed_out.copy() if isinstance(epoch, MapEpoch) else Handed(epoch.handed_count)
        )
        self.epoch = epoch
        keyed = epoch if isinstance(epoch, MapEpoch) else None  # its items name their batch
        while True:
            try:
                batch = await epoch.__anext__()
            except StopAsyncIteration:
                self._append(Kind.END, None)
                return
            except BaseException as exc:
                if is_cancellation(exc):
                    raise
                closed = isinstance(exc, EpochClosed)
                room = self._append(Kind.ERROR, exc, None if keyed is None else keyed.last_k)
                del exc
                if closed:
                    return
                if room is not None:
                    await room
                continue
            room = self._append(Kind.BATCH, batch, None if keyed is None else keyed.last_k)
            del batch
            if room is not None:
                await room

    def _append(self, kind: Kind, value: Any, k: int | None = None) -> asyncio.Future[None] | None:
        """Append an item (``k``: its batch index, None where the epoch hands out in order);
        return the future to wait on when the deque is now full."""
        with self.cond:
            self.items.append((kind, value, k))
            self.cond.notify()
            if len(self.items) < self.capacity:
                return None
            assert self.loop is not None
            self.room = self.loop.create_future()
            return self.room

    def get(self, pump: concurrent.futures.Future[None]) -> tuple[Kind, Any]:
        """In the consumer's thread: the next item, waiting while there is none.
        Raises what stopped the pump if it stopped without saying (the loop ended)."""
        with self.cond:
            while not self.items:
                if pump.done():
                    pump.result()  # raises its error
                    raise RuntimeError("aiomp.DataLoader: the loader's loop stopped")
                self.cond.wait(POLL_SECONDS)
            kind, value, k = self.items.popleft()
            room = self.room
            if room is not None and len(self.items) <= self.capacity // 2:
                self.room = None
            else:
                room = None
        if room is not None:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(_wake, room)
        if kind is not Kind.END:  # a batch's error counts as handed out, as in async code
            self.handed.add(self.handed.prefix if k is None else k)
        else:
            self.ended = True
        return kind, value


def _wake(room: asyncio.Future[None]) -> None:
    if not room.done():  # not cancelled meanwhile
        room.set_result(None)


class Batches:
    """What ``for batch in loader`` iterates: one epoch's batches, taken off its
    :class:`Handoff`. A batch's error is raised by the ``next()`` that would have given
    the batch, and the iterator goes on (torch's skip-the-bad-batch loop works); the
    epoch's end raises ``StopIteration`` for good. Closing it (or dropping it) stops the
    pump."""

    def __init__(
        self,
        handoff: Handoff,
        pump: concurrent.futures.Future[None],
        owner: object,
        watch: LengthWatch | None = None,
    ) -> None:
        self.handoff = handoff
        self.pump: concurrent.futures.Future[None] | None = pump
        self.owner: object = owner  # the loader: alive while its iterator is
        self.watch = watch  # an iterable dataset's batches, counted as they are handed out

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self.pump is None:
            raise StopIteration
        kind, value = self.handoff.get(self.pump)
        if kind is Kind.END:
            self.close()
            raise StopIteration
        if kind is Kind.ERROR:
            raise value
        if self.watch is not None:
            self.watch.step()
        return value

    def close(self) -> None:
        """Stop the pump (idempotent; the epoch stays as it was)."""
        pump, self.pump = self.pump, None
        self.owner = None
        if pump is not None and not pump.done():
            pump.cancel()

    def __del__(self) -> None:
        self.close()


#: The loaders entered by ``with`` (or a first ``for``) and not yet left.
OPEN: weakref.WeakSet[Leavable] = weakref.WeakSet()


class Leavable(Protocol):
    """A sync loader, as the exit hook sees it (:class:`~.syncface.SyncFace`)."""

    def __exit__(self, *exc_info: Any) -> None: ...


def opened(loader: Leavable) -> None:
    """Record ``loader`` as entered by ``with``. The first time: register
    :func:`_close_at_exit`, now that the workers have started (and aiomp's own exit hooks,
    and multiprocessing's, are registered): ``atexit`` runs it before them."""
    global _HOOKED
    if not _HOOKED:
        # weakref.finalize registers its own exit hook (which closes an epoch's queues)
        # with its first use: make sure it is registered before ours, so ours runs first.
        weakref.finalize(_close_at_exit, int).atexit = False
        atexit.register(_close_at_exit)
        _HOOKED = True
    OPEN.add(loader)


_HOOKED = False


def _close_at_exit() -> None:
    """Leave each sync loader still open, as ``with`` would, before the interpreter tears
    down the modules its batches and threads need, and before aiomp's exit hook kills
    their workers."""
    for loader in list(OPEN):
        try:
            loader.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - nothing to tell at exit; the workers die anyway
            pass
