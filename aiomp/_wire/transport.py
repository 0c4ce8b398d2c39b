"""Message channels between processes: unix ``SOCK_SEQPACKET`` sockets, one datagram a message.

A message is one byte of kind followed by its body; a body larger than :data:`MAX_INLINE`
travels in an anonymous memfd whose fd rides in the same datagram (kind ``LARGE``). Why
datagrams: docs/decisions/0001-datagram-queue.md. :class:`Stream` carries the same
datagrams over a ``SOCK_STREAM`` pair, each behind a 5-byte frame header (the length and
how many fds belong to it), for channels with one process at each end (see
docs/decisions/0002-stream-channels.md). The kernel never merges a sendmsg's fds into a later read,
so a Stream's
reader keeps the fds in arrival order and gives each complete frame the first ``nfds``;
one reader and one writer per end, and a sender finishes a frame before the next.

aiomp never changes a socket's blocking mode (the flag is shared by every process holding
it), but an event loop may (uvloop's ``add_reader`` does): so non-blocking calls pass
``MSG_DONTWAIT``, and blocking calls fall back to ``poll`` on EAGAIN. Async callers wait
for readiness on the running loop (:func:`wait_readable`, see
docs/decisions/0005-kept-readers.md). A
*child* module (see *Light children*).
"""

from __future__ import annotations

import array
import mmap
import os
import select
import socket
import struct
import threading
import time

from .. import _loop
from .._errors import TransportError

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: children skip importing typing
if TYPE_CHECKING:
    import asyncio
    from typing import Any

#: Largest body sent inside the datagram; larger bodies go through a memfd.
MAX_INLINE = 64 * 1024
#: The kernel's limit on fds in one ``SCM_RIGHTS`` message (``SCM_MAX_FD``).
MAX_FDS = 253

KIND_DATA = 0
KIND_LARGE = 1
KIND_CLOSED = 2

_FD_SIZE = array.array("i").itemsize
_ANC_SIZE = socket.CMSG_SPACE(MAX_FDS * _FD_SIZE)
_RECV_SIZE = MAX_INLINE + 64
# Plain ints: socket's IntFlag arithmetic costs microseconds on a hot path.
_SEND_FLAGS = SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
_RECV_BLOCKING = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_CTRUNC | socket.MSG_TRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)


def socketpair(large: bool = True) -> tuple[socket.socket, socket.socket]:
    """A connected pair of ``SOCK_SEQPACKET`` sockets, with large buffers unless
    ``large`` is false (a pair that carries one datagram each way keeps the kernel's
    defaults: four ``setsockopt`` calls less)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if large:
        for s in (a, b):
            grow_buffers(s)
    return a, b


def grow_buffers(s: socket.socket, receive: bool = True) -> None:
    """Ask for 4 MiB socket buffers each way, or the send buffer alone (best effort)."""
    # A queue of small items is bounded by the sender's buffer (each datagram costs its
    # size plus ~1 KiB of kernel overhead). Ask for 4 MiB; root may force past wmem_max.
    for opt, force in _BUFFERS if receive else _BUFFERS[:1]:
        try:
            s.setsockopt(socket.SOL_SOCKET, force, 4 << 20)
        except OSError:
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass


_BUFFERS = ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33))  # with SO_*BUFFORCE


def close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def memfd_with(body: bytes | bytearray | memoryview) -> int:
    """A fresh memfd holding ``body``, for a body too large for a datagram (the caller
    owns it: :class:`aiomp._wire.pickling.Message` closes it once sent)."""
    fd = os.memfd_create("aiomp-msg", os.MFD_CLOEXEC)
    try:
        _write_all(fd, body)
    except BaseException:
        os.close(fd)
        raise
    return fd


def large_header(size: int) -> bytes:
    """The datagram of a ``size``-byte body sent in a memfd (the datagram's last fd)."""
    return bytes((KIND_LARGE,)) + size.to_bytes(8, "little")


def decode(datagram: bytes, fds: list[int]) -> tuple[int, bytes | memoryview, list[int]]:
    """A received datagram's ``(kind, body, fds)`` (see
    :meth:`aiomp._wire.pickling.Message.datagram`); a LARGE body's memfd is consumed."""
    kind = datagram[0]
    if kind == KIND_LARGE:
        size = int.from_bytes(datagram[1:9], "little")
        fd = fds.pop()
        try:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                body: bytes | memoryview = m[:]
        finally:
            os.close(fd)
        return KIND_DATA, body, fds
    return kind, memoryview(datagram)[1:], fds


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data).cast("B")
    try:
        os.posix_fallocate(fd, 0, len(view))
    except OSError as exc:
        raise TransportError(exc.errno, f"no memory for a {len(view)}-byte message: {exc}") from exc
    while view:
        view = view[os.write(fd, view) :]


