"""aiomp.DataLoader as a drop-in for torch's (issue 39): torch's full signature in torch's
positional order with torch's meanings, ``num_workers=0`` in the calling process,
``batch_size=None``, ``for`` with no ``with``, the attributes torch code reads, torch's
default collate, ``generator`` and ``torch.manual_seed``, and torch's errors."""

from __future__ import annotations

import inspect
import multiprocessing
import threading

import anyio
import pytest

import aiomp

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from tests.children.data_dropin import Images  # noqa: E402

FS = "forkserver"


def test_torch_s_signature_in_torch_s_order() -> None:
    """Every parameter of torch's DataLoader.__init__, positional ones in torch's order."""
    ours = list(inspect.signature(aiomp.DataLoader).parameters.values())
    theirs = list(inspect.signature(torch.utils.data.DataLoader).parameters.values())
    positional = [p.name for p in theirs if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in ours[: len(positional)]] == positional
    assert {p.name for p in theirs} <= {p.name for p in ours}
    assert aiomp.DataLoader[int] is not None  # type: ignore[misc]  # subscriptable, as torch's


def test_an_unchanged_torch_training_loop_without_with() -> None:
    """The porting traps: torch's positional arguments and keywords, ``for`` with no
    ``with`` (workers start at the first iteration and persist over epochs), torch's
    default collate (labels become a tensor, so ``cross_entropy`` runs unchanged)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 3))
    loader = aiomp.DataLoader(
        Images(10),
        4,
        True,
        None,
        None,
        2,
        None,
        False,
        False,
        0,
        None,
        FS,
        None,
        prefetch_factor=None,
        persistent_workers=True,
        pin_memory_device="",
        in_order=True,
    )
    try:
        for _ in range(2):
            for images, labels in loader:
                assert isinstance(labels, torch.Tensor) and labels.dtype == torch.int64
                F.cross_entropy(model(images), labels).backward()  # type: ignore[no-untyped-call]
            pids = loader.pool.pids()
        assert len(pids) == 2 and loader.pool.pids() == pids  # persistent
    finally:
        loader.close()
    with pytest.raises(RuntimeError):
        loader.pool  # noqa: B018 - closed


def test_num_workers_0_loads_in_the_calling_process() -> None:
    """``num_workers=0``: batches built in this process (no worker: get_worker_info() is
    None), with torch's defaults; ``batch_size=None`` gives the samples themselves."""
    from tests.children.data_dropin import where_am_i

    class Where:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> object:
            return (where_am_i(i), threading.get_ident())

    got = [list(b[0]) for b in aiomp.DataLoader(Where(), 2, num_workers=0)]
    assert got == [[-1, -1], [-1, -1]]
    unbatched = list(aiomp.DataLoader(Images(3), None, num_workers=0))
    assert [label for _, label in unbatched] == [0, 1, 2]
    assert unbatched[0][0].shape == (3, 4, 4)


@pytest.mark.anyio
async def test_num_workers_0_async_runs_off_the_loop() -> None:
    """``num_workers=0`` in ``async for``: each batch is built in a thread, not on the
    event loop's."""
    loop_thread = threading.get_ident()

    class Where:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            assert threading.get_ident() != loop_thread
            return i

    with anyio.fail_after(30):
        async with aiomp.DataLoader(Where(), 2, num_workers=0) as loader:
            assert [list(b) async for b in loader] == [[0, 1], [2, 3]]


def test_attributes_torch_code_reads_and_may_not_assign() -> None:
    """``loader.sampler.set_epoch`` (a DistributedSampler), ``batch_sampler``,
    ``dataset``, ``batch_size``, ``drop_last``, ``num_workers``; assigning ``batch_size``
    or ``dataset`` after construction raises as torch's (it was accepted and ignored)."""
    data = Images(8)
    sampler: DistributedSampler[int] = DistributedSampler(
        data, num_replicas=2, rank=0, shuffle=True, seed=1
    )
    loader = aiomp.DataLoader(data, 2, sampler=sampler, num_workers=0)
    assert loader.sampler is sampler and loader.dataset is data
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (2, False, 0)
    assert len(loader.batch_sampler) == 2
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([b[1].tolist() for b in loader])
    assert epochs[0] != epochs[1]
    for name, value in (("batch_size", 3), ("dataset", data), ("sampler", None)):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, value)
    plain = aiomp.DataLoader(data, 3, drop_last=True, num_workers=0)
    assert len(plain.sampler) == 8 and list(plain.batch_sampler) == [[0, 1, 2], [3, 4, 5]]


def test_len_and_the_epoch_are_read_each_epoch() -> None:
    """Issue 39 bug 7: ``len(loader)`` and the epoch were fixed at construction; torch
    reads ``len(dataset)`` each epoch."""
    data = Images(4)
    loader = aiomp.DataLoader(data, 2, num_workers=0)
    assert len(loader) == 2
    data.n = 6
    assert len(loader) == 3 and len(list(loader)) == 3


def test_torch_manual_seed_makes_shuffle_reproducible() -> None:
    """``generator`` (or torch's global RNG) seeds the loader, as in torch."""
    orders = []
    for _ in range(2):
        torch.manual_seed(0)
        loader = aiomp.DataLoader(Images(12), 3, shuffle=True, num_workers=0)
        orders.append([b[1].tolist() for b in loader])
    assert orders[0] == orders[1]
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert (
        aiomp.DataLoader(Images(4), generator=g1, num_workers=0).seed
        == aiomp.DataLoader(Images(4), generator=g2, num_workers=0).seed
    )


def test_torch_s_argument_errors_at_construction() -> None:
    """torch's checks, raised by the constructor; a bad start method too (issue 39 bug 8:
    it passed the constructor and failed at ``with``)."""
    data = Images(4)
    cases = [
        ({"num_workers": -1}, ValueError, "non-negative"),
        ({"num_workers": 0, "prefetch_factor": 2}, ValueError, "prefetch_factor"),
        ({"num_workers": 0, "persistent_workers": True}, ValueError, "persistent_workers"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"multiprocessing_context": "thread"}, ValueError, "valid start method"),
        ({"multiprocessing_context": 3}, TypeError, "context object"),
        ({"num_workers": 0, "multiprocessing_context": "spawn"}, ValueError, "num_workers=0"),
        ({"start_method": "fork2"}, ValueError, "start_method"),
        ({"batch_size": None, "drop_last": True}, ValueError, "drop_last"),
    ]
    for kwargs, kind, match in cases:
        with pytest.raises(kind, match=match):
            aiomp.DataLoader(data, **kwargs)  # type: ignore[arg-type]
    ctx = multiprocessing.get_context(FS)
    assert aiomp.DataLoader(data, multiprocessing_context=ctx).num_workers == 2


def test_a_dropped_loader_stops_its_workers() -> None:
    """``for batch in DataLoader(...)`` with no ``with`` keeps its workers while the loader
    lives; dropped, the loader is collected at once (its epochs hold it weakly) and stops
    them, as torch's loader does."""
    import os
    import weakref

    loader = aiomp.DataLoader(list(range(6)), 2, multiprocessing_context=FS)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    pids = loader.pool.pids()
    ref = weakref.ref(loader)
    del loader
    assert ref() is None and len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # a temporary loader lives while its iterator does
    assert [b.tolist() for b in aiomp.DataLoader([1, 2, 3], 2, multiprocessing_context=FS)] == [
        [1, 2],
        [3],
    ]
