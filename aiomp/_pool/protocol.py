"""The wire format between :class:`aiomp.Pool` and its workers, used by both sides.

Every message is one ``_transport`` datagram framed on a :class:`_stream.Stream` (a
stream socket: see docs/decisions/0002-stream-channels.md for why), one per direction
(see docs/decisions/0026-two-channels.md). Its body is a 10-byte header
followed by a pickle made with ``_reduction`` (so fds of shared arrays ride in the same
datagram)::

    header   op: u8 | task id: u64 little-endian | flags: u8
    TASK     header | function id: u32 | pickle of (items, kwds), or (fn, items, kwds)
    DEF      header (task id = function id) | pickle of the function
    OK       header | pickle of the result
    ERR      header | pickle of an ErrorPayload
    INIT     header | pickle of (initializer, initargs)
    CANCEL, EXIT, READY, SKIPPED: the header alone

The task id sits outside the pickle so that a message that cannot be unpickled can still
be answered. A plain function (pickled by reference) is sent to each worker once, in a
``DEF``; its tasks then name it by id and carry only their arguments (or nothing at all,
with ``F_NOARGS``). Function id 0 means the callable travels in every task: a bound
method or a partial, whose state may change between calls.

The fused structs below pack a stream frame header, the transport's kind byte and the
message header in one call: the ``apply`` round trip packs each message once.

A *child* module: every worker imports it (see *Light children* in docs/architecture.md).
"""

from __future__ import annotations

import functools
import pickle
import struct

from .._child.report import ErrorPayload as ErrorPayload
from .._child.report import RemoteTraceback as RemoteTraceback
from .._child.report import stops
from .._loop import is_cancellation as is_cancellation
from .._wire import datagram as _transport
from .._wire import pickling as _reduction

# parent -> worker
OP_INIT = 1
OP_TASK = 2
OP_CANCEL = 3
OP_EXIT = 4
OP_DEF = 9
#: The most DEF'd functions a worker keeps: a DEF beyond it drops the oldest, in the worker
#: and in the parent's record of it alike (the stream keeps them in step), so that
#: closures made per call (sent by value, each with an id) do not pile up in workers.
MAX_FNS = 128
# worker -> parent
OP_READY = 5
OP_INIT_ERR = 6
OP_OK = 7
OP_ERR = 8
#: Sent before task ``tid``'s outcome: the worker's private memory grew past the pool's
#: ``max_memory`` (the payload: ``(grown, max_memory)`` in bytes); the pool retires it
#: after that task.
OP_RETIRE = 10
#: Task ``tid``, held by the worker behind the one it ran, was not started and never will
#: be there: a CANCEL came for it first, or the worker is retiring (``max_memory``). Sent
#: before the outcome of the task it waited behind: a task held there that has no SKIPPED
#: by then has started (see docs/decisions/0065-tasks-queued-ahead.md).
OP_SKIPPED = 11

#: TASK flags: fn is a coroutine function; items are argument tuples (starmap); the task
#: is one call ``fn(*args, **kwds)`` whose result is the value itself (apply), not a list;
#: ``fn()`` with no arguments, the task carrying no pickle at all.
F_ASYNC = 1
F_STAR = 2
F_APPLY = 4
F_NOARGS = 8

HEADER_SIZE = 10
_KIND_DATA = _transport.KIND_DATA
#: An inline datagram: the transport's kind byte, then the header.
HEAD = struct.Struct("<BBQB")
#: The same behind its stream frame header (datagram length, fd count).
_FRAMED_HEAD = struct.Struct("<IBBBQB")
#: A framed TASK header with its function id.
_FRAMED_TASK = struct.Struct("<IBBBQBI")
FID = struct.Struct("<I")
#: Below this a received payload is copied out of its datagram (cheaper than a view).
COPY_BELOW = 2048

#: The plain types (one set, shared with the queue's pickling).
PLAIN = _reduction.PLAIN


def header(op: int, tid: int = 0, flags: int = 0) -> bytes:
    return bytes((op,)) + tid.to_bytes(8, "little") + bytes((flags,))


def control(op: int, tid: int = 0) -> bytes:
    """A framed message that is a header alone (CANCEL, EXIT, READY)."""
    return _FRAMED_HEAD.pack(HEADER_SIZE + 1, 0, _KIND_DATA, op, tid, 0)


