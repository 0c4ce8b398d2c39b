"""``num_workers=0``: one epoch's batches built in the calling process, as torch's loader
builds them (in the async face, in a thread, off the event loop).

As in torch, nothing is reseeded here: the samples draw from the program's own RNGs (so
the batches are not those of a loader with workers and the same seed), and
``get_worker_info()`` is None. A batch's error is raised by the step that would have
given it; a map-style epoch goes on after it, an iterable dataset's iterator ends with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from .worker import Builder

if TYPE_CHECKING:
    from .loader import DataLoader
    from .options import LengthWatch


class LocalEpoch:
    """One epoch, iterated by ``for`` (built in this thread) or ``async for`` (built in a
    worker thread; cancelled, the batch being built is waited for, then dropped)."""

    def __init__(
        self,
        loader: DataLoader,
        epoch: int,
        skip: int,
        builder: Builder,
        batches: Iterator[list[Any]] | None,
    ) -> None:
        self.loader = loader
        self.epoch = epoch
        self.handed_count = skip
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
        if self.samples is None:
            self.samples = iter(self.builder.dataset)
        size = self.loader.batch_size or 1
        chunk = list(itertools.islice(self.samples, size))
        if not chunk or (len(chunk) < size and self.loader.drop_last):
            return self._end()
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