class Closed(Exception):
    """The other end of a point-to-point channel has gone (EOF)."""


def try_send(sock: socket.socket, datagram: bytes, fds: list[int], blocking: bool = False) -> bool:
    """Send without waiting: True if sent, False if the socket buffer is full.

    With ``blocking``, wait in the kernel instead (unless another process's event loop
    made the socket non-blocking: then it may still return False).
    """
    flags = _MSG_NOSIGNAL if blocking else _SEND_FLAGS
    try:
        if fds:
            sock.sendmsg((datagram,), [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))], flags)
        else:
            sock.send(datagram, flags)  # no iovec or cmsg to build: cheaper
    except BlockingIOError:
        return False
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise Closed from exc
    except OSError as exc:
        raise _send_error(exc, fds) from exc
    return True


def try_recv(sock: socket.socket, blocking: bool = False) -> tuple[bytes, list[int]] | None:
    """Receive one datagram without waiting: ``(datagram, fds)``, or None when empty.

    With ``blocking``, wait in the kernel (unless another process's event loop made the
    socket non-blocking: then it may still return None). Raises :class:`Closed` at EOF.
    """
    flags = _RECV_BLOCKING if blocking else _RECV_FLAGS
    try:
        data, anc, flags, _ = sock.recvmsg(_RECV_SIZE, _ANC_SIZE, flags)
    except BlockingIOError:
        return None
    except ConnectionResetError as exc:
        raise Closed from exc
    fds = fds_in(anc) if anc else []
    if flags & _TRUNCATED:
        close_fds(fds)
        if flags & _MSG_TRUNC:
            raise TransportError(0, "a message was truncated (corrupt sender?); it is lost")
        raise fds_dropped("The message is lost.")
    if not data:
        close_fds(fds)
        raise Closed
    return data, fds


def fds_in(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of a ``recvmsg``'s ancillary data (``SCM_RIGHTS``), in order."""
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % _FD_SIZE]))
    return fds


def fds_dropped(consequence: str) -> TransportError:
    """The error for a message whose fds the kernel dropped (``MSG_CTRUNC``)."""
    return TransportError(
        24,
        "a message arrived without its file descriptors: this process is at its fd limit "
        f"(RLIMIT_NOFILE={nofile()}); close arrays or raise the limit. {consequence}",
    )


def _send_error(exc: OSError, fds: list[int]) -> OSError:
    """``exc`` from a send, as a TransportError saying why when fds were the cause."""
    if exc.errno in (24, 23, 109):  # EMFILE, ENFILE, ETOOMANYREFS: too many fds in flight
        return TransportError(
            exc.errno,
            f"cannot send {len(fds)} file descriptor(s): too many are in flight or open "
            f"(RLIMIT_NOFILE={nofile()}): receive pending messages or raise the limit",
        )
    return exc


