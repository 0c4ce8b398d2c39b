"""Pickling for aiomp messages: objects that carry file descriptors, and array reducers.

``dumps(obj)`` returns an :class:`Outgoing`: the pickle bytes, the fds that must travel in
the same datagram, and cleanups to run once it has been sent (or has failed). ``loads``
takes the bytes and the received fds.

Objects that own OS resources (queues, events, shared-memory segments) reduce themselves
through :func:`add_fd` and rebuild through :func:`take_fd`: they only pickle inside an
aiomp message. Arrays and tensors are reduced by type: each library's module registers
its reducers with :func:`register` in its own ``init_reductions()`` (as
``torch.multiprocessing.reductions.init_reductions`` does for ``ForkingPickler``), and
:func:`init_reductions` below calls them, the first time a message is pickled after
numpy, torch or cupy has been imported. Importing aiomp loads none of them.

A reducer that finds, part way through a message, that an earlier object should have been
pickled differently (a small view sent inline before the array it views) calls
:func:`retry`: :func:`dumps` then discards the first pass and pickles the message once
more, and reducers see what the first pass recorded as ``current().first``.

Standard library only: children import this module.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading

from . import _transport

_local = threading.local()
_reducers: dict[type, object] = {}
_dispatch: dict[type, object] = dict(copyreg.dispatch_table)
_hooked: set[str] = set()
_LIBRARIES = 3  # numpy, torch, cupy: see init_reductions


class Outgoing:
    """A pickled message and the fds that must travel with it.

    Call :meth:`close` once it has been sent (or will not be): it closes the fds that were
    opened for this message only.
    """

    __slots__ = ("_cleanups", "_copies", "_unsent", "body", "fds")

    def __init__(
        self,
        body: bytes,
        fds: list[int],
        cleanups: list[object],
        unsent: list[object] | None = None,
        copies: list[object] | None = None,
    ) -> None:
        self.body = body
        self.fds = fds
        self._cleanups = cleanups
        self._unsent = unsent or []
        self._copies = copies or []

    def copies(self, n: int) -> None:
        """This message is sent ``n`` times in all (pickling counted one): tell the
        objects in it that count their sends (see :func:`on_copy`)."""
        for _ in range(n - 1):
            for fn in self._copies:
                fn()  # type: ignore[operator]

    def discard(self) -> None:
        """The message will not be sent: undo what pickling it promised, then close."""
        unsent, self._unsent = self._unsent, []
        try:
            for fn in reversed(unsent):
                fn()  # type: ignore[operator]
        finally:
            self.close()

    def close(self) -> None:
        cleanups, self._cleanups = self._cleanups, []
        for fn in reversed(cleanups):
            fn()  # type: ignore[operator]

    def __del__(self) -> None:
        if self._cleanups:
            self.close()


class _State:
    __slots__ = ("cleanups", "copies", "fd_index", "fds", "first", "memo", "retry", "unsent")

    def __init__(self, first: dict[object, object] | None = None) -> None:
        self.fds: list[int] = []
        self.fd_index: dict[int, int] = {}
        self.cleanups: list[object] = []
        self.unsent: list[object] = []
        self.copies: list[object] = []
        #: reducers' notes for this message (cleared with it)
        self.memo: dict[object, object] = {}
        #: on a second pass (see :func:`retry`), the first pass's memo; else None
        self.first = first
        self.retry = False


def init_reductions() -> None:
    """Register the reducers of every array library this process has imported.

    Each library's reducers live in the module that owns its types and are registered
    there, by its ``init_reductions()``. Only libraries already in ``sys.modules`` are
    hooked: aiomp never imports numpy, torch or cupy on its own.
    """
    mods = sys.modules
    if "numpy" in mods and "numpy" not in _hooked:
        _hooked.add("numpy")
        from . import _numpy

        _numpy.init_reductions()
    if "torch" in mods and "torch" not in _hooked:
        _hooked.add("torch")
        from . import _torch

        _torch.init_reductions()
    if "cupy" in mods and "cupy" not in _hooked:
        _hooked.add("cupy")
        from . import _cuda

        for cls, reducer in _cuda.reducers().items():
            register(cls, reducer)


def register(cls: type, reducer: object) -> None:
    """Reduce instances of exactly ``cls`` with ``reducer(obj)`` in aiomp messages."""
    _dispatch[cls] = reducer


class _Pickler(pickle.Pickler):
    dispatch_table = _dispatch  # type: ignore[assignment]


_PENDING = object()  # a message is being pickled; its state is made on first use


def dumps(obj: object) -> Outgoing:
    """Pickle ``obj`` for an aiomp message. Raises in the caller if it cannot be pickled."""
    if len(_hooked) < _LIBRARIES:
        init_reductions()
    out, state = _dump(obj, _PENDING)
    if state is not None and state.retry:
        out.discard()
        out, _ = _dump(obj, _State(first=state.memo))
    return out


def _dump(obj: object, start: object) -> tuple[Outgoing, _State | None]:
    # One pickler per thread, reused: building one costs more than pickling a small item.
    cached = _local.__dict__.pop("pickler", None)
    if cached is None:
        buf = io.BytesIO()
        cached = (buf, _Pickler(buf, protocol=5))
    buf, pickler = cached
    prev = getattr(_local, "out", None)
    _local.out = start
    try:
        pickler.dump(obj)
        body = buf.getvalue()
    except BaseException:
        state = _local.out
        if isinstance(state, _State):
            Outgoing(b"", [], state.cleanups, state.unsent).discard()
        raise
    finally:
        state = _local.out
        _local.out = prev
        pickler.clear_memo()
        buf.seek(0)
        buf.truncate()
        _local.pickler = cached
    if isinstance(state, _State):
        return Outgoing(body, state.fds, state.cleanups, state.unsent, state.copies), state
    return Outgoing(body, [], []), None


def current() -> _State:
    """The message being pickled; raises if called outside :func:`dumps`."""
    state = getattr(_local, "out", None)
    if state is _PENDING:
        state = _local.out = _State()
    elif state is None:
        raise pickle.PicklingError(
            "this aiomp object can only travel inside aiomp (spawn args, a Queue, a Pool task)"
        )
    return state


def retry() -> None:
    """Ask :func:`dumps` to pickle the current message a second time.

    The first pass is discarded (:meth:`Outgoing.discard`) once it ends; during the second,
    ``current().first`` is the first pass's memo, so reducers can decide with the whole
    message in view. A call during the second pass is ignored: it must not need one.
    """
    state = current()
    if state.first is None:
        state.retry = True


def add_fd(fd: int) -> int:
    """Attach ``fd`` to the message being pickled; returns its index for :func:`take_fd`."""
    state = current()
    index = state.fd_index.get(fd)
    if index is None:
        if len(state.fds) >= _transport.MAX_FDS - 1:
            raise pickle.PicklingError(
                f"a message can carry at most {_transport.MAX_FDS - 1} file descriptors "
                "(queues, events and shared segments); send fewer objects per message"
            )
        index = state.fd_index[fd] = len(state.fds)
        state.fds.append(fd)
    return index


def on_sent(fn: object) -> None:
    """Run ``fn()`` once the message being pickled has been sent or discarded."""
    current().cleanups.append(fn)


def on_copy(fn: object) -> None:
    """Run ``fn()`` for every extra time the message being pickled is sent
    (:meth:`Outgoing.copies`)."""
    current().copies.append(fn)


def on_unsent(fn: object) -> None:
    """Run ``fn()`` if the message being pickled is discarded unsent (:meth:`Outgoing.discard`).

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
        _transport.close_fds([fd for i, fd in enumerate(fds) if i not in state.taken])


def take_fd(index: int) -> int:
    """Take ownership of the message's ``index``-th fd while unpickling."""
    state: _InState = _local.inc
    state.taken.add(index)
    return state.fds[index]


def peek_fd(index: int) -> int:
    """The message's ``index``-th fd, left for :func:`loads` to close."""
    state: _InState = _local.inc
    return state.fds[index]
