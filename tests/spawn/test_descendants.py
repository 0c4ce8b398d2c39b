"""Issue 25 item 5: the processes a child starts end with it.

A Pool task or a spawned function starts a ``sleep 1000`` (``subprocess``) and an
``os.fork`` child and says their pids; then the child ends by every path that ends one
(``timeout=``, a cancelled task, a failed sibling, a normal close, the function
returning, the parent's SIGKILL). Before the fix all of them outlived it (re-parented to
init). The test holds a pidfd of each from the moment it is reported, so that a reused
pid cannot pass for one, and waits for them to exit with a bound; survivors are killed.
The keeper that makes this so is tested in ``tests/spawn/test_keeper.py``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

import aiomp
import aiomp._process.groups
from tests._gate import Gate
from tests._run import REPO
from tests.children import groups as funcs
from tests.spawn._descendants import (
    GONE_WITHIN,
    GRACE,
    METHODS,
    TIMEOUT,
    all_exit,
    watching,
    watching_later,
)


def all_exit_sync(fds: list[int]) -> bool:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    exited: set[int] = set()
    deadline = time.monotonic() + GONE_WITHIN
    while len(exited) < len(fds) and time.monotonic() < deadline:
        exited.update(fd for fd, _ in poller.poll(50))
    return len(exited) == len(fds)


# -- the Pool ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
# An idle thread of trio's cache, left by an earlier test on this xdist worker, makes
# fork warn; what this test pins is the descendants' end, not the warning.
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_a_pool_closed_normally_takes_its_workers_descendants(start_method: str) -> None:
    """A task that leaves processes running: the worker retired at close takes them."""
    with anyio.fail_after(TIMEOUT):
        with watching_later() as watch:
            async with aiomp.Pool(1, start_method=start_method, grace_period=GRACE) as pool:
                fds = watch(await pool.apply(funcs.descendants))
            await all_exit(fds)


@pytest.mark.anyio
async def test_a_timed_out_task_takes_its_descendants(gate: Gate) -> None:
    """``timeout=`` kills the worker, and with it what the task started."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.Pool(1, start_method="forkserver", grace_period=GRACE) as pool:
            await pool.apply(pow, (2, 3))  # the worker is up: the timeout counts the task
            async with anyio.create_task_group() as tg:

                async def timed_out() -> None:
                    with pytest.raises(TimeoutError):
                        await pool.apply(funcs.descendants_then_block, (0, gate.address), timeout=2)

                tg.start_soon(timed_out)
                pids = await gate.ready(2)
                with watching(pids.values()) as fds:
                    await all_exit(fds)


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_a_cancelled_task_takes_its_descendants(start_method: str, gate: Gate) -> None:
    """Cancelling a running sync task kills its worker, and what the task started."""
    with anyio.fail_after(TIMEOUT), watching_later() as watch:
        async with aiomp.Pool(1, start_method=start_method, grace_period=GRACE) as pool:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pool.apply, funcs.descendants_then_block, (0, gate.address))
                    fds = watch((await gate.ready(2)).values())
                    scope.cancel()
            await all_exit(fds)  # (outside the cancelled scope: it would not wait)


@pytest.mark.anyio
async def test_descendants_go_where_groups_are_signalled_by_number(
    gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels before 6.9 cannot signal a group through a pidfd: the parent signals it by
    number while it holds the worker unreaped, on the kill and at the exit before the
    reap. A cancelled task's worker, then a normal close."""
    monkeypatch.setattr(aiomp._process.groups, "pidfd_groups", False)
    with anyio.fail_after(TIMEOUT), watching_later() as watch:
        async with aiomp.Pool(1, start_method="fork", grace_period=GRACE) as pool:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pool.apply, funcs.descendants_then_block, (0, gate.address))
                    fds = watch((await gate.ready(2)).values())
                    scope.cancel()
            await all_exit(fds)  # (outside the cancelled scope: it would not wait)
            fds = watch(await pool.apply(funcs.descendants))
        await all_exit(fds)


# -- spawn ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_a_failed_sibling_takes_the_others_descendants(start_method: str, gate: Gate) -> None:
    """Rank 1 fails: rank 0 is terminated, and what it started goes with it."""
    with anyio.fail_after(TIMEOUT):
        ctx = await aiomp.spawn(
            funcs.descendants_or_fail,
            2,
            args=(gate.address,),
            start_method=start_method,
            grace_period=GRACE,
        )
        pids = await gate.ready(3)  # rank 0's two descendants, rank 1 (key 11)
        with watching([pids[0], pids[1]]) as fds:
            gate.release(11)
            with pytest.raises(aiomp.ProcessRaisedException, match="rank 1 failed"):
                await ctx.join()
            await all_exit(fds)


