"""Event: a cross-process flag with ``threading.Event`` semantics, async and blocking.

The flag and a generation live in a shared memfd; each thread that waits registers an
eventfd of its own in the event's registry (a datagram socket connected to itself), and
``set()`` writes to every one registered (see docs/decisions/0032-event-wake-ups.md).
Owns the state memfd and its mapping, the registry socket, and each thread's waker
eventfd, released when the object is garbage-collected. An event rebuilt in a process
that already holds it is that same object. A *child* module.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import threading
import time
import weakref

from .. import _loop
from .._loop import readers as _readers
from .._loop.finalizers import finalizer
from .._loop.waiters import FdWaiters
from .._wire import datagram as _datagram
from .._wire import pickling as _pickling
from .overflow import take_token
from .sync import no_loop

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children receiving an event skip typing
if TYPE_CHECKING:
    from collections.abc import Coroutine
    from typing import Any

_EFD = os.EFD_NONBLOCK | os.EFD_CLOEXEC
_live: weakref.WeakValueDictionary[bytes, Event] = weakref.WeakValueDictionary()


class Event:
    """A cross-process event with ``threading.Event`` semantics: a ``set()`` wakes every
    waiter waiting at that moment, in every process, thread and loop, even if ``clear()``
    follows at once.

    ``await e.wait()`` waits on the event loop; ``e.sync.wait(timeout)`` blocks. The flag
    and a generation (changed by every ``set()``) live in shared memory; a waiter returns
    once the flag is set or the generation has changed since it began. Each thread that
    waits registers an eventfd of its own in the event's registry, and ``set()`` writes
    to every one registered: see docs/decisions/0032-event-wake-ups.md.
    """

    def __init__(self) -> None:
        state = os.memfd_create("aiomp-event", os.MFD_CLOEXEC)
        try:
            os.ftruncate(state, _STATE_SIZE)
            registry = _new_registry()
        except BaseException:
            os.close(state)
            raise
        self._setup(os.urandom(16), state, registry)

    def _setup(self, token: bytes, state_fd: int, registry: socket.socket) -> None:
        self._token = token
        self._state_fd = state_fd
        self._state = mmap.mmap(state_fd, _STATE_SIZE)
        self._registry = registry
        self._units = threading.local()  # each thread's _Wakers: .aio (its loop), .sync
        self.sync = SyncEvent(self)
        self._finalizer = weakref.finalize(self, _close_event, state_fd, self._state, registry)
        _live[token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        add = _pickling.add_fd
        return _rebuild_event, (self._token, add(self._state_fd), add(self._registry.fileno()))

    def __repr__(self) -> str:
        return f"<aiomp.Event {'set' if self.is_set() else 'unset'}>"

    def is_set(self) -> bool:
        return self._state[_FLAG] == 1

    def set(self) -> None:
        """Set the event; every waiter in every process wakes, even if ``clear()``
        follows at once."""
        state = self._state
        state[_FLAG] = 1
        state[_GEN:_GEN_END] = os.urandom(8)  # fresh, whoever else sets at the same time
        _wake_registered(self._registry, state)

    def clear(self) -> None:
        self._state[_FLAG] = 0

    def wait(self) -> Coroutine[Any, Any, None]:
        """Wait until the event is set (``await e.wait()``): return once it is set, or
        once a ``set()`` happened since the wait began, even if cleared since.
        Cancellation leaves the event as it was (this thread's registration may stay, and
        then serves its next wait). Raises RuntimeError at once where no event loop runs:
        use ``e.sync.wait``."""
        if _loop.running_loop() is None:
            raise no_loop("Event.wait", "e.sync.wait()")
        return self._wait()

    async def _wait(self) -> None:
        state = self._state
        begun = state[_GEN:_GEN_END]
        if state[_FLAG]:
            return
        # This thread's waker: its tasks are the only ones that wait on it, so every
        # task it wakes runs on this thread's loop (never an event of another loop).
        waker = self._waker("aio")
        registry = self._registry
        while True:
            armed = waker.arm(registry, state)
            if _fired(state, begun):
                return
            if not armed:  # the registry is full: a set() makes room
                await waker.waits.wait(registry.fileno(), write=True)
                continue
            await waker.waits.wait(waker.fd)
            waker.take()
            if _fired(state, begun):
                return

    def _waker(self, kind: str) -> _Waker:
        waker: _Waker | None = getattr(self._units, kind, None)
        if waker is None:
            waker = _Waker()
            setattr(self._units, kind, waker)
        return waker


class SyncEvent:
    """The blocking side of an :class:`Event` (``e.sync``)."""

    __slots__ = ("_e",)

    def __init__(self, e: Event) -> None:
        self._e = e

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set, or until a ``set()`` happened since the call (even if cleared
        since): True. False if ``timeout`` seconds pass first."""
        e = self._e
        state = e._state
        begun = state[_GEN:_GEN_END]
        if state[_FLAG]:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        waker = e._waker("sync")
        registry = e._registry
        while True:
            armed = waker.arm(registry, state)
            if _fired(state, begun):
                return True
            if armed:
                if not _datagram.wait_fd_sync(waker.fd, deadline=deadline):
                    return _fired(state, begun)
                waker.take()
            elif not _datagram.wait_fd_sync(registry.fileno(), write=True, deadline=deadline):
                return _fired(state, begun)
            if _fired(state, begun):
                return True


