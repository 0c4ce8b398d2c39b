"""The one error report a child sends its parent: spawn's children and the Pool's workers.

:class:`ErrorPayload` is an exception as it travels: its traceback text, the exception
pickled on its own (and unpickled once in the child, to be sure the parent can rebuild
it), its type's name and its message, so that the text always arrives even when the
exception itself cannot. :func:`report_error` sends spawn's ``("err", payload)`` report;
the Pool's worker puts the payload in an ERR frame. Owns nothing; standard library, ``_wire``
and ``_loop`` only (every child imports it). Which exceptions are cancellations is
``aiomp._loop.is_cancellation``'s to say.
"""

from __future__ import annotations

import pickle
import socket

from .._errors import ProcessRaisedException
from .._loop import is_cancellation
from .._wire import datagram as _transport
from .._wire import pickling as _reduction


def format_error(exc: BaseException, context: str = "", traceback: bool = True) -> str:
    """``exc``'s traceback (its one-line summary without ``traceback``), after
    ``context:`` when given."""
    if traceback:
        import traceback as tb

        text = "".join(tb.format_exception(exc))
    else:
        text = f"{type(exc).__name__}: {exc}\n"
    return f"{context}:\n{text}" if context else text


class RemoteTraceback(Exception):
    """The ``__cause__`` of an exception re-raised from a worker: its traceback there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class ErrorPayload:
    """A child's exception as it travels to the parent (see the module docstring)."""

    __slots__ = ("data", "message", "text", "type_name", "why")

    def __init__(
        self, text: str, data: bytes | None, type_name: str, message: str, why: str
    ) -> None:
        self.text = text  # the formatted traceback in the child
        self.data = data  # the pickled exception, or None
        self.type_name = type_name
        self.message = message  # str(exc)
        self.why = why  # why the exception itself could not travel

    def __reduce__(self) -> tuple[object, ...]:
        return ErrorPayload, (self.text, self.data, self.type_name, self.message, self.why)

    @classmethod
    def of(cls, exc: BaseException, context: str = "", traceback: bool = True) -> ErrorPayload:
        """``exc`` ready to travel; ``context`` and ``traceback`` as :func:`format_error`
        takes them."""
        text = format_error(exc, context, traceback)
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
            exc = ProcessRaisedException(
                f"{name} raised {self.type_name}: {self.message}\n"
                f"(the exception itself could not be sent to the parent: {why})",
                slot,
                pid,
            )
        exc.__cause__ = self.traceback(name)
        return exc

    def traceback(self, name: str) -> RemoteTraceback:
        """The child's traceback, headed ``name``: the cause of what it raised, here."""
        return RemoteTraceback(f'\n"""\n{name}:\n{self.text}"""')

    def cause(self, name: str) -> BaseException:
        """The ``__cause__`` of spawn's :class:`ProcessRaisedException` for child ``name``:
        the child's exception rebuilt here, with its :meth:`traceback` as its own cause,
        as the Pool raises it; only that traceback when it cannot be rebuilt."""
        remote = self.traceback(name)
        exc, _ = self.rebuild()
        if exc is None:
            return remote
        exc.__cause__ = remote
        return exc

    def rebuild(self) -> tuple[BaseException | None, str]:
        """``(the exception, or None with why not)``, in the parent.

        A ``BaseException`` travels as itself (``SystemExit``, ``KeyboardInterrupt``, as
        ``concurrent.futures`` raises them), except a cancellation: a task that cancelled
        itself must not look like a cancellation of its caller. One that unpickling the
        exception raised here is raised instead, when it :func:`stops` the program.
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


def stops(exc: BaseException) -> bool:
    """Whether ``exc`` asks the program to stop (``SystemExit``, ``KeyboardInterrupt``, any
    ``BaseException`` but a cancellation): it must reach a caller as itself, never be
    wrapped in an ``Exception`` that ``except Exception`` would swallow."""
    return not isinstance(exc, Exception) and not is_cancellation(exc)


def send_message(sock: socket.socket, out: _reduction.Message) -> None:
    """Send ``out`` on spawn's report socket, then close it; a parent that stopped
    listening (it is terminating us) is no error."""
    try:
        _transport.send_sync(sock, *out.datagram())
    except _transport.Closed:
        pass
    finally:
        out.close()


def report_error(
    sock: socket.socket, exc: BaseException, context: str = "", traceback: bool = True
) -> None:
    """Send spawn's ``("err", ErrorPayload)`` report; its text always arrives.

    ``traceback=False`` sends only the exception's one-line summary as the text. Then
    ends the socket's sending side: the parent watches it for that hang-up, which comes
    now, before this process's teardown, even if a grandchild holds a copy of it.
    """
    send_message(sock, _reduction.dumps(("err", ErrorPayload.of(exc, context, traceback))))
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the parent is gone, or stopped listening
