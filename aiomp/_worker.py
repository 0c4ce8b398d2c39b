"""The worker process of :class:`aiomp.Pool`, and the wire format it shares with the pool.

A worker is started with ``_context.launch(main, slot, ...)``. It:

1. asks the kernel to SIGKILL it when its parent dies, ignores SIGINT (a Ctrl-C in the
   terminal reaches the whole process group; the parent decides what happens to its
   workers), and clears the ``daemon`` flag ``multiprocessing`` gave it, so that a task
   may start processes of its own (a nested pool, a data loader);
2. receives ``INIT``: runs the initializer, then answers ``READY`` (or ``INIT_ERR`` and
   exits with code 1);
3. serves ``TASK`` messages until ``EXIT`` or end of stream (the parent has gone).

A worker starts *sync*: a blocking ``recvmsg`` / run / ``sendmsg`` loop that imports
neither asyncio nor anyio. The first task whose function is a coroutine function (or an
async initializer) starts an asyncio event loop (uvloop when installed), and the worker
serves from that loop for the rest of its life: each task becomes an asyncio task, the
control socket is read by a loop reader callback, and ``CANCEL`` cancels one task. A sync
task runs on the loop thread too: the pool only sends one to a worker that holds no other
task, so it blocks nothing.

Wire format: every message, both ways, is one ``_transport`` datagram whose body is a
10-byte header (op, task id as 8 little-endian bytes, flags) followed by a pickle (made
with ``_reduction``, so fds for shared arrays ride in the same datagram). The task id sits
outside the pickle so that a message that cannot be unpickled can still be answered.

Standard library and aiomp's small modules only: this module is imported by every worker.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import sys
import types

from . import _child, _reduction, _transport

# Not `from typing import TYPE_CHECKING`: workers must not pay for importing typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# parent -> worker
OP_INIT = 1
OP_TASK = 2
OP_CANCEL = 3
OP_EXIT = 4
# worker -> parent
OP_READY = 5
OP_INIT_ERR = 6
OP_OK = 7
OP_ERR = 8

#: TASK flags: fn is a coroutine function; items are argument tuples (starmap); the task
#: is one call ``fn(*args, **kwds)`` whose result is the value itself (apply), not a list.
F_ASYNC = 1
F_STAR = 2
F_APPLY = 4

HEADER_SIZE = 10


def header(op: int, tid: int = 0, flags: int = 0) -> bytes:
    return bytes((op,)) + tid.to_bytes(8, "little") + bytes((flags,))


def parse(body: bytes | memoryview) -> tuple[int, int, int, memoryview]:
    """``(op, tid, flags, payload)`` of a message body."""
    view = memoryview(body)
    return view[0], int.from_bytes(view[1:9], "little"), view[9], view[HEADER_SIZE:]


#: Values of these types cannot hold an fd or an array: plain pickle, a third of the cost.
PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes))
DATA = bytes((_transport.KIND_DATA,))  # the framing _transport.encode gives a small body


def send(sock: socket.socket, head: bytes, payload: object) -> None:
    """Pickle ``payload`` behind ``head`` and send it, blocking while the buffer is full.

    Raises whatever pickling raises (nothing has been sent then) and
    :class:`_transport.Closed` when the other end has gone.
    """
    if type(payload) in PLAIN:
        datagram = DATA + head + pickle.dumps(payload, protocol=5)
        if len(datagram) <= _transport.MAX_INLINE:
            _transport.send_sync(sock, datagram, [])
            return
    out = _reduction.dumps(payload)
    try:
        datagram, fds, extra = _transport.encode(head + out.body, out.fds)
        try:
            _transport.send_sync(sock, datagram, fds)
        finally:
            if extra >= 0:
                os.close(extra)
    finally:
        out.close()


def error_payload(exc: BaseException, context: str = "") -> tuple[object, ...]:
    """``(traceback text, pickled exc or None, type name, str(exc), why it did not pickle)``.

    The exception is pickled on its own (and unpickled once here, to be sure the parent can
    rebuild it), so that its type and text arrive even when the exception itself cannot.
    """
    text = _child.format_error(exc, context)
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    data: bytes | None = None
    why = ""
    try:
        pickled = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)
        data = pickled
    except BaseException as err:  # noqa: BLE001 - any failure means: send the text only
        why = f"{type(err).__name__}: {err}"
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001
        message = "<str() failed>"
    return text, data, name, message, why


def _fn_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class Worker:
    """The state of one worker process."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.runner: Any = None  # asyncio.Runner, made on first need

    # -- loop ----------------------------------------------------------------------
    def get_runner(self) -> Any:
        if self.runner is None:
            import asyncio

            factory: Callable[[], Any]
            try:
                import uvloop

                factory = uvloop.new_event_loop
            except ImportError:
                factory = asyncio.new_event_loop
            self.runner = asyncio.Runner(loop_factory=factory)
        return self.runner

    def run_coro(self, coro: object) -> object:
        return self.get_runner().run(coro)

    # -- start-up ------------------------------------------------------------------
    def initialize(self) -> bool:
        got = _transport.recv_sync(self.sock)
        assert got is not None
        _, body, fds = _transport.decode(*got)
        op, _, _, payload = parse(body)
        assert op == OP_INIT, op
        try:
            msg: Any = _reduction.loads(payload, fds)
            initializer, initargs = msg
            if initializer is not None:
                result = initializer(*initargs)
                if isinstance(result, types.CoroutineType):
                    self.run_coro(result)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            send(self.sock, header(OP_INIT_ERR), error_payload(exc))
            return False
        send(self.sock, header(OP_READY), None)
        return True

    # -- sync mode -----------------------------------------------------------------
    def serve(self) -> None:
        """Serve tasks until EXIT or end of stream; switch to a loop for an async task."""
        sock = self.sock
        while True:
            got = _transport.recv_sync(sock)  # one blocking recvmsg
            assert got is not None
            _, body, fds = _transport.decode(*got)
            op, tid, flags, payload = parse(body)
            if op == OP_TASK:
                if flags & F_ASYNC:
                    self.run_coro(self.serve_async((tid, flags, payload, fds)))
                    return
                self.run_sync(tid, flags, payload, fds)
            elif op == OP_EXIT:
                _transport.close_fds(fds)
                return
            else:  # a CANCEL that crossed its task's result: nothing to cancel
                _transport.close_fds(fds)

    def load(self, tid: int, payload: memoryview, fds: list[int]) -> Any:
        try:
            return _reduction.loads(payload, fds)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            send(self.sock, header(OP_ERR, tid),
                 error_payload(exc, "the task could not be unpickled in the worker"))
            return None

    def run_sync(self, tid: int, flags: int, payload: memoryview, fds: list[int]) -> None:
        msg = self.load(tid, payload, fds)
        if msg is None:
            return
        fn, items, kwds = msg
        try:
            if flags & F_APPLY:
                result = fn(*items, **(kwds or {}))
                if isinstance(result, types.CoroutineType):
                    result = self.run_coro(result)
            else:
                # A loop in C, as multiprocessing's mapstar: a chunk may hold thousands.
                result = list(itertools.starmap(fn, items) if flags & F_STAR else map(fn, items))
                if types.CoroutineType in set(map(type, result)):  # a sync fn made coroutines
                    result = [self.run_coro(r) if isinstance(r, types.CoroutineType) else r
                              for r in result]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            del msg, fn, items, kwds
            send(self.sock, header(OP_ERR, tid), error_payload(exc))
            return
        del msg, items, kwds
        self.reply(tid, fn, result)

    def reply(self, tid: int, fn: object, result: object) -> None:
        try:
            send(self.sock, header(OP_OK, tid), result)
        except _transport.Closed:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, OSError):  # e.g. SharedMemoryError: keep its type
                err: BaseException = exc
            else:
                err = pickle.PicklingError(
                    f"the result of {_fn_name(fn)} could not be pickled to return it to "
                    f"the parent: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
            send(self.sock, header(OP_ERR, tid), error_payload(err))

    # -- async mode ----------------------------------------------------------------
    async def serve_async(self, first: tuple[int, int, memoryview, list[int]]) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        tasks: dict[int, asyncio.Task[None]] = {}

        def finish() -> None:
            if not finished.done():
                finished.set_result(None)

        def handle(tid: int, op: int, flags: int, payload: memoryview, fds: list[int]) -> None:
            if op == OP_TASK:
                task = loop.create_task(self.run_async(tid, flags, payload, fds))
                tasks[tid] = task

                def forget(_: object) -> None:
                    tasks.pop(tid, None)

                task.add_done_callback(forget)
                return
            _transport.close_fds(fds)
            if op == OP_CANCEL:
                running = tasks.get(tid)
                if running is not None:
                    running.cancel()
            elif op == OP_EXIT:
                finish()

        def readable() -> None:
            try:
                while (got := _transport.try_recv(self.sock)) is not None:
                    _, body, fds = _transport.decode(*got)
                    op, tid, flags, payload = parse(body)
                    handle(tid, op, flags, payload, fds)
            except _transport.Closed:
                finish()
            except Exception as exc:  # noqa: BLE001 - a message was lost: die, as sync mode does
                loop.remove_reader(fd)
                if not finished.done():
                    finished.set_exception(exc)

        tid, flags, payload, fds = first
        handle(tid, OP_TASK, flags, payload, fds)
        fd = self.sock.fileno()
        loop.add_reader(fd, readable)
        try:
            readable()
            await finished
        finally:
            loop.remove_reader(fd)
        # EXIT comes only when we hold no task; end of stream means the parent has gone.
        for task in list(tasks.values()):
            task.cancel()

    async def run_async(self, tid: int, flags: int, payload: memoryview, fds: list[int]) -> None:
        try:
            await self._run_async(tid, flags, payload, fds)
        except _transport.Closed:
            pass  # the parent has gone; serve_async is ending too

    async def _run_async(self, tid: int, flags: int, payload: memoryview, fds: list[int]) -> None:
        msg = self.load(tid, payload, fds)
        if msg is None:
            return
        fn, items, kwds = msg
        try:
            if flags & F_APPLY:
                result = fn(*items, **(kwds or {}))
                if isinstance(result, types.CoroutineType):
                    result = await result
            else:
                result = []
                star = flags & F_STAR
                for x in items:
                    r = fn(*x) if star else fn(x)
                    if isinstance(r, types.CoroutineType):
                        r = await r
                    result.append(r)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - CancelledError too: the parent asked
            del msg, fn, items, kwds
            send(self.sock, header(OP_ERR, tid), error_payload(exc))
            return
        del msg, items, kwds
        self.reply(tid, fn, result)


def main(rank: int, sock: socket.socket, parent_pid: int) -> None:
    """Entry point of a pool worker (``multiprocessing.Process`` target)."""
    _child.set_parent_death_signal()
    if not _child._parent_alive(parent_pid):
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import multiprocessing

    try:
        multiprocessing.current_process().daemon = False
    except AssertionError:  # pragma: no cover - not a multiprocessing child
        pass
    worker = Worker(sock)
    try:
        if not worker.initialize():
            sys.exit(1)
        worker.serve()
    except _transport.Closed:
        pass  # the parent has gone or stopped listening: nothing left to do
    finally:
        if worker.runner is not None:
            worker.runner.close()
        sock.close()
