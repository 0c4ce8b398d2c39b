"""Message channels between processes: unix ``SOCK_SEQPACKET`` sockets, one datagram a message.

Why datagrams: every ``sendmsg`` is delivered whole to exactly one ``recvmsg``, file
descriptors (``SCM_RIGHTS``) included. So many producers and many consumers can share one
socket with no lock, no feeder thread and no interleaving, and a message whose fds travel
with it cannot be split from them.

A message is one byte of kind followed by its body. A body larger than
:data:`MAX_INLINE` travels in an anonymous memfd whose fd rides in the same datagram
(kind ``LARGE``), so a datagram never outgrows the socket buffer.

aiomp never changes a socket's blocking mode (the flag is shared by every process holding
it), but an event loop may (uvloop's ``add_reader`` does): so non-blocking calls pass
``MSG_DONTWAIT``, and blocking calls fall back to ``poll`` if they meet EAGAIN. Async
callers wait for readiness through anyio, so asyncio, uvloop and trio all work. anyio is
imported only by the async functions: a child running a sync function never loads it.

Point-to-point channels: :class:`Stream`
-----------------------------------------
A channel with exactly one process at each end (a pool worker's control channel) does not
need datagrams, and pays for them: on the Linux VMs aiomp is measured on, waking a process
blocked in ``recvmsg`` on a ``SOCK_SEQPACKET`` socket costs the sender about 10 us inside
``sendmsg`` and the receiver 15 to 20 us more before it runs, against about 2 us for a
process blocked in ``recvmsg`` on a ``SOCK_STREAM`` socket (waiting in ``poll``/``epoll``
costs the same slow wake-up on either kind). So :class:`Stream` carries the same datagrams
(:func:`encode` / :func:`decode`) over a ``SOCK_STREAM`` pair, each behind a 5-byte frame
header: the datagram's length and how many fds belong to it (:func:`frame`).

The kernel hands a sendmsg's fds to the ``recvmsg`` that reads the first byte sent with
them, and never merges them into a later read: so the receiver keeps the fds it has read in
arrival order and gives each frame, once complete, the first ``nfds`` of them. One reader
and one writer per end: the sender finishes a frame (a non-blocking send may write part of
one; :meth:`Stream.try_send` says how much) before it starts the next.

This module is imported by children: standard library only.
"""

from __future__ import annotations

import array
import mmap
import os
import select
import socket
import struct
import time

from ._errors import TransportError

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
_SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
_RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
_RECV_BLOCKING = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_CTRUNC | socket.MSG_TRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of ``SOCK_SEQPACKET`` sockets with large buffers."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        _grow_buffers(s)
    return a, b


def _grow_buffers(s: socket.socket) -> None:
    # A queue of small items is bounded by the sender's buffer (each datagram costs its
    # size plus ~1 KiB of kernel overhead). Ask for 4 MiB; root may force past wmem_max.
    for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_*BUFFORCE
        try:
            s.setsockopt(socket.SOL_SOCKET, force, 4 << 20)
        except OSError:
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass


def close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def encode(body: bytes | bytearray | memoryview, fds: list[int]) -> tuple[bytes, list[int], int]:
    """Frame ``body`` as a datagram. Returns ``(datagram, fds, extra_fd)``.

    A large body is written to a fresh memfd, appended to ``fds``; ``extra_fd`` is that
    memfd (the caller closes it once sent) or -1.
    """
    if len(body) <= MAX_INLINE:
        return b"\x00" + bytes(body), fds, -1
    fd = os.memfd_create("aiomp-msg", os.MFD_CLOEXEC)
    try:
        _write_all(fd, body)
    except BaseException:
        os.close(fd)
        raise
    return bytes((KIND_LARGE,)) + len(body).to_bytes(8, "little"), [*fds, fd], fd


def decode(datagram: bytes, fds: list[int]) -> tuple[int, bytes | memoryview, list[int]]:
    """Inverse of :func:`encode`: ``(kind, body, fds)``; a LARGE body's memfd is consumed."""
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
        if exc.errno in (24, 23, 109):  # EMFILE, ENFILE, ETOOMANYREFS: too many fds in flight
            raise TransportError(
                exc.errno,
                f"cannot send {len(fds)} file descriptor(s): too many are in flight or open "
                f"(RLIMIT_NOFILE={_nofile()}): receive pending messages or raise the limit",
            ) from exc
        raise
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
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % _FD_SIZE]))
    if flags & _TRUNCATED:
        close_fds(fds)
        if flags & _MSG_TRUNC:
            raise TransportError(0, "a message was truncated (corrupt sender?); it is lost")
        raise TransportError(
            24,
            "a message arrived without its file descriptors: this process is at its fd "
            f"limit (RLIMIT_NOFILE={_nofile()}); close arrays or raise the limit. "
            "The message is lost.",
        )
    if not data:
        close_fds(fds)
        raise Closed
    return data, fds


def _nofile() -> int:
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
        _grow_buffers(s)
    return a, b


def frame(datagram: bytes | bytearray | memoryview, nfds: int = 0) -> bytes:
    """``datagram`` (from :func:`encode`) framed for a :class:`Stream`, with ``nfds`` fds."""
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

    def _read(self, flags: int) -> tuple[bytes, list[int]] | None:
        """Read once, nothing being buffered; the first complete frame read, or None.

        The common case, one whole frame without fds in one read, is returned as it is,
        without going through the buffer.
        """
        try:
            data, anc, mflags, _ = self.sock.recvmsg(_STREAM_RECV_SIZE, _ANC_SIZE, flags)
        except BlockingIOError:
            return None
        except ConnectionResetError as exc:
            raise Closed from exc
        # (msg_flags echoes MSG_CMSG_CLOEXEC back on Linux: only truncation matters here.)
        if not anc and not mflags & _TRUNCATED and len(data) >= FRAME_SIZE:
            n, nfds = FRAME.unpack_from(data)
            if not nfds and n + FRAME_SIZE == len(data):
                return data[FRAME_SIZE:], []
        self._absorb(data, anc, mflags)
        return self.take()

    def _absorb(self, data: bytes, anc: list[tuple[int, int, bytes]], mflags: int) -> None:
        if anc:
            for level, kind, payload in anc:
                if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                    self._fds.extend(
                        array.array("i", payload[: len(payload) - len(payload) % _FD_SIZE])
                    )
        if mflags & _TRUNCATED:
            # Fds were dropped (this process is at its fd limit): frames and fds are out of
            # step from here on, so nothing more can be trusted on this channel.
            fds, self._fds = self._fds, []
            close_fds(fds)
            raise TransportError(
                24,
                "a message arrived without its file descriptors: this process is at its "
                f"fd limit (RLIMIT_NOFILE={_nofile()}); close arrays or raise the limit. "
                "The channel is unusable.",
            )
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
            return self._read(_RECV_FLAGS)
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
            got = self._read(_RECV_BLOCKING)
            if got is not None:
                return got
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
            if exc.errno in (24, 23, 109):  # EMFILE, ENFILE, ETOOMANYREFS
                raise TransportError(
                    exc.errno,
                    f"cannot send {len(fds)} file descriptor(s): too many are in flight or "
                    f"open (RLIMIT_NOFILE={_nofile()}): receive pending messages or raise "
                    "the limit",
                ) from exc
            raise

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
