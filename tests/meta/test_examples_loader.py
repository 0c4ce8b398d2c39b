"""examples/data_loader.py: the example runs, and its loader keeps its promises (order,
the end of the stream, early exit, a failing worker) on asyncio, uvloop and trio."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

import aiomp
from examples.data_loader import DataLoader, SyntheticImages
from tests._run import run_python
from tests.children.loader import BrokenAt

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("extra", [[], ["--numpy", "--backend", "trio"]])
def test_example_runs(extra: list[str]) -> None:
    proc = run_python(
        "examples/data_loader.py", "--batches", "6", "--batch-size", "16", *extra, timeout=120
    )
    assert proc.stdout.splitlines()[-1] == "ok", proc.stdout


@pytest.mark.parametrize("shared", [True, False], ids=["aiomp.empty", "numpy"])
async def test_batches_come_in_order_and_the_stream_ends(shared: bool) -> None:
    dataset = SyntheticImages(7 * 5 + 3, shape=(3, 8, 8))  # 8 batches, the last short
    got = []
    with anyio.fail_after(60):
        async with DataLoader(
            dataset,
            5,
            num_workers=2,
            prefetch=3,
            shared=shared,
            start_method="forkserver",
            grace_period=1.0,
        ) as loader:
            async for images, labels in loader:
                assert aiomp.is_shared(images) == shared  # numpy: small, so inline
                # back-pressure: requested and not yet handed out <= prefetch, so built
                # and waiting (on the queue or in the reorder buffer) <= prefetch
                assert loader._batches.qsize() + len(loader._ready) <= loader.prefetch
                assert loader._sent - loader._next <= loader.prefetch
                got.append((images.copy(), labels.copy()))
    assert [len(b[0]) for b in got] == [5] * 7 + [3]
    images = np.concatenate([b[0] for b in got])
    labels = np.concatenate([b[1] for b in got])
    for i in range(len(dataset)):
        img, label = dataset[i]
        assert np.array_equal(images[i], img) and labels[i] == label, i
    assert loader.ctx is not None and sum(loader.ctx.results) == 8  # type: ignore[arg-type]


async def test_leaving_early_stops_the_workers() -> None:
    dataset = SyntheticImages(10_000, shape=(3, 8, 8))
    with anyio.fail_after(60):
        async with DataLoader(
            dataset, 4, num_workers=2, start_method="forkserver", grace_period=1.0
        ) as loader:
            async for _images, _labels in loader:
                break
    # the workers returned on the closed queues by themselves: joined, not killed
    assert loader.ctx is not None and all(p.exitcode == 0 for p in loader.ctx.processes)


async def test_a_failing_sample_raises_from_the_block() -> None:
    dataset = BrokenAt(40, bad=21)
    seen = 0
    with anyio.fail_after(60), pytest.raises(aiomp.ProcessRaisedException, match="corrupt"):
        async with DataLoader(
            dataset, 4, num_workers=2, start_method="forkserver", grace_period=1.0
        ) as loader:
            async for _images, _labels in loader:
                seen += 1
    assert seen <= 5  # batch 5 (samples 20..23) never arrives; later ones are not handed out


def test_bad_arguments_raise_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(SyntheticImages(4), 0)
    with pytest.raises(IndexError):
        SyntheticImages(4)[4]


async def test_a_receiver_keeps_recently_used_segments_mapped() -> None:
    """A receiver keeps the segments it dropped mapped up to a byte budget, so a loader
    whose 2 workers cycle 3 batch segments each (the one being filled, the one in flight,
    the one the consumer holds) never has the consumer mmap a segment again and fault its
    pages in."""
    import gc
    import weakref

    from aiomp._arrays import shared as _shared
    from aiomp._memory.segment import Segment
    from tests.children.loader import send_each_twice

    count = 6
    q, acks = aiomp.Queue(), aiomp.Queue()
    seen: list[weakref.ref[Segment]] = []
    with anyio.fail_after(60):
        async with aiomp.spawn(
            send_each_twice,
            1,
            args=(q, acks, count, 2 << 20),
            start_method="forkserver",
            grace_period=1.0,
        ):
            for i in range(2 * count):
                arr = await q.get()
                shared = _shared.shared_block(arr)
                assert shared is not None
                segment = shared[0].segment
                if i < count:
                    seen.append(weakref.ref(segment))
                else:
                    assert segment is seen[i - count](), f"segment {i - count} was mapped again"
                del arr, shared, segment
                gc.collect()
                await acks.put(None)
