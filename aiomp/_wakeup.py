"""Wake-ups that loop callbacks may set.

The Pool completes tasks from an asyncio reader callback (``loop.add_reader``), where no
task runs, so nothing reached from a callback may create an anyio object or call anyio
(see *Nothing anyio in loop callbacks* in docs/architecture.md). These wake-ups obey it:
``set()`` touches only a future (asyncio) or an event made earlier (trio); the waiting
side, always a task, makes what it waits on.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio


def running_asyncio_loop() -> Any:
    """The running asyncio loop, or None on another library (trio)."""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Signal:
    """A one-shot flag that one task at a time waits for.

    On asyncio (uvloop included) it is a bare future: the cheapest wake-up there is, which
    matters on the ``apply`` round trip. On trio it is an ``anyio.Event`` made by the
    waiter. A cancelled wait leaves the signal as it was.
    """

    __slots__ = ("_loop", "_set", "_waiter")

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._waiter: Any = None
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            waiter = self._waiter
            if waiter is not None:
                if self._loop is None:
                    waiter.set()
                elif not waiter.done():
                    waiter.set_result(None)

    async def wait(self) -> None:
        if self._set:
            return
        if self._loop is None:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()
            return
        waiter = self._waiter
        if waiter is None or waiter.done():  # done: a cancelled earlier wait
            waiter = self._waiter = self._loop.create_future()
        await waiter


class Wakeup:
    """A flag a task sleeps on and clears when it wakes: "there is work for you"."""

    __slots__ = ("_signal",)

    def __init__(self, loop: Any) -> None:
        self._signal = Signal(loop)

    def set(self) -> None:
        self._signal.set()

    async def wait(self) -> None:
        """Wait until set, then clear."""
        signal = self._signal
        await signal.wait()
        self._signal = Signal(signal._loop)
