"""Resume of an iterable-style dataset as torchdata's ``StatefulDataLoader`` resumes it
(issue 39, docs/decisions/0085-loader-torch-compat.md): a dataset with ``state_dict()`` /
``load_state_dict()`` continues mid-epoch, through a JSON round trip, with workers and
without; its state goes on over epochs; one without replays its epoch. Each test names
the torchdata test whose behaviour it pins."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

import aiomp
from tests.children.data_compat import OwnIterator, Positional, Unsharded

FS = "forkserver"


def _loader(dataset: Any, num_workers: int) -> aiomp.DataLoader:
    method = {"start_method": FS} if num_workers else {}
    return aiomp.DataLoader(
        dataset,
        None,
        num_workers=num_workers,
        collate_fn=_identity,
        **method,  # type: ignore[arg-type]
    )


def _identity(sample: Any) -> Any:
    return sample


def _json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # type: ignore[no-any-return]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", [Positional, OwnIterator])
def test_a_stateful_iterable_dataset_resumes_mid_epoch(num_workers: int, kind: type) -> None:
    """torchdata: TestStateInitializationDataset, TestJsonSerDe (iterable). Taken after
    7 batches and sent through JSON, the state resumes a new loader (a fresh dataset)
    at the 8th: the two runs give each sample once, in the order of one run."""
    sizes = [6, 9]
    whole = _loader(kind(sizes), num_workers)
    try:
        expected = list(whole)
    finally:
        whole.close()
    first = _loader(kind(sizes), num_workers)
    try:
        it = iter(first)
        got = [next(it) for _ in range(7)]
        state = _json(first.state_dict())
    finally:
        first.close()
    second = _loader(kind(sizes), num_workers)
    try:
        second.load_state_dict(state)
        assert second.state_dict() == state
        it = iter(second)
        got.append(next(it))
        assert second.state_dict()["batches"] == 8  # the epoch's count, resumed ones too
        got += list(it)
    finally:
        second.close()
    assert _values(got) == _values(expected) and len(got) == 15


def _values(samples: list[Any]) -> list[Any]:
    return [s[0] if isinstance(s, tuple | list) else s for s in samples]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_s_state_goes_on_over_epochs_and_resumes(num_workers: int) -> None:
    """torchdata: TestMultiEpochState (test_inline, test_pw). The dataset counts its
    epochs in itself (as torch's persistent workers keep their datasets): a state taken
    between epochs carries the count, and a new loader resumed from it goes on from it."""
    sizes = [3, 5]
    loader = _loader(Positional(sizes), num_workers)
    try:
        epoch0 = list(loader)
        between = _json(loader.state_dict())
        epoch1, epoch2 = list(loader), list(loader)
    finally:
        loader.close()
    assert {e for _, e in epoch0} == {0} and {e for _, e in epoch2} == {2}
    assert [(i, e - 1) for i, e in epoch1] == [tuple(s) for s in epoch0]
    again = _loader(Positional(sizes), num_workers)
    try:
        it = iter(again)
        next(it), next(it)
        again.load_state_dict(between)
        assert [tuple(s) for s in again] == [tuple(s) for s in epoch1]
        assert [tuple(s) for s in again] == [tuple(s) for s in epoch2]
    finally:
        again.close()


@pytest.mark.anyio
async def test_async_for_resumes_a_stateful_iterable_dataset() -> None:
    """torchdata: TestFastStateDictRequest (a state asked for at each step). In
    ``async for``, each state resumes at the next batch."""
    with anyio.fail_after(120):
        async with _loader(Positional([4, 4]), 2) as loader:
            got, states = [], []
            async for sample in loader:
                got.append(tuple(sample))
                states.append(loader.state_dict())
        async with _loader(Positional([4, 4]), 2) as resumed:
            resumed.load_state_dict(states[4])
            rest = []
            async for sample in resumed:
                rest.append(tuple(sample))
                if len(rest) == 1:  # the same state as the first run's at the same batch
                    assert resumed.state_dict() == states[5]
    assert got[:5] + rest == got
    assert states[4]["batches"] == 5


def test_a_dataset_keeping_no_state_replays_its_epoch() -> None:
    """Documented difference (docs/data-loading-differences.md): torchdata fast-forwards
    a stateless iterable dataset's iterator; aiomp replays the stored epoch from its
    start, so a resumed epoch is whole."""
    loader = _loader(Unsharded(6), 0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert "shards" not in state
    resumed = _loader(Unsharded(6), 0)
    resumed.load_state_dict(state)
    assert list(resumed) == list(range(6))


def test_a_state_resumes_only_with_its_number_of_workers() -> None:
    """torchdata: TestNumWorkersMismatch. An iterable dataset splits itself by worker:
    its shards' states resume with as many workers, else a ValueError says so."""
    loader = _loader(Positional([2, 2]), 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = _loader(Positional([2, 2]), 2)
    with pytest.raises(ValueError, match="same num_workers"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="'shards' must be"):
        loader.load_state_dict({**state, "shards": [1]})
