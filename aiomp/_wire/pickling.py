"""Pickling for aiomp messages: one :class:`Message` per object sent, array reducers.

``dumps(obj)`` returns a :class:`Message`: it owns everything the message holds until it
has been sent (the pickle bytes, the fds that travel with them, the memfd that carries a
body too large for a datagram, and what reducers asked to keep or undo). ``loads`` takes
the bytes and the received fds.

Objects that own OS resources (queues, events, shared-memory segments) reduce themselves
through :func:`add_fd` and rebuild through :func:`take_fd`: they only pickle inside an
aiomp message. Arrays and tensors are reduced by type: each library's module registers
its reducers with :func:`register` in its own ``init_reductions()`` (as
``torch.multiprocessing.reductions.init_reductions`` does for ``ForkingPickler``), and
:func:`init_reductions` below calls it, the first time a message is pickled after numpy,
torch or cupy has been imported. Importing aiomp loads none of them. Reducers keep what
they need per message in its :class:`Scratchpad` (:func:`current`). A module may also
register a way to send an object of its type that is a whole message without the pickler
(:func:`register_alone`: numpy's single arrays, see
docs/decisions/0013-one-array-messages.md).

A reducer that finds, part way through a message, that an earlier object should have been
pickled differently (a small view sent inline before the array it views) calls
:func:`retry`: :func:`dumps` then discards the first pass and pickles the message once
more, and reducers see the first pass's scratchpad as ``current().first``.

Standard library only: children import this module.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import sys
import threading

from .._errors import TransportError
from . import datagram as _datagram
from . import stream as _stream

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

_local = threading.local()
_dispatch: dict[type, object] = dict(copyreg.dispatch_table)
#: The libraries whose types aiomp reduces -> the aiomp module whose ``init_reductions()``
#: registers its reducers (imported only once the library itself has been).
REDUCERS = {
    "numpy": "aiomp._arrays.numpy",
    "torch": "aiomp._arrays.torch",
    "cupy": "aiomp._cuda.ipc",
}
_hooked: set[str] = set()
#: type -> ``fast(obj, prefix)``: the whole message for an object of exactly that type
#: sent alone, without the pickler, or None to pickle it (see :func:`register_alone`).
_alone: dict[type, Callable[[Any, bytes], Message | None]] = {}
_NO_FDS: list[int] = []  # shared by messages without fds; never mutated
if TYPE_CHECKING:
    _Hooks = tuple[
        list[Callable[[], object]], list[Callable[[], object]], list[Callable[[], object]]
    ]


class Message:
    """One pickled message and everything it holds until it has been sent.

    ``body`` is the pickle (after any ``prefix`` given to :func:`dumps`) and ``fds`` the
    fds of the objects in it: what the queue's overflow stores. :meth:`datagram` and
    :meth:`framed` give what a transport sends, a body too large for a datagram moved
    into a memfd that the message owns. Then exactly one of:

    - :meth:`close`: the message was sent (once, plus once per :meth:`sent_again`);
    - :meth:`discard`: it never will be: what pickling promised receivers is undone.

    Both are idempotent; ``with dumps(obj) as msg:`` closes on success and discards when
    the block raises (cancellation included). A message dropped without either is closed.
    """

    __slots__ = ("_hooks", "_memfd", "_wire", "body", "fds")

    def __init__(
        self,
        body: bytes,
        fds: list[int] = _NO_FDS,
        cleanups: list[Callable[[], object]] | None = None,
        unsent: list[Callable[[], object]] | None = None,
        again: list[Callable[[], object]] | None = None,
    ) -> None:
        self.body = body
        self.fds = fds
        # (cleanups, unsent, again) until closed; None when pickling asked for nothing
        self._hooks: _Hooks | None = (
            None if cleanups is None else (cleanups, unsent or [], again or [])
        )
        self._wire: tuple[bytes, list[int]] | None = None
        self._memfd = -1

    def datagram(self) -> tuple[bytes, list[int]]:
        """``(datagram, fds)`` for a ``SOCK_SEQPACKET`` send; made once.

        A body larger than :data:`~aiomp._wire.datagram.MAX_INLINE` is written to a memfd
        that travels as the last fd (``TransportError`` if memory is short).
        """
        wire = self._wire
        if wire is None:
            body = self.body
            if len(body) <= _datagram.MAX_INLINE:
                wire = self._wire = (b"\x00" + body, self.fds)  # KIND_DATA
            else:
                self._memfd = _datagram.memfd_with(body)
                wire = self._wire = (_datagram.large_header(len(body)), [*self.fds, self._memfd])
        return wire

    def framed(self) -> tuple[bytes, list[int]]:
        """``(frame, fds)`` for a :class:`~aiomp._wire.stream.Stream`: the datagram behind
        its frame header."""
        datagram, fds = self.datagram()
        return _stream.frame(datagram, len(fds)), fds

    def is_plain(self) -> bool:
        """Whether the body is the whole message: no fd, nothing to undo or count (it may
        then be copied and sent any number of times)."""
        return not self.fds and self._hooks is None

    def sent_again(self) -> None:
        """The message goes to one more receiver than it was pickled for: objects that
        count their sends (a ``file_system`` storage's reference count) count one more."""
        if self._hooks is not None:
            for fn in self._hooks[2]:
                fn()

    def close(self) -> None:
        """Sent (or given up after sending): release what this process held for it."""
        memfd, self._memfd = self._memfd, -1
        if memfd >= 0:
            _datagram.close_fds((memfd,))
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            for fn in reversed(hooks[0]):
                fn()

    def discard(self) -> None:
        """Never to be sent: undo what pickling promised receivers, then :meth:`close`."""
        hooks = self._hooks
        try:
            if hooks is not None:
                for fn in reversed(hooks[1]):
                    fn()
        finally:
            self.close()

    def __enter__(self) -> Message:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()

    def __del__(self) -> None:
        if self._hooks is not None or self._memfd >= 0:
            self.close()


class Scratchpad:
    """What reducers keep while one message is pickled (:func:`current`).

    :meth:`once` holds one object per key (a type or a private sentinel of the reducer's
    module, never a string) for the whole message; :meth:`keep_alive` pins an object until
    the message is pickled, so that no ``id()`` or address seen in it is reused meanwhile.
    """

    __slots__ = (
        "_kept",
        "_notes",
        "again",
        "cleanups",
        "fd_index",
        "fds",
        "first",
        "retry",
        "unsent",
    )

    def __init__(self, first: Scratchpad | None = None) -> None:
        self.fds: list[int] = []
        self.fd_index: dict[int, int] = {}
        self.cleanups: list[Callable[[], object]] = []
        self.unsent: list[Callable[[], object]] = []
        self.again: list[Callable[[], object]] = []
        self._notes: dict[object, Any] = {}
        self._kept: list[object] = []
        #: on a second pass (see :func:`retry`), the first pass's scratchpad; else None
        self.first = first
        self.retry = False

    def once(self, key: object, make: Callable[[], T]) -> T:
        """The object kept under ``key`` for this message, made by ``make()`` on first use."""
        notes = self._notes
        if key in notes:
            # One table for every key; ``make`` fixed this key's type when it was stored.
            return notes[key]  # type: ignore[no-any-return]
        value = notes[key] = make()
        return value

    def get(self, key: object) -> Any:
        """What :meth:`once` made under ``key`` in this message, or None."""
        return self._notes.get(key)

    def keep_alive(self, obj: object) -> None:
        """Keep ``obj`` alive until this message has been pickled."""
        self._kept.append(obj)

    def message(self, body: bytes) -> Message:
        return Message(body, self.fds, self.cleanups, self.unsent, self.again)


def init_reductions() -> None:
    """Register the reducers of every array library this process has imported.

    Each library's reducers live in the aiomp module that owns its types (:data:`REDUCERS`)
    and are registered there, by its ``init_reductions()``. Only libraries already in
    ``sys.modules`` are hooked: aiomp never imports numpy, torch or cupy on its own. (A
    table, because nothing tells a process that a library has just been imported short of
    an import hook, which would slow every import.)
    """
    for library, module in REDUCERS.items():
        if library in sys.modules and library not in _hooked:
            _hooked.add(library)
            importlib.import_module(module).init_reductions()


def reducers() -> dict[type, object]:
    """The table of reducers by type (live: later registrations show in it)."""
    return _dispatch


def register(cls: type, reducer: object) -> None:
    """Reduce instances of exactly ``cls`` with ``reducer(obj)`` in aiomp messages."""
    _dispatch[cls] = reducer


def register_alone(cls: type, fast: Callable[[Any, bytes], Message | None]) -> None:
    """Send an instance of exactly ``cls`` that is a whole message by ``fast(obj, prefix)``.

    ``fast`` returns the :class:`Message` (its body a pickle that rebuilds the object,
    after ``prefix``), or None to leave the object to the pickler. It must produce what
    the pickler would (see docs/decisions/0013-one-array-messages.md).
    """
    _alone[cls] = fast


class _Pickler(pickle.Pickler):
    # typeshed declares dispatch_table as an instance attribute; a class-wide table is what
    # pickle reads, and saves copying it into every Pickler.
    dispatch_table = _dispatch  # type: ignore[assignment]


_PENDING = object()  # a message is being pickled; its scratchpad is made on first use
#: Values of these types cannot hold an fd or an array: pickled with plain ``pickle.dumps``
#: (no reducer, no fd), a third of the reducing pickler's cost.
PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes))


