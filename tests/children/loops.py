"""Functions that children of tests/spawn/test_child_path.py run: an async echo on a chosen
loop.

Module level so that spawn children import them by name.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def _echo(qin: Any, qout: Any) -> int:
    """Echo items until the queue is closed and drained; how many were echoed."""
    n = 0
    async for item in qin:
        await qout.put(item)
        n += 1
    return n


def echo_on(rank: int, qin: Any, qout: Any, loop: str) -> int:
    """Run :func:`_echo` on ``loop``: ``default`` (what aiomp gives an async child: uvloop
    when installed), ``asyncio`` (asyncio's own loop) or ``trio``."""
    if loop == "trio":
        import trio

        return trio.run(_echo, qin, qout)
    if loop == "asyncio":
        with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
            return runner.run(_echo(qin, qout))
    from aiomp._child.runner import new_runner

    with new_runner() as runner:
        return runner.run(_echo(qin, qout))
