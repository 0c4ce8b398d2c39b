"""aiomp.DataLoader under a dataset's faults and in its seeds (issue 38, items 1-5): a
``BaseException`` from the dataset raised for its batch, seeds that reproduce numpy's and
torch's global RNGs, a corrupt state dict refused, ``env=`` checked when the loader is made,
and a sync loader left entered quiet at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiomp
from tests.children.data_trust import KINDS, BaseRaiseAt, BaseRaiseStream, Draws

FS = "forkserver"
ROOT = Path(__file__).resolve().parents[2]


def _names(exc: BaseException, k: int) -> bool:
    return any(f"batch {k}" in n for n in getattr(exc, "__notes__", ()))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_base_exception_from_the_dataset_is_raised_for_its_batch(
    kind: str, tmp_path: Path
) -> None:
    """Issue 38 item 1: a sample raising SystemExit, KeyboardInterrupt or GeneratorExit
    ended the program (asyncio.run raised it out of the loop) or left the consumer waiting
    for ever. It is raised by the step that hands its batch out, as its own type; iterating
    on gives the later batches, and the next epoch is whole."""
    with anyio.fail_after(60):
        async with aiomp.DataLoader(
            BaseRaiseAt(12, 7, kind, str(tmp_path)), 3, start_method=FS
        ) as loader:
            got = []
            it = loader.__aiter__()
            with pytest.raises(KINDS[kind]) as info:
                async for b in it:
                    got.append(list(b))
            assert got == [[0, 1, 2], [3, 4, 5]] and _names(info.value, 2)
            assert "Traceback" in str(info.value.__cause__)  # the worker's traceback
            assert [list(b) async for b in it] == [[9, 10, 11]]
            assert [list(b) async for b in loader] == [
                [3 * k, 3 * k + 1, 3 * k + 2] for k in range(4)
            ]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["timeout", "iterable"])
async def test_a_base_exception_on_the_other_transports(transport: str, tmp_path: Path) -> None:
    """Issue 38 item 1, with ``timeout=`` (a Pool task per batch) and with an iterable
    dataset (a Pool task per shard): the KeyboardInterrupt is raised in the consumer, the
    next epoch is whole."""
    with anyio.fail_after(60):
        if transport == "timeout":
            loader = aiomp.DataLoader(
                BaseRaiseAt(12, 7, "KeyboardInterrupt", str(tmp_path)),
                3,
                timeout=30,
                start_method=FS,
            )
        else:
            loader = aiomp.DataLoader(
                BaseRaiseStream(12, "KeyboardInterrupt", str(tmp_path)), 3, start_method=FS
            )
        async with loader:
            with pytest.raises(KeyboardInterrupt, match="raised KeyboardInterrupt"):
                async for _ in loader:
                    pass
            got = sorted(x for b in [list(b) async for b in loader] for x in b)
            assert got == list(range(12))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_base_exception_in_the_sync_form(kind: str, tmp_path: Path) -> None:
    """Issue 38 item 1, sync: the ``for`` raised CancelledError, then RuntimeError, and
    every later epoch was empty. Now: the sample's exception, then the later batches of
    the same iterator, and the next epoch whole."""
    with aiomp.DataLoader(BaseRaiseAt(12, 7, kind, str(tmp_path)), 3, start_method=FS) as loader:
        it = iter(loader)
        got = []
        with pytest.raises(KINDS[kind]) as info:
            for b in it:
                got.append(list(b))
        assert got == [[0, 1, 2], [3, 4, 5]] and _names(info.value, 2)
        assert [list(b) for b in it] == [[9, 10, 11]]
        assert [list(b) for b in loader] == [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(4)]


def _epoch_of(loader: aiomp.DataLoader) -> list[Any]:
    return [[[float(x) for x in field] for field in b] for b in loader]


@pytest.mark.parametrize("use_torch", [False, True], ids=["numpy", "torch"])
def test_one_seed_the_same_draws_whatever_num_workers(use_torch: bool) -> None:
    """Issue 38 item 2: a sample drawing from numpy's global RNG (imported by the
    dataset, lazily) got other values with 1 and with 3 workers, and ``seed=loader.seed``
    did not reproduce the epoch: a worker's first batch was built before numpy (or torch)
    was loaded, so unseeded."""
    if use_torch:
        pytest.importorskip("torch")  # in use in this process: the workers seed it too
    epochs = []
    for workers, seed in ((1, 11), (3, 11), (2, None)):
        with aiomp.DataLoader(
            Draws(12, torch=use_torch),
            2,
            shuffle=True,
            num_workers=workers,
            seed=seed,
            start_method=FS,
        ) as loader:
            epochs.append(_epoch_of(loader))
            drawn = loader.seed
        if seed is None:  # passed back, the drawn seed reproduces its epoch
            with aiomp.DataLoader(
                Draws(12, torch=use_torch),
                2,
                shuffle=True,
                num_workers=1,
                seed=drawn,
                start_method=FS,
            ) as again:
                assert _epoch_of(again) == epochs[-1]
    assert epochs[0] == epochs[1]
    for field in (1, 2):  # each batch drew its own numbers
        draws = [x for b in epochs[0] for x in b[field]]
        assert len(set(draws)) == len(draws)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batches": -3}, "batches"),
        ({"batches": "x"}, "batches"),
        ({"batches": 99}, "batches"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": 1.5}, "epoch"),
        ({"seed": None}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_a_corrupt_state_dict_is_refused_naming_the_field(
    change: dict[str, object], field: str
) -> None:
    """Issue 38 item 3: ``batches=-3`` made batch -1, which collided with the feed's end
    mark (``KeyError: 0``). A bad state dict raises ValueError naming its field, and the
    loader is left as it was."""
    loader = aiomp.DataLoader(list(range(20)), 2, seed=1)
    before = loader.state_dict()
    with pytest.raises(ValueError, match=f"'{field}'"):
        loader.load_state_dict({**before, **change})
    for missing in ("epoch", "batches", "seed"):
        with pytest.raises(ValueError, match=f"'{missing}'"):
            loader.load_state_dict({k: v for k, v in before.items() if k != missing})
    with pytest.raises(ValueError, match="dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    assert loader.state_dict() == before


def test_env_is_checked_when_the_loader_is_made() -> None:
    """Issue 38 item 4: ``DataLoader(env={1: "x"})`` was accepted and failed when
    entered; it raises TypeError at the call, as ``Pool(env=...)`` does."""
    with pytest.raises(TypeError, match="env: the key 1 is a int, not a str"):
        aiomp.DataLoader([1, 2], env={1: "x"})
    with pytest.raises(TypeError, match="env must be a dict"):
        aiomp.DataLoader([1, 2], env="A=1")
    with pytest.raises(TypeError, match=r"env\(0\)"):
        aiomp.DataLoader([1, 2], env=lambda i: {"A": i})


ABANDONED = """
import aiomp
loader = aiomp.DataLoader(list(range(100)), 2, start_method={method!r})
loader.__enter__()
it = iter(loader)
print(next(it).tolist(), flush=True)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_an_abandoned_sync_loader_is_quiet_at_exit(method: str) -> None:
    """Issue 38 item 5: entered and never exited, with an iterator still referenced: at
    interpreter exit ``Exception ignored ... Registry.drop_block ... AttributeError``, an
    anyio callback's TypeError, the workers SIGKILLed, a forkserver's ``EOFError``. Now the
    loader is closed at exit as ``with`` would, silently."""
    for _ in range(3):  # the noise came in about half the runs
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(ABANDONED.format(method=method))],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0 and out.stdout == "[0, 1]\n", out.stderr
        assert out.stderr == ""


