"""``num_workers=0``: one epoch's batches built in the calling process, as torch's loader
builds them (in the async face, in a thread, off the event loop).

As in torch, nothing is reseeded here: the samples draw from the program's own RNGs (so
the batches are not those of a loader with workers and the same seed), and
``get_worker_info()`` is None. A batch's error is raised by the step that would have
given it; a map-style epoch goes on after it, an iterable dataset's iterator ends with it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .epoch import Owner
from .worker import Builder, Position, ended, restore, snapshot, take

#: id(dataset) -> the origin of the state its last epoch here ended in (see worker.ended).
ENDS: dict[int, str] = {}

if TYPE_CHECKING:
    from .options import LengthWatch


class LocalEpoch:
    """One epoch, iterated by ``for`` (built in this thread) or ``async for`` (built in a
    worker thread; cancelled, the batch being built is waited for, then dropped)."""

    def __init__(
        self,
        loader: Owner,
        epoch: int,
        skip: int,
        builder: Builder,
        batches: Iterator[list[Any]] | None,
        resume: Position | None = None,
    ) -> None:
        self.loader = loader
        self.epoch = epoch
        self.handed_count = skip
        # An iterable dataset's one shard: where it resumes, its state after each batch.
        shard = None if resume is None else resume["shards"][0]
        self.resume: dict[str, Any] | None = shard
        if shard is not None:
            self.handed_count = shard["batches"]
        self.state: Any = None if shard is None else shard["state"]
        self.builder = builder
        self.batches = batches  # map-style: the index lists; None: an iterable dataset
        self.samples: Iterator[Any] | None = None
        self.ended = False
        self.keep: object = None  # the loader, while a sync consumer iterates
        self.watch: LengthWatch | None = None  # an iterable dataset's batches, counted

    def __iter__(self) -> LocalEpoch:
        return self

    def __next__(self) -> Any:
        got, batch = self._step()
        if not got:
            raise StopIteration
        return batch

    def __aiter__(self) -> LocalEpoch:
        return self

    async def __anext__(self) -> Any:
        got, batch = await anyio.to_thread.run_sync(self._step)
        if not got:
            raise StopAsyncIteration
        return batch

    def _step(self) -> tuple[bool, Any]:
        """``(True, the next batch)``, or ``(False, None)`` at the epoch's end."""
        if self.ended:
            return False, None
        if self.batches is not None:
            indices = next(self.batches, None)
            if indices is None:
                return self._end()
            self.handed_count += 1
            return True, self.loader.pinned(self.builder.build(indices))
        dataset = self.builder.dataset
        if self.samples is None:
            self.samples = iter(dataset)
            shard = self.resume
            if shard is not None and shard["ended"]:
                return self._end()
            mid_epoch = self.handed_count > 0
            restore(dataset, self.samples, self.state, mid_epoch, ENDS.get(id(dataset)))
        size = self.loader.batch_size or 1
        chunk = take(self.samples, size)
        if not chunk or (len(chunk) < size and self.loader.drop_last):
            self.state = copy.deepcopy(ended(dataset, self.samples, ENDS, id(dataset)))
            return self._end()
        self.state = copy.deepcopy(snapshot(dataset, self.samples))
        self.handed_count += 1
        if self.watch is not None:
            self.watch.step()
        return True, self.loader.pinned(self.builder.chunk(chunk))

    def _end(self) -> tuple[bool, Any]:
        self.loader.finished(self)
        self.close()
        return False, None

    def close(self) -> None:
        self.ended = True
        self.keep = None

    def carried(self) -> Position | None:
        """At the end of an iterable dataset's epoch: the state it ended in (None where
        it keeps none, or the dataset is map-style)."""
        if self.batches is not None or self.state is None:
            return None
        return {"turn": 0, "shards": [{"batches": 0, "state": self.state, "ended": False}]}

    def position(self) -> Position:
        """Where an iterable dataset's epoch is (as :meth:`.streams.StreamEpoch.position`,
        one shard): the next epoch starts from the same object, so its state."""
        shard = {"batches": self.handed_count, "state": self.state, "ended": self.ended}
        return {"turn": 0, "shards": [shard]}
