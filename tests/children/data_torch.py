"""torch datasets that tests/data/test_torch.py hands to aiomp.DataLoader workers: apart
from tests/children/data.py so that the torch-free tests' workers never import torch."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


class TorchSquares(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return torch.full((2, 2), float(i)) + torch.rand(()), i


class TorchRange(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return iter(range(info.id, self.n, info.num_workers))
