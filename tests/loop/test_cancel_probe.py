"""``aiomp._loop.cancel`` reads asyncio's and anyio's private records: these tests fail
loudly when either library moves them (the Pool would fall back to the slower public
calls, with a warning)."""

from __future__ import annotations

import asyncio

import anyio

from aiomp._loop import cancel


def test_the_private_readers_resolve() -> None:
    """Raises LookupError (failing here) if asyncio or anyio changed what is read."""
    cancel.private_current_task()
    cancel.private_scope_cancelled()


def test_the_readers_answer_as_the_public_calls() -> None:
    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        current = cancel.private_current_task()
        cancelled = cancel.private_scope_cancelled()
        task = current(loop)
        assert task is asyncio.current_task()
        seen = [cancelled(task, loop)]
        with anyio.CancelScope() as scope:  # noqa: ASYNC100 - read, never awaited
            seen.append(cancelled(task, loop))
            scope.cancel()
            seen.append(cancelled(task, loop))
        with anyio.CancelScope(deadline=loop.time() - 1):  # noqa: ASYNC100 - read only
            with anyio.CancelScope(shield=True):  # noqa: ASYNC100 - read only
                seen.append(cancelled(task, loop))
            seen.append(cancelled(task, loop))
        return seen

    assert asyncio.run(main()) == [False, False, True, False, True]
