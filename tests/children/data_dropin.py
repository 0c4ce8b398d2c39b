"""Datasets that tests/data/test_dropin.py hands to aiomp.DataLoader (issue 39: a drop-in
for torch's DataLoader). torch is imported at module level: these are torch datasets."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset


class Images(Dataset[tuple[Any, int]]):
    """Sample ``i``: a 3x4x4 float tensor of ``i`` and its label ``i % 3``; ``n`` may grow."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.full((3, 4, 4), float(i)), i % 3


def where_am_i(i: int) -> Any:
    """A sample saying which worker built it (None: the calling process)."""
    info = torch.utils.data.get_worker_info()
    return -1 if info is None else info.id
