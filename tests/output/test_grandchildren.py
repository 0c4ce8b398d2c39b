"""Output written by a child's own children (subprocesses, C programs it runs): they hold
copies of its stdout and stderr, so the forwarder reads until end-of-file, not until the
child exits, and when the context or pool closes it waits a bounded time, then reads once
more, counts what is left and detaches (issue 25 items 3 and 4; see
docs/decisions/0020-output-forwarding.md). On asyncio, uvloop and trio, through ``spawn``
and ``Pool``.

Every grandchild started here is killed (if still there) and waited for by the test.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

import aiomp
from tests._gate import Gate
from tests._sinks import Lines, wait_gone
from tests.children import output as funcs

TIMEOUT = 30
GRACE = 0.5


@asynccontextmanager
async def grandchild_at(gate: Gate) -> AsyncIterator[list[int]]:
    """Yields a list for the grandchild's pid, once known; on the way out the grandchild
    is SIGKILLed if it is still there, and waited for."""
    pid: list[int] = []
    try:
        yield pid
    finally:
        with anyio.CancelScope(shield=True), anyio.fail_after(TIMEOUT):
            for p in pid:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await wait_gone(p)


GRANDCHILD_LINES = [f"grandchild {i}" for i in range(20)]


@pytest.mark.anyio
async def test_a_grandchilds_output_after_the_child_exited_arrives(gate: Gate) -> None:
    """Regression (issue 25 item 3): the forwarder closed its read ends when the child
    was reaped, while a grandchild still held the write ends: 0 of its 20 lines arrived
    and it got EPIPE."""
    lines = Lines()
    async with grandchild_at(gate) as grandchild:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.spawn(
                funcs.leave_a_grandchild_writing,
                1,
                args=(gate.address, len(GRANDCHILD_LINES)),
                output=lines,
                grace_period=GRACE,
            ) as ctx:
                grandchild.append((await gate.ready(1))[100])
                assert await ctx.join()  # the child has exited, and aiomp has seen it go
                gate.release(100)
                await wait_gone(grandchild[0])
    assert lines.of(0, "stdout") == GRANDCHILD_LINES


@pytest.mark.anyio
async def test_a_grandchilds_output_after_its_worker_died_arrives(gate: Gate) -> None:
    """Issue 25 item 3, for a Pool worker: the task starts a grandchild and its worker
    exits; the grandchild's lines, written after, arrive all the same."""
    lines = Lines()
    async with grandchild_at(gate) as grandchild:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, output=lines, grace_period=GRACE) as pool:
                with pytest.raises(aiomp.BrokenWorkerError):
                    await pool.apply(
                        funcs.leave_a_grandchild_writing_and_die,
                        (gate.address, len(GRANDCHILD_LINES)),
                    )
                grandchild.append((await gate.ready(1))[100])
                gate.release(100)
                await wait_gone(grandchild[0])
    assert lines.of(0, "stdout") == GRANDCHILD_LINES


class Count:
    def __init__(self) -> None:
        self.lines = 0

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.lines += 1


def unread_reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not forwarded" in r.getMessage()]


@pytest.mark.anyio
async def test_leaving_spawn_is_not_held_by_a_grandchild_writing_for_ever(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 25 item 4): the child left ``yes`` running on its stdout, and
    leaving ``async with spawn`` hung for ever: closing the forwarder drained until
    EAGAIN, which ``yes`` never lets happen. Now it waits a bounded time, reads once
    more, logs what it left unread and detaches (``yes`` then dies of SIGPIPE)."""
    caplog.set_level(logging.WARNING, logger="aiomp")
    count = Count()
    async with grandchild_at(gate) as yes:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.spawn(
                funcs.leave_yes_running, 1, args=(gate.address,), output=count, grace_period=GRACE
            ):
                yes.append((await gate.ready(1))[100])
    assert count.lines > 0
    assert unread_reports(caplog), caplog.text


@pytest.mark.anyio
async def test_closing_a_pool_is_not_held_by_a_grandchild_writing_for_ever(
    gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 25 item 4, for a Pool: a task leaves ``yes`` running on its worker's stdout."""
    caplog.set_level(logging.WARNING, logger="aiomp")
    count = Count()
    async with grandchild_at(gate) as yes:
        with anyio.fail_after(TIMEOUT):
            async with aiomp.Pool(1, output=count, grace_period=GRACE) as pool:
                await pool.apply(funcs.leave_yes_running, (0, gate.address))
                yes.append((await gate.ready(1))[100])
    assert count.lines > 0
    assert unread_reports(caplog), caplog.text
