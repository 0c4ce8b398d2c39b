"""Stream channels: the datagrams of :mod:`aiomp._wire.datagram` over a ``SOCK_STREAM`` pair.

Each datagram travels behind a 5-byte frame header (its length and how many fds belong to
it), for channels with one process at each end (see
docs/decisions/0002-stream-channels.md). The kernel never merges a sendmsg's fds into a
later read, so a :class:`Stream`'s reader keeps the fds in arrival order and gives each
complete frame the first ``nfds``; one reader and one writer per end, and a sender
finishes a frame before the next. A Stream owns its socket and the fds read and not yet
handed out. A *child* module: standard library only.
"""

from __future__ import annotations

import array
import socket
import struct

from .._errors import TransportError
from .datagram import (
    ANC_SIZE,
    MSG_NOSIGNAL,
    RECV_BLOCKING,
    RECV_FLAGS,
    RECV_SIZE,
    SCM_RIGHTS,
    SEND_FLAGS,
    SOL_SOCKET,
    TRUNCATED,
    Closed,
    close_fds,
    fds_dropped,
    fds_in,
    grow_buffers,
    send_error,
    wait_fd_sync,
)

#: A frame header: the datagram's length, and how many of the fds read belong to it.
FRAME = struct.Struct("<IB")
FRAME_SIZE = FRAME.size
# Below glibc's mmap threshold: a 256 KiB buffer costs an mmap and munmap per read (18 us).
_STREAM_RECV_SIZE = RECV_SIZE


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

    def _read(self, flags: int) -> tuple[bytes, list[int]] | bool:
        """Read once: False if nothing was there (a non-blocking read), else True, what
        came now buffered. The common case, one whole frame without fds read while nothing
        was buffered, is returned as it came, past the buffer (msg_flags echoes
        MSG_CMSG_CLOEXEC on Linux: only truncation matters). Raises :class:`Closed` at EOF.
        """
        try:
            data, anc, mflags, _ = self.sock.recvmsg(_STREAM_RECV_SIZE, ANC_SIZE, flags)
        except BlockingIOError:
            return False
        except ConnectionResetError as exc:
            raise Closed from exc
        whole = not anc and not mflags & TRUNCATED and len(data) >= FRAME_SIZE
        if whole and self._pos == len(self._buf):
            n, nfds = FRAME.unpack_from(data)
            if not nfds and n + FRAME_SIZE == len(data):
                return data[FRAME_SIZE:], []
        self._absorb(data, anc, mflags)
        return True

    def _absorb(self, data: bytes, anc: list[tuple[int, int, bytes]], mflags: int) -> None:
        if anc:
            self._fds.extend(fds_in(anc))
        if mflags & TRUNCATED:
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
        if self._pos != len(self._buf) and (got := self.take()) is not None:
            return got
        read = self._read(RECV_FLAGS)
        if read is True:
            return self.take()
        return None if read is False else read

    def recv_sync(self, deadline: float | None = None) -> tuple[bytes, list[int]] | None:
        """One frame, blocking while there is none; None if ``deadline`` passes first.

        Without a deadline this is one blocking ``recvmsg`` per read (the cheap wake-up),
        unless an event loop made the socket non-blocking: then it polls.
        """
        flags = RECV_BLOCKING if deadline is None else RECV_FLAGS
        while True:
            if self._pos != len(self._buf) and (got := self.take()) is not None:
                return got
            read = self._read(flags)
            if read is False:  # a deadline, or an event loop made the socket non-blocking
                if not wait_fd_sync(self.sock.fileno(), deadline=deadline):
                    return None
            elif read is not True:
                return read

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
                    (data,), [(SOL_SOCKET, SCM_RIGHTS, array.array("i", fds))], SEND_FLAGS
                )
            return self.sock.send(data, SEND_FLAGS)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise Closed from exc
        except OSError as exc:
            raise send_error(exc, fds) from exc

    def send_sync(self, data: bytes, fds: list[int]) -> None:
        """Send a whole frame, blocking while the buffer is full."""
        sock = self.sock
        try:
            # One blocking syscall, as a rule. The socket may have been made non-blocking
            # by an event loop in this process (uvloop does): then poll for room.
            if fds:
                n = sock.sendmsg(
                    (data,), [(SOL_SOCKET, SCM_RIGHTS, array.array("i", fds))], MSG_NOSIGNAL
                )
            else:
                n = sock.send(data, MSG_NOSIGNAL)
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
