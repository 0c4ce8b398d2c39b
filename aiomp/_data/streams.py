"""One epoch of an iterable-style dataset in a :class:`aiomp.DataLoader`.

As in torch, each of the ``num_workers`` shards runs the dataset's own iterator, which
splits itself by ``get_worker_info()``; here shard ``s`` is one Pool task (any worker may
run it: its ``get_worker_info().id`` is ``s`` meanwhile) that puts its batches on a
bounded :class:`aiomp.Queue` of ``prefetch_factor * num_workers`` (the back-pressure).
``in_order=True`` hands the batches out round-robin over the shards, as torch does;
``False``, as they come.

A shard whose worker dies is run again on the replacement, which replays the shard's
iterator (each batch ``j`` drawn with the same seeds) and puts only the batches after
those the consumer has received; one the dead worker had put and the consumer had not
yet taken comes twice, and its copy is dropped by its index. So the shard's batches are
the same as with no death, up to ``max_retries`` deaths per shard and epoch; past that,
or where the dataset raised, the shard yields that error after its batches, then nothing
more; the other shards go on. ``timeout`` bounds the wait for each batch: past it, the
epoch's tasks are cancelled (their workers replaced by the Pool) and ``TimeoutError`` (also
torch's ``RuntimeError``) is raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._errors import BrokenWorkerError, QueueClosed
from .._loop import is_cancellation
from .._queue.queue import Queue
from . import options as _options
from . import worker as _worker
from .epoch import broken, receive

if TYPE_CHECKING:
    from .loader import DataLoader


class StreamEpoch:
    """The async iterator of one epoch of an iterable-style dataset."""

    def __init__(self, loader: DataLoader, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch
        n = loader.num_workers
        self.queue = Queue(maxsize=loader.prefetch_factor * n)
        self.received = [0] * n  # items of each shard taken off the queue
        self.ends: dict[int, int] = {}  # shard -> its number of items (batches, an error)
        self.ready: dict[tuple[int, int], tuple[bool, Any]] = {}
        self.next_j = [0] * n
        self.turn = 0
        self.handed_count = 0
        self.done = False
        self.failures: dict[int, BaseException] = {}
        self.scopes = [anyio.CancelScope() for _ in range(n)]
        #: Counts the batches handed out where this epoch is the consumer's iterator
        #: (``async for``; the sync face counts its own).
        self.watch: _options.LengthWatch | None = None
        for shard in range(n):
            loader.host_tg().start_soon(self._run, shard)

    def __aiter__(self) -> StreamEpoch:
        return self

    async def _run(self, shard: int) -> None:
        loader = self.loader
        loader.in_flight += 1
        size = loader.batch_size or 1  # None (no batching): each sample alone
        args = (self.epoch, shard, loader.seed, size, loader.drop_last, self.queue)
        try:
            with self.scopes[shard]:
                for tries in range(loader.max_retries + 1):
                    try:  # replay the shard, putting what the consumer has not received
                        await loader.pool.apply(_worker.stream, (*args, self.received[shard]))
                        break
                    except BrokenWorkerError as exc:
                        if tries == loader.max_retries:
                            self.failures[shard] = broken(exc, self.handed_count, None, tries)
        except BaseException as exc:
            if is_cancellation(exc):
                raise
            exc.add_note(f"aiomp.DataLoader: in worker {shard}'s share of the iterable dataset")
            self.failures[shard] = exc
        finally:
            loader.fetched()
        if shard in self.failures:
            try:  # behind the shard's batches already queued (FIFO), so it comes after them
                await self.queue.put((shard, -2, None))
            except QueueClosed:
                pass

    async def __anext__(self) -> Any:
        """The next batch, or a shard's failure (raised). Cancellation leaves it as it was."""
        while True:
            got = self._take()
            if got is not None:
                break
            if len(self.ends) == self.loader.num_workers and not self.ready:
                self.close()
                self.loader.finished(self)
                raise StopAsyncIteration
            await receive(self._receive)
        self.handed_count += 1
        ok, value = got
        if not ok:
            raise _options.user_error(value)
        if self.watch is not None:
            self.watch.step()
        return self.loader.pinned(value)

    async def _receive(self) -> None:
        timeout = self.loader.timeout
        try:
            with anyio.fail_after(timeout):
                shard, j, batch = await self.queue.get()
        except TimeoutError as exc:
            self.close()
            assert timeout is not None
            raise _options.timed_out(timeout, exc) from exc
        if shard in self.ends:
            return  # a replayed shard's second end
        if j == -1:
            self.ends[shard] = self.received[shard]
        elif j == -2:
            self.ready[shard, self.received[shard]] = (False, self.failures.pop(shard))
            self.ends[shard] = self.received[shard] + 1
        elif j == self.received[shard]:
            self.ready[shard, j] = (True, batch)
            self.received[shard] += 1
        # else: a batch the dead worker put, put again by its replay: dropped

    def _take(self) -> tuple[bool, Any] | None:
        if not self.loader.in_order:
            return self.ready.pop(next(iter(self.ready))) if self.ready else None
        n = self.loader.num_workers
        for _ in range(n):  # round-robin, skipping the shards that have ended
            s = self.turn
            if self.ends.get(s, -1) == self.next_j[s]:
                self.turn = (s + 1) % n
                continue
            got = self.ready.pop((s, self.next_j[s]), None)
            if got is None:
                return None
            self.next_j[s] += 1
            self.turn = (s + 1) % n
            return got
        return None

    def close(self) -> None:
        """Leave the epoch: shards stop at their next put; a hung one is cancelled."""
        if self.done:
            return
        self.done = True
        self.queue.close()
        self.ready.clear()
        for scope in self.scopes:
            scope.cancel()
