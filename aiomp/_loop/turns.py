"""ReadWatch: read one socket on the event loop in bounded turns, coalescing wake-ups.

Owns the coalescing of one socket's reads (a timer on asyncio and uvloop, the sleeps of
its task on trio), built on the socket's :mod:`aiomp._loop.watch` (a reader callback, or
a trio system task); not the socket: its owner calls :meth:`ReadWatch.stop` before it
closes it. Once the socket is readable the watch waits ``delay`` seconds, so that a writer
of many small pieces costs one wake-up per batch, then calls ``turn()``: one bounded read
that says :data:`MORE` (read again after the loop's other work), :data:`IDLE` (wait for
readability again) or :data:`END`. ``at_eof()`` ends the watch at once when the socket
is readable only because it has ended (no delay then). Nothing here touches anyio: on
asyncio it all runs in loop callbacks. Nothing waits: there is no cancellation to speak
of; :meth:`ReadWatch.stop` ends it at once.

:func:`read_watch` picks the watch for the running loop, once, when the owner starts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from . import running_asyncio_loop
from .watch import ReaderWatch, TaskWatch

if TYPE_CHECKING:
    import asyncio

#: What a turn of reading left: more may be there now, nothing is there now, the end.
MORE, IDLE, END = 0, 1, 2


class ReadWatch(Protocol):
    def stop(self) -> None: ...


class Turns(NamedTuple):
    """What a watch calls, and how long it lets a readable socket fill first."""

    turn: Callable[[], int]
    at_eof: Callable[[], bool]
    delay: float


def read_watch(sock: socket.socket, turns: Turns, name: str) -> ReadWatch:
    """Start watching ``sock`` on the running loop (see the module docstring). On the
    loop's thread, in a task."""
    loop = running_asyncio_loop()
    if loop is not None:
        return _LoopTurns(loop, sock, turns)
    watch = _TaskTurns(sock, turns, name)
    watch.start()
    return watch


class _LoopTurns:
    """asyncio and uvloop: the reader callback, paused while a coalescing timer or the
    next turn is pending."""

    __slots__ = ("_at_eof", "_delay", "_loop", "_reader", "_timer", "_turn")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, turns: Turns) -> None:
        self._loop = loop
        self._turn, self._at_eof, self._delay = turns
        self._timer: asyncio.Handle | None = None  # the pending coalescing read or next turn
        self._reader = ReaderWatch(loop, sock.fileno(), self._on_readable)
        self._reader.start()

    def _on_readable(self) -> None:
        if not self._reader.stopped and self._timer is None and not self._at_eof():
            self._reader.pause()
            self._timer = self._loop.call_later(self._delay, self._run_turn)

    def _run_turn(self) -> None:
        self._timer = None
        state = self._turn()
        if state == END or self._reader.stopped:
            return
        if state == MORE:  # the next turn after what else is ready (I/O polled between)
            self._timer = self._loop.call_soon(self._run_turn)
        else:
            self._reader.start()

    def stop(self) -> None:
        if self._reader.stopped:
            return
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._reader.stop()


class _TaskTurns(TaskWatch):
    """trio: the watch's system task, reading in turns and sleeping to coalesce."""

    __slots__ = ("_at_eof", "_delay", "_turn")

    def __init__(self, sock: socket.socket, turns: Turns, name: str) -> None:
        super().__init__(sock, _never, name, None)
        self._turn, self._at_eof, self._delay = turns

    async def run(self) -> None:
        import trio

        while not self.stopped:
            state = self._turn()
            if state == END or self.stopped:
                return
            if state == MORE:  # let every other task run, then read on
                await trio.lowlevel.checkpoint()
                continue
            try:
                await trio.lowlevel.wait_readable(self._fd)
            except (trio.ClosedResourceError, OSError):
                return
            if self._at_eof():
                return
            await trio.sleep(self._delay)


def _never() -> None:
    """The plain watch's callback, which :class:`_TaskTurns` replaces with its turns."""
