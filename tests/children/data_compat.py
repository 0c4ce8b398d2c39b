"""Datasets that tests/data/test_torch_compat_*.py hand to aiomp.DataLoader (issue 39:
torch's DataLoader behaviours, torchdata's stateful resume). Plain Python, no torch: the
workers start light."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import aiomp


def share(sizes: list[int]) -> range:
    """The samples of this worker's share: worker ``w`` of len(sizes) gets ``sizes[w]``
    consecutive ones (in the calling process, all of them)."""
    info = aiomp.get_worker_info()
    w = 0 if info is None else info.id
    if info is None:
        sizes = [sum(sizes)]
    start = sum(sizes[:w])
    return range(start, start + sizes[w])


class Positional:
    """An iterable dataset that keeps its position and an epoch count in itself (a
    generator ``__iter__``, as torchdata's tests write them): sample ``(i, epoch)``; its
    ``state_dict`` is ``{"i", "epoch"}`` and ``load_state_dict`` resumes at ``i`` at the
    next ``__iter__``; each epoch's end counts one more epoch."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.i = 0
        self.epoch = 0
        self.resume: int | None = None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        mine = share(self.sizes)
        self.i, self.resume = self.resume or 0, None
        for value in mine[self.i :]:
            self.i += 1
            yield value, self.epoch
        self.i = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume, self.epoch = state["i"], state["epoch"]


class OwnIterator:
    """An iterable dataset that is its own iterator (``__iter__`` returns self): its
    position lives in what ``__iter__`` made, which ``load_state_dict`` overwrites."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.at = 0
        self.end = 0

    def __iter__(self) -> OwnIterator:
        mine = share(self.sizes)
        self.at, self.end = mine.start, mine.stop
        return self

    def __next__(self) -> int:
        if self.at >= self.end:
            raise StopIteration
        self.at += 1
        return self.at - 1

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at, "end": self.end}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at, self.end = state["at"], state["end"]


class Unsharded:
    """An iterable dataset of ``range(n)`` that does not split itself by worker, with a
    ``__len__`` (torch warns when it gives more than that)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Slow:
    """A map-style dataset whose samples take ``seconds`` each."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n = n
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.seconds)  # handshake-free: a slow sample is what the dataset is
        return i


def raise_in_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"worker_init_fn of worker {worker_id}")


class WritesWorkerInfo:
    """A map-style dataset whose sample says what assigning to its WorkerInfo raised."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        info = aiomp.get_worker_info()
        assert info is not None
        try:
            info.id = 12345
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc} (id {info.id})"
        return "assigned"


class SlowExit(Slow):
    """A map-style dataset whose samples leave a non-daemon thread running for
    ``seconds``: its worker, asked to exit, is slow to (past the 5 s grace)."""

    def __getitem__(self, i: int) -> int:
        import threading

        threading.Thread(target=time.sleep, args=(self.seconds,)).start()
        return i
