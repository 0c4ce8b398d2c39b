"""Spawning: the child's own life: fork with threads running, signal handlers not
inherited, exit functions and non-daemon threads at exit, exit hooks, pid liveness.

How children are met and bounded: see ``tests/spawn/test_results.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._procs import gone
from tests.children import common as funcs
from tests.children import spawn as funcs_context
from tests.spawn._spawns import GRACE, METHODS, TIMEOUT, exitcodes

# trio keeps idle worker threads for a while (forkserver starts off the loop, in one), so
# a later fork test may see a thread and warn (R14); test_fork_with_threads_running_warns
# checks the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


# -- fork safety (R14) ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["async with", "await"])
# Python 3.12+ adds its own warning to os.fork in a process with threads; aiomp's, the one
# checked here, says what to do instead.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_fork_with_threads_running_warns(how: str) -> None:
    async def fork() -> aiomp.ProcessContext:
        if how == "await":
            ctx = await aiomp.spawn(funcs.echo, 1, start_method="fork", grace_period=GRACE)
            await ctx.join()
        else:
            async with aiomp.spawn(funcs.echo, 1, start_method="fork", grace_period=GRACE) as ctx:
                pass
        return ctx

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="aiomp-test-waiter")
    thread.start()
    try:
        with anyio.fail_after(TIMEOUT):
            with pytest.warns(RuntimeWarning, match="thread") as record:
                ctx = await fork()
    finally:
        stop.set()
        thread.join()
    assert ctx.results == [(0, ())]
    mine = [w for w in record if "aiomp-test-waiter" in str(w.message)]
    assert mine
    # Regression: for `await spawn(...)` the warning pointed into anyio's runner.
    assert all(w.filename == __file__ for w in mine), [w.filename for w in mine]


# -- regressions from review ---------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_while_leaving_the_block_terminates_children(gate: Gate) -> None:
    """Regression: a cancellation that arrived while `async with` waited for its children
    (the body had finished) left them running. Also: no fd is left watched on the loop."""
    with anyio.fail_after(TIMEOUT):
        with anyio.CancelScope() as scope:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)

                async def cancel_soon() -> None:
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()

                async with anyio.create_task_group() as tg:  # the body ends; the exit waits
                    tg.start_soon(cancel_soon)
    assert scope.cancelled_caught
    assert exitcodes(ctx) == [-signal.SIGTERM, -signal.SIGTERM]
    assert all(gone(pid) for pid in ctx.pids())
    assert not ctx._exits.watching  # the fd set dropped its watch on the loop


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_fork_child_does_not_inherit_the_loops_sigterm_handler(gate: Gate) -> None:
    """Regression: under fork a child kept the parent loop's SIGTERM handler and wakeup
    fd, so it ignored SIGTERM (every terminate waited out the grace period) and woke the
    parent's handler instead."""
    import asyncio

    calls: list[int] = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, calls.append, 1)
    try:
        with anyio.fail_after(TIMEOUT):
            ctx = await aiomp.spawn(
                funcs.ready_then_block,
                1,
                args=(gate.address,),
                start_method="fork",
                grace_period=10,
            )
            await gate.ready(1)
            await ctx.terminate()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    assert exitcodes(ctx) == [-signal.SIGTERM]  # died of SIGTERM, not SIGKILL after 10 s
    assert calls == []


# -- start-up cost (issue 17): what a spawn child's exit still does ----------------------


@pytest.mark.anyio
async def test_a_spawn_child_exits_without_teardown_but_runs_its_exit_functions(
    tmp_path: Path,
) -> None:
    """Pins the start-up fix for ``spawn(f, 4)`` taking 1.14-1.20x four multiprocessing
    processes: a spawn child no longer tears its interpreter down after its report (a
    global's finaliser does not run, as in a fork child), yet its ``atexit`` functions
    run and what it wrote last reaches the parent."""
    lines: list[tuple[int, str, str]] = []
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.exit_traces,
            2,
            args=(str(tmp_path),),
            output=lambda rank, stream, line: lines.append((rank, stream, line)),
        ) as ctx:
            pass
    assert ctx.results == ["done", "done"]
    assert exitcodes(ctx) == [0, 0]
    made = sorted(os.listdir(tmp_path))
    assert made == ["atexit-0", "atexit-1"]  # no "teardown-N": no interpreter teardown
    assert sorted(line for _, _, line in lines) == ["last words of 0", "last words of 1"]


@pytest.mark.anyio
@pytest.mark.parametrize("method", METHODS)
async def test_a_childs_exit_waits_for_its_non_daemon_threads(tmp_path: Path, method: str) -> None:
    """A child whose function returns while a non-daemon thread works exits once the
    thread is done, as a normal exit does (the fast exit steps aside)."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.thread_outlives_fn, 1, args=(str(tmp_path),), start_method=method
        ) as ctx:
            pass
    assert exitcodes(ctx) == [0]
    assert os.listdir(tmp_path) == ["thread-0"]


@pytest.mark.anyio
async def test_failed_exit_hooks_run_once_per_abnormal_exit() -> None:
    """``_shm`` sweeps a failed child's names through this hook; the process layer runs
    it without knowing ``_shm`` (see docs/decisions/0016-process-hooks.md)."""
    from aiomp import _lifecycle

    calls: list[None] = []

    def hook() -> None:
        calls.append(None)

    _lifecycle.on_failed_exit(hook)
    try:
        with anyio.fail_after(TIMEOUT):
            ctx = await aiomp.spawn(funcs.sys_exit, 1, args=(3,))
            with pytest.raises(aiomp.ProcessExitedException):
                await ctx.join()
            with pytest.raises(aiomp.ProcessExitedException):
                await ctx.join()  # the same failure again; the hook does not run again
    finally:
        _lifecycle._failed_exits.remove(hook)
    assert exitcodes(ctx) == [3]
    assert len(calls) == 1


def test_pid_alive_counts_a_zombie_and_a_reaped_pid_as_dead() -> None:
    """The one "is this pid alive" of children (their parent check) and of ``_shm``'s
    janitor (a segment's creator)."""
    from aiomp._lifecycle import pid_alive, start_time

    me = os.getpid()
    assert pid_alive(me) and pid_alive(me, start_time(me) or 0)
    assert not pid_alive(me, (start_time(me) or 0) + 1)  # a reused pid is another process
    assert not pid_alive(0)
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {})], ids=["trio"])
@pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")
async def test_a_child_forked_from_trio_runs_asyncio_as_asyncio() -> None:
    # Found while fixing issue 25 item 6: the fork kept sniffio's mark that trio runs the
    # thread, so anyio in the child's own asyncio loop took it for trio and failed.
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(
            funcs_context.async_library, 1, start_method="fork", grace_period=GRACE
        ) as ctx:
            pass
    assert ctx.results == ["asyncio"]


def test_start_processes_in_torchs_positional_order_is_refused_clearly() -> None:
    """issue 42: aiomp.start_processes has spawn's signature, not torch's positional
    ``(fn, args, nprocs, ...)``: a tuple where nprocs goes says so."""

    async def start() -> None:
        await aiomp.start_processes(funcs.echo, ("x",))  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="args= as a keyword"):
        anyio.run(start)
