"""A worker kind without processes: each "worker" runs its tasks in a thread of this
process (a sync task in a worker thread, abandoned when the worker is killed), so the
engine, the calls and the scheduler are tested over the kind seam alone."""

from __future__ import annotations

import itertools
import signal
import traceback
from collections.abc import Callable
from typing import Any

import anyio

from aiomp._loop import running_asyncio_loop
from aiomp._loop.wakeup import Signal, Wakeup
from aiomp._pool.engine import Engine
from aiomp._pool.kinds import Call, Events, Handle, Options, WorkerKind
from aiomp._pool.pool import attach
from aiomp._pool.protocol import RemoteTraceback
from aiomp._pool.tasks import Task
from tests.children import contract as funcs

_pids = itertools.count(900_000)


class _Call:
    def __init__(self, fn: Callable[..., Any], flags: int, items: Any, kwds: Any) -> None:
        self.fn, self.flags, self.items, self.kwds = fn, flags, items, kwds

    def close(self) -> None:
        pass

    discard = close


class _Died(Exception):
    pass


def _run(call: _Call) -> Any:
    from aiomp._pool import protocol as P

    fn = call.fn
    if fn is funcs.die:
        raise _Died(call.items[0])
    if call.flags & P.F_APPLY:
        return fn(*call.items, **(call.kwds or {}))
    return [fn(*x) if call.flags & P.F_STAR else fn(x) for x in call.items]


class FakeHandle(Handle):
    in_order = False

    def __init__(self, slot: int, events: Events) -> None:
        self.slot = slot
        self._pid = next(_pids)
        self._events = events
        loop = running_asyncio_loop()
        self._more = Wakeup(loop)
        self._stop = Signal(loop)
        self._inbox: list[Task] = []
        self.exitcode: int | None = 0
        self.dead = anyio.Event()

    @property
    def name(self) -> str:
        return f"worker {self.slot} (pid {self._pid})"

    @property
    def pid(self) -> int:
        return self._pid

    def send(self, task: Task) -> bool:
        if self._stop.is_set():
            return False
        self._inbox.append(task)
        self._more.set()
        return True

    def unsend(self, task: Task) -> bool:
        if task in self._inbox:
            self._inbox.remove(task)
            return True
        return False

    def send_exit(self) -> None:
        self._stop.set()

    def cancel(self, tid: int) -> None:
        self.kill()

    def kill(self, now: bool = False) -> None:
        if not self._stop.is_set():
            self.exitcode = -signal.SIGKILL
        self._stop.set()

    async def watch_exit(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._events.on_exit(self, self.exitcode, [t.tid for t in self._inbox])
            self.dead.set()

    async def _serve(self) -> None:
        self._events.on_ready(self)
        while True:
            await self._more.wait()
            while self._inbox:
                task = self._inbox.pop(0)
                try:
                    value = await anyio.to_thread.run_sync(
                        _run, task.message, abandon_on_cancel=True
                    )
                except _Died as exc:
                    self.exitcode = int(exc.args[0])
                    self._stop.set()
                    return
                except Exception as exc:  # noqa: BLE001 - the task's outcome
                    exc.__cause__ = RemoteTraceback("".join(traceback.format_exception(exc)))
                    self._events.on_result(self, task.tid, False, exc)
                    continue
                self._events.on_result(self, task.tid, True, value)


class FakeKind(WorkerKind):
    chunks_per_slot = 4

    async def prepare(self, processes: int) -> int:
        return processes

    def start(self, slot: int, events: Events, options: Options) -> Handle:
        return FakeHandle(slot, events)

    def encode(self, call: Call) -> Any:
        _, fn, _, flags, items, kwds, _ = call
        return _Call(fn, flags, items, kwds)

    async def close(self, linger: bool) -> None:
        pass


def fake_pool(processes: int, grace_period: float) -> Any:
    """An ``aiomp.Pool`` whose workers are :class:`FakeHandle`\\ s."""
    import aiomp

    pool = aiomp.Pool.__new__(aiomp.Pool)
    attach(pool, Engine(FakeKind(), processes, 1, None, grace_period))
    return pool
