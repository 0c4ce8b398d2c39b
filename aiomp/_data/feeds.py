"""One epoch of a map-style dataset served by one long-running Pool task per worker slot.

:class:`FeedEpoch` is :class:`~.epoch.Epoch` (the prefetch bound, the order, the resume
count) with another transport: instead of one ``pool.apply`` per batch, each slot ``s``
runs one :func:`~.worker.feed` task for the epoch, which takes ``(k, indices, seed)``
requests from the slot's own :class:`aiomp.Queue` and puts its batches on the epoch's
results queue. A worker then finds its next request waiting when it finishes a batch
(no idle round trip to the consumer), and the consumer has no task to start per batch.
A batch goes to the slot with the fewest batches owed. See
docs/decisions/0047-loader-feeds.md.

Faults: a slot's batches come back in the order it was asked for them, and the end of
its feed task (the worker died, or the Pool failed it) is announced on the same results
queue, behind every batch the worker put. So when the consumer reads that mark, the
slot's first batch still owed is the one the worker was building: it is re-issued up to
``max_retries`` times (then :class:`aiomp.BrokenWorkerError` names it) and the slot's
other owed batches go, in order, to a new feed task on a new request queue (the old one
is closed: nothing is built twice). Used without ``timeout=`` (a timeout per batch needs
the Pool to see each batch: :class:`~.epoch.Epoch` does that).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .._child.report import ErrorPayload
from .._errors import BrokenWorkerError, QueueClosed
from .._loop import is_cancellation
from .._pool.tasks import fn_info
from .._pool.workers import never_ahead
from .._queue.queue import Queue
from . import worker as _worker
from .epoch import Epoch, broken, note_batch
from .sampling import derive

if TYPE_CHECKING:
    from .loader import DataLoader

#: The ``k`` of the mark a slot's feed task puts on the results queue when it ends early.
ENDED = -1

# A feed task runs until its epoch ends, which needs the other slots' feeds: none may
# wait behind it in its worker (docs/decisions/0065-tasks-queued-ahead.md).
never_ahead(fn_info(_worker.feed).fid)


class FeedEpoch(Epoch):
    """The async iterator of one epoch, its batches built by per-slot feed tasks."""

    def __init__(
        self,
        loader: DataLoader,
        epoch: int,
        skip: int,
        batches: Iterator[list[Any]],
        later: Iterable[int] = (),
    ) -> None:
        super().__init__(loader, epoch, skip, batches, later)
        n = loader.num_workers
        self.results = Queue()
        self.requests: list[Queue | None] = [None] * n  # a slot's queue while it is fed
        self.owed: list[deque[tuple[int, list[Any]]]] = [deque() for _ in range(n)]
        self.ended: dict[int, BaseException] = {}  # slot -> why its feed task ended
        self.tries: dict[int, int] = {}  # batch -> times its worker died building it

    def _dispatch(self, k: int, indices: list[Any]) -> None:
        """Have batch ``k`` built by the least-owed slot's worker."""
        slot = min(range(len(self.owed)), key=lambda s: len(self.owed[s]))
        self.owed[slot].append((k, indices))
        self._send(slot, k, indices)

    def _send(self, slot: int, k: int, indices: list[Any]) -> None:
        requests = self.requests[slot]
        if requests is None:
            self.requests[slot] = requests = Queue()
            self.loader.host_tg().start_soon(self._feed, slot, requests)
        requests.put_nowait((k, indices, derive(self.loader.seed, self.epoch, k)))

    async def _feed(self, slot: int, requests: Queue) -> None:
        """Run slot ``slot``'s feed task; if it ends early, mark it on the results queue."""
        loader = self.loader
        loader.in_flight += 1
        try:
            await loader.pool.apply(_worker.feed, (requests, self.results, slot))
            return
        except BaseException as exc:
            if is_cancellation(exc):
                raise
            self.ended[slot] = exc
        finally:
            loader.fetched()
        if self.closed:
            return  # the epoch was left: its results queue is closed
        try:
            self.results.put_nowait((slot, ENDED, False, None))
        except QueueClosed:
            pass  # the epoch was left

    async def _receive(self) -> None:
        """Wait for one item on the results queue: a batch, or the mark of a feed's end."""
        slot, k, ok, value = await self.results.get()
        if k == ENDED:
            self._ended(slot)
            return
        owed = self.owed[slot]
        if not owed or owed[0][0] != k:
            return  # a batch of a queue already given up (never expected: dropped)
        indices = owed.popleft()[1]
        if not ok:
            error, pid = value
            value = self._raised(error, pid, k, indices)
        self.running -= 1
        self.ready[k] = (ok, value)

    def _raised(self, error: ErrorPayload, pid: int, k: int, indices: list[Any]) -> BaseException:
        return note_batch(
            error.exception(f"aiomp.DataLoader worker (pid {pid})", -1, pid), k, indices
        )

    def _ended(self, slot: int) -> None:
        """Slot ``slot``'s feed task ended early: settle the batch it was building, hand
        the rest of what it owed to a new feed task."""
        exc = self.ended.pop(slot)
        old = self.requests[slot]
        self.requests[slot] = None
        if old is not None:
            old.close()  # what the dead worker had not taken is asked again below
        owed = self.owed[slot]
        if not owed:
            return  # a new feed task starts with the slot's next request
        k, indices = owed[0]
        retries = self.loader.max_retries
        if isinstance(exc, BrokenWorkerError) and self.tries.get(k, 0) < retries:
            self.tries[k] = self.tries.get(k, 0) + 1
        else:
            owed.popleft()
            if isinstance(exc, BrokenWorkerError):
                exc = broken(exc, k, indices, retries)
            else:
                note_batch(exc, k, indices)
            self.running -= 1
            self.ready[k] = (False, exc)
        for k, indices in owed:
            self._send(slot, k, indices)

    def close(self) -> None:
        """Stop taking this epoch's batches: the feed tasks end at their next get or put
        (the batches they are building are dropped)."""
        super().close()
        self.results.close()
        for requests in self.requests:
            if requests is not None:
                requests.close()
