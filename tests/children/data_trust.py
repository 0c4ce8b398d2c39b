"""Datasets that tests/data/test_trust.py hands to aiomp.DataLoader workers (issue 38:
a dataset's BaseException, seeds that reproduce numpy's and torch's global RNGs).

Standard library only at module level: numpy and torch are imported by the samples that
draw from them, as a dataset that imports them lazily does (the worker must seed them
anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
}


class BaseRaiseAt:
    """Sample ``bad`` raises ``kind`` (a BaseException's name) the first ``times`` times
    it is built (counted in files under ``marks``)."""

    def __init__(self, n: int, bad: int, kind: str, marks: str, times: int = 1) -> None:
        self.n, self.bad, self.kind, self.marks, self.times = n, bad, kind, marks, times

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            done = len(list(Path(self.marks).iterdir()))
            if done < self.times:
                Path(self.marks, str(done)).touch()
                raise KINDS[self.kind](f"sample {i} raised {self.kind}")
        return i


class BaseRaiseStream:
    """An iterable dataset whose shard 0 raises ``kind`` at its second sample, once."""

    def __init__(self, n: int, kind: str, marks: str) -> None:
        self.n, self.kind, self.marks = n, kind, marks

    def __iter__(self) -> Any:
        import aiomp

        info = aiomp.get_worker_info()
        assert info is not None
        for i in range(info.id, self.n, info.num_workers):
            if i == info.num_workers and not Path(self.marks, "raised").exists():
                Path(self.marks, "raised").touch()
                raise KINDS[self.kind](f"sample {i} raised {self.kind}")
            yield i


class Draws:
    """Sample ``i`` is ``(i, random.random(), numpy.random.random(), torch.rand(()))``
    (torch's only with ``torch=True``), numpy and torch imported by the sample."""

    def __init__(self, n: int, torch: bool = False) -> None:
        self.n, self.torch = n, torch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        import random

        import numpy

        t = 0.0
        if self.torch:
            import torch

            t = float(torch.rand(()))
        return (i, random.random(), float(numpy.random.random()), t)


class KeepsPosition:
    """An iterable dataset that keeps its position in itself (as a file reader would):
    each shard yields the samples ``i % num_workers == id`` of ``range(n)``. Shard 0
    touches ``marks/shard0-done`` at its end."""

    def __init__(self, n: int, marks: str) -> None:
        self.n, self.marks, self.pos = n, marks, 0

    def __iter__(self) -> Any:
        import aiomp

        info = aiomp.get_worker_info()
        assert info is not None
        while self.pos < self.n:
            i, self.pos = self.pos, self.pos + 1
            if i % info.num_workers == info.id:
                yield i
        if info.id == 0:
            Path(self.marks, "shard0-done").touch()


def slot1_waits_for_shard0(worker_id: int, marks: str) -> None:
    """A worker_init_fn: worker 1 is not ready before shard 0 has ended, so that the Pool
    gives shard 1 to worker 0 after shard 0 (bounded: 60 s)."""
    import time

    if worker_id != 1:
        return
    deadline = time.monotonic() + 60
    while not Path(marks, "shard0-done").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # handshake-free: workers share no channel (bounded)


class HeldBack:
    """Sample 0 waits (bounded: 60 s) until sample 6 has been built, the first time: with
    two workers and ``in_order=False``, batch 0 (of 2) comes after batches 1 and 3."""

    def __init__(self, n: int, marks: str) -> None:
        self.n, self.marks = n, marks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        import time

        released = Path(self.marks, "released")
        if i == 6:
            released.touch()
        if i == 0:
            deadline = time.monotonic() + 60
            while not released.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # handshake-free: workers share no channel (bounded)
        return i