def dumps(obj: object, prefix: bytes = b"") -> Message:
    """Pickle ``obj`` for an aiomp message, after ``prefix`` (a header the receiver strips).

    Raises in the caller if it cannot be pickled, with everything pickling made undone.
    """
    cls = type(obj)
    if cls in PLAIN or (
        cls is tuple
        # mypy does not narrow on ``type(obj) is tuple`` (isinstance would admit subclasses).
        and len(obj) <= 8  # type: ignore[arg-type]
        and all(type(x) in PLAIN for x in obj)  # type: ignore[attr-defined]
    ):
        # The common small item: ten times cheaper than the reducing pickler.
        body = pickle.dumps(obj, 5)
        return Message(prefix + body if prefix else body)
    if len(_hooked) < len(REDUCERS):
        init_reductions()
    fast = _alone.get(cls)
    if fast is not None:
        alone = fast(obj, prefix)
        if alone is not None:
            return alone
    return _dump_retrying(obj, prefix, None)


def dumps_with(
    make: Callable[[io.BytesIO], pickle.Pickler], obj: object, prefix: bytes = b""
) -> Message:
    """:func:`dumps` with the pickler ``make(buffer)`` returns: a subclass of this module's
    that pickles some objects its own way (:mod:`aiomp._wire.byvalue`'s)."""
    if len(_hooked) < len(REDUCERS):
        init_reductions()
    return _dump_retrying(obj, prefix, make)