def nofile() -> int:
    """This process's soft ``RLIMIT_NOFILE``, for error messages."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _poll(fd: int, events: int, timeout: float | None) -> bool:
    p = select.poll()
    p.register(fd, events)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return bool(p.poll(ms))


def wait_fd_sync(fd: int, *, write: bool = False, deadline: float | None = None) -> bool:
    """Block until ``fd`` is ready; False if ``deadline`` (a ``time.monotonic()``) passes."""
    events = select.POLLOUT if write else select.POLLIN
    while True:
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            return _poll(fd, events, 0)
        if _poll(fd, events, timeout):
            return True


def send_sync(
    sock: socket.socket, datagram: bytes, fds: list[int], deadline: float | None = None
) -> bool:
    """Send, blocking while the buffer is full; False if ``deadline`` passes first."""
    # One blocking syscall. The socket may have been switched to non-blocking by an
    # event loop in any process holding it (uvloop does): then poll below.
    if deadline is None and try_send(sock, datagram, fds, blocking=True):
        return True
    while not try_send(sock, datagram, fds):
        if not wait_fd_sync(sock.fileno(), write=True, deadline=deadline):
            return False
    return True


def recv_sync(sock: socket.socket, deadline: float | None = None) -> tuple[bytes, list[int]] | None:
    """Receive, blocking while empty; None if ``deadline`` passes first."""
    if deadline is None:
        got = try_recv(sock, blocking=True)
        if got is not None:
            return got
    while (got := try_recv(sock)) is None:
        if not wait_fd_sync(sock.fileno(), deadline=deadline):
            return None
    return got


async def send_async(sock: socket.socket, datagram: bytes, fds: list[int]) -> None:
    """Send, waiting on the event loop while the buffer is full.

    On cancellation nothing has been sent. Only one task per process may wait on one
    socket at a time (callers serialise with a lock).
    """
    import anyio

    while not try_send(sock, datagram, fds):
        await anyio.wait_writable(sock)


async def recv_async(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Receive, waiting on the event loop while empty. On cancellation nothing is consumed."""
    import anyio

    while (got := try_recv(sock)) is None:
        await anyio.wait_readable(sock)
    return got


# -- waiting on the running event loop -------------------------------------------------


async def wait_readable(fd: int) -> None:
    """Wait until ``fd`` is readable, on the running loop (asyncio, uvloop or trio).

    On asyncio and uvloop the loop keeps watching ``fd`` between waits (a :class:`_Reader`,
    see :func:`kept_readable`: any number of tasks may wait) instead of adding and
    removing a reader per wait; on trio this is trio's own ``wait_readable`` (one task per
    process and fd at a time: the queue's waiters fan out). The fd's owner calls
    :func:`forget` before closing it. Cancellation leaves nothing behind but the idle
    watch. See docs/decisions/0005-kept-readers.md.
    """
    loop = _loop.running_asyncio_loop()
    if loop is None:
        import trio

        await trio.lowlevel.wait_readable(fd)
        return
    fut = kept_readable(loop, fd)
    if fut is None:
        import anyio

        await anyio.wait_readable(fd)
        return
    await wait_kept(fd, fut)


def kept_readable(loop: Any, fd: int) -> asyncio.Future[None] | None:
    """A future of ``loop`` resolved once ``fd`` is readable, through the reader kept for
    ``fd`` (made on first use), or None where no reader can be kept (another loop's
    task waits on ``fd``, another thread's running loop keeps it, or the loop has no
    ``add_reader``): then wait another way. Any number of tasks may wait on one fd this
    way: the reader resolves every future it holds. The caller awaits it with
    :func:`wait_kept`."""
    reader = _readers.get(fd)
    if reader is None or reader.loop is not loop:
        if reader is not None:
            if reader.waiters or (
                reader.thread != threading.get_ident() and reader.loop.is_running()
            ):
                # A task of another loop waits, or another thread's loop runs (it may be
                # adding a waiter right now: only its thread changes its reader; issue 25
                # item 8): leave its reader be.
                return None
            reader.remove()
        if type(loop) in _readerless:
            return None
        try:
            reader = _Reader(loop, fd)
        except NotImplementedError:
            _readerless.add(type(loop))
            return None
        _readers[fd] = reader
    fut: asyncio.Future[None] = loop.create_future()
    reader.waiters.append(fut)
    reader.idle = 0
    return fut


