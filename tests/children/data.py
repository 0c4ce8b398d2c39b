"""Datasets that tests/data/ hands to aiomp.DataLoader workers (importable by children)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np

Pair = namedtuple("Pair", "x y")


class Squares:
    """A torch-free map-style dataset: sample ``i`` is a dict of every leaf kind, plus the
    RNG draws made while building it (so tests can check per-batch seeding)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {
            "image": np.full((4, 3), i, np.float32),
            "index": i,
            "scale": i / 2,
            "odd": bool(i % 2),
            "name": f"s{i}",
            "pair": Pair(i, np.int16(i)),
            "noise": random.random() + float(np.random.random()),
        }


class DieAt:
    """Sample ``bad`` SIGKILLs its worker: ``times`` times (counted in files under
    ``marks``), or always when ``times`` is None."""

    def __init__(self, n: int, bad: int, marks: str, times: int | None) -> None:
        self.n, self.bad, self.marks, self.times = n, bad, marks, times

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            done = len(list(Path(self.marks).iterdir()))
            if self.times is None or done < self.times:
                Path(self.marks, str(done)).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return i


class RaiseAt:
    """Sample ``bad`` raises a KeyError, as a missing file would."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise KeyError(f"sample {i} is missing")
        return i


class HangAt:
    """Sample ``bad`` hangs (in ``time.sleep``), once per worker slot."""

    def __init__(self, n: int, bad: int, marks: str) -> None:
        self.n, self.bad, self.marks = n, bad, marks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad and not Path(self.marks, "hung").exists():
            Path(self.marks, "hung").touch()
            time.sleep(3600)  # handshake-free: the hang under test; the timeout kills it
        return i


class Counting:
    """Records each index it builds as a file under ``marks`` (to prove resume builds no
    skipped batch)."""

    def __init__(self, n: int, marks: str) -> None:
        self.n, self.marks = n, marks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        Path(self.marks, str(i)).touch()
        return i


class Stream:
    """An iterable-style dataset (no ``__getitem__``), sharded by ``aiomp.get_worker_info``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        import aiomp

        info = aiomp.get_worker_info()
        assert info is not None
        return iter(range(info.id, self.n, info.num_workers))


def worker_id_seen(worker_id: int) -> None:
    """A worker_init_fn: records what get_worker_info says, in the environment."""
    import aiomp

    info = aiomp.get_worker_info()
    assert info is not None and info.id == worker_id
    os.environ["AIOMP_TEST_INIT"] = str(worker_id)


def add_one(samples: list[int]) -> list[int]:
    """A collate_fn."""
    return [s + 1 for s in samples]


class Big:
    """Samples of 8 MiB each (float64 ``i`` everywhere): a batch of 4 is 32 MiB."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return np.full(1 << 20, float(i))


def small_shm_main() -> None:
    """Run in a mount namespace whose /dev/shm holds 16 MiB: batches of 32 MiB come
    through (memfd segments do not live in /dev/shm), with the sync face."""
    import aiomp

    with aiomp.DataLoader(Big(), 4, start_method="forkserver") as loader:
        sums = [float(b.sum()) / (1 << 20) for b in loader]
    assert sums == [6.0, 22.0, 38.0], sums
    print("ok")


if __name__ == "__main__":
    small_shm_main()


class StreamDieAt:
    """An iterable-style dataset sharded by ``aiomp.get_worker_info`` whose sample ``bad``
    SIGKILLs its worker once (counted in files under ``marks``)."""

    def __init__(self, n: int, bad: int, marks: str) -> None:
        self.n, self.bad, self.marks = n, bad, marks

    def __iter__(self) -> Any:
        import aiomp

        info = aiomp.get_worker_info()
        assert info is not None
        for i in range(info.id, self.n, info.num_workers):
            if i == self.bad and not any(Path(self.marks).iterdir()):
                Path(self.marks, "0").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            yield i


def slow_start(worker_id: int) -> None:
    """A ``worker_init_fn`` that takes 6 s: a worker's start longer than a 3 s timeout."""
    time.sleep(6)  # handshake-free: the slow start under test, nothing to wait for
