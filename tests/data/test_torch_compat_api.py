"""aiomp.DataLoader keeps torch's DataLoader behaviours that torch's own tests check
(issue 39): the constructor's checks in torch's order and words, torch's timeout error,
the worker_init_fn's exception as its own type, a read-only WorkerInfo, torch's warnings.
Each test names the torch test whose behaviour it pins."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import anyio
import pytest

import aiomp
from aiomp._child.info import WorkerInfo
from tests.children.data import HangAt, Stream
from tests.children.data_compat import Unsharded, WritesWorkerInfo, raise_in_init

FS = "forkserver"


def test_the_constructor_checks_in_torch_s_order() -> None:
    """torch: TestDataLoader.test_invalid_ctor_args_combinations. With several bad
    arguments the first error is torch's first: sampler/shuffle before batch_sampler, an
    iterable dataset's shuffle before its sampler before its batch_sampler."""
    cases = [
        (dict(batch_sampler=[[0]], sampler=[0], shuffle=True), "sampler option is mutually"),
        (dict(batch_sampler=[[0]], shuffle=True), "batch_sampler option is mutually"),
        (dict(batch_size=None, drop_last=True), "batch_size=None option disables"),
        (dict(num_workers=-1, timeout=-1), "num_workers option should be non-negative"),
        (dict(timeout=-1, prefetch_factor=2), "timeout option should be non-negative"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            aiomp.DataLoader([1, 2], **kwargs)  # type: ignore[arg-type]
    iterable = [
        (dict(shuffle=True, sampler=[0]), "expected unspecified shuffle option"),
        (dict(sampler=[0], batch_sampler=[[0]]), "expected unspecified sampler option"),
        (dict(batch_sampler=[[0]]), "expected unspecified batch_sampler option"),
    ]
    for kwargs, message in iterable:
        with pytest.raises(ValueError, match=f"DataLoader with IterableDataset: {message}"):
            aiomp.DataLoader(Stream(3), **kwargs)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_timeout_is_torch_s_runtime_error_and_a_timeout_error(tmp_path: Path) -> None:
    """torch: TestDataLoader.test_timeout. torch raises RuntimeError("DataLoader timed
    out after N seconds"); aiomp's error is that and a TimeoutError (as anyio's and the
    Pool's), so both ``except`` clauses catch it."""
    with anyio.fail_after(120):
        async with aiomp.DataLoader(
            HangAt(4, bad=0, marks=str(tmp_path)), 2, timeout=1, start_method=FS
        ) as loader:
            with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1 seconds") as info:
                async for _ in loader:
                    pass
    assert isinstance(info.value, TimeoutError)
    assert any("was terminated and replaced" in note for note in info.value.__notes__)


def test_a_worker_init_fn_error_arrives_as_its_own_type() -> None:
    """torch: TestDataLoader.test_error_in_init. The exception worker_init_fn raised, not
    the Pool's BrokenPoolError around it; a loader used without ``with`` and dropped
    after it leaves no worker, thread or fd (the autouse leak check: it left its private
    loop's fds, and collected, it hung on its loop's leftover tasks)."""
    loader = aiomp.DataLoader(list(range(4)), 2, worker_init_fn=raise_in_init, start_method=FS)
    with pytest.raises(ZeroDivisionError, match="worker_init_fn of worker") as info:
        for _ in loader:
            pass
    assert any("workers' initializer" in note for note in info.value.__notes__)
    del loader, info


def test_worker_info_is_read_only() -> None:
    """torch: TestDataLoader.test_get_worker_info (WorkerInfo refuses assignments after
    it is made, issue 39 bug 8), in a worker and here."""
    with aiomp.DataLoader(WritesWorkerInfo(), None, start_method=FS) as loader:
        got = list(loader)
    assert got == ["RuntimeError: Cannot assign attributes to WorkerInfo objects (id 0)"] * 2 or (
        set(got)
        <= {
            f"RuntimeError: Cannot assign attributes to WorkerInfo objects (id {i})" for i in (0, 1)
        }
    )
    info = WorkerInfo(0, 1)
    with pytest.raises(RuntimeError, match="Cannot assign attributes"):
        info.seed = 3
    with pytest.raises(RuntimeError):
        del info.id
    assert (info.id, info.num_workers, info.pid) == (0, 1, os.getpid())


def test_more_workers_than_cpus_warns_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch: DataLoader.check_worker_number_rationality (torch's TestDataLoader runs
    its loaders under it): a UserWarning in torch's words when the loader starts more
    workers than the CPUs this process may run on; none otherwise."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.warns(
        UserWarning,
        match=r"will create 2 worker processes in total\. Our "
        r"suggested max number of worker in current system is 1",
    ):
        with aiomp.DataLoader([1, 2], start_method=FS):
            pass
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with aiomp.DataLoader([1, 2], start_method=FS):
            pass


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_past_its_length_warns_as_torch(num_workers: int) -> None:
    """torch: TestDataLoader.test_iterable_style_dataset (NOTE [ IterableDataset and
    __len__ ]). An unsharded iterable dataset gives its samples once per worker: once
    ``len(loader)`` was asked, each batch past it warns, in the consumer's thread, as it
    is handed out; before ``len()`` is asked, nothing warns."""
    method = {"start_method": FS} if num_workers else {}
    loader = aiomp.DataLoader(Unsharded(4), num_workers=num_workers, **method)  # type: ignore[arg-type]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(iter(loader))) == 4 * max(num_workers, 1)  # iter(): no len()
            assert len(loader) == 4
            it = iter(loader)
            for _ in range(4):
                next(it)
        if num_workers:
            for _ in range(2):
                with pytest.warns(
                    UserWarning,
                    match=r"reported to be 4 \(when accessing "
                    r"len\(dataloader\)\), but \d+ samples have been fetched\. "
                    "For multiprocessing data-loading",
                ):
                    next(it)
    finally:
        loader.close()
