"""aiomp.DataLoader's sync face (issue 27): batches reach a plain ``for`` through the
handoff (one pump task per epoch on the private loop), and what the consumer has taken,
not what waits in the handoff, is what ``state_dict`` counts and what an error or a
``break`` leaves behind."""

from __future__ import annotations

import pytest

import aiomp
from tests.children.data import RaiseAt

FS = "forkserver"


def test_state_dict_counts_what_the_for_loop_took() -> None:
    with aiomp.DataLoader(list(range(40)), 2, seed=3, start_method=FS) as loader:
        for i, _ in enumerate(loader):
            # the pump runs ahead into the handoff: the count is still the consumer's
            at = {"epoch": 0, "batches": i + 1} if i < 19 else {"epoch": 1, "batches": 0}
            assert loader.state_dict() == {**at, "seed": 3}
        assert loader.state_dict() == {"epoch": 1, "batches": 0, "seed": 3}


def test_break_then_the_next_epoch_is_whole() -> None:
    with aiomp.DataLoader(list(range(20)), 2, start_method=FS) as loader:
        for batch in loader:
            if list(batch) == [4, 5]:
                break
        assert loader.state_dict()["batches"] == 3
        assert [list(b) for b in loader] == [[2 * i, 2 * i + 1] for i in range(10)]


def test_an_error_ends_the_for_and_the_next_epoch_is_whole() -> None:
    """The failed batch counts as handed out (as in async code, issue 39 bug 10)."""
    with aiomp.DataLoader(RaiseAt(12, bad=7), 3, start_method=FS) as loader:
        got = []
        with pytest.raises(KeyError, match="sample 7 is missing") as info:
            for b in loader:
                got.append(list(b))
        assert got == [[0, 1, 2], [3, 4, 5]]
        assert any("batch 2 (samples [6, 7, 8])" in n for n in info.value.__notes__)
        assert loader.state_dict()["batches"] == 3
        with pytest.raises(KeyError):
            for _ in loader:
                pass


def test_torch_s_skip_the_bad_batch_loop_gets_the_later_batches() -> None:
    """Issue 39 bug 10: after a batch raised, the sync iterator ended (torch's
    skip-the-bad-batch loop got 1 batch of 4, silently). It goes on, as the async one."""
    with aiomp.DataLoader(RaiseAt(12, bad=4), 3, start_method=FS) as loader:
        it = iter(loader)
        got, errors = [], 0
        while True:
            try:
                got.append(list(next(it)))
            except StopIteration:
                break
            except KeyError:
                errors += 1
        assert got == [[0, 1, 2], [6, 7, 8], [9, 10, 11]] and errors == 1
        assert loader.state_dict() == {"epoch": 1, "batches": 0, "seed": loader.seed}


def test_leaving_with_an_unfinished_iterator_referenced() -> None:
    """Issue 39 bug 1: ``with loader:`` never returned while an unfinished
    ``it = iter(loader)`` was still referenced (its pump waited for room for ever)."""
    with aiomp.DataLoader(list(range(200)), 2, start_method=FS) as loader:
        it = iter(loader)
        assert list(next(it)) == [0, 1]
    assert it is not None
    with pytest.raises(StopIteration):
        next(it)
