"""One Pool worker process as the pool sees it: its process, its channels, its outbox.

A :class:`ProcessHandle` is made (from a task) right after the process kind has launched
the process, and owns from then on the process's pidfd and the pool's ends of its two
stream sockets (tasks out, results in: a second pair, so that reading a result wakes
nobody blocked on the first). Its :meth:`ProcessHandle.run` is the worker's *watcher*, one
task in the pool's task group, and the only task that:

* waits for the process's exit (the pidfd) and signals or reaps it;
* reads the results channel (an :func:`~aiomp._loop.watch.fd_watch`: on asyncio a
  reader callback that stays registered and decodes each message at once);
* flushes what did not fit in the socket buffer (the outbox, in order).

It decodes the worker's frames itself (:mod:`aiomp._pool.protocol`) and reports to the
engine's :class:`~aiomp._pool.kinds.Events`: ``on_result(handle, tid, ok, value)``,
``on_ready``, ``on_init_failed``, ``on_lost`` (a message could not be received or
decoded: the channel is unusable) and ``on_exit(handle, exitcode, unsent)``, once, after
the process has exited and the channels are closed.

Sending never blocks and never touches anyio (loop callbacks call it): one path,
:meth:`ProcessHandle._push`, sends a frame whole or in part and keeps the rest (the
*partial*) and whatever comes after it in the outbox for the flusher. The watcher is
shielded from cancellation around the pool: it always ends, because killing is bounded
(SIGTERM, the grace period, SIGKILL).
"""

from __future__ import annotations

import collections
import pickle
import signal
import socket
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import ProcessRaisedException
from .._loop.taskhost import Started
from .._loop.wakeup import Signal, Wakeup
from .._loop.watch import fd_watch
from .._process import child as _process
from .._process import groups as _groups
from .._process import launch as _launch
from .._process.cgroups import OomWatch
from .._process.terminate import terminate_all
from .._wire import datagram as _transport
from .._wire import pickling as _reduction
from .._wire import stream as _stream
from . import health as _health
from . import protocol as P
from .kinds import Events, Handle
from .tasks import Task

if TYPE_CHECKING:
    import asyncio

_EXIT = P.control(P.OP_EXIT)
_NO_FDS: list[int] = []  # never changed: try_send only reads it
_SEND_NOW = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_KIND_DATA = _transport.KIND_DATA
_HEAD = P.HEAD.unpack_from
_SMALL = P.COPY_BELOW


