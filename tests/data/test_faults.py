"""aiomp.DataLoader faults (issue 27): a worker killed at a chosen sample (once: the batch
is re-issued and identical; always: BrokenWorkerError naming the batch), an exception in
__getitem__ (its own type, naming the batch), a hung worker (TimeoutError, replaced), and
the loader usable for the next epoch after each."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import aiomp
from tests.children.data import DieAt, HangAt, RaiseAt, StreamDieAt

pytestmark = pytest.mark.anyio
FS = "forkserver"


async def test_a_worker_killed_once_its_batch_is_reissued(tmp_path: Path) -> None:
    with anyio.fail_after(90):
        async with aiomp.DataLoader(
            DieAt(12, bad=5, marks=str(tmp_path), times=1), 3, start_method=FS
        ) as loader:
            got = [list(b) async for b in loader]
            pids = set(loader.pool.pids())
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert _count(tmp_path) == 1 and len(pids) == 2


async def test_a_worker_killed_every_time_names_the_batch(tmp_path: Path) -> None:
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            DieAt(12, bad=5, marks=str(tmp_path), times=None), 3, max_retries=1, start_method=FS
        ) as loader:
            got = []
            with pytest.raises(aiomp.BrokenWorkerError, match=r"batch 1 \(samples \[3, 4, 5\]\)"):
                async for b in loader:
                    got.append(list(b))
            assert got == [[0, 1, 2]]
            assert _count(tmp_path) == 2  # the first try and one retry


async def test_after_a_lost_batch_the_next_epoch_is_whole(tmp_path: Path) -> None:
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            DieAt(12, bad=5, marks=str(tmp_path), times=1), 3, max_retries=0, start_method=FS
        ) as loader:
            with pytest.raises(aiomp.BrokenWorkerError, match="batch 1"):
                async for _ in loader:
                    pass
            assert [list(b) async for b in loader][1] == [3, 4, 5]


async def test_the_error_s_fields(tmp_path: Path) -> None:
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            DieAt(6, bad=0, marks=str(tmp_path), times=None), 3, max_retries=0, start_method=FS
        ) as loader:
            with pytest.raises(aiomp.BrokenWorkerError) as info:
                async for _ in loader:
                    pass
    err = info.value
    assert err.batch_index == 0 and err.indices == [0, 1, 2]  # type: ignore[attr-defined]
    assert err.signal_name == "SIGKILL"


async def test_a_raising_sample_raises_its_own_type_naming_the_batch() -> None:
    with anyio.fail_after(60):
        async with aiomp.DataLoader(RaiseAt(12, bad=7), 3, start_method=FS) as loader:
            got = []
            it = loader.__aiter__()
            with pytest.raises(KeyError, match="sample 7 is missing") as info:
                async for b in it:
                    got.append(list(b))
            assert got == [[0, 1, 2], [3, 4, 5]]
            assert any("batch 2 (samples [6, 7, 8])" in n for n in info.value.__notes__)
            assert "Traceback" in str(info.value.__cause__)  # the worker's traceback
            # iterating on gives the later batches; the next epoch is whole
            assert [list(b) async for b in it] == [[9, 10, 11]]
            with pytest.raises(KeyError):
                async for _ in loader:
                    pass


async def test_a_hung_worker_times_out_and_is_replaced(tmp_path: Path) -> None:
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            HangAt(8, bad=2, marks=str(tmp_path)), 2, timeout=3, start_method=FS
        ) as loader:
            got = []
            it = loader.__aiter__()
            with pytest.raises(TimeoutError):
                async for b in it:
                    got.append(list(b))
            assert got == [[0, 1]]
            assert [list(b) async for b in it] == [[4, 5], [6, 7]]
            assert [list(b) async for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
            assert loader.pool.statistics().replaced >= 1


async def test_an_iterable_dataset_s_dead_worker_is_replayed(tmp_path: Path) -> None:
    """Issue 27 (iterable-style): the worker of shard 1 dies at sample 9 (its 5th sample,
    batch 2 of the shard); the replacement replays the shard and every batch comes once,
    in the order of an epoch with no death."""
    with anyio.fail_after(90):
        async with aiomp.DataLoader(
            StreamDieAt(16, bad=9, marks=str(tmp_path)), 2, num_workers=2, start_method=FS
        ) as loader:
            got = [list(b) async for b in loader]
            again = [list(b) async for b in loader]
    shard0 = [[0, 2], [4, 6], [8, 10], [12, 14]]
    shard1 = [[1, 3], [5, 7], [9, 11], [13, 15]]
    expected = [b for pair in zip(shard0, shard1, strict=True) for b in pair]
    assert got == again == expected
    assert _count(tmp_path) == 1


def _count(marks: Path) -> int:
    """How many times the sample has killed its worker."""
    return len(list(marks.iterdir()))