def _dump_retrying(
    obj: object, prefix: bytes, make: Callable[[io.BytesIO], pickle.Pickler] | None
) -> Message:
    msg, pad = _dump(obj, prefix, _PENDING, make)
    if pad is not None and pad.retry:
        msg.discard()
        msg, _ = _dump(obj, prefix, Scratchpad(first=pad), make)
    return msg


def _dump(
    obj: object,
    prefix: bytes,
    start: object,
    make: Callable[[io.BytesIO], pickle.Pickler] | None = None,
) -> tuple[Message, Scratchpad | None]:
    if make is None:
        # One pickler per thread, reused: building one costs more than pickling a small item.
        cached = _local.__dict__.pop("pickler", None)
        if cached is None:
            buf = io.BytesIO()
            cached = (buf, _Pickler(buf, protocol=5))
    else:
        buf = io.BytesIO()
        cached = (buf, make(buf))
    buf, pickler = cached
    prev = getattr(_local, "out", None)
    _local.out = start
    try:
        if prefix:
            buf.write(prefix)
        pickler.dump(obj)
        body = buf.getvalue()
    except BaseException:
        pad = _local.out
        if isinstance(pad, Scratchpad):
            pad.message(b"").discard()
        raise
    finally:
        pad = _local.out
        _local.out = prev
        pickler.clear_memo()
        buf.seek(0)
        buf.truncate()
        if make is None:
            _local.pickler = cached
    if isinstance(pad, Scratchpad):
        return pad.message(body), pad
    return Message(body), None


