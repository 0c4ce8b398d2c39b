"""Datagrams between processes: unix ``SOCK_SEQPACKET`` sockets, one datagram a message.

A message is one byte of kind followed by its body; a body larger than :data:`MAX_INLINE`
travels in an anonymous memfd whose fd rides in the same datagram (kind ``LARGE``). Why
datagrams: docs/decisions/0001-datagram-queue.md. Sends and receives now, blocking or by
a deadline; fds ride as ``SCM_RIGHTS``; errors map to :class:`Closed` (the other end has
gone) and :class:`~aiomp.TransportError` (fd limits, truncation, no memory). Owns a LARGE
body's memfd until :func:`memfd_with`'s caller takes it; no socket (its callers own them).

aiomp never changes a socket's blocking mode (the flag is shared by every process holding
it), but an event loop may (uvloop's ``add_reader`` does): so non-blocking calls pass
``MSG_DONTWAIT``, and blocking calls fall back to ``poll`` on EAGAIN. A *child* module:
standard library only.
"""

from __future__ import annotations

import array
import mmap
import os
import select
import socket
import time

from .._errors import TransportError

#: Largest body sent inside the datagram; larger bodies go through a memfd.
MAX_INLINE = 64 * 1024
#: The kernel's limit on fds in one ``SCM_RIGHTS`` message (``SCM_MAX_FD``).
MAX_FDS = 253

KIND_DATA = 0
KIND_LARGE = 1

_FD_SIZE = array.array("i").itemsize
ANC_SIZE = socket.CMSG_SPACE(MAX_FDS * _FD_SIZE)
RECV_SIZE = MAX_INLINE + 64
# Plain ints: socket's IntFlag arithmetic costs microseconds on a hot path.
SEND_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
RECV_BLOCKING = int(socket.MSG_CMSG_CLOEXEC)
TRUNCATED = int(socket.MSG_CTRUNC | socket.MSG_TRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
MSG_NOSIGNAL = int(socket.MSG_NOSIGNAL)
SOL_SOCKET = int(socket.SOL_SOCKET)
SCM_RIGHTS = int(socket.SCM_RIGHTS)


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
    flags = MSG_NOSIGNAL if blocking else SEND_FLAGS
    try:
        if fds:
            sock.sendmsg((datagram,), [(SOL_SOCKET, SCM_RIGHTS, array.array("i", fds))], flags)
        else:
            sock.send(datagram, flags)  # no iovec or cmsg to build: cheaper
    except BlockingIOError:
        return False
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise Closed from exc
    except OSError as exc:
        raise send_error(exc, fds) from exc
    return True


def try_recv(sock: socket.socket, blocking: bool = False) -> tuple[bytes, list[int]] | None:
    """Receive one datagram without waiting: ``(datagram, fds)``, or None when empty.

    With ``blocking``, wait in the kernel (unless another process's event loop made the
    socket non-blocking: then it may still return None). Raises :class:`Closed` at EOF.
    """
    flags = RECV_BLOCKING if blocking else RECV_FLAGS
    try:
        data, anc, flags, _ = sock.recvmsg(RECV_SIZE, ANC_SIZE, flags)
    except BlockingIOError:
        return None
    except ConnectionResetError as exc:
        raise Closed from exc
    fds = fds_in(anc) if anc else []
    if flags & TRUNCATED:
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
        if level == SOL_SOCKET and kind == SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % _FD_SIZE]))
    return fds


def fds_dropped(consequence: str) -> TransportError:
    """The error for a message whose fds the kernel dropped (``MSG_CTRUNC``)."""
    return TransportError(
        24,
        "a message arrived without its file descriptors: this process is at its fd limit "
        f"(RLIMIT_NOFILE={nofile()}); close arrays or raise the limit. {consequence}",
    )


def send_error(exc: OSError, fds: list[int]) -> OSError:
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
