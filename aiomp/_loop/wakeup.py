"""Wake-ups that loop callbacks may set.

The Pool completes tasks from an asyncio reader callback (``loop.add_reader``), where no
task runs, so nothing reached from a callback may create an anyio object or call anyio
(see *Nothing anyio in loop callbacks* in docs/architecture.md). These wake-ups obey it:
``set()`` touches only a future (asyncio) or an event made earlier (trio); the waiting
side, always a task, makes what it waits on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    import asyncio


class Signal:
    """A one-shot flag that one task at a time waits for.

    On asyncio (uvloop included) it is a bare future: the cheapest wake-up there is, which
    matters on the ``apply`` round trip. On trio it is an ``anyio.Event`` made by the
    waiter. A cancelled wait leaves the signal as it was.
    """

    __slots__ = ("_event", "_future", "_loop", "_set")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None  # asyncio: the waiter's
        self._event: anyio.Event | None = None  # trio: made by the waiter
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            future = self._future
            if future is not None:
                if not future.done():
                    future.set_result(None)
            elif self._event is not None:
                self._event.set()

    async def wait(self) -> None:
        if self._set:
            return
        loop = self._loop
        if loop is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
            return
        future = self._future
        if future is None or future.done():  # done: a cancelled earlier wait
            future = self._future = loop.create_future()
        await future


class Wakeup:
    """A flag a task sleeps on and clears when it wakes: "there is work for you"."""

    __slots__ = ("_signal",)

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._signal = Signal(loop)

    def set(self) -> None:
        self._signal.set()

    async def wait(self) -> None:
        """Wait until set, then clear."""
        signal = self._signal
        await signal.wait()
        self._signal = Signal(signal._loop)
