"""One Pool worker process as the pool sees it: its process, its channel, its outbox.

A :class:`WorkerHandle` is made (from a task) right after ``_process.launch`` has started
the process, and owns from then on the process's pidfd and the pool's end of its stream
socket. Its :meth:`WorkerHandle.run` is the worker's *watcher*, one task in the pool's
task group, and the only task that:

* waits for the process's exit (the pidfd) and signals or reaps it;
* reads its channel (on asyncio, through a reader callback that stays registered and
  hands each message to ``on_message`` at once; on trio, a reader task);
* flushes what did not fit in the socket buffer (the outbox, in order).

It reports upward through four callbacks: ``on_message(handle, (data, fds))``,
``on_lost(handle, exc)`` (a message could not be received or handled: the channel is
unusable), ``on_failed(handle, tid, exc)`` (a queued task's fds could not be sent) and
``on_exit(handle, exitcode, unsent)``, called once, after the process has exited and the
channel is closed.

:meth:`send`, :meth:`send_exit`, :meth:`cancel` and :meth:`kill` never block and never
touch anyio (see *Nothing anyio in loop callbacks* in docs/architecture.md). The watcher is
shielded from cancellation around the pool: it always ends, because killing is bounded
(SIGTERM, the grace period, SIGKILL).
"""

from __future__ import annotations

import collections
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._loop.wakeup import Signal, Wakeup
from .._process import child as _process
from .._process.terminate import terminate_all
from .._wire import transport as _transport
from . import protocol as P
from .scheduler import Task

if TYPE_CHECKING:
    import asyncio

_EXIT = P.control(P.OP_EXIT)
_NO_FDS: list[int] = []  # never changed: try_send only reads it
_SEND_NOW = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