async def wait_kept(fd: int, fut: asyncio.Future[None]) -> None:
    """Await a future from :func:`kept_readable`. On cancellation the future is cancelled
    and dropped from the reader; nothing else changes."""
    try:
        await fut
    finally:
        if fut.cancelled():
            drop_waiter(fd, fut)


def drop_waiter(fd: int, fut: asyncio.Future[None]) -> None:
    """A future from :func:`kept_readable` was cancelled: the reader forgets it."""
    reader = _readers.get(fd)
    if reader is not None:
        try:
            reader.waiters.remove(fut)
        except ValueError:
            pass


def forget(fd: int) -> None:
    """``fd`` is about to be closed: stop watching it (see :func:`wait_readable`)."""
    reader = _readers.pop(fd, None)
    if reader is not None:
        reader.remove()


class _Reader:
    """A reader callback that stays registered on an asyncio loop for one fd.

    It watches its own duplicate of the fd, closed only once the loop no longer watches
    it: so a registration never outlives the fd it names, whoever closes the original.
    A report with waiters wakes them all. A loop may report the fd once more after a
    waiter woke and before it read; so a report with nobody waiting is ignored once, and
    the second in a row since the last wait stops the watch (the fd is readable and nobody
    here waits: it would fire at every turn of the loop). On asyncio's own loop that
    second report can also reach a waiter registered after the read (the loop queued it
    before the woken task ran): there the reader looks with ``poll`` before waking anyone.
    uvloop runs woken tasks before it looks at fds again: there it wakes without a look
    (a waiter that finds nothing, another process having read first, waits again).
    """

    __slots__ = ("fd", "idle", "loop", "poll", "thread", "waiters", "watched")

    def __init__(self, loop: Any, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.thread = threading.get_ident()
        self.waiters: list[Any] = []
        self.idle = 0  # reports with nobody waiting, since the last wait began
        self.poll: select.poll | None = None
        self.watched = os.dup(fd)
        try:
            if not type(loop).__module__.startswith("uvloop"):
                self.poll = select.poll()
                self.poll.register(self.watched, select.POLLIN)
            loop.add_reader(self.watched, self.fire)
        except BaseException:
            os.close(self.watched)
            raise

    def fire(self) -> None:
        waiters = self.waiters
        if not waiters:
            self.idle += 1
            if self.idle > 1:
                if _readers.get(self.fd) is self:
                    del _readers[self.fd]
                self.remove()
            return
        if self.poll is not None and not self.poll.poll(0):
            return  # a stale report: what made the fd readable was read since
        self.waiters = []
        for fut in waiters:
            if not fut.done():  # a cancelled waiter's future is done
                fut.set_result(None)

    def remove(self) -> None:
        """Stop watching and close the duplicate (from the loop's thread, or through it)."""
        watched, self.watched = self.watched, -1
        if watched < 0:
            return
        loop = self.loop
        if threading.get_ident() != self.thread and loop.is_running():
            loop.call_soon_threadsafe(_unwatch, loop, watched)
        else:
            _unwatch(loop, watched)


def _unwatch(loop: Any, fd: int) -> None:
    try:
        loop.remove_reader(fd)
    except (RuntimeError, ValueError, OSError):
        pass  # the loop is closed: it watches nothing any more
    os.close(fd)


#: Loop types without ``add_reader`` (an asyncio loop may lack it): waits go through anyio.
_readerless: set[type] = set()
#: fd -> the reader watching it, in this process (a forked child inherits none).
_readers: dict[int, _Reader] = {}


def _after_fork_in_child() -> None:
    # The parent's loops are not ours: close the duplicates, touch no loop (an epoll
    # instance is shared with the parent).
    readers = list(_readers.values())
    _readers.clear()
    close_fds([r.watched for r in readers if r.watched >= 0])


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- point-to-point stream channels ----------------------------------------------------

#: A frame header: the datagram's length, and how many of the fds read belong to it.
FRAME = struct.Struct("<IB")
FRAME_SIZE = FRAME.size
# Below glibc's mmap threshold: a 256 KiB buffer costs an mmap and munmap per read (18 us).
_STREAM_RECV_SIZE = _RECV_SIZE


def stream_socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of ``SOCK_STREAM`` unix sockets with large buffers."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        grow_buffers(s)
    return a, b


def frame(datagram: bytes | bytearray | memoryview, nfds: int = 0) -> bytes:
    """``datagram`` framed for a :class:`Stream`, with ``nfds`` fds."""
    return FRAME.pack(len(datagram), nfds) + datagram


class Stream:
    """One end of a point-to-point channel of framed datagrams over a unix stream socket.

    Owns ``sock`` and the fds received and not yet handed out in a frame (:meth:`close`
    closes both). One task or thread reads and one writes, in each process.
    """

    __slots__ = ("_buf", "_fds", "_pos", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf: bytes = b""  # bytes read and not yet framed, from _pos
        self._pos = 0
        self._fds: list[int] = []  # fds read and not yet handed to a frame, in order

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        fds, self._fds = self._fds, []
        close_fds(fds)
        self._buf = b""
        self._pos = 0

    # -- receiving -------------------------------------------------------------------
    def take(self) -> tuple[bytes, list[int]] | None:
        """The next complete frame's ``(datagram, fds)`` among those read, or None.

        Never touches the socket: a reader that got a frame from :meth:`try_recv` takes the
        others that came in the same read with this.
        """
        buf, pos = self._buf, self._pos
        if len(buf) - pos < FRAME_SIZE:
            return None
        n, nfds = FRAME.unpack_from(buf, pos)
        start = pos + FRAME_SIZE
        end = start + n
        if len(buf) < end:
            return None
        if end == len(buf):
            self._buf, self._pos = b"", 0
        else:
            self._pos = end
        data = buf[start:end]
        if not nfds:
            return data, []
        fds = self._fds
        if len(fds) < nfds:  # cannot happen unless the sender is broken
            raise TransportError(
                0,
                "a message arrived without its file descriptors "
                "(corrupt sender?); the channel is unusable",
            )
        taken = fds[:nfds]
        del fds[:nfds]
        return data, taken

    def _fill(self, flags: int) -> bool:
        """Read once; False if nothing was there. Raises :class:`Closed` at EOF."""
        try:
            data, anc, mflags, _ = self.sock.recvmsg(_STREAM_RECV_SIZE, _ANC_SIZE, flags)
        except BlockingIOError:
            return False
        except ConnectionResetError as exc:
            raise Closed from exc
        self._absorb(data, anc, mflags)
        return True

    def _absorb(self, data: bytes, anc: list[tuple[int, int, bytes]], mflags: int) -> None:
        if anc:
            self._fds.extend(fds_in(anc))
        if mflags & _TRUNCATED:
            # Fds were dropped (this process is at its fd limit): frames and fds are out of
            # step from here on, so nothing more can be trusted on this channel.
            fds, self._fds = self._fds, []
            close_fds(fds)
            raise fds_dropped("The channel is unusable.")
        if not data:
            raise Closed  # a frame cut short by EOF is lost with the sender
        if self._pos == len(self._buf):
            self._buf, self._pos = data, 0
        else:
            self._buf, self._pos = self._buf[self._pos :] + data, 0

    def try_recv(self) -> tuple[bytes, list[int]] | None:
        """One frame's ``(datagram, fds)`` without waiting, or None.

        None means nothing complete has arrived yet; the socket may have been read, so a
        caller that waits for readability must call this again until it returns None.
        Raises :class:`Closed` at EOF.
        """
        if self._pos == len(self._buf):
            # Nothing buffered: read once. The common case, one whole frame without fds,
            # is returned as it came, past the buffer (msg_flags echoes MSG_CMSG_CLOEXEC
            # on Linux: only truncation matters). Written out here and in recv_sync, not
            # in a helper: a frame less per message on the Pool's round trip.
            try:
                data, anc, mflags, _ = self.sock.recvmsg(_STREAM_RECV_SIZE, _ANC_SIZE, _RECV_FLAGS)
            except BlockingIOError:
                return None
            except ConnectionResetError as exc:
                raise Closed from exc
            if not anc and not mflags & _TRUNCATED and len(data) >= FRAME_SIZE:
                n, nfds = FRAME.unpack_from(data)
                if not nfds and n + FRAME_SIZE == len(data):
                    return data[FRAME_SIZE:], []
            self._absorb(data, anc, mflags)
            return self.take()
        got = self.take()
        if got is None and self._fill(_RECV_FLAGS):
            got = self.take()
        return got

    def recv_sync(self, deadline: float | None = None) -> tuple[bytes, list[int]] | None:
        """One frame, blocking while there is none; None if ``deadline`` passes first.

        Without a deadline this is one blocking ``recvmsg`` per read (the cheap wake-up),
        unless an event loop made the socket non-blocking: then it polls.
        """
        if deadline is None and self._pos == len(self._buf):
            # One blocking read, and its fast path as in try_recv.
            try:
                data, anc, mflags, _ = self.sock.recvmsg(
                    _STREAM_RECV_SIZE, _ANC_SIZE, _RECV_BLOCKING
                )
            except BlockingIOError:
                pass  # an event loop made the socket non-blocking: wait below
            except ConnectionResetError as exc:
                raise Closed from exc
            else:
                if not anc and not mflags & _TRUNCATED and len(data) >= FRAME_SIZE:
                    n, nfds = FRAME.unpack_from(data)
                    if not nfds and n + FRAME_SIZE == len(data):
                        return data[FRAME_SIZE:], []
                self._absorb(data, anc, mflags)
        while (got := self.take()) is None:
            if deadline is None and self._fill(_RECV_BLOCKING):
                continue
            if not self._fill(_RECV_FLAGS) and not wait_fd_sync(
                self.sock.fileno(), deadline=deadline
            ):
                return None
        return got

    async def recv_async(self) -> tuple[bytes, list[int]]:
        """One frame, waiting on the event loop. On cancellation nothing is consumed."""
        import anyio

        while (got := self.try_recv()) is None:
            await anyio.wait_readable(self.sock)
        return got

    # -- sending ---------------------------------------------------------------------
    def try_send(self, data: bytes | memoryview, fds: list[int]) -> int:
        """Send without waiting; returns how many bytes went (the fds go with the first).

        0 means nothing was sent, fds included. A caller that got less than ``len(data)``
        must send the rest (without fds) before anything else.
        """
        try:
            if fds:
                return self.sock.sendmsg(
                    (data,), [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))], _SEND_FLAGS
                )
            return self.sock.send(data, _SEND_FLAGS)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise Closed from exc
        except OSError as exc:
            raise _send_error(exc, fds) from exc

    def send_sync(self, data: bytes, fds: list[int]) -> None:
        """Send a whole frame, blocking while the buffer is full."""
        sock = self.sock
        try:
            # One blocking syscall, as a rule. The socket may have been made non-blocking
            # by an event loop in this process (uvloop does): then poll for room.
            if fds:
                n = sock.sendmsg(
                    (data,), [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))], _MSG_NOSIGNAL
                )
            else:
                n = sock.send(data, _MSG_NOSIGNAL)
        except BlockingIOError:
            n = 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise Closed from exc
        if n == len(data):
            return
        if n == 0 and fds:
            while (n := self.try_send(data, fds)) == 0:
                wait_fd_sync(sock.fileno(), write=True)
        view = memoryview(data)[n:]
        while view:
            sent = self.try_send(view, [])
            if sent:
                view = view[sent:]
            else:
                wait_fd_sync(sock.fileno(), write=True)
