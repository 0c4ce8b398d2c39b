"""The worker process of :class:`aiomp.Pool` (its wire format: :mod:`aiomp._pool.protocol`).

A worker is started with ``_process.launch(..., main, slot, ...)``. It:

1. reads the pool's messages from one stream socket and writes its own to a second one
   (see docs/decisions/0026-two-channels.md), asks the kernel to SIGKILL it when its
   parent dies, ignores SIGINT (a Ctrl-C in the terminal reaches the parent, and the worker
   through the parent's keeper: see ``aiomp._process.groups``; the parent decides what happens to
   its workers), and clears the ``daemon`` flag ``multiprocessing`` gave it, so that a
   task may start processes of its own (a nested pool, a data loader; they end with the
   worker: it leads their process group);
2. receives ``INIT``: runs the initializer, then answers ``READY`` (or ``INIT_ERR`` and
   exits with code 1);
3. serves ``TASK`` messages until ``EXIT`` or end of stream (the parent has gone).

A worker starts *sync*: a blocking ``recvmsg`` / run / ``sendmsg`` loop that imports
neither asyncio nor anyio. The first task whose function is a coroutine function (or an
async initializer) starts an asyncio event loop (uvloop when installed), and the worker
serves from that loop for the rest of its life: each task becomes an asyncio task, the
channel is read by a loop reader callback, and ``CANCEL`` cancels one task. A sync
task runs on the loop thread too: the pool only sends one to a worker that holds no other
task (or only sync chunks of the same map), so it blocks nothing.

In either mode a worker runs the sync tasks it holds one at a time, in the order they
came: the pool counts on it to know that a sync task sent behind another had not started
when the worker died (see docs/decisions/0025-pool-failures.md).

In sync mode the pool keeps a task *queued ahead* in the worker, behind the one it runs,
so that the worker starts it the moment the first ends, without waiting for the parent
(docs/decisions/0065-tasks-queued-ahead.md). Before it sends a sync task's outcome, the
worker reads without waiting what has come meanwhile: a ``CANCEL`` of a task held there
answers ``SKIPPED`` and the task never starts, as does every task once ``max_memory``
has retired the worker. So the pool knows, when that outcome comes, that the next task
held here has started unless a ``SKIPPED`` came first.

Whatever a task raises is its outcome, sent to its caller: ``SystemExit`` and
``KeyboardInterrupt`` too, as ``concurrent.futures`` sends them (the worker ignores SIGINT,
so a KeyboardInterrupt can only come from the task itself). The worker serves on.

The wire format is in ``_protocol``. The worker keeps every function it was sent in a
``DEF`` for its whole life; a ``DEF`` that cannot be unpickled here fails every task that
names it, with that error.

Standard library and aiomp's small modules only: this module is imported by every worker.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import select
import signal
import socket
import struct
import sys
import types

from .._child import bootstrap as _child
from .._child import output as _child_output
from .._child import runner as _runner
from .._process.start import Start
from .._wire import datagram as _transport
from .._wire import pickling as _reduction
from .._wire import stream as _stream
from . import health as _health
from . import protocol as P
from . import worker_loop as _loop

# Not `from typing import TYPE_CHECKING`: workers must not pay for importing typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_NONE = pickle.dumps(None, protocol=5)
FID = P.FID.unpack_from
_Coroutine = types.CoroutineType
# The round trip's hot path (see docs/decisions/0027-apply-critical-path.md): a TASK
# datagram of ``fn()`` is its fused header alone, and ``None`` has a constant reply.
_NOARGS_SIZE = P.TASK_HEAD.size
_NOARGS_HEAD = P.TASK_HEAD.unpack_from
_APPLY_NOARGS = P.F_APPLY | P.F_NOARGS
_KIND_DATA = _transport.KIND_DATA
_OK_NONE_HEAD = P.framed(P.OP_OK, 0, 0, _NONE)[:7]  # frame header, kind, op
_TID = struct.Struct("<QB")  # task id, flags


def send(chan: _stream.Stream, op: int, tid: int, payload: object) -> None:
    """Pickle ``payload`` behind a header and send it, blocking while the buffer is full.

    Raises whatever pickling raises (nothing has been sent then) and
    :class:`_transport.Closed` when the other end has gone.
    """
    if type(payload) in P.PLAIN:
        pickled = pickle.dumps(payload, protocol=5)
        if P.fits_inline(pickled):
            chan.send_sync(P.framed(op, tid, 0, pickled), [])
            return
    msg = P.TaskMessage(op, tid, 0, b"", payload)
    try:
        chan.send_sync(msg.frame, msg.fds)
    finally:
        msg.close()


class _BadDef:
    """A function whose ``DEF`` could not be unpickled here: the answer to its tasks."""

    __slots__ = ("error",)

    def __init__(self, error: P.ErrorPayload) -> None:
        self.error = error


class Server:
    """The state of one worker process: what it serves, and from which loop."""

    def __init__(self, tasks: _stream.Stream, chan: _stream.Stream) -> None:
        self.tasks = tasks  # read: the pool's messages
        self.chan = chan  # written: the replies (see docs/decisions/0026-two-channels.md)
        self.runner: Any = None  # asyncio.Runner, made on first need
        self.sync_turn: Any = None  # asyncio.Lock, in async mode (see serve_async)
        self.fns: dict[int, Any] = {}  # DEF'd functions by id (or a _BadDef)
        # The logging-records socket to the parent, until logging is imported here (by the
        # initializer or a function's module) and its records can be forwarded.
        self.records: tuple[socket.socket, int] | None = None
        #: The pool's ``max_memory``, until the initializer has run; then its guard.
        self.max_memory: int | None = None
        self.guard: _health.MemoryGuard | None = None
        #: Sync mode: messages read ahead, unpacked, to serve before reading again (the
        #: task queued ahead; see :meth:`read_ahead`).
        self.pending: collections.deque[tuple[int, int, int, bytes | memoryview, list[int]]]
        self.pending = collections.deque()
        self.sync_mode = True
        # Whether more has come, without a Python call: a frame already read (``take``),
        # or the socket readable (``poll(0)``).
        self.take = tasks.take
        poller = select.poll()
        poller.register(tasks.fileno(), select.POLLIN)
        self.poll = poller.poll
        #: ``max_memory`` retired it: no task it holds or is sent starts any more.
        self.retired = False

    def forward_logging(self) -> None:
        if self.records is not None and "logging" in sys.modules:
            sock, level = self.records
            self.records = None
            _child_output.forward_logging(sock, level)

    # -- loop ----------------------------------------------------------------------
    def get_runner(self) -> Any:
        if self.runner is None:
            self.runner = _runner.new_runner()
        return self.runner

    def run_coro(self, coro: Any) -> object:
        """Run ``coro`` on the worker's loop; raise what it raises.

        A ``SystemExit`` or ``KeyboardInterrupt`` leaves the coroutine as a value and is
        raised here, after the loop has stopped: asyncio lets those two out of the loop in
        the middle of its step, leaving the loop to stop at once when it next runs.
        """
        ok, value = self.get_runner().run(_loop.boxed(coro))
        if ok:
            return value
        raise value

    # -- start-up ------------------------------------------------------------------
    def initialize(self) -> bool:
        got = self.tasks.recv_sync()
        assert got is not None
        op, _, _, payload, fds = P.unpack(*got)
        assert op == P.OP_INIT, op
        try:
            msg: Any = _reduction.loads(payload, fds)
            initializer, initargs = msg
            if initializer is not None:
                result = initializer(*initargs)
                if isinstance(result, types.CoroutineType):
                    self.run_coro(result)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: reported to the parent
            send(self.chan, P.OP_INIT_ERR, 0, P.ErrorPayload.of(exc))
            return False
        self.forward_logging()
        if self.max_memory is not None:
            try:  # its level now, after the initializer, is the one to grow from
                self.guard = _health.MemoryGuard(self.max_memory)
            except OSError:  # pragma: no cover - no /proc: nothing to guard with
                pass
        send(self.chan, P.OP_READY, 0, None)
        return True

    def check_memory(self, tid: int) -> None:
        """Between tasks, before task ``tid``'s outcome goes: if private memory has
        grown past ``max_memory``, say so first, so that the pool sends this worker
        nothing more (see :mod:`aiomp._pool.health`)."""
        assert self.guard is not None
        try:
            grown = self.guard.grown()
        except OSError:  # pragma: no cover - /proc went away
            grown = None
        if grown is not None:
            limit, self.guard = self.guard.limit, None
            self.retired = True
            send(self.chan, P.OP_RETIRE, tid, (grown, limit))

    # -- tasks queued ahead (sync mode) ---------------------------------------------
    def read_ahead(self, got: tuple[bytes, list[int]] | None = None) -> None:
        """Before a sync task's outcome goes: keep what came meanwhile (``got``, then
        whatever else is there) in :attr:`pending`, and answer SKIPPED for each task held
        there that a CANCEL names, or every one once the worker is retiring. Never waits.
        """
        pending = self.pending
        if got is None:
            got = self.tasks.try_recv()
        while got is not None:
            op, tid, flags, payload, fds = P.unpack(*got)
            if op == P.OP_CANCEL:
                for i, held in enumerate(pending):
                    if held[0] == P.OP_TASK and held[1] == tid:
                        del pending[i]
                        self.skip(held[1], held[4])
                        break
            else:
                pending.append((op, tid, flags, payload, fds))
            got = self.tasks.try_recv()
        if self.retired and pending:
            for held in [m for m in pending if m[0] == P.OP_TASK]:
                pending.remove(held)
                self.skip(held[1], held[4])

    def skip(self, tid: int, fds: list[int]) -> None:
        """Task ``tid`` never starts here: say so (its fds closed)."""
        _transport.close_fds(fds)
        self.chan.send_sync(P.control(P.OP_SKIPPED, tid), [])

    # -- sync mode -----------------------------------------------------------------
    def serve(self) -> None:
        """Serve tasks until EXIT or end of stream; switch to a loop for an async task."""
        recv = self.tasks.recv_sync
        fns = self.fns
        pending = self.pending
        while True:
            if pending:  # read ahead, before the last outcome went
                op, tid, flags, payload, fds = pending.popleft()
            else:
                got = recv()  # one blocking recvmsg
                assert got is not None  # (no deadline)
                data, fds = got
                if len(data) == _NOARGS_SIZE and not fds:
                    # ``fn()`` of a DEF'd sync function: one unpack, no payload, no pickle.
                    kind, op, tid, flags, fid = _NOARGS_HEAD(data)
                    if kind == _KIND_DATA and op == P.OP_TASK and flags == _APPLY_NOARGS:
                        fn = fns.get(fid)
                        if fn is not None and type(fn) is not _BadDef and not self.retired:
                            self.call(tid, flags, fn, (), None)
                            continue
                op, tid, flags, payload, fds = P.unpack(data, fds)
            if op == P.OP_TASK:
                if self.retired:  # sent before the pool learnt: it goes elsewhere
                    self.skip(tid, fds)
                    continue
                if flags & P.F_ASYNC:
                    self.sync_mode = False
                    self.run_coro(_loop.serve_async(self, (tid, flags, payload, fds)))
                    return
                self.run_sync(tid, flags, payload, fds)
            elif op == P.OP_DEF:
                self.define(tid, payload, fds)
            elif op == P.OP_EXIT:
                _transport.close_fds(fds)
                return
            else:  # a CANCEL that crossed its task's result: nothing to cancel
                _transport.close_fds(fds)

    def define(self, fid: int, payload: bytes | memoryview, fds: list[int]) -> None:
        if len(self.fns) >= P.MAX_FNS:  # the parent dropped the same one (P.MAX_FNS)
            del self.fns[next(iter(self.fns))]
        try:
            self.fns[fid] = _reduction.loads(payload, fds)
            if self.records is not None:
                self.forward_logging()
        except BaseException as exc:  # noqa: BLE001 - each task naming it reports it
            self.fns[fid] = _BadDef(
                P.ErrorPayload.of(exc, "the task's function could not be unpickled in the worker")
            )

    def load(
        self, tid: int, flags: int, payload: bytes | memoryview, fds: list[int]
    ) -> tuple[Any, Any, Any] | None:
        """``(fn, items, kwds)`` of a task; None once a failure to unpickle is answered."""
        try:
            fid = P.function_id(payload)
            if not fid:
                whole: Any = _reduction.loads(payload[4:], fds)
                fn, items, kwds = whole
                return fn, items, kwds
            fn = self.fns[fid]
            if type(fn) is _BadDef:
                _transport.close_fds(fds)
                if self.sync_mode:
                    self.read_ahead()
                send(self.chan, P.OP_ERR, tid, fn.error)
                return None
            if flags & P.F_NOARGS:
                return fn, (), None
            args: Any = _reduction.loads(payload[4:], fds)
            return fn, args[0], args[1]
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the task's outcome
            if self.sync_mode:
                self.read_ahead()
            send(
                self.chan,
                P.OP_ERR,
                tid,
                P.ErrorPayload.of(exc, "the task could not be unpickled in the worker"),
            )
            return None

    def run_sync(self, tid: int, flags: int, payload: bytes | memoryview, fds: list[int]) -> None:
        msg = self.load(tid, flags, payload, fds)
        if msg is not None:
            self.call(tid, flags, *msg)

    def call(self, tid: int, flags: int, fn: Any, items: Any, kwds: Any) -> None:
        """Run a sync task (an apply's call, or a map's chunk) and send its outcome."""
        try:
            if flags & P.F_APPLY:
                result = fn(*items, **kwds) if kwds else fn(*items)
                if type(result) is _Coroutine:
                    result = self.run_coro(result)
            else:
                # A loop in C, as multiprocessing's mapstar: a chunk may hold thousands.
                result = list(itertools.starmap(fn, items) if flags & P.F_STAR else map(fn, items))
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the task's outcome
            del fn, items, kwds
            if self.guard is not None:
                self.check_memory(tid)
            self.read_ahead()
            send(self.chan, P.OP_ERR, tid, P.ErrorPayload.of(exc))
            return
        del items, kwds
        if self.guard is not None:
            self.check_memory(tid)
        if (got := self.take()) is not None or self.poll(0) or self.retired:
            self.read_ahead(got)  # the task queued ahead, a CANCEL of it
        if result is None:
            self.chan.send_sync(_OK_NONE_HEAD + _TID.pack(tid, 0) + _NONE, [])
        else:
            self.reply(tid, fn, result, chunk=not flags & P.F_APPLY)

    def send_error(self, tid: int, exc: BaseException) -> None:
        """Send ``exc`` as task ``tid``'s outcome."""
        send(self.chan, P.OP_ERR, tid, P.ErrorPayload.of(exc))

    def reply(self, tid: int, fn: object, result: object, chunk: bool = False) -> None:
        """Send ``result`` (OK), or why it cannot be sent (ERR).

        ``chunk``: ``result`` is a map chunk's list. A sync function that returned
        coroutines for it (a partial of an ``async def``, say) cannot be pickled; they are
        awaited then, and the list sent again: no scan of every chunk for the rare case.
        """
        try:
            send(self.chan, P.OP_OK, tid, result)
        except _transport.Closed:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the task's outcome
            if chunk and type(result) is list and _Coroutine in set(map(type, result)):
                try:
                    result = [self.run_coro(r) if type(r) is _Coroutine else r for r in result]
                except BaseException as run_exc:  # noqa: BLE001
                    send(self.chan, P.OP_ERR, tid, P.ErrorPayload.of(run_exc))
                    return
                self.reply(tid, fn, result)
                return
            if isinstance(exc, OSError):  # e.g. SharedMemoryError: keep its type
                err: BaseException = exc
            else:
                err = pickle.PicklingError(
                    f"the result of {P.fn_name(fn)} could not be pickled to return it to "
                    f"the parent: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
            send(self.chan, P.OP_ERR, tid, P.ErrorPayload.of(err))


def main(
    rank: int,
    stream: socket.socket,
    start: Start,
    results: socket.socket,
    stacks: socket.socket | None = None,
    max_memory: int | None = None,
) -> None:
    """Entry point of a pool worker (``multiprocessing.Process`` target).

    ``stream`` and ``results`` are stream sockets the pool made
    (``_stream.stream_socketpair``): the pool's messages come on ``stream``, the
    worker's go on ``results``; its stack, should it be terminated, on ``stacks``
    (:func:`aiomp._pool.health.print_stack_on_sigterm`). ``max_memory``: the pool's
    (see :class:`aiomp._pool.health.MemoryGuard`). ``start``: see
    :class:`aiomp._child.bootstrap.Start`.
    """
    _child.begin(start)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stacks is not None:
        _health.print_stack_on_sigterm(stacks)
    import multiprocessing

    try:
        multiprocessing.current_process().daemon = False
    except AssertionError:  # pragma: no cover - not a multiprocessing child
        pass
    worker = Server(_stream.Stream(stream), _stream.Stream(results))
    worker.max_memory = max_memory
    if start.output is not None:
        worker.records = (start.output[3], start.output[4])
    try:
        if not worker.initialize():
            sys.exit(1)
        worker.serve()
    except _transport.Closed:
        pass  # the parent has gone or stopped listening: nothing left to do
    finally:
        if worker.runner is not None:
            worker.runner.close()
        worker.tasks.close()
        worker.chan.close()
        if worker.records is not None:
            worker.records[0].close()