def test_an_iterable_dataset_s_shards_each_iterate_their_own_copy(tmp_path: Path) -> None:
    """Issue 39 bug 6: two shards run one after the other in one worker shared the
    dataset object, so a dataset keeping its position in itself delivered 7 of 14
    samples. Each shard iterates its own copy, as each torch worker does."""
    import functools

    from tests.children.data_trust import KeepsPosition, slot1_waits_for_shard0

    init = functools.partial(slot1_waits_for_shard0, marks=str(tmp_path))
    with aiomp.DataLoader(
        KeepsPosition(14, str(tmp_path)), 2, worker_init_fn=init, start_method=FS
    ) as loader:
        got = sorted(x for b in loader for x in b.tolist())
    assert got == list(range(14))


def test_state_dict_right_after_load_state_dict_is_what_was_loaded() -> None:
    """Issue 39 bug 5: ``state_dict()`` right after ``load_state_dict(s)`` did not return
    ``s`` (an epoch in progress still answered; an iterable dataset said 0 batches)."""
    from tests.children.data import Stream

    s = {"epoch": 2, "batches": 3, "seed": 7}
    loader = aiomp.DataLoader(list(range(20)), 2, num_workers=0)
    it = iter(loader)
    next(it)
    loader.load_state_dict(s)
    assert loader.state_dict() == s
    assert list(next(iter(loader))) == [6, 7]  # the 4th batch of epoch 2, in order
    stream = aiomp.DataLoader(Stream(10), 2, num_workers=0)
    stream.load_state_dict(s)
    assert stream.state_dict() == s


def test_resume_out_of_order_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Issue 39 bug 4: with ``in_order=False`` the state counted the batches handed out
    and the resume skipped that many in sampler order: batches 1 and 3 handed out first
    made a resume skip 0 and 1 (0 lost, 3 twice). The state names them."""
    from tests.children.data_trust import HeldBack

    with aiomp.DataLoader(
        HeldBack(16, str(tmp_path)), 2, num_workers=2, in_order=False, start_method=FS
    ) as loader:
        it = iter(loader)
        got = [next(it).tolist(), next(it).tolist()]
        state = loader.state_dict()
    assert sorted(got) == [[2, 3], [6, 7]]
    assert state == {"epoch": 0, "batches": 0, "seed": loader.seed, "later": [1, 3]}
    with aiomp.DataLoader(
        HeldBack(16, str(tmp_path)), 2, num_workers=3, in_order=False, start_method=FS
    ) as again:
        again.load_state_dict(state)
        assert again.state_dict() == state
        rest = [b.tolist() for b in again]
    assert sorted(x for b in got + rest for x in b) == list(range(16))
