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
    CANCEL, EXIT, READY: the header alone

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
import sys

from .._wire import datagram as _transport
from .._wire import pickling as _reduction

# parent -> worker
OP_INIT = 1
OP_TASK = 2
OP_CANCEL = 3
OP_EXIT = 4
OP_DEF = 9
# worker -> parent
OP_READY = 5
OP_INIT_ERR = 6
OP_OK = 7
OP_ERR = 8

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

    def __init__(self, op: int, tid: int, flags: int, prefix: bytes, obj: object) -> None:
        from .._wire import pickling as _reduction

        self._msg = _reduction.dumps(obj, header(op, tid, flags) + prefix)
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


class RemoteTraceback(Exception):
    """The ``__cause__`` of an exception re-raised from a worker: its traceback there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class ErrorPayload:
    """A worker's exception as it travels to the parent (the body of ERR and INIT_ERR).

    The exception is pickled on its own, and unpickled once in the worker to be sure the
    parent can rebuild it, so that its type, text and traceback arrive even when the
    exception itself cannot.
    """

    __slots__ = ("data", "message", "text", "type_name", "why")

    def __init__(
        self, text: str, data: bytes | None, type_name: str, message: str, why: str
    ) -> None:
        self.text = text  # the formatted traceback in the worker
        self.data = data  # the pickled exception, or None
        self.type_name = type_name
        self.message = message  # str(exc)
        self.why = why  # why the exception itself could not travel

    def __reduce__(self) -> tuple[object, ...]:
        return ErrorPayload, (self.text, self.data, self.type_name, self.message, self.why)

    @classmethod
    def of(cls, exc: BaseException, context: str = "") -> ErrorPayload:
        from .._child import bootstrap as _child

        text = _child.format_error(exc, context)
        kind = type(exc)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
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
        return cls(text, data, name, message, why)

    def exception(self, name: str, slot: int, pid: int | None) -> BaseException:
        """The exception to raise in the parent for worker ``name``: the worker's own
        (or a ProcessRaisedException naming its type and text when it cannot travel),
        with the worker's traceback as its ``__cause__``, as concurrent.futures does."""
        exc, why = self.rebuild()
        if exc is None:
            from .._errors import ProcessRaisedException

            exc = ProcessRaisedException(
                f"{name} raised {self.type_name}: {self.message}\n"
                f"(the exception itself could not be sent to the parent: {why})",
                slot,
                pid,
            )
        exc.__cause__ = RemoteTraceback(f'\n"""\n{name}:\n{self.text}"""')
        return exc

    def rebuild(self) -> tuple[BaseException | None, str]:
        """``(the exception, or None with why not)``, in the parent.

        A ``BaseException`` travels as itself (``SystemExit``, ``KeyboardInterrupt``, as
        ``concurrent.futures`` raises them), except a cancellation: a task that cancelled
        itself must not look like a cancellation of its caller. One that unpickling the
        exception raised here is raised instead, as :func:`unpickling_failed` says.
        """
        if self.data is None:
            return None, self.why
        try:
            exc = pickle.loads(self.data)
        except BaseException as err:  # noqa: BLE001 - never out of the reader callback
            if stops(err):
                err.add_note(f"(raised while unpickling a task's {self.type_name} in the parent)")
                return err, ""
            return None, f"{type(err).__name__}: {err}"
        if is_cancellation(exc):
            return None, f"it is a cancellation ({self.type_name}), not the caller's"
        return exc, ""


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is (or, a group, holds) asyncio's CancelledError or trio's Cancelled.

    Looked up in ``sys.modules``: an exception of a module never imported cannot exist.
    """
    for module, name in _CANCELLATIONS:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    if isinstance(exc, BaseExceptionGroup):
        return any(is_cancellation(e) for e in exc.exceptions)
    return False


_CANCELLATIONS = (("asyncio", "CancelledError"), ("trio", "Cancelled"))


def stops(exc: BaseException) -> bool:
    """Whether ``exc`` asks the program to stop (``SystemExit``, ``KeyboardInterrupt``, any
    ``BaseException`` but a cancellation): it must reach a caller as itself, never be
    wrapped in an ``Exception`` that ``except Exception`` would swallow."""
    return not isinstance(exc, Exception) and not is_cancellation(exc)


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
