"""A pool worker's async mode: its tasks served from an asyncio event loop.

A worker (:mod:`aiomp._pool.worker_main`) switches to this mode for good with the first
task whose function is a coroutine function: each task then becomes an asyncio task, the
channel is read by a loop reader callback, and ``CANCEL`` cancels one task. Sync tasks run
on the loop thread one at a time, in the order they came (``Server.sync_turn``).

Standard library and aiomp's small modules only: this module is imported by every worker.
"""

from __future__ import annotations

import types

from .._wire import datagram as _transport
from . import protocol as P

# Not `from typing import TYPE_CHECKING`: workers must not pay for importing typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .worker_main import Server


async def serve_async(
    server: Server, first: tuple[int, int, bytes | memoryview, list[int]]
) -> None:
    """Serve ``server``'s tasks from this event loop, ``first`` first, until EXIT or end of
    stream; then cancel the tasks still running."""
    import asyncio

    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    tasks: dict[int, asyncio.Task[None]] = {}
    # Sync tasks one at a time, in the order they came (see the module docstring):
    # each task's first step, in creation order, queues it on this FIFO lock.
    server.sync_turn = asyncio.Lock()

    def finish() -> None:
        if not finished.done():
            finished.set_result(None)

    def handle(tid: int, op: int, flags: int, payload: bytes | memoryview, fds: list[int]) -> None:
        if op == P.OP_TASK:
            task = loop.create_task(run_async(server, tid, flags, payload, fds))
            tasks[tid] = task

            def forget(_: object) -> None:
                tasks.pop(tid, None)

            task.add_done_callback(forget)
            return
        if op == P.OP_DEF:
            server.define(tid, payload, fds)
            return
        _transport.close_fds(fds)
        if op == P.OP_CANCEL:
            running = tasks.get(tid)
            if running is not None:
                running.cancel()
        elif op == P.OP_EXIT:
            finish()

    def readable() -> None:
        try:
            while (got := chan.try_recv()) is not None:
                op, tid, flags, payload, fds = P.unpack(*got)
                handle(tid, op, flags, payload, fds)
        except _transport.Closed:
            finish()
        except Exception as exc:  # noqa: BLE001 - a message was lost: die, as sync mode does
            loop.remove_reader(fd)
            if not finished.done():
                finished.set_exception(exc)

    chan = server.tasks
    tid, flags, payload, fds = first
    handle(tid, P.OP_TASK, flags, payload, fds)
    while server.pending:  # read ahead in sync mode (the pool sends none: a guard)
        op, tid, flags, payload, fds = server.pending.popleft()
        handle(tid, op, flags, payload, fds)
    fd = chan.fileno()
    loop.add_reader(fd, readable)
    try:
        readable()
        await finished
    finally:
        loop.remove_reader(fd)
    # EXIT comes only when we hold no task; end of stream means the parent has gone.
    for task in list(tasks.values()):
        task.cancel()


async def run_async(
    server: Server, tid: int, flags: int, payload: bytes | memoryview, fds: list[int]
) -> None:
    try:
        if flags & P.F_ASYNC:
            await _run_async(server, tid, flags, payload, fds)
        else:
            async with server.sync_turn:
                await _run_async(server, tid, flags, payload, fds)
    except _transport.Closed:
        pass  # the parent has gone; serve_async is ending too


async def _run_async(
    server: Server, tid: int, flags: int, payload: bytes | memoryview, fds: list[int]
) -> None:
    msg = server.load(tid, flags, payload, fds)
    if msg is None:
        return
    fn, items, kwds = msg
    try:
        if flags & P.F_APPLY:
            result = fn(*items, **kwds) if kwds else fn(*items)
            if isinstance(result, types.CoroutineType):
                result = await result
        else:
            result = []
            star = flags & P.F_STAR
            for x in items:
                r = fn(*x) if star else fn(x)
                if isinstance(r, types.CoroutineType):
                    r = await r
                result.append(r)
    except BaseException as exc:  # noqa: BLE001 - CancelledError (the parent asked) too
        del msg, fn, items, kwds
        if server.guard is not None:
            server.check_memory(tid)
        server.send_error(tid, exc)
        return
    del msg, items, kwds
    if server.guard is not None:
        server.check_memory(tid)
    server.reply(tid, fn, result)


async def boxed(coro: Any) -> tuple[bool, Any]:
    """``(True, what coro returns)``, or ``(False, the SystemExit or KeyboardInterrupt it
    raised)``: those two never leave an asyncio task (see :meth:`Server.run_coro`)."""
    try:
        return True, await coro
    except (KeyboardInterrupt, SystemExit) as exc:
        return False, exc
