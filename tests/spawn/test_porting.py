"""Porting a torch script to aiomp.spawn without traps (issue 31, items 1 to 4).

A handle dropped unawaited warns as a coroutine does (item 1); forked children get
fresh global seeds (item 2); a failing rank finishes exiting on its own (item 3); its
exception keeps torch's type and attributes and carries the child's own as
``__cause__`` (item 4). On asyncio, uvloop and trio; every await on a child bounded.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests.children import common as funcs
from tests.children import porting

TIMEOUT = 30
METHODS = ["spawn", "forkserver", "fork"]

pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


def _no_child() -> None:
    import multiprocessing

    assert multiprocessing.active_children() == []


# -- item 1: a forgotten await warns ----------------------------------------------------------


def test_a_spawn_handle_dropped_unawaited_warns_like_a_coroutine() -> None:
    """Issue 31 item 1: `aiomp.spawn(...)` in a plain `def main()` returned a handle and
    ran nothing, silently. Now dropping it warns, naming the call, its line and the fix."""

    def main() -> None:
        aiomp.spawn(funcs.echo, 2, args=(1,))  # the sync port: no await

    with pytest.warns(RuntimeWarning) as record:
        main()
        gc.collect()
    (w,) = record
    text = str(w.message)
    assert "aiomp.spawn(echo, 2) was never awaited or entered" in text
    assert "async with aiomp.spawn(...)" in text and "asyncio.run(main())" in text
    assert w.filename == __file__ and "anyio.run(main)" in text
    _no_child()


def test_asyncio_run_of_a_spawn_handle_says_to_await_it() -> None:
    """Issue 31 item 1: `asyncio.run(aiomp.spawn(...))` said only "a coroutine was
    expected"; the handle's repr, which that message shows, says what to do."""
    with pytest.warns(RuntimeWarning, match="never awaited"):
        with pytest.raises(ValueError, match=r"await it, or enter it with `async with`"):
            asyncio.run(aiomp.spawn(funcs.echo, 1))  # type: ignore[arg-type]
        gc.collect()
    _no_child()


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["await", "async with", "invalid"])
async def test_an_awaited_or_entered_handle_does_not_warn(how: str) -> None:
    """The warning is for handles never used; one awaited, entered, or refused while
    starting (its error is the message) says nothing more."""
    with anyio.fail_after(TIMEOUT):
        if how == "await":
            ctx = await aiomp.spawn(funcs.echo, 1, args=(1,))
            assert await ctx.join()
        elif how == "async with":
            async with aiomp.spawn(funcs.echo, 1, args=(1,)):
                pass
        else:
            with pytest.raises(ValueError):
                await aiomp.spawn(funcs.echo, 0)
    gc.collect()  # the error-level warning filter would fail the test


# -- item 2: forked children get their own random streams ----------------------------------


def seeded_parent() -> None:
    """The parent imports and seeds numpy and torch, as a training script does."""
    import numpy as np

    np.random.seed(0)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)


def assert_all_distinct(draws: list[porting.Draws], forked: bool) -> None:
    """Every child's draws differ from every other's, generator by generator."""
    for gen in range(3):
        got = [tuple(x) for d in draws if (x := d[gen]) is not None]
        assert len(set(got)) == len(got), (gen, got)
        if forked:  # the parent's numpy and torch came with the fork
            assert len(got) == len(draws)


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_forked_ranks_draw_their_own_random_numbers(start_method: str) -> None:
    """Issue 31 item 2: under fork, ranks' `np.random` and `torch.rand` draws repeated
    (64 of 64 when the parent had seeded numpy): numpy's and torch's global generators
    do not reseed after a fork. Now each rank gets its own seeds."""
    seeded_parent()
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(porting.rank_draws, 3, start_method=start_method)
        assert await ctx.join()
    assert_all_distinct(ctx.results, start_method == "fork")  # type: ignore[arg-type]


# -- item 3: the failing rank finishes its own exit -----------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_a_failing_rank_finishes_exiting_while_the_others_are_terminated(
    start_method: str, gate: Gate, tmp_path: Path
) -> None:
    """Issue 31 item 3: aiomp read the failing rank's report and then SIGTERMed every
    rank, the failing one included: its atexit functions were cut and its exit code was
    -15. torch: `[-15, 1]`, handler completed. Now the others are terminated while the
    failing rank exits on its own (bounded by the grace period)."""
    marker = tmp_path / "atexit"
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException, match="rank 1 failed") as info:
            async with aiomp.spawn(
                porting.fail_with_a_slow_atexit,
                2,
                args=(gate.address, str(marker)),
                start_method=start_method,
                grace_period=20,
            ) as ctx:
                await anyio.sleep_forever()
    assert info.value.error_index == 1
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGTERM, 1]
    if start_method == "spawn":  # fork children leave by os._exit: no atexit (as torch)
        assert marker.read_text() == "finished"


# -- item 4: exception types ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["async with", "join"])
async def test_a_ranks_exception_is_the_cause_with_its_remote_traceback(how: str) -> None:
    """Issue 31 item 4: spawn raised ProcessRaisedException with `__cause__` None for a
    rank's ValueError. Now torch's exception (message, error_index, error_pid) has the
    rank's own exception as its cause, which carries the child's traceback, as the Pool
    raises it."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException) as info:
            if how == "join":
                ctx = await aiomp.spawn(funcs.raise_on, 2, args=(1,), grace_period=5)
                await ctx.join()
            else:
                async with aiomp.spawn(funcs.raise_on, 2, args=(1,), grace_period=5) as ctx:
                    await anyio.sleep_forever()
    exc = info.value
    assert exc.error_index == 1 and exc.error_pid == exc.pid == ctx.pids()[1]
    assert "ValueError" in exc.msg  # torch's message: the child's traceback
    cause = exc.__cause__
    assert isinstance(cause, ValueError)
    assert "process 1:" in str(cause.__cause__) and "raise_on" in str(cause.__cause__)
    again = pickle.loads(pickle.dumps(exc))
    assert (again.error_index, again.error_pid) == (1, exc.pid)


def test_error_pid_is_torchs_name_for_pid() -> None:
    """Issue 31 item 4: the README promises torch's attributes: `error_pid` among them."""
    exc = aiomp.ProcessExitedException("process 2 terminated", 2, 1234, -9, "SIGKILL")
    assert exc.error_pid == exc.pid == 1234
    assert pickle.loads(pickle.dumps(exc)).error_pid == 1234
    assert aiomp.ProcessRaisedException("x", 0, os.getpid()).error_pid == os.getpid()