def current() -> Scratchpad:
    """The scratchpad of the message being pickled; raises outside :func:`dumps`."""
    pad = getattr(_local, "out", None)
    if pad is _PENDING:
        pad = _local.out = Scratchpad()
    elif pad is None:
        raise pickle.PicklingError(
            "this aiomp object can only travel inside aiomp (spawn args, a Queue, a Pool task)"
        )
    return pad


def retry() -> None:
    """Ask :func:`dumps` to pickle the current message a second time.

    The first pass is discarded (:meth:`Message.discard`) once it ends; during the second,
    ``current().first`` is the first pass's scratchpad, so reducers can decide with the
    whole message in view. A call during the second pass is ignored: it must not need one.
    """
    pad = current()
    if pad.first is None:
        pad.retry = True


def add_fd(fd: int) -> int:
    """Attach ``fd`` to the message being pickled; returns its index for :func:`take_fd`."""
    pad = current()
    index = pad.fd_index.get(fd)
    if index is None:
        if len(pad.fds) >= _datagram.MAX_FDS - 1:
            # R1: a typed error at the call. EINVAL: what sendmsg says past SCM_MAX_FD.
            raise TransportError(
                22,
                f"a message can carry at most {_datagram.MAX_FDS - 1} file descriptors "
                "(queues, events and shared segments); send fewer objects per message",
            )
        index = pad.fd_index[fd] = len(pad.fds)
        pad.fds.append(fd)
    return index


def on_sent(fn: Callable[[], object]) -> None:
    """Run ``fn()`` once the message being pickled has been sent or discarded."""
    current().cleanups.append(fn)


def on_copy(fn: Callable[[], object]) -> None:
    """Run ``fn()`` for every extra time the message being pickled is sent
    (:meth:`Message.sent_again`)."""
    current().again.append(fn)


def on_unsent(fn: Callable[[], object]) -> None:
    """Run ``fn()`` if the message being pickled is discarded unsent (:meth:`Message.discard`).

    Senders call ``discard`` on every path that gives up; a sender that does not
    (an error it did not foresee) leaves the promise in place, which is the safe side.
    """
    current().unsent.append(fn)


class _InState:
    __slots__ = ("fds", "taken")

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.taken: set[int] = set()


def loads(body: bytes | memoryview, fds: list[int]) -> object:
    """Unpickle a message; fds that no object took are closed, also on error."""
    if not fds:
        return pickle.loads(body)
    state = _InState(fds)
    prev = getattr(_local, "inc", None)
    _local.inc = state
    try:
        return pickle.loads(body)
    finally:
        _local.inc = prev
        _datagram.close_fds([fd for i, fd in enumerate(fds) if i not in state.taken])


def take_fd(index: int) -> int:
    """Take ownership of the message's ``index``-th fd while unpickling."""
    state: _InState = _local.inc
    state.taken.add(index)
    return state.fds[index]


def peek_fd(index: int) -> int:
    """The message's ``index``-th fd, left for :func:`loads` to close."""
    state: _InState = _local.inc
    return state.fds[index]