def framed(op: int, tid: int, flags: int, pickled: bytes) -> bytes:
    """A framed message whose small pickle stays inline (no fds)."""
    return (
        _FRAMED_HEAD.pack(HEADER_SIZE + 1 + len(pickled), 0, _KIND_DATA, op, tid, flags) + pickled
    )


def task_frame(tid: int, flags: int, fid: int, pickled: bytes) -> bytes:
    """A small framed TASK without fds."""
    return (
        _FRAMED_TASK.pack(HEADER_SIZE + 5 + len(pickled), 0, _KIND_DATA, OP_TASK, tid, flags, fid)
        + pickled
    )


#: ``noargs_task(tid, flags, fid)``: the whole framed TASK of ``fn()`` (flags with
#: ``F_NOARGS``), packed in one C call: the ``apply`` round trip's hot path.
noargs_task = functools.partial(_FRAMED_TASK.pack, HEADER_SIZE + 5, 0, _KIND_DATA, OP_TASK)
#: The fused header of a received inline TASK datagram (after its stream frame header):
#: kind, op, task id, flags, function id.
TASK_HEAD = struct.Struct("<BBQBI")


def task_body(fid: int, pickled: bytes) -> bytes:
    """What follows a TASK header: the function id, then the pickle."""
    return FID.pack(fid) + pickled


def fits_inline(pickled: bytes) -> bool:
    """Whether a pickle this size travels inside its datagram with a task header."""
    return len(pickled) < _transport.MAX_INLINE - 32


def function_id(payload: bytes | memoryview) -> int:
    return int(FID.unpack_from(payload)[0])


def unpack(data: bytes, fds: list[int]) -> tuple[int, int, int, bytes | memoryview, list[int]]:
    """``(op, tid, flags, payload, fds)`` of a received datagram."""
    if data[0] == _KIND_DATA:
        _, op, tid, flags = HEAD.unpack_from(data)
        payload = data[11:] if len(data) < COPY_BELOW else memoryview(data)[11:]
        return op, tid, flags, payload, fds
    _, body, fds = _transport.decode(data, fds)
    view = memoryview(body)
    return view[0], int.from_bytes(view[1:9], "little"), view[9], view[HEADER_SIZE:], fds


class TaskMessage:
    """One encoded message of the pool's wire that may carry fds (a task, or a worker's
    reply): ``obj`` pickled after its header, framed.

    ``close()`` releases what this process holds for it, whether it was sent or not;
    ``discard()`` also undoes what pickling promised to receivers that will never come
    (a ``file_system`` send count). Both are those of the :class:`aiomp._wire.pickling.Message`
    it wraps.
    """

    __slots__ = ("_msg", "fds", "frame")

    def __init__(
        self, op: int, tid: int, flags: int, prefix: bytes, obj: object, by_value: bool = False
    ) -> None:
        from .._wire import byvalue
        from .._wire import pickling as _reduction

        # by_value: what a worker cannot import by name goes by value (a task's function
        # and arguments; see aiomp._wire.byvalue)
        dumps = byvalue.dumps if by_value else _reduction.dumps
        self._msg = dumps(obj, header(op, tid, flags) + prefix)
        try:
            self.frame, self.fds = self._msg.framed()
        except BaseException:
            self._msg.close()
            raise

    def sent_again(self) -> None:
        """The message goes to one more receiver than it was pickled for."""
        self._msg.sent_again()

    def close(self) -> None:
        self.frame, self.fds = b"", []
        self._msg.close()

    def discard(self) -> None:
        """Never to be sent: undo what pickling promised, then close."""
        self.frame, self.fds = b"", []
        self._msg.discard()


def unpickling_failed(exc: BaseException, what: str) -> BaseException:
    """What the caller gets when unpickling ``what`` (a task's result) raised ``exc`` in the
    parent: ``pickle.UnpicklingError`` from ``exc``, or ``exc`` itself when it
    :func:`stops` the program, as ``anyio.to_process`` raises it, with a note."""
    if stops(exc):
        exc.add_note(f"(raised while unpickling {what} in the parent)")
        return exc
    err = pickle.UnpicklingError(
        f"{what} could not be unpickled in the parent: {type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc
    return err


def fn_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
