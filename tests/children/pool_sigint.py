"""A service whose Pool worker ignores SIGTERM; tests/pool/test_lifecycle.py Ctrl-Cs it.

``python -m tests.children.pool_sigint asyncio|uvloop|trio``: prints ``ready <pid>`` (the
worker's) once the task runs, then waits to be interrupted.
"""

from __future__ import annotations

import sys

import aiomp
from tests.children import pool as funcs


async def main() -> None:
    async with aiomp.Pool(1, start_method="forkserver", grace_period=10) as pool:
        await pool.apply(funcs.deaf_and_report)


if __name__ == "__main__":
    loop = sys.argv[1]
    if loop == "trio":
        import trio

        trio.run(main)
    else:
        import asyncio

        factory = None
        if loop == "uvloop":
            import uvloop

            factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
