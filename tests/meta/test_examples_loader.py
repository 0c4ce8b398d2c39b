"""examples/data_loader.py: the example trains with aiomp.DataLoader, async (asyncio,
trio) and sync, and its dataset is what the loader's batches hold."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiomp
from examples.data_loader import SyntheticImages
from tests._run import run_python

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("extra", [[], ["--backend", "trio"], ["--sync"]])
def test_example_runs(extra: list[str]) -> None:
    proc = run_python(
        "examples/data_loader.py", "--batches", "4", "--batch-size", "16", *extra, timeout=120
    )
    assert proc.stdout.splitlines()[-1] == "ok", proc.stdout


async def test_the_example_dataset_through_the_loader() -> None:
    dataset = SyntheticImages(7 * 5 + 3, shape=(3, 8, 8))  # 8 batches, the last short
    with anyio.fail_after(60):
        async with aiomp.DataLoader(dataset, 5, start_method="forkserver") as loader:
            got = [(images, labels) async for images, labels in loader]
    assert [len(b[0]) for b in got] == [5] * 7 + [3]
    images = np.concatenate([b[0] for b in got])
    labels = np.concatenate([b[1] for b in got])
    for i in range(len(dataset)):
        img, label = dataset[i]
        assert np.array_equal(images[i], img) and labels[i] == label, i
