"""aiomp.DataLoader with torch (issue 27): a torch Dataset gives tensor batches on shared
storage, torch samplers and batch samplers work, torch's get_worker_info() answers in a
worker so an IterableDataset shards unchanged, and torch's RNG is seeded per batch."""

from __future__ import annotations

import itertools

import anyio
import pytest

import aiomp

torch = pytest.importorskip("torch")
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler  # noqa: E402

from tests.children.data_torch import TorchRange, TorchSquares  # noqa: E402

pytestmark = pytest.mark.anyio
FS = "forkserver"


async def test_a_torch_dataset_gives_shared_tensors() -> None:
    with anyio.fail_after(90):
        async with aiomp.DataLoader(TorchSquares(6), 3, seed=5, start_method=FS) as loader:
            got = [b async for b in loader]
    x, y = got[0]
    assert isinstance(x, torch.Tensor) and x.shape == (3, 2, 2) and x.is_shared()
    # torch's default_collate (issue 39): the labels are a tensor, as torch's loader gives
    assert isinstance(y, torch.Tensor) and y.tolist() == [0, 1, 2] and int(x[2, 0, 0]) == 2


async def test_torch_samplers_and_batch_samplers() -> None:
    data = list(range(10))
    sampler = SequentialSampler(data)
    with anyio.fail_after(90):
        async with aiomp.DataLoader(data, 4, sampler=sampler, start_method=FS) as loader:
            assert [list(b) async for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        batches = BatchSampler(RandomSampler(data), 3, drop_last=True)
        async with aiomp.DataLoader(data, batch_sampler=batches, start_method=FS) as loader:
            assert len(loader) == 3
            got = [list(b) async for b in loader]
    assert len(got) == 3 and len(set(list(itertools.chain.from_iterable(got)))) == 9


# One loop: the sharding is the workers' own (torch's get_worker_info() in the child); the
# loader on each loop is pinned by the tests above.
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_an_iterable_dataset_shards_by_torch_get_worker_info() -> None:
    with anyio.fail_after(90):
        async with aiomp.DataLoader(TorchRange(10), 2, num_workers=2, start_method=FS) as loader:
            got = [b.tolist() async for b in loader]
    assert sorted(list(itertools.chain.from_iterable(got))) == list(range(10))
    assert got[0] == [0, 2] and got[1] == [1, 3]  # round-robin over the shards, as torch


# One loop: the seeding happens in the workers, per batch, whatever loop awaits them (the
# loader on each loop is pinned by the tests above); three loops cost 9 s.
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_torch_rng_seeded_per_batch_whatever_num_workers() -> None:
    draws = []
    for workers in (1, 2):
        with anyio.fail_after(90):
            async with aiomp.DataLoader(
                TorchSquares(8), 2, seed=9, num_workers=workers, start_method=FS
            ) as loader:
                draws.append([b[0].tolist() async for b in loader])
    assert draws[0] == draws[1]
