"""Which samples make each batch, the seed of each batch, and the resume state.

Everything here runs in the consumer and is pure: the order of an epoch is a function of
the loader's seed and the epoch (built-in samplers) or of the user's sampler, never of the
workers, so one seed gives the same batches whatever ``num_workers`` is, and resuming
skips batch index lists without building a batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def derive(seed: int, *parts: int) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (blake2b: stable across processes and runs,
    unlike ``hash``)."""
    text = ",".join(str(x) for x in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """How many batches ``samples`` make (the last one short unless ``drop_last``)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def is_map_style(dataset: object) -> bool:
    """Map-style: ``__getitem__`` and ``__len__`` (torch's ``Dataset``, a list, an array).
    Iterable-style: ``__iter__`` without ``__getitem__`` (torch's ``IterableDataset``)."""
    kind = type(dataset)
    if _is_torch_iterable(kind):
        return False
    if hasattr(kind, "__getitem__") and hasattr(kind, "__len__"):
        return True
    if hasattr(kind, "__iter__"):
        return False
    raise TypeError(
        f"a DataLoader's dataset needs __getitem__ and __len__ (map-style) or __iter__ "
        f"(iterable-style); {kind.__name__} has neither"
    )


def _is_torch_iterable(kind: type) -> bool:
    return any(
        c.__name__ == "IterableDataset" and c.__module__.startswith("torch.utils.data")
        for c in kind.__mro__
    )


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The batches of each epoch of a map-style dataset: lists of sample indices.

    The built-in samplers (sequential, or shuffled from ``derive(seed, epoch)``) are a pure
    function of the epoch. A user's ``sampler`` or ``batch_sampler`` is iterated here;
    one with ``set_epoch`` (torch's ``DistributedSampler``) is told the epoch first, and
    one with ``state_dict``/``load_state_dict`` (torchdata's stateful samplers) has its
    state kept in the loader's.
    """

    dataset: Any  # its len() is read at each epoch, as torch's samplers read it
    batch_size: int | None
    shuffle: bool
    sampler: Iterable[Any] | None
    batch_sampler: Iterable[list[Any]] | None
    drop_last: bool

    @property
    def size(self) -> int:
        return len(self.dataset)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        n = self.size if self.sampler is None else len(self.sampler)  # type: ignore[arg-type]
        return batch_count(n, self.batch_size or 1, self.drop_last)

    def order(self, seed: int, epoch: int) -> list[int] | range:
        """The built-in sampler's indices for ``epoch``: in order, or shuffled."""
        if not self.shuffle:
            return range(self.size)
        order = list(range(self.size))
        random.Random(derive(seed, epoch)).shuffle(order)
        return order

    def user_sampler(self) -> object:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def batches(self, seed: int, epoch: int, skip: int) -> Iterator[list[Any]]:
        """The epoch's batches after the first ``skip`` (skipped as index lists only)."""
        user = self.user_sampler()
        if user is not None and hasattr(user, "set_epoch"):
            user.set_epoch(epoch)
        if self.batch_sampler is not None:
            return itertools.islice(iter(self.batch_sampler), skip, None)
        indices: Iterable[Any] = self.order(seed, epoch) if self.sampler is None else self.sampler
        size = self.batch_size or 1  # None (no batching): each sample alone
        if isinstance(indices, range | list):  # skip without visiting the skipped indices
            indices = indices[skip * size :]
            return _chunks(iter(indices), size, self.drop_last)
        return itertools.islice(_chunks(iter(indices), size, self.drop_last), skip, None)


def _chunks(indices: Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    while batch := list(itertools.islice(indices, size)):
        if len(batch) < size and drop_last:
            return
        yield batch


class BuiltinSampler:
    """``loader.sampler`` where none was given: the indices of the loader's next epoch
    (in order, or shuffled from its seed), with ``__len__``, as torch's samplers."""

    def __init__(self, sampling: Sampling, where: Callable[[], tuple[int, int]]) -> None:
        self._sampling = sampling
        self._where = where  # () -> (seed, next epoch)

    def __len__(self) -> int:
        return self._sampling.size

    def __iter__(self) -> Iterator[int]:
        return iter(self._sampling.order(*self._where()))


class BuiltinBatchSampler:
    """``loader.batch_sampler`` where none was given: ``sampler`` in lists of
    ``batch_size`` (torch's ``BatchSampler`` names)."""

    def __init__(self, sampler: Iterable[Any], batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self) -> int:
        return batch_count(len(self.sampler), self.batch_size, self.drop_last)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[Any]]:
        return _chunks(iter(self.sampler), self.batch_size, self.drop_last)
