"""aiomp.DataLoader (issue 27): batches, order, collate into shared memory, seeding,
prefetch bound, options, on asyncio, uvloop and trio, and sync with no event loop."""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest

import aiomp
from tests.children.data import Pair, Squares, Stream, add_one, worker_id_seen

pytestmark = pytest.mark.anyio
FS = "forkserver"  # quick starts; the default (spawn) is covered by the sync test


async def _epoch(loader: aiomp.DataLoader) -> list[dict[str, object]]:
    return [batch async for batch in loader]


async def test_batches_in_order_every_leaf_kind_in_shared_memory() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(Squares(10), 4, num_workers=2, start_method=FS) as loader:
            assert len(loader) == 3
            got = await _epoch(loader)
    assert [list(b["index"]) for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    b = got[0]
    assert isinstance(b["image"], np.ndarray) and b["image"].shape == (4, 4, 3)
    assert b["image"].dtype == np.float32 and b["image"][3, 0, 0] == 3
    # ints, floats, bools: int64, float64, bool arrays; strings: a list; namedtuples kept
    assert b["index"].dtype == np.int64 and b["scale"].dtype == np.float64
    assert b["odd"].dtype == np.bool_ and list(b["odd"]) == [False, True, False, True]
    assert b["name"] == ["s0", "s1", "s2", "s3"]
    assert isinstance(b["pair"], Pair) and b["pair"].y.dtype == np.int16
    # no copy after collation: the consumer's arrays are on the worker's shared memory
    for leaf in (b["image"], b["index"], b["scale"], b["odd"], b["pair"].x):
        assert aiomp.is_shared(leaf)


async def test_epochs_shuffle_drop_last_and_set_epoch() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(
            list(range(10)), 3, shuffle=True, drop_last=True, seed=7, start_method=FS
        ) as loader:
            assert len(loader) == 3
            e0 = [list(b) for b in await _epoch(loader)]
            e1 = [list(b) for b in await _epoch(loader)]
            loader.set_epoch(0)
            again = [list(b) for b in await _epoch(loader)]
    assert len(e0) == 3 and all(len(b) == 3 for b in e0)
    assert e0 != e1 and again == e0  # one seed: each epoch its own order, repeatable
    assert len(set(list(itertools.chain.from_iterable(e0)))) == 9


async def test_prefetch_bound_and_out_of_order() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(
            list(range(40)), 2, num_workers=2, prefetch_factor=1, in_order=False, start_method=FS
        ) as loader:
            seen = []
            epoch = loader.__aiter__()
            async for batch in epoch:
                # requested and not yet handed out: at most prefetch_factor * num_workers
                assert epoch.requested <= 2
                seen.extend(batch)
    assert sorted(seen) == list(range(40))


async def test_collate_fn_worker_init_fn_and_worker_info() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(
            list(range(6)),
            3,
            collate_fn=add_one,
            worker_init_fn=worker_id_seen,
            start_method=FS,
        ) as loader:
            got = await _epoch(loader)
    assert got == [[1, 2, 3], [4, 5, 6]]


async def test_iterable_dataset_sharded_by_worker_info() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(Stream(11), 3, num_workers=2, start_method=FS) as loader:
            first = [list(b) for b in await _epoch(loader)]
            second = [list(b) for b in await _epoch(loader)]
    for got in (first, second):
        assert sorted(list(itertools.chain.from_iterable(got))) == list(
            range(11)
        )  # each sample once: sharded
        assert all(b == sorted(b) and len(set(x % 2 for x in b)) == 1 for b in got)


async def test_same_batches_whatever_num_workers() -> None:
    """(seed, epoch, batch index) seeds each batch: random and numpy draws agree."""
    results = []
    for workers in (1, 3):
        with anyio.fail_after(60):
            async with aiomp.DataLoader(
                Squares(12), 4, shuffle=True, num_workers=workers, seed=3, start_method=FS
            ) as loader:
                results.append([(list(b["index"]), list(b["noise"])) for b in await _epoch(loader)])
    assert results[0] == results[1]


def test_options_checked_as_torch() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        aiomp.DataLoader([1], num_workers=-1)
    with pytest.raises(TypeError, match="num_workers must be an int"):
        aiomp.DataLoader([1], num_workers=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefetch_factor must be an int"):
        aiomp.DataLoader([1], prefetch_factor="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shuffle"):
        aiomp.DataLoader([1], sampler=[0], shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler"):
        aiomp.DataLoader([1], 2, batch_sampler=[[0]])
    with pytest.raises(ValueError, match="IterableDataset: expected unspecified shuffle"):
        aiomp.DataLoader(Stream(3), shuffle=True)
    with pytest.raises(TypeError, match="neither"):
        aiomp.DataLoader(3)


def test_sync_with_no_event_loop_default_spawn() -> None:
    with aiomp.DataLoader(list(range(7)), 2, seed=1) as loader:
        first = [list(b) for b in loader]
        second = [list(b) for b in loader]
    assert first == second == [[0, 1], [2, 3], [4, 5], [6]]


async def test_sync_with_refused_inside_a_loop() -> None:
    loader = aiomp.DataLoader([1, 2])
    with pytest.raises(RuntimeError, match="async with"):
        loader.__enter__()
