"""aiomp.DataLoader resume (issue 27): state_dict() mid-epoch, load_state_dict() on a new
loader with another num_workers continues with the next batch, building none skipped."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import anyio
import pytest

import aiomp
from tests.children.data import Counting

pytestmark = pytest.mark.anyio
FS = "forkserver"


async def test_resume_mid_epoch_builds_no_skipped_batch(tmp_path: Path) -> None:
    full = tmp_path / "full"
    part = tmp_path / "part"
    full.mkdir()
    part.mkdir()
    with anyio.fail_after(90):
        async with aiomp.DataLoader(
            Counting(20, str(full)), 2, shuffle=True, seed=4, num_workers=1, start_method=FS
        ) as loader:
            await _take(loader, 10)  # epoch 0 whole
            async for _ in loader:  # epoch 1: stop after 4 batches
                if loader.state_dict()["batches"] == 4:
                    break
            state = pickle.loads(pickle.dumps(loader.state_dict()))
            loader.set_epoch(1)
            expected = [list(b) async for b in loader]  # epoch 1 whole, for reference
    assert state == {"epoch": 1, "batches": 4, "seed": 4}
    with anyio.fail_after(90):
        async with aiomp.DataLoader(
            Counting(20, str(part)), 2, shuffle=True, num_workers=3, start_method=FS
        ) as loader:
            loader.load_state_dict(state)
            rest = [list(b) async for b in loader]
            after = loader.state_dict()
    assert rest == expected[4:]
    assert sorted(int(p.name) for p in part.iterdir()) == sorted(
        list(itertools.chain.from_iterable(rest))
    )
    assert after == {"epoch": 2, "batches": 0, "seed": 4}


async def _take(loader: aiomp.DataLoader, n: int) -> None:
    got = [b async for b in loader]
    assert len(got) == n
