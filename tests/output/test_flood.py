"""A child that writes faster than the parent forwards (issue 25 item 1): the parent's
loop reads a bounded amount per turn, so other tasks and timeouts run in between, and
nothing is lost (see docs/decisions/0020-output-forwarding.md). On asyncio, uvloop and
trio, through ``spawn`` and ``Pool``."""

from __future__ import annotations

import time

import anyio
import pytest

import aiomp
from tests._sinks import Stalls
from tests.children import output as funcs

TIMEOUT = 60
GRACE = 0.5
#: How long the child floods. Before the fix the loop froze for all of it and more
#: (24 MiB of short lines froze it 2.3-3.9 s), so a stall bound well below it tells.
FLOOD_SECONDS = 2.0
#: The worst stall allowed: one turn reads 64 KiB (a few ms of work), so this leaves
#: room for a loaded machine and still fails the old drain, which stalled for the flood.
MAX_STALL = 0.5


class Count:
    """A line callback that counts the lines of ``flood`` and keeps the last."""

    def __init__(self) -> None:
        self.lines = 0
        self.last = ""

    def __call__(self, rank: int, stream: str, line: str) -> None:
        self.lines += 1
        self.last = line


@pytest.mark.anyio
async def test_a_flooding_child_neither_stalls_the_loop_nor_loses_a_line() -> None:
    """Regression (issue 25 item 1): the reader drained the socket until EAGAIN in one
    callback, which a child writing faster than the parent forwards never lets happen:
    the loop froze for as long as the child wrote (and a timeout could not fire)."""
    count, stalls = Count(), Stalls()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stalls.watch)
            async with aiomp.spawn(
                funcs.flood, 1, args=(FLOOD_SECONDS,), output=count, grace_period=GRACE
            ) as ctx:
                pass
            tg.cancel_scope.cancel()
    assert count.lines == ctx.results[0]
    assert count.last == "flood line 04095"
    assert stalls.worst < MAX_STALL, f"the loop stalled for {stalls.worst:.2f} s"


@pytest.mark.anyio
async def test_a_flooding_worker_neither_stalls_the_loop_nor_loses_a_line() -> None:
    """Issue 25 item 1, through a Pool worker's forwarder."""
    count, stalls = Count(), Stalls()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stalls.watch)
            async with aiomp.Pool(1, output=count, grace_period=GRACE) as pool:
                written = await pool.apply(funcs.flood, (0, FLOOD_SECONDS))
            tg.cancel_scope.cancel()
    assert count.lines == written
    assert stalls.worst < MAX_STALL, f"the loop stalled for {stalls.worst:.2f} s"


@pytest.mark.anyio
async def test_a_timeout_fires_while_a_child_writes_without_end() -> None:
    """Regression (issue 25 item 1): with a child writing for ever, ``fail_after(3)``
    never fired; the loop was inside the reader's drain. Here the child stops after 40 s,
    so that the old code fails instead of hanging."""
    count = Count()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(1):
            async with aiomp.spawn(funcs.flood, 1, args=(40,), output=count, grace_period=GRACE):
                await anyio.sleep_forever()
    # the timeout, the child's termination, and what it had written by then forwarded
    assert time.monotonic() - start < 10
    assert count.lines > 0
