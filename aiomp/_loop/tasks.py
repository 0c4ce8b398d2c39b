"""A callback kept on a readable fd for as long as a task serves it.

:class:`ReadableWatch` calls ``readable()`` each time its fd may be read, until
:meth:`ReadableWatch.stop`. On asyncio (uvloop included) ``readable`` is the loop's reader
callback itself, registered once and left registered between messages (two ``epoll_ctl``
calls per message cost more than they save), so what it resolves wakes its waiter with no
task in between; on trio it runs in the serving task after each ``wait_readable``. Owns the
registration of the fd on the loop (never the fd itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


class ReadableWatch:
    """Calls ``readable()`` while :meth:`serve` runs; ``readable`` reads one message (the
    selector is level-triggered) and calls :meth:`stop` at the end of the stream."""

    __slots__ = ("_eof", "_fd", "_loop", "_readable", "_stopped")

    def __init__(
        self, loop: asyncio.AbstractEventLoop | None, fd: int, readable: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._fd = fd
        self._readable = readable
        self._stopped = False
        self._eof: asyncio.Future[None] | None = None

    async def serve(self) -> None:
        """Call ``readable`` until :meth:`stop` (or cancellation, which leaves nothing
        registered)."""
        loop = self._loop
        if loop is None:
            import trio

            while not self._stopped:
                await trio.lowlevel.wait_readable(self._fd)
                self._readable()
            return
        self._eof = eof = loop.create_future()
        if self._stopped:
            return
        loop.add_reader(self._fd, self._readable)
        try:
            await eof
        finally:
            loop.remove_reader(self._fd)

    def stop(self) -> None:
        """No more calls (from ``readable`` itself, or anywhere on the loop's thread)."""
        self._stopped = True
        loop = self._loop
        if loop is not None:
            loop.remove_reader(self._fd)
            eof = self._eof
            if eof is not None and not eof.done():
                eof.set_result(None)