class ProcessHandle(Handle):
    """See the module docstring."""

    #: A worker runs its sync tasks one at a time, in the order sent (``worker_main``).
    in_order = True
    looks_ahead = True
    prints_stack = True

    def __init__(
        self,
        slot: int,
        child: _process.Child,
        sock: socket.socket,
        results: socket.socket,
        loop: asyncio.AbstractEventLoop | None,
        grace: float,
        events: Events,
        stacks: socket.socket | None = None,
    ) -> None:
        self.slot = slot
        self.child = child
        self.chan = _stream.Stream(sock)  # tasks and control frames, to the worker
        self._sock_send = sock.send  # (try_send_now's, a bound method made once)
        self.results = _stream.Stream(results)
        self._try_recv = self.results.try_recv
        self._take = self.results.take
        self._grace = grace
        self._events = events
        self._on_result = events.on_result
        # Frames (bytes, or (bytes, fds)) and tasks waiting for room in the socket buffer.
        self._outbox: collections.deque[Any] = collections.deque()
        self._partial: memoryview | None = None  # the unsent rest of a frame sent in part
        self._more = Wakeup(loop)  # the outbox has something
        self._kill = Signal(loop)
        self._watch = fd_watch(loop, self.results.fileno(), self._readable)
        #: ids of the functions DEF'd to it, oldest first (see protocol.MAX_FNS)
        self.fns: dict[int, None] = {}
        self.closed = False  # its channel is closed: nothing more goes out
        # Made here, in a task (handles are never made in a loop callback); set by the
        # watcher. Any number of tasks may wait for it.
        self.dead = anyio.Event()
        # Worker health (``_pool.health``): where it prints its stack as it is
        # terminated (read if the pool expected the kill) and its memory cgroup's OOM
        # kills.
        self._stacks = stacks
        self._oom = OomWatch(child.pid)

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
        fid = task.fn_id
        if fid and fid not in self.fns:
            if not self._push(task.define, task.define, None):
                return False
            if len(self.fns) >= P.MAX_FNS:  # the worker drops the same one
                del self.fns[next(iter(self.fns))]
            self.fns[fid] = None
        msg = task.message
        if type(msg) is bytes:
            return self._push(task, msg, None)
        return self._push(task, msg.frame, msg.fds)

    def try_send_now(self, frame: bytes, fid: int) -> bool:
        """Send a small task frame (no fds) before its Task exists, if nothing must go
        before it (its function's DEF, frames waiting for room); False: nothing was sent,
        the caller submits the Task instead (whose send says why, if the worker has gone).
        """
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
            self._keep_rest(frame, n)
        return True

    def _push(self, item: object, data: bytes, fds: list[int] | None) -> bool:
        """The one send: ``data`` (and ``fds``) now, or ``item`` into the outbox behind what
        waits there. False: the worker has gone and nothing was sent. Raises
        TransportError when the fds cannot be sent (nothing was)."""
        if self.closed:
            return False
        if self._outbox or self._partial is not None:
            self._outbox.append(item)
            return True
        try:
            n = self.chan.try_send(data, fds or _NO_FDS)
        except _transport.Closed:
            return False
        if n == 0:
            self._outbox.append(item)
            self._more.set()
        elif n < len(data):
            self._keep_rest(data, n)
        return True

    def _keep_rest(self, data: bytes | memoryview, n: int) -> None:
        """``data`` went in part (its fds with the first part): the flusher sends the rest
        before anything else."""
        self._partial = memoryview(data)[n:]
        self._more.set()

    def unsend(self, task: Task) -> bool:
        """Take ``task`` back if it is still waiting in the outbox (nothing of it sent)."""
        try:
            self._outbox.remove(task)
        except ValueError:
            return False
        return True

    def send_control(self, frame: bytes, fds: list[int] | None = None) -> None:
        """Send a control frame (INIT, CANCEL, EXIT); dropped if the worker has gone, or
        is not this process's (a fork of the pool's process: the worker is its parent's)."""
        if self.child.disowned:
            return
        self._push(frame if fds is None else (frame, fds), frame, fds)

    def send_exit(self) -> None:
        self.send_control(_EXIT)

    def cancel(self, tid: int) -> None:
        """Ask the worker to cancel async task ``tid``."""
        self.send_control(P.control(P.OP_CANCEL, tid))

    def expect_kill(self) -> None:
        self.child.expected_kill = True  # (and its stack is read at its exit)

    def kill(self, now: bool = False) -> None:
        """Have the watcher terminate the process (SIGTERM, grace period, SIGKILL), or
        with ``now`` send SIGKILL at once (a second Ctrl-C during shutdown)."""
        if now:
            self.child.kill(quiet=True)
        self._kill.set()

    # -- receiving (in the reader callback on asyncio) -------------------------------
    def _readable(self) -> None:
        """Read and decode what the worker sent (one read: the selector is level-triggered)."""
        try:
            got = self._try_recv()
        except _transport.Closed:
            self._watch.stop()  # the process is exiting: the watcher sees it next
            return
        except OSError as exc:  # fds were lost (fd limit): the channel is unusable
            self._watch.stop()
            self._events.on_lost(self, exc)
            return
        while got is not None:
            try:
                self._decode(got)
            except Exception as exc:  # noqa: BLE001 - a bug or an unreadable message
                self._watch.stop()
                self._events.on_lost(self, exc)
                return
            got = self._take()  # more that came in the same read

    def _decode(self, got: tuple[bytes, list[int]]) -> None:
        """One message from the worker, reported to the engine."""
        data, fds = got
        if data[0] == _KIND_DATA and len(data) < _SMALL:  # hot path: tests/budgets
            _, op, tid, _ = _HEAD(data)
            payload: bytes | memoryview = data[11:]
        else:
            op, tid, _, payload, fds = P.unpack(data, fds)
        if op == P.OP_OK:
            try:
                value: Any = _reduction.loads(payload, fds) if fds else pickle.loads(payload)
            except BaseException as exc:  # noqa: BLE001 - the caller's, never the loop's
                # (A SystemExit raised here would leave the reader callback and stop the
                # loop.)
                what = f"the result of {self._events.task_name(self, tid)} from {self.name}"
                self._on_result(self, tid, False, P.unpickling_failed(exc, what))
                return
            self._on_result(self, tid, True, value)
        elif op == P.OP_ERR:
            if self._events.task_name(self, tid) is None:
                _transport.close_fds(fds)
                return
            self._on_result(self, tid, False, self._remote_error(payload, fds))
        elif op == P.OP_SKIPPED:
            self._events.on_skipped(self, tid)
        elif op == P.OP_RETIRE:
            grown, limit = pickle.loads(payload)
            self._events.on_retire(self, tid, grown, limit)
        elif op == P.OP_READY:
            _transport.close_fds(fds)
            self._oom.look(self.pid)  # (its initializer may have moved it)
            # The keeper before any task is sent (it watches over what the task starts);
            # the resource tracker after (its fork and boot are the first task's business
            # no more than the other workers' are: decision 0091).
            _groups.start_deferred_keeper()
            self._events.on_ready(self)
            _launch.start_deferred_helpers()
        elif op == P.OP_INIT_ERR:
            self._events.on_init_failed(self, self._remote_error(payload, fds))
        else:
            _transport.close_fds(fds)
            self._events.on_lost(self, RuntimeError(f"an unknown message (op {op})"))

    def _remote_error(self, payload: bytes | memoryview, fds: list[int]) -> BaseException:
        try:
            error = _reduction.loads(payload, fds)
            if not isinstance(error, P.ErrorPayload):
                raise TypeError(f"an ErrorPayload was expected, not {type(error).__name__}")
        except Exception as err:  # noqa: BLE001
            return ProcessRaisedException(
                f"{self.name} raised an exception that could not be unpickled: {err!r}",
                self.slot,
                self.pid,
            )
        return error.exception(self.name, self.slot, self.pid)

    # -- the watcher -----------------------------------------------------------------
    async def watch_exit(self) -> None:
        """Watch the process until it exits (or is killed), then report and clean up.

        Shielded: cancelling the pool's task group does not stop it; :meth:`kill` does,
        after the termination it starts, which is bounded.
        """
        child = self.child
        started = Started()
        try:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    started.start_soon(tg, self._watch.serve)
                    started.start_soon(tg, self._flush)
                    exit_wait = anyio.CancelScope()

                    async def killer() -> None:
                        await self._kill.wait()
                        exit_wait.cancel()

                    started.start_soon(tg, killer)
                    with exit_wait:
                        await child.wait_exit()
                    if not child.exited:
                        await terminate_all([child], self._grace)
                    tg.cancel_scope.cancel()
        finally:
            started.close()
            if not child.exited:
                # Only a native cancellation of this task (asyncio.run cancelling every
                # task after its main one ended) gets here: no child may outlive it.
                child.signal(signal.SIGKILL)
                child.process.join(_process.KILL_TIMEOUT)
                child.poll_exit()
            unsent = self._close()
            self._check_health()
            self._events.on_exit(self, child.exitcode, unsent)
            self.dead.set()

    def _check_health(self) -> None:
        """It has exited: its peak RSS, whether the OOM killer killed it (a SIGKILL the
        pool did not send, as its cgroup's count rose) and, if the pool asked, the stack
        it printed as it was terminated."""
        child = self.child
        self.peak_rss = child.peak_rss
        self.oom_killed = (
            child.exitcode == -signal.SIGKILL and not child.sent_kill and self._oom.rose()
        )
        if self._stacks is not None:
            if child.expected_kill:
                self.stack = _health.read_stack(self._stacks)
            self._stacks.close()

    def _close(self) -> list[int]:
        """Close the channels; the ids of tasks that never left the outbox."""
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

    def _drain(self) -> None:
        while True:
            try:
                got = self._try_recv()
            except (_transport.Closed, OSError):
                return
            if got is None:
                return
            try:
                self._decode(got)
            except Exception as exc:  # noqa: BLE001 - a bug or an unreadable message
                self._events.on_lost(self, exc)
                return

    async def _flush(self) -> None:
        """Send what waits (a partial frame's rest, then the outbox), in order, as the
        socket drains."""
        while True:
            await self._more.wait()
            try:
                while self._partial is not None or self._outbox:
                    if not self._flush_one():
                        await anyio.wait_writable(self.chan.sock)
            except _transport.Closed:
                return  # dying: the watcher sees it, and the scheduler fails or requeues

    def _flush_one(self) -> bool:
        """Send the rest of a partial frame, else the head of the outbox; False if the
        buffer is full."""
        rest = self._partial
        if rest is not None:
            n = self.chan.try_send(rest, _NO_FDS)
            self._partial = rest[n:] if n < len(rest) else None
            return self._partial is None
        item = self._outbox[0]
        if isinstance(item, Task):
            msg = item.message
            data, fds = (msg, None) if type(msg) is bytes else (msg.frame, msg.fds)
        elif isinstance(item, tuple):
            data, fds = item
        else:
            data, fds = item, None
        try:
            n = self.chan.try_send(data, fds or _NO_FDS)
        except _transport.Closed:
            raise
        except OSError as exc:  # TransportError: too many fds in flight
            self._outbox.popleft()
            if isinstance(item, Task):
                self._on_result(self, item.tid, False, exc)  # that task's failure alone
            else:
                self._events.on_lost(self, exc)
            return True
        if n == 0:
            return False
        self._outbox.popleft()
        if n < len(data):
            self._partial = memoryview(data)[n:]
        return True
