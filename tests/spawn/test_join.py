"""The join of a spawn's children: one waiter for every child's exit fd and report socket.

What the spawn's one fd set (``aiomp._loop.fdset.FdSet``) must keep:
an exit is seen whoever holds the report socket, a reported error acts before the failed
child's teardown ends, cancellation anywhere terminates and reaps and leaves no watch
behind, and a clean spawn-4 costs one waiting task, woken once. On asyncio, uvloop and
trio; every await on a child bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._sinks import wait_gone
from tests.children import common as funcs
from tests.children import spawn as funcs_fork

TIMEOUT = 20
GRACE = 0.5
METHODS = ["spawn", "forkserver", "fork"]

pytestmark = pytest.mark.filterwarnings("ignore:start_method='fork' with:RuntimeWarning")


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_exit_is_seen_while_a_grandchild_holds_the_report_socket(
    start_method: str, gate: Gate
) -> None:
    """The child exits without a report while its grandchild keeps the report socket open
    (no EOF ever comes on it): its exit alone must end the wait."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessExitedException) as info:
            async with aiomp.spawn(
                funcs_fork.exit_leaving_a_grandchild,
                1,
                args=(gate.address,),
                start_method=start_method,
                grace_period=GRACE,
            ):
                pass
        assert info.value.exit_code == 3
        grandchild = (await gate.ready(1))[100]
        os.kill(grandchild, 0)  # still there (ProcessLookupError if not), holding the socket
        gate.release(100)
        await wait_gone(grandchild)


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", METHODS)
async def test_a_reported_error_acts_before_the_childs_teardown_ends(
    start_method: str, gate: Gate
) -> None:
    """Rank 0 reports its error and then never finishes exiting (a non-daemon thread
    blocks its teardown) while rank 1 runs: the error must end the block, rank 1 be
    terminated, and rank 0, which is exiting on its own, be SIGKILLed once the grace
    period has passed (issue 31 item 3: a failing rank gets no SIGTERM)."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessRaisedException, match="rank 0 failed") as info:
            async with aiomp.spawn(
                funcs_fork.raise_then_hang_in_teardown,
                2,
                args=(gate.address,),
                start_method=start_method,
                grace_period=GRACE,
            ) as ctx:
                await anyio.sleep_forever()
    assert info.value.error_index == 0
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGKILL, -signal.SIGTERM]


@pytest.mark.anyio
async def test_terminate_from_the_body_while_the_block_watches(gate: Gate) -> None:
    """terminate() in the body shares the block's watches: it reaps every child, and
    leaving raises what the first one died of."""
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(aiomp.ProcessExitedException) as info:
            async with aiomp.spawn(
                funcs.ready_then_block, 2, args=(gate.address,), grace_period=GRACE
            ) as ctx:
                await gate.ready(2)
                await ctx.terminate()
    assert info.value.signal_name == "SIGTERM"
    assert [p.exitcode for p in ctx.processes] == [-signal.SIGTERM] * 2
    assert not ctx._exits.watching  # no watch left on the loop


class _Count:
    """Counts, while installed, the asyncio tasks created, or on trio the steps of the
    current task and the tasks below it (system tasks apart: fd watches, output readers)."""

    def __init__(self) -> None:
        self.tasks = 0
        self.steps = 0
        self._undo: Any = None

    def __enter__(self) -> _Count:
        loop = aiomp_loop()
        if loop is None:
            import trio

            me = trio.lowlevel.current_task()
            counter = self

            def below_me(task: Any) -> bool:
                while task is not None:
                    if task is me:
                        return True
                    nursery = task.parent_nursery
                    task = None if nursery is None else nursery.parent_task
                return False

            class Steps(trio.abc.Instrument):  # type: ignore[misc]
                def before_task_step(self, task: trio.lowlevel.Task) -> None:
                    if below_me(task):
                        counter.steps += 1

            steps = Steps()
            trio.lowlevel.add_instrument(steps)
            self._undo = lambda: trio.lowlevel.remove_instrument(steps)
            return self
        before = loop.get_task_factory()

        def factory(loop: Any, coro: Any, **kw: Any) -> Any:
            self.tasks += 1
            return asyncio.Task(coro, loop=loop, **kw)

        loop.set_task_factory(factory)
        self._undo = lambda: loop.set_task_factory(before)
        return self

    def __exit__(self, *exc: object) -> None:
        self._undo()


def aiomp_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@pytest.mark.anyio
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
async def test_a_clean_spawn_of_four_wakes_one_waiting_task_once(start_method: str) -> None:
    """Regression (issue 17): a spawn-4's join ran a supervisor, a watcher and a message
    task per child and five task groups (29 loop iterations, 1.7 ms of parent CPU against
    multiprocessing's 0.2 ms). Now: one supervisor task, woken once, whatever the timing."""
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 4, start_method=start_method):
            pass  # the fork server is up, the imports are done
        with _Count() as count:
            async with aiomp.spawn(funcs.echo, 4, start_method=start_method) as ctx:
                pass
    if aiomp_loop() is None:
        # trio: this task's two steps (enter; woken once the children are gone) and the
        # supervisor's two (start; woken once); the fd watches are system tasks
        assert count.steps <= 4, count.steps
    else:
        assert count.tasks == 1  # the supervisor
    assert ctx._exits.wakeups == 1


@pytest.mark.anyio
async def test_a_large_payload_and_result_fit_the_report_sockets_default_buffers() -> None:
    """The report socket keeps the kernel's default buffers (no 4 MiB request per
    child): a body over 64 KiB rides in a memfd, each way."""
    big = b"x" * (3 << 20)
    with anyio.fail_after(TIMEOUT):
        async with aiomp.spawn(funcs.echo, 2, args=(big,), grace_period=GRACE) as ctx:
            pass
    assert ctx.results == [(0, (big,)), (1, (big,))]
