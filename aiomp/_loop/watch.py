"""ReadWatch: read one socket on the event loop in bounded turns, coalescing wake-ups.

Owns the loop's watch on the socket (a reader callback and a timer on asyncio and
uvloop, a system task on trio), not the socket: its owner calls :meth:`ReadWatch.stop`
before it closes it. Once the socket is readable the watch waits ``delay`` seconds, so
that a writer of many small pieces costs one wake-up per batch, then calls ``turn()``:
one bounded read that says :data:`MORE` (read again after the loop's other work),
:data:`IDLE` (wait for readability again) or :data:`END`. ``at_eof()`` ends the watch at
once when the socket is readable only because it has ended (no delay then). Nothing
here touches anyio: on asyncio it all runs in loop callbacks. Nothing waits: there is no
cancellation to speak of; :meth:`ReadWatch.stop` ends it at once.

:func:`read_watch` picks the watch for the running loop, once, when the owner starts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import running_asyncio_loop

if TYPE_CHECKING:
    import asyncio

#: What a turn of reading left: more may be there now, nothing is there now, the end.
MORE, IDLE, END = 0, 1, 2


class ReadWatch(Protocol):
    def stop(self) -> None: ...


def read_watch(
    sock: socket.socket,
    turn: Callable[[], int],
    at_eof: Callable[[], bool],
    delay: float,
    name: str,
) -> ReadWatch:
    """Start watching ``sock`` on the running loop (see the module docstring). On the
    loop's thread, in a task."""
    loop = running_asyncio_loop()
    if loop is not None:
        return _LoopWatch(loop, sock, turn, at_eof, delay)
    return _SystemTaskWatch(sock, turn, at_eof, delay, name)


class _LoopWatch:
    """asyncio and uvloop: a reader callback, removed while a coalescing timer or the
    next turn is pending."""

    __slots__ = ("_at_eof", "_delay", "_fd", "_loop", "_stopped", "_timer", "_turn")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        turn: Callable[[], int],
        at_eof: Callable[[], bool],
        delay: float,
    ) -> None:
        self._loop = loop
        self._fd = sock.fileno()
        self._turn, self._at_eof, self._delay = turn, at_eof, delay
        self._timer: asyncio.Handle | None = None  # the pending coalescing read or next turn
        self._stopped = False
        loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        if not self._stopped and self._timer is None and not self._at_eof():
            self._loop.remove_reader(self._fd)
            self._timer = self._loop.call_later(self._delay, self._run_turn)

    def _run_turn(self) -> None:
        self._timer = None
        state = self._turn()
        if state == END or self._stopped:
            return
        if state == MORE:  # the next turn after what else is ready (I/O polled between)
            self._timer = self._loop.call_soon(self._run_turn)
        else:
            self._loop.add_reader(self._fd, self._on_readable)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        try:
            self._loop.remove_reader(self._fd)
        except Exception:  # noqa: BLE001 - the loop is closed: nothing to remove
            pass


class _SystemTaskWatch:
    """trio: a system task per socket, which :meth:`stop` wakes (``notify_closing``) and
    cancels."""

    __slots__ = ("_at_eof", "_delay", "_scope", "_sock", "_stopped", "_turn")

    def __init__(
        self,
        sock: socket.socket,
        turn: Callable[[], int],
        at_eof: Callable[[], bool],
        delay: float,
        name: str,
    ) -> None:
        import trio

        self._sock = sock
        self._turn, self._at_eof, self._delay = turn, at_eof, delay
        self._scope: Any = None  # trio.CancelScope, once the task runs
        self._stopped = False
        trio.lowlevel.spawn_system_task(self._run, name=name)

    async def _run(self) -> None:
        import trio

        with trio.CancelScope() as scope:
            self._scope = scope
            while not self._stopped:
                state = self._turn()
                if state == END or self._stopped:
                    return
                if state == MORE:  # let every other task run, then read on
                    await trio.lowlevel.checkpoint()
                    continue
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except (trio.ClosedResourceError, OSError):
                    return
                if self._at_eof():
                    return
                await trio.sleep(self._delay)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        import trio

        try:
            trio.lowlevel.notify_closing(self._sock)
        except RuntimeError:
            pass  # outside trio.run: nobody waits on it
        if self._scope is not None:
            try:
                self._scope.cancel()
            except RuntimeError:  # trio.run has ended
                pass
