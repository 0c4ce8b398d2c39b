"""Datasets that tests/data/test_start.py hands to aiomp.DataLoader workers: they tell how
the worker started."""

from __future__ import annotations

from typing import Any

#: 0 as imported; the test's parent sets 1 before its loader starts: a worker that sees 1
#: was forked from it (spawn and forkserver workers import this module afresh).
MARK = 0


class Marked:
    """Sample ``i`` is :data:`MARK` as the worker sees it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return MARK


class Conv:
    """torch's TestConvAfterFork dataset: each sample is a small convolution."""

    def __init__(self, n: int) -> None:
        import torch

        self.n = n
        self.x = torch.ones(1, 1, 24000, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.nn.functional.conv2d(self.x, torch.ones(1, 1, 2, 1))
