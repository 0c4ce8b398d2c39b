"""Spawned: one child :func:`aiomp.spawn` started, with the socket its one report comes on.

The child sends ``("ok", result)`` or ``("err", ErrorPayload)`` (``aiomp._child.report``)
before its interpreter shuts down, so a failure reaches the parent within milliseconds.
The parent reads it at the socket's hang-up, not at its data: a child that reports an
error ends its side at once, one that succeeded closes it when it exits, so a clean
child costs one wake-up, not two. Owns the parent's end of the report socket; its exit
fd and the socket are watched through its spawn's one :class:`~aiomp._loop.fdset.FdSet`,
and both are forgotten there before they are closed.
"""

from __future__ import annotations

import multiprocessing
import select
import socket
from typing import Any

from .._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    exit_description,
)
from .._loop.fdset import FdSet
from .._output.forwarder import Forwarder
from .._process.child import Child
from .._wire import datagram as _transport
from .._wire import pickling as _reduction

#: The report socket is watched for its hang-up: the child has exited, or ended its side
#: after reporting an error.
REPORT_EVENTS = select.EPOLLRDHUP


class Spawned(Child):
    """A child :func:`aiomp.spawn` started, with the socket its one report arrives on
    (see the module docstring). Every wait on it goes through its spawn's fd set."""

    def __init__(
        self,
        rank: int,
        process: multiprocessing.process.BaseProcess,
        start_method: str,
        output: Forwarder | None,
        report: socket.socket,
        exits: FdSet,
    ) -> None:
        self.sock: socket.socket | None = report
        self.outcome: tuple[str, object] | None = None  # ("ok", value) / ("err", exc)
        super().__init__(rank, process, start_method, output, exits)
        exits.add(report.fileno(), REPORT_EVENTS, self._report_ready)

    def finished(self) -> bool:
        return self.outcome is not None

    def _exited(self) -> None:
        self.poll_message()  # sent before the exit: read it before the socket closes

    def _release(self) -> None:
        self._close_sock()
        super()._release()

    def _close_sock(self) -> None:
        if self.sock is not None:
            self.exits.forget(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _report_ready(self) -> bool:
        """The report socket hung up (a loop callback on asyncio): read the report; True
        while there is still one to wait for."""
        self.poll_message()  # one report per child: once read, nothing more to watch
        return self.sock is not None and self.outcome is None

    def poll_message(self) -> None:
        """Read the child's report if it is there (never waits)."""
        if self.outcome is not None or self.sock is None:
            return
        try:
            got = _transport.try_recv(self.sock)
        except _transport.Closed as exc:
            # A child that exits with our message unread makes the kernel report
            # ECONNRESET once, ahead of what it sent: its report may still be queued.
            got = None
            if isinstance(exc.__cause__, ConnectionResetError):
                try:
                    got = _transport.try_recv(self.sock)
                except (_transport.Closed, OSError):
                    pass
            if got is None:
                self._close_sock()
                return
        except OSError as exc:
            self._fail(f"sent a report that could not be received: {exc}")
            return
        if got is None:
            return
        try:
            _, body, fds = _transport.decode(*got)
            msg: Any = _reduction.loads(body, fds)
        except Exception as exc:  # noqa: BLE001 - reported as the child's failure
            self._fail(f"returned a value that could not be unpickled in the parent: {exc!r}")
            return
        if msg[0] == "ok":
            self.outcome = ("ok", msg[1])
        else:
            self._fail(f"raised:\n\n{msg[1].text.rstrip()}", msg[1].cause(f"process {self.rank}"))

    def _fail(self, what: str, cause: BaseException | None = None) -> None:
        exc = ProcessRaisedException(
            f"process {self.rank} (pid {self.pid}) {what}", self.rank, self.pid
        )
        exc.__cause__ = cause  # `raise exc` keeps a cause set beforehand
        self.outcome = ("err", exc)

    def failure(self) -> ProcessException | None:
        """The failure this child stands for, if any, as soon as it is known."""
        if self.outcome is not None and self.outcome[0] == "err":
            return self.outcome[1]  # type: ignore[return-value]
        if self.exitcode is not None and self.exitcode != 0:
            what, name = exit_description(self.exitcode)
            return ProcessExitedException(
                f"process {self.rank} {what}", self.rank, self.pid, self.exitcode, name
            )
        return None
