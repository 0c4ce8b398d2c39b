"""Datasets that tests/test_examples_loader.py hands to loader workers (importable by children)."""

from __future__ import annotations

from typing import Any

from examples.data_loader import SyntheticImages


class BrokenAt(SyntheticImages):
    """Sample ``bad`` raises, as a corrupt file would."""

    def __init__(self, length: int, bad: int) -> None:
        super().__init__(length, shape=(3, 8, 8))
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return super().__getitem__(i)