# An Event's shared state: the flag (1 while set), then the generation, 8 random bytes
# that every set() replaces (random, not counted: two processes setting at once need no
# lock to each write a value no waiter has seen).
_FLAG = 0
_GEN = 8
_GEN_END = 16
_STATE_SIZE = 16
_REGISTRATION = 16  # a registration's body: the waker's id, then the generation it saw
_REGISTRATION_FDS = socket.CMSG_SPACE(4)
_RECV_FLAGS = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
_PEEK_FLAGS = _RECV_FLAGS | socket.MSG_PEEK


def _fired(state: mmap.mmap, begun: bytes) -> bool:
    """Whether a wait that began at generation ``begun`` is over."""
    return state[_FLAG] == 1 or state[_GEN:_GEN_END] != begun


def _new_registry() -> socket.socket:
    """A datagram socket connected to itself: what one holder sends, any holder receives,
    and no other socket may send to it (the kernel refuses a foreign sender of a socket
    that is connected, with EPERM). Its name is an abstract one the kernel picks."""
    registry = socket.socket(
        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
    )
    try:
        registry.bind("")
        registry.connect(registry.getsockname())
    except BaseException:
        registry.close()
        raise
    return registry


class _Waker:
    """One thread's wake-up for one Event (one for its loop's tasks, one for ``e.sync``).

    Registering sends the waker's eventfd, with the generation seen, into the event's
    registry; a ``set()`` takes each registration made before its own generation and
    writes to the eventfd. Tasks of one thread share the waker: one waits on the eventfd,
    the others for it (:class:`~aiomp._loop.waiters.FdWaiters`), all on that thread's loop.
    """

    __slots__ = ("__weakref__", "fd", "id", "parked", "waits")

    def __init__(self) -> None:
        self.fd = os.eventfd(0, _EFD)
        self.id = os.urandom(8)
        self.parked = b""  # the generation in this waker's registration, b"" if none
        self.waits = FdWaiters(_readers.wait_readable)
        weakref.finalize(self, _close_waker, self.fd)

    def arm(self, registry: socket.socket, state: mmap.mmap) -> bool:
        """Make sure that a registration of this waker, sent after the event's current
        generation was written, waits in ``registry``; False if the registry is full.
        The waiter reads the generation again after this: any ``set()`` then either
        writes a generation the waiter sees or finds the registration."""
        gen = state[_GEN:_GEN_END]
        if self.parked == gen:
            return True  # no set() since it was sent: it still waits there
        # A set() since: the registration was taken (and written to), or is about to be.
        take_token(self.fd)
        try:
            registry.sendmsg(
                [self.id + gen],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, self.fd.to_bytes(4, sys.byteorder))],
                socket.MSG_DONTWAIT,
            )
        except BlockingIOError:
            return False
        self.parked = gen
        return True

    def take(self) -> None:
        """After a wake-up: a write to the eventfd means the registration was taken."""
        if take_token(self.fd):
            self.parked = b""


def _wake_registered(registry: socket.socket, state: mmap.mmap) -> None:
    """Write to the waker of every registration made before the current generation.

    Registrations queue in the order sent, and one made after the current generation was
    written has its waiter see that generation (it reads it after registering): so the
    first such registration ends the walk, and everything behind it stays for the next
    ``set()``. The walk is bounded by the registrations already there. Each registration is
    written to before it is taken: a setter killed in between leaves it for the next
    ``set()`` (a spurious wake-up at worst). Another setter may take the head first: what
    this one then takes is written to as well.
    """
    while True:
        head = _registration(registry, _PEEK_FLAGS)
        if head is None:
            return
        body, fd = head
        if body[8:] == state[_GEN:_GEN_END]:
            _datagram.close_fds([fd])
            return
        _write_and_close(fd)
        taken = _registration(registry, _RECV_FLAGS)
        if taken is None:
            return
        if taken[0][:8] != body[:8]:  # not the same waker's
            _write_and_close(taken[1])
        else:
            _datagram.close_fds([taken[1]])


def _registration(registry: socket.socket, flags: int) -> tuple[bytes, int] | None:
    """The registry's first registration (its body and a new fd for its waker), taken or
    peeked at; None if there is none."""
    try:
        body, anc, _, _ = registry.recvmsg(_REGISTRATION, _REGISTRATION_FDS, flags)
    except BlockingIOError:
        return None
    fds = _datagram.fds_in(anc)
    _datagram.close_fds(fds[1:])
    return body, (fds[0] if fds else -1)


def _write_and_close(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.eventfd_write(fd, 1)
    except OSError:
        pass  # the counter is full: the waker is awake already
    finally:
        os.close(fd)


@finalizer
def _close_waker(fd: int) -> None:
    _readers.forget(fd)
    os.close(fd)


@finalizer
def _close_event(state_fd: int, state: mmap.mmap, registry: socket.socket) -> None:
    state.close()
    registry.close()
    os.close(state_fd)


def _rebuild_event(token: bytes, state_fd: int, registry: int) -> Event:
    existing = _live.get(token)
    if isinstance(existing, Event):
        return existing  # the message's fds are closed by loads
    take = _pickling.take_fd
    e = Event.__new__(Event)
    e._setup(token, take(state_fd), socket.socket(fileno=take(registry)))
    return e


def _after_fork_in_child() -> None:
    # An Event's wakers are the parent's: their eventfds are shared with it, and a set()
    # writing to one would wake whichever process read it first. Fresh ones on first use.
    for e in list(_live.values()):
        e._units = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)

for _cls in (Event, SyncEvent):
    _cls.__module__ = "aiomp"