@pytest.mark.anyio
async def test_a_function_that_returns_takes_its_descendants(gate: Gate) -> None:
    """A spawned function that returns, leaving processes running: they end as it exits."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs.descendants_then_return,
            1,
            args=(gate.address,),
            start_method="forkserver",
            grace_period=GRACE,
        ) as ctx:
            pids = await gate.ready(3)
            with watching([pids[0], pids[1]]) as fds:
                gate.release(10)
                assert await ctx.join()
                await all_exit(fds)


# -- the parent's death -----------------------------------------------------------------

_PARENT = textwrap.dedent("""
    import sys

    import anyio

    import aiomp
    from tests.children import groups as funcs

    async def main():
        address, method = "\\0" + sys.argv[1], sys.argv[2]
        async with aiomp.Pool(1, start_method=method) as pool:
            funcs.report(address, 1, await pool.apply(funcs.descendants))
            async with aiomp.spawn(funcs.descendants_then_block, 1, args=(address,),
                                   start_method=method):
                await anyio.sleep_forever()

    if __name__ == "__main__":
        anyio.run(main)
""")


@pytest.mark.parametrize(
    ("start_method", "target"),
    [("spawn", "parent"), ("forkserver", "parent"), ("fork", "parent"), ("spawn", "group")],
)
def test_the_parents_sigkill_takes_the_descendants(start_method: str, target: str) -> None:
    """The parent is SIGKILLed (alone, or with its whole process group, as ``kill -9 -PGID``
    does): its children die by their parent-death signal, and its keeper (out of the
    parent's group and session: no terminal here) takes the descendants."""
    _sigkill_parent(_PARENT, start_method, reports=4, whole_group=target == "group")


def _sigkill_parent(program: str, arg: str, reports: int, whole_group: bool = False) -> None:
    """Run ``program`` (the gate's address and ``arg`` its arguments) in a group of its
    own; once its descendants have reported, SIGKILL it (or its whole group): they must
    all exit."""
    gate = Gate()
    parent = subprocess.Popen(
        [sys.executable, "-c", program, gate.address[1:], arg],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, to SIGKILL whole
    )
    try:
        pids = gate.ready_sync(reports, timeout=TIMEOUT)
        with watching(pids.values()) as fds:
            if whole_group:
                os.killpg(parent.pid, signal.SIGKILL)
            else:
                parent.kill()
            parent.communicate(timeout=TIMEOUT)
            assert all_exit_sync(fds), "descendants outlived their parent's SIGKILL"
    finally:
        gate.close()
        if parent.poll() is None:
            parent.kill()
            parent.communicate()


_RUN_SYNC_PARENT = textwrap.dedent("""
    import sys

    import anyio

    import aiomp
    from tests.children import groups as funcs

    async def main():
        await aiomp.run_sync(funcs.descendants_then_block, 1, "\\0" + sys.argv[1])

    if __name__ == "__main__":
        anyio.run(main, backend=sys.argv[2])
""")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_parents_sigkill_takes_the_descendants_of_run_syncs_first_call(
    backend: str,
) -> None:
    """``run_sync``'s first worker starts before the keeper does (decision 0048): the
    keeper is up before that worker runs anything of the caller's, so the descendants
    its first call starts die with the parent all the same."""
    _sigkill_parent(_RUN_SYNC_PARENT, backend, reports=2)


_SPAWN_WHILE_DEFERRED = textwrap.dedent("""
    import os
    import select
    import sys

    import anyio
    import anyio.lowlevel

    import aiomp
    from tests.children import groups as funcs

    if __name__ == "__mp_main__":
        # The default pool's first worker: never ready while the test looks, and gone
        # with us (it has no parent-death signal yet): it waits for our exit.
        select.select([os.pidfd_open(os.getppid())], [], [])
        raise SystemExit

    async def main():
        address = "\\0" + sys.argv[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(aiomp.run_sync, sum, [1, 2])  # its keeper waits for its worker
            await anyio.lowlevel.checkpoint()  # (that task launches its worker)
            async with aiomp.spawn(funcs.descendants_then_block, 1, args=(address,),
                                   start_method="fork"):
                await anyio.sleep_forever()

    if __name__ == "__main__":
        anyio.run(main, backend=sys.argv[2])
""")


def test_a_child_started_while_the_keeper_waits_for_run_syncs_worker_starts_it() -> None:
    """Review of decision 0048: the keeper deferred for ``run_sync``'s first worker is
    started by any other launch (here ``aiomp.spawn``, while that worker is still
    booting), so that child's descendants die with the parent too."""
    _sigkill_parent(_SPAWN_WHILE_DEFERRED, "asyncio", reports=2)
