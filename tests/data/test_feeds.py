"""The map-style transport's pure parts, with no worker (issue 39, "Simpler while you are
in it"): the named marks, the batches handed out, and the feeds' one retry rule and
``timeout=`` deadline, driven by hand through their results queue."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiomp
from aiomp._data.epoch import Handed
from aiomp._data.feeds import FeedMark, Feeds
from aiomp._data.handoff import Kind
from aiomp._data.worker import ShardMark
from tests.children.data import HangAt, slow_start


def test_the_marks_are_no_batch_index_and_survive_pickling() -> None:
    """``ENDED = -1`` was also a batch index: a mark is an enum member now, the same
    object after a trip through a queue (pickled by name)."""
    for mark in (FeedMark.ENDED, ShardMark.END, ShardMark.FAILED, Kind.END):
        assert pickle.loads(pickle.dumps(mark)) is mark
        assert all(mark != k for k in (-2, -1, 0, 1))


def test_handed_counts_a_prefix_and_the_batches_past_it() -> None:
    handed = Handed(2, [5])
    for k in (3, 2, 4):
        handed.add(k)
    copy = handed.copy()
    handed.add(7)
    assert (copy.prefix, copy.later) == (6, set())
    assert (handed.prefix, handed.later) == (6, {7})


class Host:
    """A loader's task host with no pool: the feed tasks started are recorded, not run."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.started: list[tuple[int, int]] = []  # (slot, generation)

    @property
    def pool(self) -> Any:
        raise AssertionError("no feed task runs here")

    def host_tg(self) -> Any:
        return self

    def start_soon(self, fn: Any, slot: int, generation: int, requests: Any) -> None:
        self.started.append((slot, generation))  # its requests stay queued, untaken

    def fetched(self) -> None:
        self.in_flight -= 1


def _feeds(retries: int = 1, timeout: float | None = None) -> tuple[Feeds, Host]:
    host = Host()
    feeds = Feeds(host, 2, epoch=0, seed=1, retries=retries, timeout=timeout)
    for k in range(4):
        feeds.send(k, [2 * k, 2 * k + 1])
    return feeds, host


def _died(feeds: Feeds, slot: int) -> None:
    """Slot ``slot``'s feed task ended: its worker died (as ``_feed`` marks it)."""
    generation = feeds.feeding[slot]
    feeds.ended[generation] = aiomp.BrokenWorkerError("died", 0, 123, -9, "SIGKILL")
    feeds.results.put_nowait((slot, FeedMark.ENDED, generation, None))


@pytest.mark.anyio
async def test_a_batch_whose_worker_died_goes_back_then_fails_naming_it() -> None:
    feeds, host = _feeds(retries=1)
    try:
        assert [list(o) for o in feeds.owed] == [
            [(0, [0, 1]), (2, [4, 5])],
            [(1, [2, 3]), (3, [6, 7])],
        ]
        assert host.started == [(0, 1), (1, 2)]
        with anyio.fail_after(30):
            _died(feeds, 1)
            assert await feeds.receive() is None  # batch 1 again, on a new feed task
            assert host.started[-1] == (1, 3) and [k for k, _ in feeds.owed[1]] == [1, 3]
            feeds.results.put_nowait((1, 3, True, "stale"))  # put by no current feed: dropped
            assert await feeds.receive() is None
            _died(feeds, 1)
            k, ok, error = await feeds.receive() or (None, None, None)
    finally:
        feeds.close()
    assert (k, ok) == (1, False) and isinstance(error, aiomp.BrokenWorkerError)
    assert error.batch_index == 1 and "on each of its 2 tries" in str(error)  # type: ignore[attr-defined]
    assert host.started[-1] == (1, 4) and [k for k, _ in feeds.owed[1]] == [3]


@pytest.mark.anyio
async def test_a_batch_past_its_deadline_times_out_and_its_feed_is_replaced() -> None:
    feeds, host = _feeds(timeout=0.2)
    try:
        scope = anyio.CancelScope()
        feeds.scopes[1] = scope  # slot 1's worker has its first batch from now
        feeds.since[1] = time.monotonic()
        feeds.results.put_nowait((0, 0, True, "batch 0"))
        with anyio.fail_after(30):
            assert await feeds.receive() == (0, True, "batch 0")
            k, ok, error = await feeds.receive() or (None, None, None)
    finally:
        feeds.close()
    assert (k, ok) == (1, False) and isinstance(error, TimeoutError)
    assert any("building batch 1 (samples [2, 3])" in n for n in error.__notes__)
    assert scope.cancel_called  # the Pool terminates the hung worker
    assert host.started[-1] == (1, 3) and [k for k, _ in feeds.owed[1]] == [3]
    assert feeds.since[1] is None  # no deadline until the new feed task has a worker


@pytest.mark.anyio
# One loop: the deadline is the feeds' own (the loop-specific waits are pinned by
# test_faults' hung-worker tests on every loop), and each run costs 15 s.
@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_a_worker_s_start_does_not_count_against_the_timeout(tmp_path: Path) -> None:
    """``timeout=`` counts from the moment a worker has the batch: workers whose start
    (``worker_init_fn``) takes twice the timeout time nothing out, the first epoch's and
    the replacement of a hung one's alike."""
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            HangAt(6, bad=2, marks=str(tmp_path)),
            2,
            num_workers=1,
            timeout=3,
            worker_init_fn=slow_start,
            start_method="forkserver",
        ) as loader:
            it = loader.__aiter__()
            got = [list(await it.__anext__())]
            with pytest.raises(TimeoutError, match="batch 1 was not built within 3"):
                await it.__anext__()
            got += [list(b) async for b in it]  # batch 2 waits for the replacement's start
    assert got == [[0, 1], [4, 5]]