class WorkerHandle:
    """See the module docstring."""

    #: A worker runs its sync tasks one at a time, in the order sent (``_worker``).
    in_order = True

    def __init__(
        self,
        slot: int,
        child: _process.Child,
        sock: socket.socket,
        results: socket.socket,
        loop: asyncio.AbstractEventLoop | None,
        grace: float,
        on_message: Callable[[WorkerHandle, tuple[bytes, list[int]]], None],
        on_lost: Callable[[WorkerHandle, BaseException], None],
        on_failed: Callable[[WorkerHandle, int, BaseException], None],
        on_exit: Callable[[WorkerHandle, int | None, list[int]], None],
    ) -> None:
        self.slot = slot
        self.child = child
        self.chan = _transport.Stream(sock)  # tasks and control frames, to the worker
        self._sock_send = sock.send  # (send_first's, a bound method made once)
        # Its results, from the worker: a second pair, so that reading a result wakes
        # nobody (see docs/decisions/0026-two-channels.md).
        self.results = _transport.Stream(results)
        self._loop = loop
        self._grace = grace
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_failed = on_failed
        self._on_exit = on_exit
        # Frames (bytes, or (bytes, fds)) and tasks waiting for room in the socket buffer.
        self._outbox: collections.deque[Any] = collections.deque()
        self._partial: memoryview | None = None  # the unsent rest of a frame sent in part
        self._more = Wakeup(loop)  # the outbox has something
        self._kill = Signal(loop)
        self.fns: set[int] = set()  # ids of the functions DEF'd to it
        self.closed = False  # its channel is closed: nothing more goes out
        # Made here, in a task (handles are never made in a loop callback); set by the
        # watcher. Any number of tasks may wait for it.
        self.dead = anyio.Event()

    @property
    def name(self) -> str:
        return f"worker {self.slot} (pid {self.child.pid})"

    @property
    def pid(self) -> int:
        return self.child.pid

    # -- sending (never blocks) ------------------------------------------------------
    def send(self, task: Task) -> bool:
        """Send ``task`` (its function's DEF first, if this worker lacks it).

        True: sent, or queued behind earlier frames for the flusher. False: the worker
        has gone and nothing of the task was sent (it may go to another worker). Raises
        :class:`aiomp.TransportError` when the task's fds cannot be sent (the fd limit):
        the task's own failure, not the worker's. The task's message stays open until the
        task is done: should this worker die before starting it, it goes to another.
        """
        if self.closed:
            return False
        fid = task.fn_id
        if fid and fid not in self.fns:
            if not self._send_frame(task.define, None):
                return False
            self.fns.add(fid)
        if self._outbox or self._partial is not None:
            self._outbox.append(task)
            return True
        msg = task.message
        small = type(msg) is bytes  # (the round trip's hot path: no _try_send frame)
        data = msg if small else msg.frame
        try:
            n = self.chan.try_send(data, _NO_FDS if small else msg.fds)
        except _transport.Closed:
            return False
        if n == len(data):
            return True
        if n == 0:
            self._outbox.append(task)
        else:
            self._partial = memoryview(data)[n:]  # (its fds went with the first part)
        self._more.set()
        return True

    def send_first(self, frame: bytes, fid: int) -> bool:
        """Send a small task frame (no fds) before its Task exists, if nothing must go
        before it (its function's DEF, frames waiting for room); False: nothing was sent,
        the caller submits the Task instead (whose send says why, if the worker has gone).
        ``apply``'s hot path: see docs/decisions/0028-apply-sends-first.md."""
        if (
            self.closed
            or self._outbox
            or self._partial is not None
            or (fid and fid not in self.fns)
        ):
            return False
        try:
            n = self._sock_send(frame, _SEND_NOW)
        except OSError:  # BlockingIOError (no room), or gone: submit's send finds out
            return False
        if n < len(frame):  # (a stream socket with room for a few bytes only)
            self._partial = memoryview(frame)[n:]
            self._more.set()
        return True

    def unsend(self, task: Task) -> bool:
        """Take ``task`` back if it is still waiting in the outbox (nothing of it sent)."""
        try:
            self._outbox.remove(task)
        except ValueError:
            return False
        return True

    def send_frame(self, frame: bytes, fds: list[int] | None = None) -> None:
        """Send a control frame (INIT, CANCEL); dropped if the worker has gone."""
        self._send_frame(frame, fds)

    def send_exit(self) -> None:
        self._send_frame(_EXIT, None)

    def cancel(self, tid: int) -> None:
        """Ask the worker to cancel async task ``tid``."""
        self._send_frame(P.control(P.OP_CANCEL, tid), None)

    def kill(self, now: bool = False) -> None:
        """Have the watcher terminate the process (SIGTERM, grace period, SIGKILL), or
        with ``now`` send SIGKILL at once (a second Ctrl-C during shutdown)."""
        if now:
            self.child.signal(signal.SIGKILL)
        self._kill.set()

    def _send_frame(self, frame: bytes, fds: list[int] | None) -> bool:
        if self.closed:
            return False
        if self._outbox or self._partial is not None:
            self._outbox.append(frame if fds is None else (frame, fds))
            return True
        sent = self._try_send(frame, fds)
        if sent is None:
            return False
        if sent == 0:
            self._outbox.append(frame if fds is None else (frame, fds))
            self._more.set()
        return True

    def _try_send(self, data: bytes, fds: list[int] | None) -> int | None:
        """Bytes of ``data`` sent (0: the buffer is full); None: the worker has gone.

        The rest of a frame sent in part goes to ``_partial`` and the flusher is woken.
        Raises TransportError when the fds cannot be sent (nothing was).
        """
        try:
            n = self.chan.try_send(data, fds or [])
        except _transport.Closed:
            return None
        if 0 < n < len(data):
            self._partial = memoryview(data)[n:]
            self._more.set()
        return n

    # -- the watcher -----------------------------------------------------------------
    async def run(self) -> None:
        """Watch the process until it exits (or is killed), then report and clean up.

        Shielded: cancelling the pool's task group does not stop it; :meth:`kill` does,
        after the termination it starts, which is bounded.
        """
        child = self.child
        try:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._read)
                    tg.start_soon(self._flush)
                    exit_wait = anyio.CancelScope()

                    async def killer() -> None:
                        await self._kill.wait()
                        exit_wait.cancel()

                    tg.start_soon(killer)
                    with exit_wait:
                        await child.wait_exit()
                    if not child.exited:
                        await terminate_all([child], self._grace)
                    tg.cancel_scope.cancel()
        finally:
            if not child.exited:
                # Only a native cancellation of this task (asyncio.run cancelling every
                # task after its main one ended) gets here: no child may outlive it.
                child.signal(signal.SIGKILL)
                child.process.join(_process.KILL_TIMEOUT)
                child.poll_exit()
            unsent = self._close()
            self._on_exit(self, child.exitcode, unsent)
            self.dead.set()

    def _close(self) -> list[int]:
        """Close the channel; the ids of tasks that never left the outbox."""
        if self.child.exited:
            self._drain()  # results sent just before the exit
        # Tasks still here never reached the worker: the scheduler queues them again.
        unsent = [t.tid for t in self._outbox if isinstance(t, Task)]
        self._outbox.clear()
        self._partial = None
        self.closed = True
        self.chan.close()
        self.results.close()
        return unsent

    async def _read(self) -> None:
        """The one reader of the results channel, until end of stream or cancellation."""
        chan = self.results
        loop = self._loop
        if loop is None:
            while True:
                try:
                    got = await chan.recv_async()
                except _transport.Closed:
                    return  # the process is exiting: the watcher sees it next
                except OSError as exc:  # fds were lost (fd limit): the channel is unusable
                    self._on_lost(self, exc)
                    return
                if not self._handle(got):
                    return
        # asyncio: a reader callback that stays registered. It hands each message on
        # straight away (resolving its caller's future), without waking a task and without
        # re-registering the fd for every message (two epoll_ctl calls per round trip cost
        # more than they save). One read per call: the selector is level-triggered.
        eof = loop.create_future()
        try_recv, take, on_message = chan.try_recv, chan.take, self._on_message

        def readable() -> None:
            try:
                got = try_recv()
            except _transport.Closed:
                loop.remove_reader(fd)
                if not eof.done():
                    eof.set_result(None)
                return
            except OSError as exc:
                loop.remove_reader(fd)  # fds were lost: the channel is unusable
                self._on_lost(self, exc)
                return
            while got is not None:
                try:
                    on_message(self, got)
                except Exception as exc:  # noqa: BLE001 - a bug or an unreadable message
                    loop.remove_reader(fd)
                    self._on_lost(self, exc)
                    return
                got = take()  # more that came in the same read

        fd = chan.fileno()
        loop.add_reader(fd, readable)
        try:
            await eof
        finally:
            loop.remove_reader(fd)

    def _handle(self, got: tuple[bytes, list[int]]) -> bool:
        try:
            self._on_message(self, got)
        except Exception as exc:  # noqa: BLE001 - a bug or an unreadable message
            self._on_lost(self, exc)
            return False
        return True

    def _drain(self) -> None:
        while True:
            try:
                got = self.results.try_recv()
            except (_transport.Closed, OSError):
                return
            if got is None or not self._handle(got):
                return

    async def _flush(self) -> None:
        """Send what waits in the outbox, in order, as the socket drains."""
        chan = self.chan
        while True:
            await self._more.wait()
            try:
                while True:
                    if self._partial is not None:
                        rest = self._partial
                        n = chan.try_send(rest, [])
                        if n < len(rest):
                            self._partial = rest[n:]
                            await anyio.wait_writable(chan.sock)
                            continue
                        self._partial = None
                    if not self._outbox:
                        break
                    if not self._flush_one():
                        await anyio.wait_writable(chan.sock)
            except _transport.Closed:
                return  # dying: the watcher sees it, and the scheduler fails or requeues

    def _flush_one(self) -> bool:
        """Send the head of the outbox; False if the buffer is full."""
        item = self._outbox[0]
        if isinstance(item, Task):
            msg = item.message
            data, fds = (msg, None) if type(msg) is bytes else (msg.frame, msg.fds)
        elif isinstance(item, tuple):
            data, fds = item
        else:
            data, fds = item, None
        try:
            n = self.chan.try_send(data, fds or [])
        except _transport.Closed:
            raise
        except OSError as exc:  # TransportError: too many fds in flight
            self._outbox.popleft()
            if isinstance(item, Task):
                self._on_failed(self, item.tid, exc)  # that task's failure alone
            else:
                self._on_lost(self, exc)
            return True
        if n == 0:
            return False
        self._outbox.popleft()
        if n < len(data):
            self._partial = memoryview(data)[n:]
        return True
