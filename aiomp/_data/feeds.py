"""The one transport of a map-style epoch: one long-running Pool task per worker slot.

Each slot ``s`` runs one :func:`~.worker.feed` task for the epoch, which takes ``(k,
indices, seed)`` requests from the slot's own :class:`aiomp.Queue` and puts its batches
on the epoch's results queue. A worker then finds its next request waiting when it
finishes a batch (no idle round trip to the consumer), and the consumer has no task to
start per batch. A batch goes to the slot with the fewest batches owed. See
docs/decisions/0047-loader-feeds.md.

A slot's batches come back in the order it was asked for them, so the slot's first batch
owed is the one its worker is building. Faults, each settling that batch:

- The feed task ended early (the worker died, or the Pool failed it): its end is
  announced on the results queue behind every batch the worker put (:attr:`FeedMark.ENDED`).
  A worker that died has its batch re-issued up to ``max_retries`` times, then
  :class:`aiomp.BrokenWorkerError` names it (decision 0025's rule: a batch whose worker
  died goes back; the only retry rule of a map-style epoch).
- ``timeout=``: a deadline on that batch, counted from the moment a worker has it (the
  slot's previous batch came back, or, for a feed task's first batch, a worker was ready
  for the task: a worker's start does not count). Past it, while the consumer waits, the
  batch raises ``TimeoutError`` and the feed task is cancelled: the Pool terminates its
  worker (logging its stack) and starts a replacement.

Either way the slot's other owed batches go, in order, to a new feed task on a new request
queue (the old one is closed: nothing is built twice; a batch the old worker still put
is dropped, as it is no longer the slot's first owed).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._errors import BrokenWorkerError, QueueClosed
from .._loop import is_cancellation
from .._pool.tasks import fn_info
from .._pool.workers import never_ahead
from .._queue.queue import Empty, Queue
from . import options as _options
from . import worker as _worker
from .sampling import derive

if TYPE_CHECKING:
    import anyio.abc

    from .._child.report import ErrorPayload
    from .._pool.pool import Pool

# A feed task runs until its epoch ends, which needs the other slots' feeds: none may
# wait behind it in its worker (docs/decisions/0065-tasks-queued-ahead.md).
never_ahead(fn_info(_worker.feed).fid)

#: A batch's outcome: ``(k, True, batch)`` or ``(k, False, exception)``.
Outcome = tuple[int, bool, Any]


class FeedMark(enum.Enum):
    """What the results queue carries besides batches (never taken for a batch index)."""

    #: ``(slot, ENDED, generation, None)``: that feed task of the slot ended early.
    ENDED = "feed ended"


class Host(Protocol):
    """What the feeds use of the loader that runs them: its pool, its task group, and its
    count of Pool tasks running (leaving the loader waits for them)."""

    in_flight: int

    @property
    def pool(self) -> Pool: ...

    def host_tg(self) -> anyio.abc.TaskGroup: ...

    def fetched(self) -> None: ...


class Feeds:
    """The feed tasks of one map-style epoch: :meth:`send` a batch, :meth:`receive` the
    outcomes, :meth:`close` when the epoch ends or is left."""

    def __init__(
        self,
        host: Host,
        slots: int,
        epoch: int,
        seed: int,
        retries: int,
        timeout: float | None,
    ) -> None:
        self.host = host
        self.epoch = epoch
        self.seed = seed
        self.retries = retries
        self.timeout = timeout
        self.results = Queue()
        self.requests: list[Queue | None] = [None] * slots  # a slot's queue while it is fed
        self.feeding = [0] * slots  # the generation of the slot's feed task (0: none)
        self.generations = 0
        self.owed: list[deque[tuple[int, list[Any]]]] = [deque() for _ in range(slots)]
        self.ended: dict[int, BaseException] = {}  # generation -> why its feed task ended
        self.tries: dict[int, int] = {}  # batch -> times its worker died building it
        self.closed = False
        # timeout= only: a slot's running feed task, and when its first owed batch started
        self.scopes: list[anyio.CancelScope | None] = [None] * slots
        self.since: list[float | None] = [None] * slots

    def send(self, k: int, indices: list[Any]) -> None:
        """Have batch ``k`` built by the least-owed slot's worker."""
        slot = min(range(len(self.owed)), key=lambda s: len(self.owed[s]))
        owed = self.owed[slot]
        owed.append((k, indices))
        if len(owed) == 1 and self.scopes[slot] is not None:
            self.since[slot] = time.monotonic()  # its worker is idle: it takes it now
        self._request(slot, k, indices)

    def _request(self, slot: int, k: int, indices: list[Any]) -> None:
        requests = self.requests[slot]
        if requests is None:
            self.requests[slot] = requests = Queue()
            self.generations += 1
            self.feeding[slot] = self.generations
            self.host.host_tg().start_soon(self._feed, slot, self.generations, requests)
        requests.put_nowait((k, indices, derive(self.seed, self.epoch, k)))

    async def _feed(self, slot: int, generation: int, requests: Queue) -> None:
        """Run a feed task of slot ``slot``; if it ends early, mark it on the results queue
        (behind the batches its worker put). Cancelled by its deadline: settled already."""
        host = self.host
        host.in_flight += 1
        scope = anyio.CancelScope()
        try:
            with scope:
                if self.timeout is not None:
                    await self._ready(slot, generation, scope)
                await host.pool.apply(_worker.feed, (requests, self.results, slot))
            return
        except BaseException as exc:
            if is_cancellation(exc):
                raise
            self.ended[generation] = exc
        finally:
            host.fetched()
            if self.scopes[slot] is scope:  # no worker has the slot's batches now
                self.scopes[slot] = self.since[slot] = None
        if self.closed:
            return  # the epoch was left: its results queue is closed
        try:
            self.results.put_nowait((slot, FeedMark.ENDED, generation, None))
        except QueueClosed:
            pass  # the epoch was left

    async def _ready(self, slot: int, generation: int, scope: anyio.CancelScope) -> None:
        """``timeout=``: wait for a worker ready to take the feed task (so that no deadline
        counts a worker's start), then start the deadline of the slot's first owed batch."""
        pool = self.host.pool
        if not pool.statistics().idle:
            await pool.apply(_worker.ready)
        if self.feeding[slot] == generation:
            self.scopes[slot] = scope
            self.since[slot] = time.monotonic() if self.owed[slot] else None

    async def receive(self) -> Outcome | None:
        """Wait for the next item of the results queue: a batch's outcome, or ``None``
        where the item settled nothing (a feed task's end that re-issued its batch, a batch
        of a feed task given up). ``timeout=``: a batch past its deadline, failed."""
        if self.timeout is None:
            item = await self.results.get()
        else:
            item = await self._get_by_deadline()
            if item is None:
                return self._expired()
        if item[1] is FeedMark.ENDED:
            return self._ended(item[0], item[2])
        slot, k, ok, value = item
        owed = self.owed[slot]
        if not owed or owed[0][0] != k:
            return None  # put by a feed task already given up: dropped
        indices = owed.popleft()[1]
        if self.scopes[slot] is not None:
            self.since[slot] = time.monotonic() if owed else None  # the worker's next
        if not ok:
            error, pid = value
            value = self._raised(error, pid, k, indices)
        return k, ok, value

    async def _get_by_deadline(self) -> Any:
        """The next item of the results queue, or ``None`` once the first deadline of a
        batch (:meth:`_late`) passes with none there. With no deadline running, it looks
        again every ``timeout`` s (a feed task may start one meanwhile)."""
        timeout = self.timeout
        assert timeout is not None
        while True:
            late = self._late()
            wait = timeout if late is None else late[0] + timeout - time.monotonic()
            with anyio.move_on_after(wait):
                return await self.results.get()
            try:
                return self.results.get_nowait()  # one that came as the deadline passed
            except Empty:
                if late is not None and self._late() == late:  # not settled meanwhile
                    return None

    def _late(self) -> tuple[float, int] | None:
        """``(since, slot)`` of the batch whose deadline comes first, if any."""
        started = [(t, s) for s, t in enumerate(self.since) if t is not None]
        return min(started) if started else None

    def _expired(self) -> Outcome:
        """The first batch past its deadline: fail it, replace its feed task."""
        late = self._late()
        assert late is not None
        slot = late[1]
        k, indices = self.owed[slot].popleft()
        assert self.timeout is not None
        exc = _options.timed_out(self.timeout)  # torch's RuntimeError too, with its text
        exc.add_note(
            f"aiomp.DataLoader: batch {k} was not built within {self.timeout} s; its worker "
            "was terminated and replaced (its stack: the 'aiomp' logger's INFO line)"
        )
        self._restart(slot)
        return k, False, note_batch(exc, k, indices)

    def _raised(self, error: ErrorPayload, pid: int, k: int, indices: list[Any]) -> BaseException:
        return note_batch(
            error.exception(f"aiomp.DataLoader worker (pid {pid})", -1, pid), k, indices
        )

    def _ended(self, slot: int, generation: int) -> Outcome | None:
        """A feed task of slot ``slot`` ended early: settle the batch it was building (or
        re-issue it), hand the rest of what the slot owes to a new feed task."""
        exc = self.ended.pop(generation)
        if self.feeding[slot] != generation:
            return None  # given up already (its deadline passed)
        owed = self.owed[slot]
        outcome: Outcome | None = None
        if owed:
            k, indices = owed[0]
            if isinstance(exc, BrokenWorkerError) and self.tries.get(k, 0) < self.retries:
                self.tries[k] = self.tries.get(k, 0) + 1
            else:
                owed.popleft()
                if isinstance(exc, BrokenWorkerError):
                    exc = broken(exc, k, indices, self.retries)
                else:
                    note_batch(exc, k, indices)
                outcome = k, False, exc
        self._restart(slot)
        return outcome

    def _restart(self, slot: int) -> None:
        """Give up the slot's feed task (cancelled if it runs) and its request queue; what
        the slot still owes goes to a new one (none until it owes a batch)."""
        scope, old = self.scopes[slot], self.requests[slot]
        self.scopes[slot] = self.requests[slot] = self.since[slot] = None
        self.feeding[slot] = 0
        if scope is not None:
            scope.cancel()  # the Pool terminates the worker and replaces it
        if old is not None:
            old.close()  # what the old worker had not taken is asked again below
        for k, indices in self.owed[slot]:
            self._request(slot, k, indices)

    def close(self) -> None:
        """Stop: the feed tasks end at their next get or put (the batches they are
        building are dropped)."""
        self.closed = True
        self.results.close()
        for requests in self.requests:
            if requests is not None:
                requests.close()


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
